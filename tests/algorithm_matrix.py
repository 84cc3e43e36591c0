"""The algorithm matrix: every registered algorithm and every plug-in on every host it
accepts, two rounds on each engine path (tests/test_algorithm_matrix.py).

Run as a script it prints the multi-device rows as one JSON line (one process per device
count: JAX fixes the CPU device count when it starts):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/algorithm_matrix.py 0 2
(shard 0 of 2); a third argument runs that many clients (SIZES repeated) in place of six.
"""

import json
import os
import sys
from typing import NamedTuple

import jax

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

# pylint: disable=wrong-import-position
from fedora_jax import algorithms
from fedora_jax.algorithms import ala, byzantine, confree, dp, robust
from fedora_jax.engine import sharding
from fedora_jax.simulation import TrainConfig, run_algorithm
import tiny

# One size bucket: a bucket compiles its own client program, and buckets are covered
# elsewhere (test_engine.py, test_participation.py).
SIZES = (5, 6, 9, 5, 8, 7)
PARTIAL = 0.5                  # 3 of the 6 clients a round


class Path(NamedTuple):
  devices: int
  client_chunk: int | None     # None: vmap; n: lax.map over chunks of n (shard_map on 2+)
  participation: float


# In a 2-device process, at partial participation: vmap over the sampled clients on one
# device, and client chunks under shard_map on two (each device a lax.map over its own
# chunks, the one-device chunk path inside), which must agree client by client. Chunks
# against vmap at full participation: test_engine.py; every algorithm at full
# participation: its own tests and tests/golden.
PATHS = (Path(1, None, PARTIAL), Path(2, 1, PARTIAL))
# The 2-device processes compile ~80 tiny rounds: skip LLVM's costly optimisations.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# Options that take an algorithm off its engine fast path (shared_model, uploads_unordered:
# rounds.py) or change what its clients compute (APFL's PFLlib form: its own alpha step
# and a round's-end mixture; coaching's norm f_s: its own pull; pFedLA's local view: the
# server's stored models scored), as "field=value[,...]",
# the CNN with its CPU convolutions (FedAvg's shared model, FEDORA's propagation) on 16x16
# images, and BatchNorm (the tiny ResNet) in the algorithms whose gradient loops are their
# own rather than the trainer's (and ALA's weight learning), run as their own rows;
# "a,b" combines a plug-in with a model. pFedSim's rounds=2 puts its warm-up's end after
# the first round (its default row is all warm-up); CCVR's calibrate=every calibrates in
# both rounds (its default, once in the last of 100); CFL's row lets every cluster of
# more than 2 clients split from round 1 (its default waits 20 rounds); Floco's rounds=2
# places its clients on the simplex after the first round (its default row never does); a
# number is read as its field's type.
OPTION_ROWS = (("fedprox", "evaluate=local"), ("apfl", "mixing=pfllib"),
               ("coaching", "fs=norm,lr_r_rule=fixed"), ("pfedla", "evaluate=local"),
               ("fedavg", "model=cnn"),
               ("fedora", "model=cnn"), ("perfedavg", "model=resnet"),
               ("pfedme", "model=resnet"), ("fedavg", "ala,model=resnet"),
               ("pfedsim", "rounds=2"), ("ccvr", "calibrate=every"),
               ("cfl", "warmup_rounds=0,eps1=100,eps2=0"), ("floco", "rounds=2"))
# FLUTE with every local epoch joint (the authors' code as run; its default row trains
# the head alone for the first of the matrix's two epochs).
OPTION_ROWS += (("flute", "rep_epochs=2"),)
# MetaFed's stages within the matrix's two rounds (its default row is all warm-up): an
# accumulation round of copies setting the flags, then the personalisation; and a warm-up
# round, then an accumulation round whose flagged clients distil.
OPTION_ROWS += (("metafed", "rounds=2,threshold=0"),
                ("metafed", "rounds=3,warmup_epochs=2,threshold=0"))
# FedRep and FedPAC with a fresh optimizer state when the body's phase begins (the
# authors' optimizer per phase).
OPTION_ROWS += (("fedrep", "phase_optimizer=separate"), ("fedpac", "phase_optimizer=separate"))
# FedPAC in PFLlib's form: its plain prototype mean, no pull without a global
# prototype, the head weights left as zeroed.
OPTION_ROWS += (("fedpac", "proto_mean=clients,missing_proto=own,renormalize=false"),)
# FedFomo's official sampling (explore or exploit per slot, last round's uploaders only)
# and PFLlib's (at most as many models as last round's uploaders, its own a candidate).
OPTION_ROWS += (("fedfomo", "sampling=slot,pool=uploaders"),
                ("fedfomo", "pool=uploader_count,candidates=self"))
