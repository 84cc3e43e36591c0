"""Algorithm registry: name -> (config class, factory(config, trainer) -> Algorithm).

Each config is a NamedTuple whose defaults are its paper's values. experiments/flags.py
turns every field into a flag `--<name>_<field>` (help text from `flag_help`); a registry
entry may rename a field's flag (`flag_names`: coaching's --coach_lambda, FedALA reading
the --ala_* flags of the ALA plug-in), name presets of its fields (`presets`, picked by
`--<name>_variant`: FEDORA's paper and authors' settings), take fields from the client
training (`train_fields`: FEDORA's lr), tie a field to another's value (`only_with`) or to
a plug-in (`only_under`: FedProx's ala_anchor acts only under --ala).

Plug-ins wrap a registered host (`build`, `Plugged`): ALA (ala.py, --ala) in front of the
client update of a host that sends a global model, ConFREE (confree.py,
--aggregation=confree) or a robust aggregator (robust.py, --aggregation=median, krum, ...)
in place of the server mean of a host's shared part, and Byzantine attackers (byzantine.py,
--attack) poisoning the uploads of that shared part, and user-level DP (dp.py, --dp_*)
in place of the server mean of a host's uploads; a host takes one by declaring what it
needs (plugin_fields.py; `ala_hosts`, `confree_hosts`, `dp_hosts`).
"""

import functools
from typing import Any, Callable, Mapping, NamedTuple

from fedora_jax.algorithms import (apfl, ditto, fedamp, fedavg, fedavg_ft, fedfomo, fedora,
                                   fedper, fedprox, fedprox_ft, fedu, fesem, ifca,
                                   lg_fedavg, local, pfedhn)
from fedora_jax.algorithms import ala as ala_lib
from fedora_jax.algorithms import (apple, coaching, confree, fedala, fedavg_c, fedbabu,
                                   fedbn, fedcp, fedpac, fedphp, fedprox_c, fedproto, fedrep,
                                   fedrod, moon, partialfed, perfedavg, pfedla, pfedme)
from fedora_jax.algorithms import (fedavgm, feddyn, fedlc, fednova, fedntd, fedopt,
                                   scaffold)
from fedora_jax.algorithms import fedas, fedcac, feddbe, feddistill, fedgh, fml, gpfl, pflda
from fedora_jax.algorithms import fedkd, fedmtl, fedpcl
from fedora_jax.algorithms import fedcross, fedgc, fedgen
from fedora_jax.algorithms import elastic, fedadmm, pfedsim
from fedora_jax.algorithms import ccvr, fediir
from fedora_jax.algorithms import fedsr, floco
from fedora_jax.algorithms import cfl, fedem
from fedora_jax.algorithms import fedah, knnper
from fedora_jax.algorithms import pefll, pfedfda
from fedora_jax.algorithms import adcol, fedmd
from fedora_jax.algorithms import fedap
from fedora_jax.algorithms import flute
from fedora_jax.algorithms import fedfed
from fedora_jax.algorithms import metafed
from fedora_jax.algorithms import byzantine, robust
from fedora_jax.algorithms import dp as dp_lib
from fedora_jax.algorithms.base import (Algorithm, AlgorithmState, ClientOutput, InitContext,
                                        RoundCost, no_round_cost)
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError


class Registered(NamedTuple):
  config_class: type
  factory: Callable[[Any, Any], Algorithm]
  flag_help: dict[str, str] = {}  # config field -> help text of --<name>_<field>
  flag_names: dict[str, str] = {}  # config field -> its flag's name, if not <name>_<field>
  presets: dict[str, dict[str, Any]] = {}  # preset name -> field values over the defaults
  default_preset: str | None = None
  preset_help: str = ""
  train_fields: tuple[str, ...] = ()  # fields copied from the client training (TrainConfig)
  only_with: dict[str, tuple[str, Any]] = {}  # field -> (field, value) it only acts with
  only_under: dict[str, str] = {}  # field -> the plug-in (AlgorithmConfig field) it acts under
  # Whether the algorithm serves clients held out of training (FEDORA's Algorithm 2,
  # ExperimentConfig.new_clients): its check of the config that does (one-line error);
  # None: it does not.
  new_clients: Callable[[Any], None] | None = None
  # Training fields the algorithm never reads (LOCAL averages nothing; FEDORA, IFCA,
  # FedFomo, FedU, FedAMP and pFedHN read a client's weight only as "took part or not":
  # client_weights); without plug-ins a run's identity holds them at their defaults, so
  # one run serves every value (tests/test_reproduce.py runs both).
  ignores: tuple[str, ...] = ()
  # Its config -> what a round computes beyond training and scoring (the benchmark's FLOPs).
  round_cost: Callable[[Any], RoundCost] = no_round_cost
  # Whether benchmarks/torch_loop.py replays its rounds as a sequential PyTorch loop.
  torch_loop: bool = False
  # Its config -> the public set it distils on (data/public.py: training samples no
  # client holds, in InitContext.data.public): its default size, unless --public_size.
  # None: it reads no public set.
  public_size: Callable[[Any], int] | None = None


