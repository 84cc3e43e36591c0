"""Command-line flags shared by experiments.main (and later reproduce / benchmark).

Flags are grouped by prefix: run and data flags, client training flags, then one group
per algorithm (--fedora_*). Presets live in experiments/configs/*.flags (--flagfile).
"""

import os

from absl import flags

import jax

from fedora_jax import algorithms
from fedora_jax.algorithms import ala as ala_lib
from fedora_jax.algorithms import confree as confree_lib
from fedora_jax.algorithms import fedora as fedora_lib
from fedora_jax.data import datasets, partitions
from fedora_jax.engine import sharding
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError
from fedora_jax.experiment import TrainConfig
from fedora_jax.models import MODELS, default_client_batch

FLAGS = flags.FLAGS

# Run and data.
flags.DEFINE_enum("algorithm", "fedora", sorted(algorithms.REGISTRY), "Algorithm to run.")
flags.DEFINE_enum("dataset", "rmnist", sorted(datasets.DATASETS), "Federated dataset.")
flags.DEFINE_string("data_dir", None, "Data root, one folder per dataset (mnist/,"
                    " fashion-mnist/, cifar10/, cifar100/, gtsrb/, yearbook/, leaf/);"
                    " a missing one with a public source is downloaded into it; or one"
                    " dataset's own folder. Default: $FEDORA_JAX_DATA, else"
                    " ~/.cache/fedora_jax (MNIST: else the copy in the package).")
flags.DEFINE_enum("data_source", "files", list(datasets.DATA_SOURCES),
                  "files: the dataset's own files in --data_dir; tfds: a prepared TFDS"
                  " dataset (ArrayRecord; mnist, fashion_mnist, cifar10, cifar100) read"
                  " with tfds.data_source from the data root (default: the one above if"
                  " it holds it, else ~/tensorflow_datasets).")
flags.DEFINE_integer("num_clients", None, "Number of clients K (default: the dataset's,"
                     " 36 for rmnist).", lower_bound=1)
flags.DEFINE_enum("setting", "balanced", list(partitions.SETTINGS),
                  "Client sizes: balanced, or imbalanced (one client holds the rest).")
# Client partition (fedora_jax/data/partitions.py); None: the dataset's default.
flags.DEFINE_enum("partition", None, list(partitions.KINDS),
                  "How clients are cut (default: the dataset's; rotation for rmnist and"
                  " rfmnist, pathological for cifar10, iid for mnist).")
flags.DEFINE_integer("classes_per_client", None, "pathological: classes per client"
                     " (default: the dataset's, 2).", lower_bound=1)
flags.DEFINE_float("dirichlet_alpha", None, "dirichlet: concentration alpha (default 0.3;"
                   " parameter coaching uses 0.1 and 0.3).")
flags.DEFINE_integer("min_client_size", None, "Training samples every client must get"
                     " (default 1); dirichlet redraws until it holds.", lower_bound=0)
flags.DEFINE_integer("fixed_train_size", None, "Training samples each regular client keeps"
                     " (default: rotation 128, Appendix B; label-skew partitions 2/3 of"
                     " the client's whole share, 1/3 going to validation).",
                     lower_bound=1)
flags.DEFINE_integer("fixed_val_size", None, "With --fixed_train_size: validation samples"
                     " per regular client (default: half of --fixed_train_size).",
                     lower_bound=1)
_PARTITION_FLAGS = ("partition", "classes_per_client", "dirichlet_alpha", "min_client_size",
                    "fixed_train_size", "fixed_val_size")
flags.DEFINE_integer("rounds", 500, "Communication rounds.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of model init and training randomness.")
flags.DEFINE_integer("data_seed", None, "Seed of the client partition (default: --seed).")
flags.DEFINE_string("workdir", None, "Where results go (default: runs/<dataset>_"
                    "<setting>_<algorithm>_seed<seed>).")
flags.DEFINE_string("reference", None, "results.json of a LOCAL run on the same split to"
                    " measure R-Acc and PTR against; without it the run trains LOCAL too.")
flags.DEFINE_float("max_pad_ratio", 2.0, "Size buckets: a client is padded to at most this"
                   " many times its training-set size.", lower_bound=1.0)
flags.DEFINE_integer("new_clients", 0, "FEDORA's Algorithm 2: hold this many clients out of"
                     " training; afterwards each gets its propagated model, used as is and"
                     " fine-tuned, against FedAvg's global model.", lower_bound=0)