# pFedLA on BatchNorm (the tiny ResNet), its running averages each client's own and the
# public codes' sign.
OPTION_ROWS += (("pfedla", "buffers=own,delta_sign=after_minus_before,model=resnet"),)
MODEL_ROWS = {"model=cnn": (lambda: tiny.tiny_cnn(conv="banded"), tiny.CNN_X_SHAPE),
              "model=resnet": (tiny.tiny_resnet, tiny.RESNET_X_SHAPE)}
# FedAMP's attention from the round's uploaders only (PFLlib's): the aggregate
# reads who took part from the weights.
OPTION_ROWS += (("fedamp", "attention_from=uploaders"),)
# FedU in its authors' code's form: only the round's clients step, over each
# other, the code's step, its random graph in the server state.
OPTION_ROWS += (("fedu", "update=sampled,step=code,graph=random"),)
# FeSEM's M-step over the round's uploaders by their weights (the authors' code, issue
# 46), from the random start so that its E/M steps run in both rounds.
OPTION_ROWS += (("fesem", "m_step=uploaders,init=random"),)
# FedFed in FL-bench's forms: own data and uniform pool rows as one set, its distilled
# classifier as the global model; on BatchNorm (its stage's gradient loop is its own).
OPTION_ROWS += (("fedfed", "mix=union,classifier=model"), ("fedfed", "model=resnet"))
# ADCOL's model=fedavg (FL-bench's): one shared model, the engine's shared_model path.
OPTION_ROWS += (("adcol", "model=fedavg"),)
# Per-FedAvg scored as the references score it: every client adapts the
# latest global model (PFLlib's), or takes two steps on test batches (PFLlib a41f7ba's).
OPTION_ROWS += (("perfedavg", "evaluation=latest"), ("perfedavg", "evaluation=test"))
# pFedMe training only the sampled clients (PFLlib's; its default trains every client).
OPTION_ROWS += (("pfedme", "train_clients=sampled"),)
# FedPHP in PFLlib a41f7ba's form: the global model teaches, each client starts from a
# mix with its last model, mu ramped over the two rounds.
OPTION_ROWS += (("fedphp", "teacher=global,mu_max=0.5,mu_participations=2"),)
# FedAP on BatchNorm (the tiny ResNet), its warm-up's end after round 1 (rounds=2): its
# similarities from the BatchNorm inputs, then the mixtures; and FL-bench's form.
OPTION_ROWS += (("fedap", "rounds=2,model=resnet"),
                ("fedap", "rounds=2,batch_norm=statistics,score=trained,model=resnet"))
# APPLE in PFLlib's form: p from 1/N, its mean-of-means gradient after the core's
# step, the mixture before the last step uploaded, lambda a round late.
OPTION_ROWS += (("apple", "p_start=uniform,p_gradient=pfllib,upload=mixture,"
                          "lambda_round=previous"),)
# Clients as they really are (fedora_jax/availability.py): 30 % dropout and
# half the clients straggling (partial work), or a deadline that drops the slow ones, as
# rows of their own on both paths above and at full participation (FULL: the masks on
# every client rather than on sampled slots). They cover each way a server reads its
# clients: the fast paths (FedAvg: shared_model, uploads_unordered; with ALA), weights
# > 0 as "took part" (SCAFFOLD, FedCAC), zero uploads (pFedHN), client state read as an
# upload (FEDORA, FedFomo), and local-training loops of their own (Per-FedAvg, pFedMe);
# FedADMM's random epochs, a step budget inside the straggler's.
CONDITIONS = {
    "dropout": dict(client_dropout=0.3, stragglers=0.5, straggler_speed="uniform:0.2,1"),
    "deadline": dict(client_dropout=0.3, stragglers=0.5, straggler_speed="uniform:0.2,1",
                     round_deadline=2.0)}
CONDITION_ROWS = tuple((name, "dropout") for name in (
    "fedavg", "ditto", "fedrep", "fedala", "fedora", "pfedhn", "fedfomo", "scaffold",
    "fedcac", "perfedavg", "pfedme", "fedadmm")) + (("fedavg", "ala,dropout"),
                                                    ("ditto", "deadline"))
FULL = Path(1, None, 1.0)
# Byzantine clients and the robust aggregators: every rule and every attack on
# FedAvg, paired so each row has both, and one pairing on each other host of a shared
# part (FedCP's and FedPAC's is a part of their server). "attack=X:sampled" draws the
# attackers anew each round; one client in six attacks.
ATTACKERS = 1 / 6
BYZANTINE_ROWS = (
    ("fedavg", "aggregation=median,attack=sign_flip"),
    ("fedavg", "aggregation=trimmed_mean,attack=gaussian:sampled"),
    ("fedavg", "aggregation=krum,attack=alie"),
    ("fedavg", "aggregation=multi_krum,attack=ipm:sampled"),
    ("fedavg", "aggregation=centered_clip,attack=label_flip"),
    ("fedavg", "aggregation=norm_bound,attack=alie:sampled"),
    *((host, "aggregation=centered_clip,attack=alie") for host in
      ("apfl", "fedala", "fedcp", "fedpac", "fedper", "fedrep", "fedrod", "lg_fedavg")))