REGISTRY: dict[str, Registered] = {
    "local": Registered(local.LocalConfig, local.local, ignores=("client_weights",)),
    "fedavg": Registered(fedavg.FedAvgConfig, fedavg.fedavg),
    "fedora": Registered(fedora.FedoraConfig, fedora.fedora, fedora.FLAG_HELP,
                         presets=fedora.PRESETS, default_preset=fedora.DEFAULT_VARIANT,
                         preset_help=fedora.PRESET_HELP, train_fields=("lr",),
                         only_with=fedora.ONLY_WITH, new_clients=fedora.check_new_clients,
                         round_cost=fedora.round_cost, torch_loop=True,
                         ignores=("client_weights",)),
    "fedprox": Registered(fedprox.FedProxConfig, fedprox.fedprox, fedprox.FLAG_HELP,
                          only_under={"ala_anchor": "ala"}),
    "fedavg_ft": Registered(fedavg_ft.FedAvgFTConfig, fedavg_ft.fedavg_ft),
    "fedprox_ft": Registered(fedprox_ft.FedProxFTConfig, fedprox_ft.fedprox_ft,
                             fedprox_ft.FLAG_HELP),
    "fedavg_c": Registered(fedavg_c.FedAvgCConfig, fedavg_c.fedavg_c, fedavg_c.FLAG_HELP),
    "fedprox_c": Registered(fedprox_c.FedProxCConfig, fedprox_c.fedprox_c, fedprox_c.FLAG_HELP),
    "ditto": Registered(ditto.DittoConfig, ditto.ditto, ditto.FLAG_HELP,
                        train_fields=("lr",)),
    "apfl": Registered(apfl.ApflConfig, apfl.apfl, apfl.FLAG_HELP, train_fields=("lr",)),
    "lg_fedavg": Registered(lg_fedavg.LgFedAvgConfig, lg_fedavg.lg_fedavg, lg_fedavg.FLAG_HELP),
    "fedper": Registered(fedper.FedPerConfig, fedper.fedper, fedper.FLAG_HELP),
    "ifca": Registered(ifca.IfcaConfig, ifca.ifca, ifca.FLAG_HELP,
                       ignores=("client_weights",)),
    "fesem": Registered(fesem.FesemConfig, fesem.fesem, {
        "num_clusters": "Number of centers C",
        "init": "kmeans: k-means on the local models of the first rounds; random: the paper's"
                " random centers and assignment",
        "warmup_rounds": "Rounds of local training whose models k-means clusters"
                         " (init=kmeans)",
        "kmeans_iterations": "Lloyd steps of that k-means (init=kmeans)",
        "m_step": "mean: each center the plain mean of its clients' current models, stale"
                  " ones included (the paper's); uploaders: of its clients that uploaded"
                  " this round, by --client_weights (the authors' code)"}),
    "fedfomo": Registered(fedfomo.FedFomoConfig, fedfomo.fedfomo, {
        "num_models": "Models M each client downloads per round",
        "epsilon": "Initial probability of downloading M random models instead of the"
                   " top-M by affinity",
        "epsilon_decay": "Subtracted from epsilon after every round",
        "candidates": "others: the paper's candidates; self: P starts as the identity and"
                      " the client's own model is a candidate (PFLlib)",
        "baseline": "current: weights measured against the client's model; previous:"
                    " against the model its last training started from (PFLlib)",
        "validation": "split: the client's validation split; train_tail: the last fifth of"
                      " its training data, trained on the rest (PFLlib)",
        "affinity_update": "normalized: P adds the normalised weights; raw: the signed,"
                           " unnormalised ones (PFLlib)",
        "distance_eps": "Added to ||theta_n - theta_i|| in the weights (PFLlib: 1e-5)"},
        ignores=("client_weights",)),
    "fedu": Registered(fedu.FedUConfig, fedu.fedu, {
        "lam": "Laplacian regularisation strength lambda",
        "eta": "Step size of the Laplacian step after local training",
        "update": "all: every client steps over every client's stored model; sampled: only"
                  " the round's clients, over each other (the authors' code)",
        "step": "paper: eta lambda per unit a_kl; code: 0.5 local_epochs eta lambda (the"
                " authors' code)",
        "graph": "complete: a_kl = 1; random: the authors' code's K = 0 graph, (B + B^T) / 2"
                 " with B ~ U(0, 1), entries below 0.25 zeroed, drawn once"},
        ignores=("client_weights",)),
    "fedamp": Registered(fedamp.FedAmpConfig, fedamp.fedamp, {
        "attention": "distance: xi_ij = alpha_k exp(-||w_i - w_j||^2 / sigma) / sigma"
                     " (FedAMP); cosine: HeurFedAMP's softmax of cosines",
        "alpha_k": "Message-passing step size alpha_k",
        "lam": "Attentive regulariser weight lambda; the client's proximal weight is"
               " lambda / (2 alpha_k)",
        "sigma": "Scale sigma of A(x) = 1 - exp(-x / sigma)",
        "self_weight": "HeurFedAMP's self-attention xi_ii (cosine attention only)",
        "cosine_scale": "HeurFedAMP's scale of the cosines in the softmax (cosine only)",
        "clip_step": "Attention step min(alpha_k, sigma / (K - 1)) so every xi_ii >= 0"
                     " (the paper's bound); false: alpha_k as given (PFLlib)",
        "attention_from": "all: attention and cloud models from every client's stored"
                          " model; uploaders: from the round's uploaded models only"
                          " (PFLlib, under --participation < 1)"},
        ignores=("client_weights",)),
    "pfedhn": Registered(pfedhn.PfedhnConfig, pfedhn.pfedhn, {
        "embed_dim": "Client embedding size; 0: 1 + K / 4",
        "hidden_dim": "Hypernetwork hidden width",
        "n_hidden": "Hidden Linear(H, H) layers of the hypernetwork",
        "server_lr": "Learning rate of the hypernetwork and the embeddings",
        "server_momentum": "Momentum of the server SGD",
        "server_weight_decay": "Weight decay of the server SGD",
        "grad_clip": "Max global norm of the hypergradient (0: no clipping)",
        "server_steps": "pFedHN server: one step a round on the clients' summed"
                        " hypergradients (summed) or one step per sampled client, each"
                        " clipped, decayed and with momentum (per_client, the official"
                        " trainer's)"},
        ignores=("client_weights",)),
    "fedala": Registered(fedala.FedAlaConfig, fedala.fedala, fedala.FLAG_HELP,
                         fedala.FLAG_NAMES),
    "coaching": Registered(coaching.CoachingConfig, coaching.coaching, coaching.FLAG_HELP,
                           coaching.FLAG_NAMES),
    "fedrep": Registered(fedrep.FedRepConfig, fedrep.fedrep, fedrep.FLAG_HELP),
    "fedrod": Registered(fedrod.FedRodConfig, fedrod.fedrod, fedrod.FLAG_HELP),
    "perfedavg": Registered(perfedavg.PerFedAvgConfig, perfedavg.perfedavg,
                            perfedavg.FLAG_HELP),
    "pfedme": Registered(pfedme.PfedmeConfig, pfedme.pfedme, pfedme.FLAG_HELP),
    "fedphp": Registered(fedphp.FedPhpConfig, fedphp.fedphp, fedphp.FLAG_HELP),
    "apple": Registered(apple.AppleConfig, apple.apple, apple.FLAG_HELP),
    "partialfed": Registered(partialfed.PartialFedConfig, partialfed.partialfed,
                             partialfed.FLAG_HELP),
    "fedpac": Registered(fedpac.FedPacConfig, fedpac.fedpac, fedpac.FLAG_HELP),
    "fedcp": Registered(fedcp.FedCpConfig, fedcp.fedcp, fedcp.FLAG_HELP),
    "moon": Registered(moon.MoonConfig, moon.moon, moon.FLAG_HELP),
    "fedproto": Registered(fedproto.FedProtoConfig, fedproto.fedproto, fedproto.FLAG_HELP),
    "fedbabu": Registered(fedbabu.FedBabuConfig, fedbabu.fedbabu, fedbabu.FLAG_HELP),
    "pfedla": Registered(pfedla.PfedlaConfig, pfedla.pfedla, pfedla.FLAG_HELP),
    "fedbn": Registered(fedbn.FedBnConfig, fedbn.fedbn, fedbn.FLAG_HELP),
    "scaffold": Registered(scaffold.ScaffoldConfig, scaffold.scaffold, scaffold.FLAG_HELP,
                           train_fields=("lr", "momentum")),
    "feddyn": Registered(feddyn.FedDynConfig, feddyn.feddyn, feddyn.FLAG_HELP),
    "fedavgm": Registered(fedavgm.FedAvgMConfig, fedavgm.fedavgm, fedavgm.FLAG_HELP),
    "fedopt": Registered(fedopt.FedOptConfig, fedopt.fedopt, fedopt.FLAG_HELP,
                         presets=fedopt.PRESETS, default_preset=fedopt.DEFAULT_VARIANT,
                         preset_help=fedopt.PRESET_HELP),
    "fednova": Registered(fednova.FedNovaConfig, fednova.fednova, train_fields=("momentum",)),
    "fedntd": Registered(fedntd.FedNtdConfig, fedntd.fedntd, fedntd.FLAG_HELP),
    "fedlc": Registered(fedlc.FedLcConfig, fedlc.fedlc, fedlc.FLAG_HELP),
    "feddbe": Registered(feddbe.FedDbeConfig, feddbe.feddbe, feddbe.FLAG_HELP),
    "gpfl": Registered(gpfl.GpflConfig, gpfl.gpfl, gpfl.FLAG_HELP),
    "fedcac": Registered(fedcac.FedCacConfig, fedcac.fedcac, fedcac.FLAG_HELP),
    "fedas": Registered(fedas.FedAsConfig, fedas.fedas, fedas.FLAG_HELP),
    "fedgh": Registered(fedgh.FedGhConfig, fedgh.fedgh, fedgh.FLAG_HELP),
    "fml": Registered(fml.FmlConfig, fml.fml, fml.FLAG_HELP),
    "feddistill": Registered(feddistill.FedDistillConfig, feddistill.feddistill,
                             feddistill.FLAG_HELP),
    "pflda": Registered(pflda.PflDaConfig, pflda.pflda, pflda.FLAG_HELP),
    "fedkd": Registered(fedkd.FedKdConfig, fedkd.fedkd, fedkd.FLAG_HELP,
                        train_fields=("rounds",)),
    "fedmtl": Registered(fedmtl.FedMtlConfig, fedmtl.fedmtl, fedmtl.FLAG_HELP),
    "fedpcl": Registered(fedpcl.FedPclConfig, fedpcl.fedpcl, fedpcl.FLAG_HELP),
    "fedgen": Registered(fedgen.FedGenConfig, fedgen.fedgen, fedgen.FLAG_HELP),
    "fedcross": Registered(fedcross.FedCrossConfig, fedcross.fedcross, fedcross.FLAG_HELP),
    "fedgc": Registered(fedgc.FedGcConfig, fedgc.fedgc, fedgc.FLAG_HELP, train_fields=("lr",)),
    "pfedsim": Registered(pfedsim.PfedSimConfig, pfedsim.pfedsim, pfedsim.FLAG_HELP,
                          train_fields=("rounds",)),
    "fedap": Registered(fedap.FedApConfig, fedap.fedap, fedap.FLAG_HELP,
                        train_fields=("rounds",)),
    "fedadmm": Registered(fedadmm.FedAdmmConfig, fedadmm.fedadmm, fedadmm.FLAG_HELP),
    "elastic": Registered(elastic.ElasticConfig, elastic.elastic, elastic.FLAG_HELP),
    "ccvr": Registered(ccvr.CcvrConfig, ccvr.ccvr, ccvr.FLAG_HELP,
                       train_fields=("lr", "rounds")),
    "fediir": Registered(fediir.FedIirConfig, fediir.fediir, fediir.FLAG_HELP),
    "fedmd": Registered(fedmd.FedMdConfig, fedmd.fedmd, fedmd.FLAG_HELP,
                        public_size=fedmd.public_size),
    "adcol": Registered(adcol.AdcolConfig, adcol.adcol, adcol.FLAG_HELP),
    "fedem": Registered(fedem.FedEmConfig, fedem.fedem, fedem.FLAG_HELP),
    "cfl": Registered(cfl.CflConfig, cfl.cfl, cfl.FLAG_HELP),
    "knnper": Registered(knnper.KnnPerConfig, knnper.knnper, knnper.FLAG_HELP),
    "fedah": Registered(fedah.FedAhConfig, fedah.fedah, fedah.FLAG_HELP),
    "pfedfda": Registered(pfedfda.PfedFdaConfig, pfedfda.pfedfda, pfedfda.FLAG_HELP),
    "pefll": Registered(pefll.PefllConfig, pefll.pefll, pefll.FLAG_HELP),
    "fedsr": Registered(fedsr.FedSrConfig, fedsr.fedsr, fedsr.FLAG_HELP),
    "floco": Registered(floco.FlocoConfig, floco.floco, floco.FLAG_HELP,
                        train_fields=("rounds",)),
    "flute": Registered(flute.FluteConfig, flute.flute, flute.FLAG_HELP),
    "fedfed": Registered(fedfed.FedFedConfig, fedfed.fedfed, fedfed.FLAG_HELP,
                         train_fields=("lr", "momentum", "weight_decay")),
    "metafed": Registered(metafed.MetaFedConfig, metafed.metafed, metafed.FLAG_HELP,
                          train_fields=("rounds",), round_cost=metafed.round_cost),
}


