"""Command-line flags of experiments.main (shared by reproduce and benchmark), and the
ExperimentConfig they describe: each flag that sets the config is the setting of its
name (fedora_jax/settings.py), and the config is built from them there.

Run and data flags, client training flags, then one group per registered algorithm,
generated from its config: --<algorithm>_<field> (or the registry's own name for it),
default None meaning "the config's value", plus --<algorithm>_variant for an algorithm
with presets (FEDORA's paper and authors' settings). Presets of whole runs live in
experiments/configs/*.flags (--flagfile).
"""

import sys
import textwrap

from absl import flags

from fedora_jax import accounting, algorithms, availability
from fedora_jax import settings as settings_lib
from fedora_jax.algorithms import ala as ala_lib
from fedora_jax.algorithms import byzantine as byzantine_lib
from fedora_jax.algorithms import confree as confree_lib
from fedora_jax.algorithms import dp as dp_lib
from fedora_jax.algorithms import robust as robust_lib
from fedora_jax.data import datasets, partitions
from fedora_jax.engine.precision import PRECISIONS
from fedora_jax import sweep
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.host_simulation import CLIENT_DATA
from fedora_jax.models import MODELS
from fedora_jax.rounds import CLIENT_WEIGHTS
from fedora_jax.train import ExperimentConfig

FLAGS = flags.FLAGS

# Run and data.
# Names in any case (PFLlib's FedAvg is fedavg); the flag holds the registry's spelling.
flags.DEFINE_enum("algorithm", "fedora", sorted(algorithms.REGISTRY), "Algorithm to run.",
                  case_sensitive=False)
flags.DEFINE_enum("dataset", "rmnist", sorted(datasets.DATASETS), "Federated dataset.",
                  case_sensitive=False)
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
flags.DEFINE_enum("split", None, list(partitions.SPLITS),
                  "Clients' sampling: ours (default) or authors, the FEDORA authors'"
                  " loader draw for draw, seeded with the data seed (their runs:"
                  " --data_seed=42): rotated clients (their rotated-MNIST loader), or"
                  " pathological ones (CIFAR-10: their pFedHN loader, fixed class pairs,"
                  " 20 training images a client). Balanced setting only.")
flags.DEFINE_integer("classes_per_client", None, "pathological: classes per client"
                     " (default: the dataset's, 2).", lower_bound=1)
flags.DEFINE_float("dirichlet_alpha", None, "dirichlet: concentration alpha (default 0.3;"
                   " parameter coaching uses 0.1 and 0.3).")
flags.DEFINE_float("synthetic_alpha", None, "--dataset=synthetic: std of each client's"
                   " model mean u_k (model skew; default 1).", lower_bound=0)
flags.DEFINE_float("synthetic_beta", None, "--dataset=synthetic: std of each client's"
                   " feature mean B_k (feature skew; default 1).", lower_bound=0)
flags.DEFINE_float("synthetic_size_mu", None, "--dataset=synthetic: a client's size is"
                   " int(lognormal(mu, sigma)) + 50; mu (default 4, FedProx's).")
flags.DEFINE_float("synthetic_size_sigma", None, "--dataset=synthetic: that lognormal's"
                   " sigma (default 2, FedProx's).", lower_bound=0)
flags.DEFINE_integer("min_client_size", None, "Training samples every client must get"
                     " (default 1); dirichlet redraws until it holds.", lower_bound=0)
flags.DEFINE_integer("fixed_train_size", None, "Training samples each regular client keeps"
                     " (default: rotation 128, Appendix B; label-skew partitions 2/3 of"
                     " the client's whole share, 1/3 going to validation).",
                     lower_bound=1)
flags.DEFINE_integer("fixed_val_size", None, "With --fixed_train_size: validation samples"
                     " per regular client (default: half of --fixed_train_size).",
                     lower_bound=1)
flags.DEFINE_float("val_fraction", None, "Label-skew partitions without fixed sizes: the"
                   " share of each client's pool held out for validation (default 1/3,"
                   " Appendix B's 64 : 128).")
flags.DEFINE_float("data_fraction", None, "Partition a seeded random share of the training"
                   " set and of the test set only (default 1: all; parameter coaching's 10"
                   " clients hold 0.1).")