# User-level DP on every host that declares what it needs (the "dp" rows of
# pairings), with adaptive clipping so the server's clip norm moves too, and on FedAvg
# with dropouts (a dropped client lowers the noised sum, not its denominator).
DP_CONFIG = dp.DpConfig(clip_norm=1.0, noise_multiplier=0.5, delta=1e-5,
                        adaptive_clip_quantile=0.5, clipped_count_stddev=1.0)
DP_ROWS = (("fedavg", "dp,dropout"),)


def pairings() -> list[tuple[str, str]]:
  """(algorithm, plug-in) for every algorithm alone and every plug-in on every host, and
  the OPTION_ROWS (algorithm, "field=value")."""
  pairs = [(name, "") for name in sorted(algorithms.REGISTRY)]
  pairs += [(host, "ala") for host in algorithms.ala_hosts()]
  pairs += [(host, "confree") for host in algorithms.confree_hosts()]
  pairs += [(host, "dp") for host in algorithms.dp_hosts()]
  return (pairs + list(OPTION_ROWS) + list(BYZANTINE_ROWS) + list(CONDITION_ROWS)
          + list(DP_ROWS))


def byzantine_plugins(plugin: str) -> dict:
  """The robust aggregation and the attack a BYZANTINE_ROWS entry names."""
  given = dict(option.split("=") for option in plugin.split(","))
  attack, _, sampled = given["attack"].partition(":")
  return {"aggregation": robust.RobustConfig(rule=given["aggregation"]),
          "attack": byzantine.AttackConfig(attack=attack, fraction=ATTACKERS,
                                           sampled=sampled == "sampled")}


def conditions_of(plugin: str) -> dict:
  """The TrainConfig fields of a CONDITION_ROWS row ({} for the others)."""
  return next((CONDITIONS[p] for p in plugin.split(",") if p in CONDITIONS), {})


def paths_of(plugin: str) -> tuple[Path, ...]:
  return PATHS + ((FULL,) if conditions_of(plugin) else ())


def config_of(name: str, plugin: str):
  config = tiny.default_config(name)
  plugin = ",".join(p for p in plugin.split(",")
                    if p not in MODEL_ROWS and p not in CONDITIONS)
  if not plugin:
    return config
  if "attack=" in plugin:
    return algorithms.Plugged(config, **byzantine_plugins(plugin))
  if "=" in plugin:
    given = dict(option.split("=") for option in plugin.split(","))
    return config._replace(**{field: type(getattr(config, field))(value)
                              if type(getattr(config, field)) in (int, float) else value
                              for field, value in given.items()})
  if plugin == "ala":
    return algorithms.Plugged(config, ala=ala.AlaConfig())
  if plugin == "confree":
    return algorithms.Plugged(config, aggregation=confree.ConfreeConfig())
  if plugin == "dp":
    return algorithms.Plugged(config, dp=DP_CONFIG)
  return config


def client_sizes(num_clients: int) -> tuple[int, ...]:
  return tuple(SIZES[i % len(SIZES)] for i in range(num_clients))


def run_path(name: str, plugin: str, path: Path, num_clients: int = len(SIZES)) -> dict:
  """Two rounds on `path`: the per-client metrics of both, as lists."""
  models = [MODEL_ROWS[p] for p in plugin.split(",") if p in MODEL_ROWS]
  make_model, x_shape = models[0] if models else (tiny.tiny_model, None)
  data, _ = tiny.tiny_data(client_sizes(num_clients), x_shape=x_shape)
  config = config_of(name, plugin)
  data = tiny.with_public(data, algorithms.public_size(name, config), x_shape)
  model = make_model()
  train = TrainConfig(rounds=2, local_epochs=2, batch_size=4, lr=0.1, momentum=0.9,
                      log_every=0, client_chunk=path.client_chunk,
                      participation=path.participation, **conditions_of(plugin))
  mesh = sharding.client_mesh(jax.devices()[:path.devices])
  result = run_algorithm(algorithms.make(name, config), model, data, train,
                         mesh=mesh)
  history = result.history
  return {"val_loss": history.val_loss.tolist(), "test_acc": history.test_score.tolist(),
          "train_loss": history.train_loss.tolist(),
          "local_steps": history.local_steps.tolist(),
          "bytes_up": history.bytes_up.tolist(), "bytes_down": history.bytes_down.tolist()}


def main(shard: int, num_shards: int, num_clients: int = len(SIZES)) -> None:
  assert jax.device_count() >= 2, jax.devices()
  rows = {}
  for name, plugin in pairings()[shard::num_shards]:
    try:
      rows[f"{name}+{plugin}"] = [run_path(name, plugin, p, num_clients)
                                  for p in paths_of(plugin)]
    except Exception as e:  # pylint: disable=broad-except
      rows[f"{name}+{plugin}"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
  print(json.dumps(rows))


if __name__ == "__main__":
  main(*map(int, sys.argv[1:4]))