# The algorithm every run is measured against (R-Acc, PTR): LOCAL, trained beside a run
# unless the run is LOCAL itself or reads a finished LOCAL run (--reference).
REFERENCE = "local"


def canonical_name(name: str) -> str:
  """The registry's spelling of algorithm `name`, given in any case ("FedAvg": fedavg)."""
  if name in REGISTRY:
    return name
  if name.lower() in REGISTRY:
    return name.lower()
  raise ConfigError(f"unknown algorithm {name!r}; known: {', '.join(sorted(REGISTRY))}")


def get(name: str) -> Registered:
  """The registered algorithm `name`, in any case."""
  return REGISTRY[canonical_name(name)]


def public_size(name: str, config: Any) -> int | None:
  """The public set `name` declares with `config` (None: it reads none)."""
  declared = get(name).public_size
  return None if declared is None else declared(config)


def default_config(name: str, train: Any = None, preset: str | None = None, **overrides):
  """`name`'s config: its `preset` (default: the registry's default preset) with the
  fields in `train_fields` taken from `train` (a TrainConfig) and `overrides` on top."""
  registered = get(name)
  preset = preset or registered.default_preset
  if preset is not None and preset not in registered.presets:
    raise ConfigError(f"unknown {name} variant {preset!r}; known:"
                      f" {', '.join(registered.presets)}")
  values = dict(registered.presets[preset]) if preset is not None else {}
  if train is not None:
    values.update({field: getattr(train, field) for field in registered.train_fields})
  values.update(overrides)
  return registered.config_class(**values)