flags.DEFINE_integer("rounds", 500, "Communication rounds.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of model init and training randomness.")
flags.DEFINE_integer("data_seed", None, "Seed of the client partition (default: --seed).")
# Several runs (fedora_jax/sweep: run_configs trains those that differ only in values as
# one program, fedora_jax/batch.py).
flags.DEFINE_integer("seeds", 1, "Run seeds --seed .. --seed+N-1, as one compiled program"
                     " where they can share one, and report mean and std; each run in its"
                     " default workdir, or --workdir/[<name>=<value>,...]/seed<s>.",
                     lower_bound=1)
flags.DEFINE_multi_string("sweep", [], "name=v1,v2,...: run each value of the run flag"
                          " --name (each combination of several --sweep; each over"
                          " --seeds), as one program where the values keep its shapes"
                          " (--lr, --weight_decay, an algorithm's float hyperparameter),"
                          " one program each otherwise; --sweep=algorithm=local,...: LOCAL"
                          " is the others' reference (algorithm=all: every registered"
                          " one). With --workdir, the table in <workdir>/sweep.md")
flags.DEFINE_bool("batch_runs", True, "--seeds, --sweep and reproduce's rows that differ"
                  " only in values train as one program; false: one at a time.")
RUNS_PER_STEP = flags.DEFINE_integer(
    "runs_per_step", None, "Runs of one program (--seeds, --sweep, reproduce's rows,"
    " benchmark's --runs_per_program) stepped at once (lax.map over chunks of them;"
    " default: one on CPUs, all (vmapped) on accelerators).", lower_bound=1)
flags.DEFINE_string("workdir", None, "Where results go (default: runs/<dataset>_"
                    "<setting>_<algorithm>_seed<seed>_<hash of every other setting but"
                    " --rounds>, so a changed setting never collides and the same command"
                    " resumes).")
flags.DEFINE_string("reference", None, "results.json of a LOCAL run on the same split to"
                    " measure R-Acc and PTR against; without it the run trains LOCAL too."
                    " A LOCAL run of more rounds is read at this run's last round; 'none':"
                    " no LOCAL, R-Acc and PTR null (a model per client that does not fit).")
flags.DEFINE_float("max_pad_ratio", 2.0, "Size buckets: a client is padded to at most this"
                   " many times its training-set size.", lower_bound=1.0)
flags.DEFINE_integer("new_clients", 0, "FEDORA's Algorithm 2: hold this many clients out of"
                     " training; afterwards each gets its propagated model, used as is and"
                     " fine-tuned, against FedAvg's global model.", lower_bound=0)
flags.DEFINE_integer("public_size", None, "Training samples held out of every client as a"
                     " public set, for algorithms that distil on one (FedMD); default: the"
                     " size the algorithm declares, none for the others.", lower_bound=0)
flags.DEFINE_integer("new_client_epochs", 5, "Epochs a new client with labels trains.",
                     lower_bound=1)
flags.DEFINE_bool("verbose", False, "Show the Python traceback of an unexpected error,"
                  " and JAX's, XLA's and absl's own log lines.")
flags.DEFINE_integer("log_every", 50, "Progress: on a terminal a live bar; otherwise a line"
                     " every N rounds (0: neither).", lower_bound=0)
flags.DEFINE_integer("eval_every", 1, "Score test every N rounds, at the last round and at"
                     " each round whose mean validation score is the best so far (so the"
                     " final and best-validation results are exact; the history's other"
                     " rounds hold NaN test scores). Validation is scored every round.",
                     lower_bound=1)
flags.DEFINE_integer("checkpoint_every", 50, "Checkpoint every N rounds and after the last"
                     " one, into <workdir>/checkpoints; rerunning the same command resumes"
                     " from the latest (0: no checkpoints, always start afresh).",
                     lower_bound=0)
flags.DEFINE_float("stall_timeout", None, "Seconds a round may run without finishing before"
                   " the run ends with a one-line error and exit status 75, its last"
                   " checkpoint kept, so that rerunning the command resumes (a hung run"
                   " never waits forever). Default: 20 times the median round so far, at"
                   " least 600 s. 0: no watchdog.", lower_bound=0)
flags.DEFINE_float("compile_timeout", 3600, "Seconds the model and algorithm init,"
                   " compilation and the first round may take before the run ends as with"
                   " --stall_timeout.", lower_bound=0)