flags.DEFINE_integer("new_client_epochs", 5, "Epochs a new client with labels trains.",
                     lower_bound=1)
flags.DEFINE_bool("verbose", False, "Show the Python traceback of an unexpected error.")
flags.DEFINE_integer("log_every", 50, "Log progress every N rounds (0: never).",
                     lower_bound=0)
flags.DEFINE_integer("checkpoint_every", 50, "Checkpoint every N rounds and after the last"
                     " one, into <workdir>/checkpoints; rerunning the same command resumes"
                     " from the latest (0: no checkpoints, always start afresh).",
                     lower_bound=0)

# Devices and processes (fedora_jax/engine/sharding.py). The client axis is split over
# every device of every process; results do not depend on how many there are.
flags.DEFINE_bool("distributed", False, "Join a multi-process run via"
                  " jax.distributed.initialize(): its environment auto-detection (SLURM,"
                  " Open MPI, TPU pods), or the three flags below.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0, e.g."
                    " 10.0.0.1:1234 (implies --distributed).")
flags.DEFINE_integer("num_processes", None, "Processes in the run (implies --distributed).",
                     lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index, 0 .. --num_processes-1"
                     " (implies --distributed).", lower_bound=0)
flags.DEFINE_integer("cpu_devices", None, "JAX CPU devices to split the clients over"
                     " (default: one per core; 1: JAX's own default, both cores on one"
                     " device). Not changed by default in multi-process runs or when"
                     " XLA_FLAGS sets --xla_force_host_platform_device_count.",
                     lower_bound=1)

# Model and client training (defaults: the FEDORA authors' code).
flags.DEFINE_enum("model", None, sorted(MODELS), "Model (default: the dataset's).")
flags.DEFINE_list("hidden", ["128", "128"], "Hidden widths of the MLP.")
flags.DEFINE_integer("local_epochs", 5, "Local epochs per round.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Local batch size.", lower_bound=1)
flags.DEFINE_float("lr", 5e-3, "Client learning rate.", lower_bound=0.0)
flags.DEFINE_float("momentum", 0.9, "Client SGD momentum.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("weight_decay", 5e-5, "Client weight decay (PyTorch-style, coupled).",
                   lower_bound=0.0)
flags.DEFINE_float("participation", 1.0, "Fraction of clients sampled each round (the"
                  " same clients in the same rounds for every algorithm, from --seed);"
                  " the others keep their state.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("eval_batch_size", 1024, "Evaluation chunk size.", lower_bound=1)
flags.DEFINE_integer("client_batch", None, "Clients trained together: 0 vmaps all of them,"
                     " n > 0 runs lax.map over chunks of n on each device (default on CPUs:"
                     " cnn 1, mlp 2; elsewhere 0; see models.default_client_batch).",
                     lower_bound=0)

# FEDORA (Wu et al., KDD 2023). Explicit flags override the variant's preset; the help
# gives each field's value under the printed equations (paper) and the authors' code.
flags.DEFINE_enum("fedora_variant", fedora_lib.DEFAULT_VARIANT, sorted(fedora_lib.PRESETS),
                  "authors (default): the public code's graph, kappa, lambda rule and pull,"
                  " whose numbers the paper reports (rotated MNIST: Acc 0.816 against the"
                  " paper's 0.825); paper: the equations as printed, which end near LOCAL"
                  " (0.761; see fedora_jax/algorithms/fedora.py).")
flags.DEFINE_float("fedora_alpha", None, "Propagation strength alpha, kappa = alpha/(1+alpha)"
                   " (paper 1; authors' code kappa 0.8, i.e. alpha 4).")
flags.DEFINE_integer("fedora_p", None, "Singular vectors per client subspace (paper 1).")
flags.DEFINE_enum("fedora_weights", None, ["cosine", "exp"],
                  "Graph weights: sum of cosines (paper) or exp(temperature * it) (code).")
flags.DEFINE_float("fedora_temperature", None, "Temperature of exp weights (code: 10).")
flags.DEFINE_bool("fedora_zero_diagonal", None, "Drop self-similarity from W (code).")
flags.DEFINE_integer("fedora_top_k", None, "Keep each client's k strongest neighbours;"
                     " 0 keeps all (paper 0, code 2).")
flags.DEFINE_enum("fedora_lambda_rule", None, list(fedora_lib.LAMBDA_RULES),
                  "lambda = max(eps, diff) (paper) or exp(diff/2), 0 if diff < 0 (code);"
                  " constant: --fedora_lambda_value for every client (Table 5).")
flags.DEFINE_float("fedora_lambda_eps", None, "The paper's lambda floor (1e-8).")
flags.DEFINE_float("fedora_lambda_value", None, "lambda_k of every client with"
                   " --fedora_lambda_rule=constant (default 1; Table 5: 0.01, 0.1, 1, 10).")
flags.DEFINE_enum("fedora_similarity", None, list(fedora_lib.SIMILARITIES),
                  "Client similarity W is built from: principal_angles of the data"
                  " subspaces (paper and code); Table 4's random (FedU), parameters"
                  " (cosine of the client models, FedAMP) or gradients (cosine of the"
                  " client updates, clustered FL), the last two recomputed every round.")
flags.DEFINE_enum("fedora_pull", None, ["prox", "decoupled"],
                  "Proximal term in the loss (paper) or a pull after each step (code).")
flags.DEFINE_integer("fedora_propagation_steps", None,
                     "0: closed-form propagation; n > 0: n steps of the iterative form.")

_FEDORA_FIELDS = ("alpha", "p", "weights", "temperature", "zero_diagonal", "top_k",
                  "lambda_rule", "lambda_eps", "lambda_value", "pull", "propagation_steps",
                  "similarity")
_DEFINE_BY_TYPE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                   float: flags.DEFINE_float, str: flags.DEFINE_string}
# Flag name -> the algorithm whose hyperparameter it is (names can share prefixes:
# --fedprox_mu and --fedprox_ft_mu belong to different algorithms).
_ALGORITHM_OF_FLAG = {f"fedora_{field}": "fedora" for field in (*_FEDORA_FIELDS, "variant")}