def variant_label(name: str, fields: Mapping[str, Any]) -> str | None:
  """The preset of `name` nearest a run's recorded config `fields`, with the fields the
  run changed on top of it ("paper; alpha=0.5"); None where `name` has no presets."""
  registered = get(name)
  if not registered.presets:
    return None
  changes = {}
  for preset, values in registered.presets.items():
    train_values = {field: fields[field] for field in registered.train_fields
                    if field in fields}
    defaults = registered.config_class(**{**values, **train_values})._asdict()
    changes[preset] = [f"{k}={fields[k]}" for k, v in defaults.items()
                       if k in fields and fields[k] != v]
  nearest = min(changes, key=lambda preset: len(changes[preset]))
  return "; ".join([nearest, *changes[nearest]])


class Plugged(NamedTuple):
  """An algorithm's config with the plug-ins applied around it: ALA in front of
  its client update (--ala), ConFREE or a robust rule as its server aggregation
  (--aggregation), attackers among its clients (--attack)."""
  config: Any
  ala: ala_lib.AlaConfig | None = None
  aggregation: confree.ConfreeConfig | robust.RobustConfig | None = None
  attack: byzantine.AttackConfig | None = None
  dp: dp_lib.DpConfig | None = None  # user-level DP around the server mean (--dp_*)