flags.DEFINE_bool("keep_checkpoints", True, "Keep <workdir>/checkpoints once the run has"
                  " finished. --nokeep_checkpoints deletes them then (and its LOCAL"
                  " reference's): results.json, history.npz and timing.json stay, which is"
                  " all `reproduce` reads a finished row from, but the run can no longer be"
                  " extended to more --rounds. A 100-client CNN run keeps ~0.7 GB.")

flags.DEFINE_bool("per_client", False, "Print each client's scores (they are always in"
                  " <workdir>/clients.csv), not just the run's summary.")
flags.DEFINE_string("help_algorithm", None, "Show one algorithm's flags (its"
                    " hyperparameters) with their defaults, and exit.")

# Devices and processes (experiments/cli.py). The client axis is split over every device
# of every process; results do not depend on how many there are.
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
flags.DEFINE_enum("client_weights", None, list(CLIENT_WEIGHTS), "Each client's weight in"
                  " the server's averages (FedAvg's and every algorithm's aggregate):"
                  " samples, its training samples n_k (McMahan et al.; the default), or"
                  " uniform, 1 for every client the round trained (docs/runs.md).")
# Clients as they really are (fedora_jax/availability.py; docs/communication.md). Checked
# by train.check_config, so a bad value is one line naming its flag.
flags.DEFINE_float("client_dropout", 0.0, "Probability that a sampled client drops before"
                   " uploading, drawn per round per client from the round key: to the"
                   " server it is a client that was not sampled, and its state stays."
                   " In [0, 1).")
flags.DEFINE_string("availability_trace", None, "A [rounds x K] table of 0/1 (a .npy array,"
                    " or text: one row a round, K entries separated by spaces or commas):"
                    " a sampled client marked 0 in the round's row is offline and drops;"
                    " round r reads row r mod the rows.")
flags.DEFINE_float("stragglers", 0.0, "Probability that a client straggles in a round:"
                   " it completes only --straggler_speed of its local steps (or, with"
                   " --round_deadline, drops if too slow). In [0, 1].")
flags.DEFINE_string("straggler_speed", availability.DEFAULT_SPEED, "A straggler's speed, the"
                    " share of its local steps it completes: uniform:LO,HI (drawn per"
                    " round) or a fixed fraction S.")
flags.DEFINE_float("round_deadline", 0.0, "How long the server waits, in units of a full"
                   " client's local-training time: it takes finished work only, so a"
                   " straggler of speed s with s * deadline < 1 drops and the others train"
                   " all their steps. 0: no deadline (stragglers send partial work).")
flags.DEFINE_enum("precision", None, list(PRECISIONS), "The model's arithmetic: float32"
                  " (default), or bfloat16 with float32 parameters, gradients and optimizer"
                  " state (fast on accelerators' bfloat16 units, slow on CPUs).")
flags.DEFINE_enum("client_data", None, list(CLIENT_DATA), "Where the clients' data live:"
                  " device (default), every client stacked on the device; host, in host"
                  " memory or generated per sampled client, only a round's sampled clients"
                  " moved to the device (FedAvg-like algorithms; the same numbers;"
                  " docs/performance.md).")
flags.DEFINE_integer("eval_clients", None, "With --client_data=host: clients scored a"
                     " round, drawn from --seed (the last round scores all; default all).",
                     lower_bound=1)
flags.DEFINE_integer("eval_batch_size", None, "Samples a client's evaluation forwards at"
                     " once (default on CPUs: 64 for the CNNs, else 1024; see"
                     " models.default_eval_batch_size).", lower_bound=1)
flags.DEFINE_integer("client_chunk", None, "Clients trained together: 0 vmaps all of them,"
                     " n > 0 runs lax.map over chunks of n on each device (default on CPUs:"
                     " cnn 1, mlp 2; elsewhere 0; see models.default_client_chunk).",
                     lower_bound=0)

_DEFINE_BY_TYPE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                   float: flags.DEFINE_float, str: flags.DEFINE_string}
# Flag -> the algorithm whose hyperparameter it is (names can share prefixes:
# --fedprox_mu and --fedprox_ft_mu belong to different algorithms).
OWNER_OF_FLAG: dict[str, str] = {}