def _define_algorithm_flags() -> None:
  """--<algorithm>_<field> for each hyperparameter of every other registered algorithm.

  Defaults stay None, meaning "the paper's value" (the config's own default), so a
  flag's absence and its paper value read the same.
  """
  for name, registered in algorithms.REGISTRY.items():
    if name == "fedora":
      continue
    for field, default in registered.config_class._field_defaults.items():
      help_text = registered.flag_help.get(field, field.replace("_", " "))
      flag_name = _flag_name(name, field)
      _DEFINE_BY_TYPE[type(default)](flag_name, None, f"{help_text} (paper: {default!r}).")
      _ALGORITHM_OF_FLAG[flag_name] = name


def _flag_name(algorithm: str, field: str) -> str:
  """--<algorithm>_<field>, unless the registry names it otherwise (--coach_lambda)."""
  return algorithms.get(algorithm).flag_names.get(field, f"{algorithm}_{field}")


_define_algorithm_flags()

# Plug-ins (issue 7) around the chosen algorithm. --ala_* are also FedALA's own flags.
flags.DEFINE_bool("ala", False, "FedALA's Adaptive Local Aggregation in front of the"
                  " algorithm's local training (hosts: fedavg, fedprox, ditto, apfl, fedamp);"
                  " settings --ala_*.")
flags.DEFINE_enum("aggregation", "mean", ["mean", "confree"],
                  "Server aggregation of the shared part: mean (the algorithm's own) or"
                  " confree (ConFREE, conflict-free; settings --confree_*).")
# "default", not "paper": ConFREE's paper gives none of these values (confree.py says
# where each default comes from).
for _field, _default in confree_lib.ConfreeConfig._field_defaults.items():
  _DEFINE_BY_TYPE[type(_default)](f"confree_{_field}", None,
                                  f"{confree_lib.FLAG_HELP[_field]} (default: {_default!r}).")
_ALA_FLAGS = tuple(f"ala_{field}" for field in ala_lib.AlaConfig._fields)
_CONFREE_FLAGS = tuple(f"confree_{field}" for field in confree_lib.ConfreeConfig._fields)


def train_config() -> TrainConfig:
  if FLAGS.participation <= 0.0:
    raise ConfigError(f"--participation must be in (0, 1], got {FLAGS.participation}")
  return TrainConfig(rounds=FLAGS.rounds, local_epochs=FLAGS.local_epochs,
                     batch_size=FLAGS.batch_size, lr=FLAGS.lr, momentum=FLAGS.momentum,
                     weight_decay=FLAGS.weight_decay, seed=FLAGS.seed,
                     eval_batch_size=FLAGS.eval_batch_size, log_every=FLAGS.log_every,
                     client_batch=client_batch(), participation=FLAGS.participation)