def stand_in_trainer(lr: float = 5e-3, momentum: float = 0.9, weight_decay: float = 5e-5,
                     epochs: int = 5, batch_size: int = 64):
  """A trainer that builds an algorithm without a model (its factory only closes over
  it), so its config checks run; defaults: the default run's (simulation.TrainConfig)."""
  return make_client_trainer(lambda params, x: x,
                             make_optimizer(lr, momentum, weight_decay), epochs, batch_size)


@functools.cache
def _declares(name: str) -> tuple[bool, bool, bool]:
  """Whether `name`, at its defaults, declares what ALA, ConFREE and DP need."""
  host = get(name).factory(default_config(name), stand_in_trainer())
  return host.ala_hooks is not None, host.shared_part is not None, host.upload_mean is not None


def ala_hosts() -> list[str]:
  """The registered algorithms ALA can wrap (they declare Algorithm.ala_hooks)."""
  return [name for name in sorted(REGISTRY) if _declares(name)[0]]


def confree_hosts() -> list[str]:
  """The registered algorithms ConFREE can wrap (they declare Algorithm.shared_part)."""
  return [name for name in sorted(REGISTRY) if _declares(name)[1]]


def dp_hosts() -> list[str]:
  """The registered algorithms DP can wrap (they declare Algorithm.upload_mean)."""
  return [name for name in sorted(REGISTRY) if _declares(name)[2]]