_PARTITION_FLAGS = {"kind": "partition", "train_per_client": "fixed_train_size",
                    "val_per_client": "fixed_val_size"}


def flag_name(owner: str, field: str) -> str:
  """--<owner>_<field>, unless the registry names it otherwise (--coach_lambda); the
  run's own fields (owners "experiment" and "train") are flags of their own name."""
  if owner in ("experiment", "train"):
    return field
  if owner == "partition":  # PartitionConfig's fields by their flags
    return _PARTITION_FLAGS.get(field, field)
  return settings_lib.setting_name(owner, field)  # an algorithm's, a plug-in's


def _preset_values(registered, field) -> str:
  values = {name: {**registered.config_class._field_defaults, **preset}[field]
            for name, preset in registered.presets.items()}
  return "; ".join(f"{name}: {value!r}" for name, value in values.items())


def _define_algorithm_flags() -> None:
  """--<algorithm>_<field> for each hyperparameter of every registered algorithm, and
  --<algorithm>_variant for one with presets. Defaults stay None, meaning "the config's
  (or the preset's) value", so a flag's absence and its paper value read the same."""
  for name, registered in algorithms.REGISTRY.items():
    if registered.presets:
      flags.DEFINE_enum(f"{name}_variant", registered.default_preset,
                        sorted(registered.presets), registered.preset_help + ".")
      OWNER_OF_FLAG[f"{name}_variant"] = name
    for field, default in registered.config_class._field_defaults.items():
      if field in registered.train_fields:
        continue
      help_text = registered.flag_help.get(field, field.replace("_", " "))
      values = _preset_values(registered, field) if registered.presets else f"default: {default!r}"
      name_of_flag = flag_name(name, field)
      _DEFINE_BY_TYPE[type(default)](name_of_flag, None, f"{help_text} ({values}).")
      OWNER_OF_FLAG[name_of_flag] = name


_define_algorithm_flags()

# Plug-ins around the chosen algorithm. --ala_* are also FedALA's own flags.
flags.DEFINE_bool("ala", False, "FedALA's Adaptive Local Aggregation in front of the"
                  f" algorithm's local training (hosts: {', '.join(algorithms.ala_hosts())});"
                  " settings --ala_*.")
flags.DEFINE_enum("aggregation", "mean", ["mean", "confree", *robust_lib.RULES],
                  "Server aggregation of the shared part: mean (the algorithm's own),"
                  " confree (ConFREE, conflict-free; settings --confree_*), or a"
                  " Byzantine-robust rule (median, trimmed_mean, krum, multi_krum,"
                  " centered_clip, norm_bound; settings --robust_*; docs/robustness.md);"
                  f" hosts: {', '.join(algorithms.confree_hosts())}.")
# "default", not "paper": ConFREE's paper gives none of these values
# (docs/algorithms/confree.md says where each default comes from).
for _field, _default in confree_lib.ConfreeConfig._field_defaults.items():
  _DEFINE_BY_TYPE[type(_default)](f"confree_{_field}", None,
                                  f"{confree_lib.FLAG_HELP[_field]} (default: {_default!r}).")
PLUGIN_FLAGS = {"ala": tuple(f"ala_{field}" for field in ala_lib.AlaConfig._fields),
                "aggregation": tuple(f"confree_{field}"
                                     for field in confree_lib.ConfreeConfig._fields)}
# The robust rules' settings and the attackers (settings.CHOSEN_PLUGINS).
for _field, _default in robust_lib.RobustConfig._field_defaults.items():
  if _field != "rule":
    _DEFINE_BY_TYPE[type(_default)](f"robust_{_field}", None,
                                    f"{robust_lib.FLAG_HELP[_field]} (default: {_default!r}).")
flags.DEFINE_enum("attack", "none", ["none", *byzantine_lib.ATTACKS],
                  "Byzantine clients: what the --attackers upload in place of their update"
                  " of the shared part (sign_flip, gaussian, alie, ipm) or train on"
                  " (label_flip); settings --attack_*; docs/robustness.md; hosts: as"
                  " --aggregation's.")
flags.DEFINE_float("attackers", None, "The fraction of the clients that attack, in [0, 1):"
                   " round(fraction K) of them, a set drawn from the seed (default: 0.2"
                   " with --attack).")