def client_batch() -> int | None:
  """--client_batch, else models.default_client_batch for this platform; None means vmap."""
  if FLAGS.client_batch is not None:
    return FLAGS.client_batch or None
  model = FLAGS.model or datasets.get_spec(FLAGS.dataset).model
  return default_client_batch(model, jax.default_backend())


# Flags that change nothing a run computes, so a workdir may be resumed with other values.
# --rounds may grow: a round's randomness depends only on the seed and the round number and
# there is no schedule, so a longer run extends a shorter one exactly (cutting a run short
# is refused by fedora_jax.checkpoint). --reference only changes what R-Acc compares with.
_NOT_IDENTITY = ("workdir", "rounds", "reference", "log_every", "checkpoint_every", "verbose",
                 "distributed", "coordinator_address", "num_processes", "process_id",
                 "cpu_devices")


# Flags whose default changed, and the value a run recorded before the change ran with.
# run_config.json records every identity flag's value, default or not, so such a run holds
# the old value and is refused by the new default (never resumed as the other variant);
# this entry keeps that true even for a record that lacks the flag.
_ABSENT_MEANS = {"fedora_variant": "paper"}  # the default until 2026-11-26


def identity_defaults() -> dict:
  """Each identity flag's default: at its default a flag counts as absent when a workdir's
  recorded run is compared (checkpoint.claim_workdir), so runs recorded before a flag
  was added still resume. A flag whose default changed counts as absent at its old value
  (_ABSENT_MEANS)."""
  return {flag.name: _ABSENT_MEANS.get(flag.name, flag.default)
          for flag in FLAGS.get_flags_for_module(__name__)
          if flag.name not in _NOT_IDENTITY}


def run_identity(algorithm: str) -> dict:
  """What a run of `algorithm` with these flags computes, kept in run_config.json.

  Every flag of this module except _NOT_IDENTITY, so a flag added later counts by
  default; an algorithm's own group (--fedora_*, --fedprox_*, ...) only for it. Flags as given, not resolved, so an
  explicit default (e.g. --num_clients=36) reads as a different run: refused, never mixed.
  """
  identity = {flag.name: flag.value for flag in FLAGS.get_flags_for_module(__name__)
              if flag.name not in _NOT_IDENTITY}
  identity["algorithm"] = algorithm
  # Plug-in flags count only when the plug-in is on (so runs without one keep their
  # identity); --ala_* always for fedala, whose own flags they are.
  ala_on = FLAGS.ala and algorithm != "local"
  confree_on = FLAGS.aggregation == "confree" and algorithm != "local"
  for k in ("ala", *_ALA_FLAGS) if not ala_on else ():
    if k == "ala" or algorithm != "fedala":
      identity.pop(k, None)
  for k in ("aggregation", *_CONFREE_FLAGS) if not confree_on else ():
    identity.pop(k, None)
  if identity.get("data_source") == "files":  # the default: earlier runs keep their identity
    identity.pop("data_source")
  for k in (*_PARTITION_FLAGS, "client_batch"):  # unset: earlier runs keep their identity
    if identity.get(k) is None:
      identity.pop(k, None)
  # Only the chosen algorithm's own group counts.
  return {k: v for k, v in identity.items()
          if _ALGORITHM_OF_FLAG.get(k, algorithm) == algorithm
          or (ala_on and k in _ALA_FLAGS)}


def algorithm_config(name: str):
  """The algorithm's hyperparameters from its flag group."""
  registered = algorithms.get(name)
  if name != "fedora":
    fields = registered.config_class._fields
    return registered.config_class(**{
        field: FLAGS[_flag_name(name, field)].value for field in fields
        if FLAGS[_flag_name(name, field)].value is not None})
  overrides = {field: FLAGS[f"fedora_{field}"].value for field in _FEDORA_FIELDS
               if FLAGS[f"fedora_{field}"].value is not None}
  config = fedora_lib.config_for_variant(FLAGS.fedora_variant, lr=FLAGS.lr, **overrides)
  if "lambda_value" in overrides and config.lambda_rule != "constant":
    raise ConfigError(f"--fedora_lambda_value is the lambda of --fedora_lambda_rule=constant;"
                      f" this run's rule is {config.lambda_rule}")
  return config