def check_plugins(name: str, ala: Any = None, aggregation: Any = None,
                  attack: Any = None, dp: Any = None) -> None:
  """One-line ConfigError for a plug-in its host cannot take (call before any work)."""
  name = canonical_name(name)
  takes_ala, takes_confree, takes_dp = _declares(name)
  if ala is not None and not takes_ala:
    raise ConfigError(f"--ala needs an algorithm that sends a global model; {name} does not"
                      f" (supported: {', '.join(ala_hosts())}; fedala has ALA built in)")
  if aggregation is not None and not takes_confree:
    rule = getattr(aggregation, "rule", "confree")
    raise ConfigError(f"--aggregation={rule} needs an algorithm whose server averages a"
                      f" shared part; not {name} (supported: {', '.join(confree_hosts())})")
  if attack is not None and not takes_confree:
    raise ConfigError(f"--attack needs an algorithm whose server averages a shared part its"
                      f" clients upload; not {name} (supported: {', '.join(confree_hosts())})")
  if dp is not None:
    if not takes_dp:
      raise ConfigError(f"DP (--dp_clip_norm) needs an algorithm whose server averages what"
                        f" its clients upload; {name} does not (supported:"
                        f" {', '.join(dp_hosts())})")
    if aggregation is not None or attack is not None:
      # The aggregators read each client's update; DP's server sees only their noised sum.
      raise ConfigError("DP (--dp_clip_norm) takes the server mean's place: it does not"
                        f" combine with --{'aggregation' if aggregation else 'attack'}")


def build(name: str, config: Any, trainer: Any, ala: Any = None,
          aggregation: Any = None, attack: Any = None, dp: Any = None) -> Algorithm:
  """The registered algorithm `name`, wrapped by the plug-ins (also taken from a Plugged):
  ALA innermost, then the aggregation, then the attackers, whose poisoned uploads the
  aggregation sees; DP (alone of the server's plug-ins) outermost."""
  if isinstance(config, Plugged):
    config, ala, aggregation, attack, dp = (config.config, config.ala, config.aggregation,
                                            config.attack, config.dp)
  check_plugins(name, ala, aggregation, attack, dp)
  algorithm = get(name).factory(config, trainer)
  if ala is not None:
    algorithm = ala_lib.with_ala(algorithm, ala, trainer)
  if isinstance(aggregation, robust.RobustConfig):
    algorithm = robust.with_robust(algorithm, aggregation,
                                   attack.fraction if attack is not None else 0.0)
  elif aggregation is not None:
    algorithm = confree.with_confree(algorithm, aggregation)
  if attack is not None:
    algorithm = byzantine.with_attackers(algorithm, attack)
  if dp is not None:
    algorithm = dp_lib.with_dp(algorithm, dp)
  return algorithm


def make(name: str, config: Any = None, ala: Any = None,
         aggregation: Any = None, attack: Any = None,
         dp: Any = None) -> Callable[[Any], Algorithm]:
  """The registered algorithm `name` as the runner takes it: trainer -> Algorithm
  (simulation.run_algorithm). `config`: its config or a Plugged (default: its defaults);
  a plug-in its host cannot take fails here, before any work."""
  name = canonical_name(name)
  if config is None:
    config = default_config(name)
  plugins = ((config.ala, config.aggregation, config.attack, config.dp)
             if isinstance(config, Plugged) else (ala, aggregation, attack, dp))
  check_plugins(name, *plugins)
  return functools.partial(build, name, config, ala=ala, aggregation=aggregation,
                           attack=attack, dp=dp)


__all__ = ["Algorithm", "AlgorithmState", "ClientOutput", "InitContext", "Plugged", "REFERENCE",
           "REGISTRY", "RoundCost", "ala_hosts", "build", "check_plugins", "confree_hosts", "dp_hosts",
           "default_config", "get", "make", "stand_in_trainer", "variant_label"]