flags.DEFINE_bool("attackers_sampled", None, "Draw the attackers anew each round, rather than"
                  " one set for the run (default: false).")
for _field in ("std", "epsilon", "z"):
  _DEFINE_BY_TYPE[float](f"attack_{_field}", None, f"{byzantine_lib.FLAG_HELP[_field]}"
                         f" (default: {byzantine_lib.AttackConfig._field_defaults[_field]!r}).")
# User-level DP (docs/privacy.md): any --dp_* flag turns it on.
_DP_CHOICES = {"accountant": list(accounting.ACCOUNTANTS), "sampling": list(accounting.SAMPLINGS)}
for _field, _help in dp_lib.FLAG_HELP.items():
  _default = dp_lib.DpConfig._field_defaults[_field]
  _help = f"{_help} (default: {'unset' if _default is None else repr(_default)})."
  if _field in _DP_CHOICES:
    flags.DEFINE_enum(f"dp_{_field}", None, _DP_CHOICES[_field], _help)
  else:
    flags.DEFINE_float(f"dp_{_field}", None, _help)
DP_FLAGS = tuple(settings_lib.DP_SETTINGS)
BYZANTINE_FLAGS = (tuple(f"robust_{field}" for field in robust_lib.RobustConfig._fields
                         if field != "rule")
                   + ("attack", "attackers", "attackers_sampled", "attack_std",
                      "attack_epsilon", "attack_z"))


def flag_lines(name: str) -> list[str]:
  """--name, its default and its help (an enum's choices as words), wrapped."""
  flag = FLAGS[name]
  default = "" if flag.default is None else f" (default: {flag.default_as_str.strip(chr(39))})"
  text = flag.help
  if text.startswith("<") and ">: " in text:  # absl's "<a|b|c>: " before an enum's help
    choices, text = text[1:].split(">: ", 1)
    text = f"{text} One of: {', '.join(choices.split('|'))}."
  return [f"  --{name}{default}"] + textwrap.wrap(text, 86, initial_indent="      ",
                                                  subsequent_indent="      ")


def algorithm_help(name: str) -> str:
  """`name`'s flags, each with its help and default, under its paper (--help_algorithm)."""
  registered = algorithms.get(name)
  name = algorithms.canonical_name(name)
  paper = (sys.modules[registered.factory.__module__].__doc__ or name).strip().splitlines()[0]
  owned = [flag for flag, owner in OWNER_OF_FLAG.items() if owner == name]
  lines = [f"--algorithm={name}: {paper}"]
  if not owned:
    lines.append("  no hyperparameters of its own; the training flags (--lr,"
                 " --local_epochs, ...) apply")
  for flag in owned:
    lines += flag_lines(flag)
  if name in algorithms.ala_hosts():
    lines.append("  takes FedALA's ALA plug-in: --ala (settings --ala_*)")
  if name in algorithms.dp_hosts():
    lines.append("  takes user-level DP: --dp_clip_norm with --dp_noise_multiplier or"
                 " --dp_target_epsilon (settings --dp_*; docs/privacy.md)")
  if name in algorithms.confree_hosts():
    lines.append("  takes ConFREE's aggregation: --aggregation=confree (settings --confree_*)")
    lines.append("  takes the robust rules (--aggregation=median, ...) and --attack"
                 " (docs/robustness.md)")
  return "\n".join(lines)


def settings() -> dict:
  """The run's settings as the flags hold them (fedora_jax/settings.py's names, which
  are the flags'; None: unset)."""
  names = settings_lib.names()
  return {flag.name: flag.value for flag in run_flags() if flag.name in names}


def given_settings() -> dict:
  """The settings the command line (or a flagfile) gives: a sweep's rows run with them."""
  return {name: value for name, value in settings().items() if FLAGS[name].present}


def experiment_config() -> ExperimentConfig:
  """The experiment the flags describe (plug-ins checked before any work)."""
  return settings_lib.from_settings(settings())