def plugged_config(name: str):
  """The algorithm's config with the plug-ins the flags ask for (algorithms.Plugged), or
  its plain config without any; a one-line ConfigError for an unsupported combination."""
  config = algorithm_config(name)
  ala = aggregation = None
  if FLAGS.ala:
    ala = ala_lib.AlaConfig(**{field: FLAGS[f"ala_{field}"].value
                               for field in ala_lib.AlaConfig._fields
                               if FLAGS[f"ala_{field}"].value is not None})
  if FLAGS.aggregation == "confree":
    aggregation = confree_lib.ConfreeConfig(**{
        field: FLAGS[f"confree_{field}"].value for field in confree_lib.ConfreeConfig._fields
        if FLAGS[f"confree_{field}"].value is not None})
  algorithms.check_plugins(name, ala, aggregation)
  plugged = (config if ala is None and aggregation is None else
             algorithms.Plugged(config=config, ala=ala, aggregation=aggregation))
  # Built once around a stand-in model, so every algorithm's own checks of its
  # hyperparameters run now, before any data is loaded or any workdir claimed.
  stand_in = make_client_trainer(lambda params, x: x, make_optimizer(
      FLAGS.lr, FLAGS.momentum, FLAGS.weight_decay), FLAGS.local_epochs, FLAGS.batch_size)
  algorithms.build(name, plugged, stand_in)
  return plugged


def partition_config(dataset: str) -> partitions.PartitionConfig:
  """The client partition the flags ask for, the dataset's defaults filling the rest."""
  spec = datasets.get_spec(dataset)
  defaults = partitions.PartitionConfig()
  return partitions.PartitionConfig(
      kind=FLAGS.partition or spec.partition, setting=FLAGS.setting,
      classes_per_client=FLAGS.classes_per_client or spec.classes_per_client,
      dirichlet_alpha=(defaults.dirichlet_alpha if FLAGS.dirichlet_alpha is None
                       else FLAGS.dirichlet_alpha),
      min_client_size=(defaults.min_client_size if FLAGS.min_client_size is None
                       else FLAGS.min_client_size),
      train_per_client=FLAGS.fixed_train_size, val_per_client=FLAGS.fixed_val_size)


def hidden_widths() -> tuple[int, ...]:
  try:
    widths = tuple(int(w) for w in FLAGS.hidden)
  except ValueError:
    raise ConfigError(f"--hidden must be comma-separated integers, got {FLAGS.hidden}") from None
  if any(w < 1 for w in widths):
    raise ConfigError(f"--hidden widths must be >= 1, got {FLAGS.hidden}")
  return widths


def configure_cpu_devices() -> None:
  """One JAX CPU device per core (or --cpu_devices), set before any backend starts.

  Each device then runs its share of the clients on its own core, which beat one device
  using both cores by 1.7x for FEDORA's round on a 2-core CPU (docs/performance.md).
  Left alone: multi-process runs (a process per host or core is the user's layout) and
  an XLA_FLAGS that already sets --xla_force_host_platform_device_count."""
  multi_process = FLAGS.distributed or FLAGS.num_processes is not None
  forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
  if FLAGS.cpu_devices is None and (multi_process or forced):
    return
  try:
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices or sharding.cpu_device_count())
  except RuntimeError as e:  # a backend already started (e.g. in a notebook)
    raise ConfigError(f"--cpu_devices must be set before JAX starts: {e}") from None


def initialize_distributed() -> None:
  """Starts jax.distributed when asked to, before anything touches a device."""
  explicit = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ConfigError("--coordinator_address, --num_processes and --process_id go"
                      " together (or use --distributed alone for auto-detection)")
  if FLAGS.num_processes is not None and FLAGS.process_id >= FLAGS.num_processes:
    raise ConfigError(f"--process_id={FLAGS.process_id} must be below"
                      f" --num_processes={FLAGS.num_processes}")
  if FLAGS.distributed or FLAGS.num_processes is not None:
    sharding.initialize_distributed(*explicit)


def shutdown_distributed() -> None:
  """Leaves a multi-process run together with the other processes (a no-op otherwise)."""
  if jax.process_count() > 1:
    jax.distributed.shutdown()