def sweep_values() -> dict[str, list]:
  """--sweep's values by setting name, each parsed as its flag parses it."""
  grid: dict[str, list] = {}
  for given in FLAGS.sweep:
    name, _, text = given.partition("=")
    name = name.strip().lstrip("-")
    if name not in settings_lib.names() or name not in FLAGS:
      raise ConfigError(f"--sweep={given}: {name!r} is not a run flag (name=v1,v2,...,"
                        " e.g. --sweep=fedprox_mu=0.01,0.1)")
    if name in grid or name in ("seeds", "sweep"):
      raise ConfigError(f"--sweep={given}: {name} swept twice")
    if name == "algorithm" and text.strip() == "all":  # LOCAL first: the others' reference
      text = ",".join([algorithms.REFERENCE] + [a for a in algorithms.REGISTRY
                                                if a != algorithms.REFERENCE])
    try:
      values = [FLAGS[name].parser.parse(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as e:
      raise ConfigError(f"--sweep={given}: {e}") from None
    if not values:
      raise ConfigError(f"--sweep={given}: no values (name=v1,v2,...)")
    grid[name] = values
  return grid


def runs() -> list[sweep.Row]:
  """The runs the flags describe: one, or --seeds' and --sweep's (sweep.seeds_grid)."""
  return sweep.seeds_grid(settings(), sweep_values(), FLAGS.seed, FLAGS.seeds,
                          FLAGS.workdir)


# --helpfull lists flags by the module that registered them, modules in name order: this
# module's flags are registered under these headings, which sort before the libraries'
# (absl, jax, orbax). Flags not named here are the run's own (group 1).
_HELP_GROUPS = {
    "1. the run: algorithm, data, seeds": (
        "algorithm", "dataset", "data_dir", "data_source", "num_clients", "setting",
        "rounds", "seed", "data_seed", "new_clients", "new_client_epochs", "public_size",
        "seeds", "sweep",
        "batch_runs", "runs_per_step"),
    "2. client partition": (
        "partition", "split", "classes_per_client", "dirichlet_alpha", "min_client_size",
        "synthetic_alpha", "synthetic_beta", "synthetic_size_mu", "synthetic_size_sigma",
        "fixed_train_size", "fixed_val_size", "val_fraction", "data_fraction",
        "max_pad_ratio"),
    "3. model and client training": (
        "model", "hidden", "local_epochs", "batch_size", "lr", "momentum", "weight_decay",
        "participation", "client_weights", "eval_batch_size", "client_chunk",
        "client_dropout", "availability_trace", "stragglers", "straggler_speed",
        "round_deadline", "precision", "client_data", "eval_clients"),
    "4. output: workdir, progress, checkpoints, watchdog": (
        "workdir", "reference", "per_client", "log_every", "eval_every", "checkpoint_every",
        "keep_checkpoints", "stall_timeout", "compile_timeout", "verbose", "help_algorithm"),
    "5. devices and processes": (
        "cpu_devices", "distributed", "coordinator_address", "num_processes", "process_id"),
    "6. plug-ins: ALA (--ala) and ConFREE (--aggregation=confree)": (
        ("ala", "aggregation") + PLUGIN_FLAGS["aggregation"]),
    "6. plug-ins: robust aggregation (--aggregation=median, ...) and attackers (--attack)": (
        BYZANTINE_FLAGS),
    "6. plug-ins: user-level differential privacy (--dp_clip_norm, ...)": DP_FLAGS,
}
_GROUP_OF_FLAG = {name: group for group, names in _HELP_GROUPS.items() for name in names}


def _help_group(name: str) -> str:
  if name in OWNER_OF_FLAG:  # an algorithm's hyperparameters (FedALA's: --ala_*)
    return f"7. algorithm {OWNER_OF_FLAG[name]}"
  return _GROUP_OF_FLAG.get(name, "1. the run: algorithm, data, seeds")


_HELP_MODULES: set[str] = set()


def _register_by_group() -> None:
  by_module = FLAGS.flags_by_module_dict()
  for flag in by_module.pop(__name__, []):
    group = _help_group(flag.name)
    _HELP_MODULES.add(group)
    FLAGS.register_flag_by_module(group, flag)


def run_flags() -> list:
  """Every flag this module defines (the run's settings), whatever heading it is under."""
  by_module = FLAGS.flags_by_module_dict()
  return [flag for group in sorted(_HELP_MODULES) for flag in by_module.get(group, [])]


def as_flag_error(error: FieldError) -> str:
  """A config field's error in the command line's words: --fedprox_mu must be >= 0."""
  return f"--{flag_name(error.owner, error.field)} {error.problem}"


_register_by_group()
