"""The library's entry point: one experiment from a config to its results files.

  from fedora_jax import train
  results = train.train_and_evaluate(train.ExperimentConfig(dataset="rmnist"), "runs/x")

trains the algorithm, the LOCAL reference its R-Acc and PTR are measured against (unless
`reference` names a LOCAL run's results.json), and for FEDORA's Algorithm 2 the FedAvg
baseline of the held-out clients; writes results.json, timing.json, clients.csv,
rounds.csv, history.npz, the algorithm's arrays, plots and TensorBoard events to
`workdir` (the LOCAL run to `workdir/local`); returns the results document.
`python -m experiments.main` builds an ExperimentConfig from its flags and calls this.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
from typing import Any, Callable

import jax

from fedora_jax import algorithms, availability
from fedora_jax import progress as progress_lib
from fedora_jax import checkpoint as checkpoint_lib
from fedora_jax import metric_writer, new_clients, plots
from fedora_jax import results as results_lib
from fedora_jax.data import datasets, partitions
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.models import build_model, check_inputs
from fedora_jax.progress import Progress
from fedora_jax.algorithms import dp as dp_lib
from fedora_jax.algorithms import robust
from fedora_jax.rounds import CLIENT_WEIGHTS, num_sampled_clients
from fedora_jax.simulation import (TrainConfig, resolve_progress, root_keys,
                                   run_algorithm)
from fedora_jax.watchdog import Watchdog

logger = logging.getLogger("fedora_jax")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """What one experiment computes. Defaults: the paper's rotated-MNIST FEDORA run."""
  dataset: str = "rmnist"
  algorithm: str = "fedora"
  # The algorithm's NamedTuple config, or an algorithms.Plugged with its plug-ins;
  # None: the registry's defaults (FEDORA: the authors' variant).
  algorithm_config: Any = None
  data_dir: str | None = None
  data_source: str = "files"        # or "tfds"
  num_clients: int | None = None    # None: the dataset's (36 for rmnist)
  setting: str = "balanced"         # client sizes: balanced or imbalanced
  partition: partitions.PartitionConfig | None = None  # None: the dataset's default
  data_seed: int | None = None      # None: train.seed
  max_pad_ratio: float = 2.0
  model: str | None = None          # None: the dataset's
  hidden: tuple[int, ...] = (128, 128)
  train: TrainConfig = TrainConfig()
  reference: str | None = None      # a LOCAL run's results.json to compare against
  checkpoint_every: int = 50        # 0: no checkpoints
  keep_checkpoints: bool = True     # False: a finished run deletes its checkpoints
  new_clients: int = 0              # FEDORA's Algorithm 2: clients held out of training
  new_client_epochs: int = 5


def resolved_algorithm_config(config: ExperimentConfig):
  """The algorithm's config, the registry default when none is given."""
  if config.algorithm_config is not None:
    return config.algorithm_config
  return algorithms.default_config(config.algorithm, config.train)


def check_config(config: ExperimentConfig) -> None:
  """One-line ConfigErrors for a bad combination, before any data is loaded."""
  datasets.get_spec(config.dataset)
  algorithm_config = resolved_algorithm_config(config)
  if isinstance(algorithm_config, algorithms.Plugged) and algorithm_config.dp is not None:
    algorithm_config = resolve_dp(algorithm_config, config.train, num_clients_of(config))
  if not 0.0 < config.train.participation <= 1.0:
    raise FieldError("train", "participation",
                     f"must be in (0, 1], got {config.train.participation}")
  if config.train.eval_every < 1:
    raise FieldError("train", "eval_every", f"must be >= 1, got {config.train.eval_every}")
  availability.check_settings(config.train.client_dropout, config.train.stragglers,
                              config.train.straggler_speed, config.train.round_deadline,
                              config.train.availability_trace)
  if config.train.client_weights not in CLIENT_WEIGHTS:
    raise FieldError("train", "client_weights", f"must be one of {', '.join(CLIENT_WEIGHTS)},"
                     f" got {config.train.client_weights!r}")
  if any(w < 1 for w in config.hidden):
    raise FieldError("experiment", "hidden",
                     f"widths must be >= 1, got {','.join(map(str, config.hidden))}")
  # A training field an algorithm's config repeats (FEDORA's, Ditto's, APFL's lr) has
  # one source: a config built without this run's TrainConfig must still agree with it.
  own = (algorithm_config.config if isinstance(algorithm_config, algorithms.Plugged)
         else algorithm_config)
  for field in algorithms.get(config.algorithm).train_fields:
    ours, theirs = getattr(config.train, field), getattr(own, field)
    if ours != theirs:
      raise ConfigError(f"the {config.algorithm} config's {field}={theirs!r} differs from"
                        f" train.{field}={ours!r}; build it with"
                        f" algorithms.default_config({config.algorithm!r}, train)")
  # Built once around a stand-in model, so every algorithm's own checks of its
  # hyperparameters (and its plug-ins') run now.
  train = config.train
  stand_in = algorithms.stand_in_trainer(train.lr, train.momentum, train.weight_decay,
                                         train.local_epochs, train.batch_size)
  algorithms.build(config.algorithm, algorithm_config, stand_in)
  _check_attackers(config, algorithm_config)
  if config.new_clients:
    check_new_clients = algorithms.get(config.algorithm).new_clients
    if check_new_clients is None:
      serving = [name for name, r in algorithms.REGISTRY.items() if r.new_clients]
      raise FieldError("experiment", "new_clients",
                       f"serves clients held out of training, which {config.algorithm} does"
                       f" not; use it with {' or '.join(serving)} (FEDORA's Algorithm 2)")
    check_new_clients(algorithm_config)
    task = datasets.get_spec(config.dataset).task
    if task != "classification":
      raise FieldError("experiment", "new_clients",
                       f"reports accuracies; {config.dataset} is a {task}")


def _check_attackers(config: ExperimentConfig, algorithm_config: Any) -> None:
  """One line where a robust rule cannot tolerate the run's attackers among a round's
  sampled clients (robust.check_tolerance), or label_flip meets data without classes."""
  if not isinstance(algorithm_config, algorithms.Plugged):
    return
  aggregation, attack = algorithm_config.aggregation, algorithm_config.attack
  task = datasets.get_spec(config.dataset).task
  if attack is not None and attack.attack == "label_flip" and task != "classification":
    raise ConfigError(f"--attack=label_flip flips class labels; {config.dataset} is a"
                      f" {task}")
  clients = config.num_clients or datasets.get_spec(config.dataset).num_clients
  if isinstance(aggregation, robust.RobustConfig) and clients is not None:
    robust.check_tolerance(aggregation, attack.fraction if attack is not None else 0.0,
                           num_sampled_clients(config.train.participation, clients))


def num_clients_of(config: ExperimentConfig) -> int:
  """K: the config's, else the dataset's."""
  return config.num_clients or datasets.default_num_clients(config.dataset, config.data_dir)


def resolve_dp(algorithm_config: Any, train: TrainConfig, num_clients: int) -> Any:
  """The algorithm config (a Plugged) with its DP settings fixed for this run
  (dp.resolve: the expected cohort of `num_clients` clients, the noise multiplier of a
  target epsilon); as it was without DP."""
  if not isinstance(algorithm_config, algorithms.Plugged) or algorithm_config.dp is None:
    return algorithm_config
  return algorithm_config._replace(dp=_resolved_dp(
      algorithm_config.dp, train.rounds, num_clients, train.participation,
      num_sampled_clients(train.participation, num_clients)))


@functools.lru_cache(maxsize=16)
def _resolved_dp(dp: dp_lib.DpConfig, rounds: int, num_clients: int, participation: float,
                 sampled: int) -> dp_lib.DpConfig:
  return dp_lib.resolve(dp, rounds, num_clients, participation, sampled)


def _engine_train(train: TrainConfig, dp: dp_lib.DpConfig | None) -> TrainConfig:
  """The TrainConfig the run's engine takes: with Poisson DP sampling every client
  trains each round and the plug-in draws who counts (participation is its rate)."""
  if dp is not None and dp.sampling == "poisson":
    return dataclasses.replace(train, participation=1.0)
  return train


def default_workdir(config: ExperimentConfig) -> str:
  """runs/<dataset>_<setting>_<algorithm>_seed<seed>_<hash>: the hash is of everything
  the run computes but its rounds (config_identity; the data's folder left out), so a
  run with any other setting gets its own folder, and the same config, or more rounds
  of it, resumes in the same one."""
  identity = config_identity(config, config.algorithm)
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
  return os.path.join("runs", f"{config.dataset}_{config.setting}_{config.algorithm}"
                              f"_seed{config.train.seed}_{digest}")


def config_identity(config: ExperimentConfig, algorithm: str) -> dict:
  """What a run of `algorithm` (the config's, or its LOCAL reference) computes, for
  run_config.json when the caller gives no identity (the CLI records its flags): every
  field but those that change nothing a run computes (see checkpoint.claim_workdir)."""
  own = algorithm == config.algorithm
  identity = dataclasses.asdict(dataclasses.replace(
      config, algorithm=algorithm, algorithm_config=None, reference=None,
      checkpoint_every=0, keep_checkpoints=True))
  del identity["data_dir"]  # moving the data changes no number
  identity["algorithm_config"] = repr(resolved_algorithm_config(config)) if own else None
  identity["train"] = {k: v for k, v in _train_info(config.train).items()
                       if k not in ("rounds", "log_every", "eval_every")}
  return json.loads(json.dumps(identity, default=str))


def _run_info(config: ExperimentConfig, num_clients: int, model_name: str,
              partition: partitions.PartitionConfig | None) -> dict:
  """results.json's description of the run (its keys and order are the file format)."""
  spec = datasets.get_spec(config.dataset)
  train = config.train
  info = {"dataset": config.dataset, "algorithm": config.algorithm,
          "setting": config.setting, "num_clients": num_clients, "seed": train.seed,
          "data_seed": _data_seed(config), "rounds": train.rounds, "model": model_name,
          "hidden": list(config.hidden), "devices": jax.device_count(),
          "processes": jax.process_count(), "platform": jax.default_backend(),
          "train": _train_info(train)}
  if spec.task != "classification":
    info["task"] = spec.task  # results name MAE in place of accuracy
  if config.data_source != "files":
    info["data_source"] = config.data_source
  if partition is not None and partition.kind != "rotation":  # rotation keeps its keys
    # `split` is rotation's alone (always "ours" here): left out, as before it existed.
    info["partition"] = {k: v for k, v in partition._asdict().items() if k != "split"}
  if partition is not None and partition.split != "ours":  # absent: our own sampling
    info["split"] = partition.split
  return info


# TrainConfig fields results.json leaves out at their defaults, so that the files of runs
# from before they existed stay as they were.
_OMITTED_AT_DEFAULT = ("eval_every", "client_weights", "client_dropout",
                       "availability_trace", "stragglers", "straggler_speed",
                       "round_deadline", "precision")


def _train_info(train: TrainConfig) -> dict:
  """results.json's `train`: every TrainConfig field, those of _OMITTED_AT_DEFAULT only
  when they are not at their defaults."""
  info = dataclasses.asdict(train)
  defaults = TrainConfig()
  for name in _OMITTED_AT_DEFAULT:
    if info[name] == getattr(defaults, name):
      del info[name]
  return info


def _data_seed(config: ExperimentConfig) -> int:
  return config.train.seed if config.data_seed is None else config.data_seed


def _client_info(federated) -> dict:
  """clients.csv's and results.json's per-client columns besides the scores."""
  data, ids = federated.data, federated.client_ids
  angles = federated.partition.angles
  info = {"id": ids, **({"angle": angles[ids]} if angles is not None else {}),
          "n_train": data.split_sizes("train"), "n_val": data.split_sizes("val"),
          "n_test": data.split_sizes("test")}
  if federated.partition.kind != "rotation" and federated.partition.class_counts is not None:
    info["class_counts"] = federated.partition.class_counts[ids]  # [K, C]
  if federated.groups is not None:  # clients are the data's groups (years), not rotations
    info = {"id": info.pop("id"), "group": federated.groups[ids],
            **{k: v for k, v in info.items() if k != "angle"}}
  return info


def train_and_evaluate(config: ExperimentConfig, workdir: str | None = None,
                       identity: Callable[[str], dict] | None = None,
                       identity_defaults: dict | None = None,
                       progress: Progress | None | str = "auto",
                       watchdog: Watchdog | None = None) -> dict:
  """Runs the experiment `config` into `workdir` (default `default_workdir`); returns the
  results document (results.json) and prints nothing.

  `progress` reports every run it trains, the LOCAL reference included ("auto": a bar in
  a terminal or notebook, else a line every config.train.log_every rounds; None:
  nothing; fedora_jax/progress.py). A `watchdog`
  (fedora_jax/watchdog.py, entered) watches every run's compilation and rounds.

  `identity(algorithm)` is what run_config.json records for the run of `algorithm` (the
  config's, or "local" for its reference) and a rerun must match to resume from the
  workdir's checkpoints (default `config_identity`); `identity_defaults` (setting ->
  default) lets a setting added later count as absent at its default (see
  checkpoint.check_workdir).
  """
  config = dataclasses.replace(config, algorithm=algorithms.canonical_name(config.algorithm))
  check_config(config)
  progress = resolve_progress(progress, config.train.log_every)  # one for every run
  spec = datasets.get_spec(config.dataset)
  algorithm_config = resolved_algorithm_config(config)
  train = config.train
  num_clients = num_clients_of(config)
  algorithm_config = resolve_dp(algorithm_config, train, num_clients)
  dp = algorithm_config.dp if isinstance(algorithm_config, algorithms.Plugged) else None
  # DP's epsilon after each round (accounting.py): rounds.csv, TensorBoard, the progress.
  epsilons = None if dp is None else dp_lib.epsilons(dp, train.rounds, num_clients)
  model_name = config.model or spec.model
  workdir = workdir or default_workdir(config)
  # Every process computes the same results: process 0 writes them to the workdir, the
  # others to workdir/process<i> (no two writers), and all save into the workdir's
  # checkpoints (orbax's multi-process saves: one folder, process 0 finalizes).
  checkpoint_root = workdir
  if jax.process_index() > 0:
    workdir = os.path.join(workdir, f"process{jax.process_index()}")
  partition = None  # datasets whose clients are given by the data have no partition
  if spec.load_groups is None:
    partition = config.partition or datasets.default_partition(config.dataset,
                                                               config.setting)
  run_info = _run_info(config, num_clients, model_name, partition)
  reference = None
  is_reference = config.algorithm == algorithms.REFERENCE  # LOCAL: its own reference
  if config.reference and not is_reference:
    reference = results_lib.load_reference(config.reference, run_info)
  # Before any work: refuse a workdir holding another run, and find checkpoints to resume.
  identity = identity or functools.partial(config_identity, config)
  recorded = identity(config.algorithm)
  if dp is not None:  # the noise it trains with: a target over more rounds is another run
    recorded = {**recorded, "dp_resolved": {"noise_multiplier": dp.noise_multiplier,
                                            "expected_clients": dp.expected_clients}}
  checkpointer = checkpoint_lib.open_run(workdir, recorded, train.rounds,
                                         config.checkpoint_every, checkpoint_root,
                                         identity_defaults)
  local_checkpointer = None
  if not is_reference and reference is None:
    local_checkpointer = checkpoint_lib.open_run(
        os.path.join(workdir, algorithms.REFERENCE), identity(algorithms.REFERENCE),
        train.rounds, config.checkpoint_every,
        os.path.join(checkpoint_root, algorithms.REFERENCE), identity_defaults)

  federated = datasets.build_federated_dataset(
      config.dataset, config.data_dir, num_clients, config.setting, _data_seed(config),
      config.max_pad_ratio, config.new_clients, data_source=config.data_source,
      partition_config=partition)
  run_info["data"] = federated.source.name  # e.g. "CIFAR-10 (JPEG copy)"
  data = federated.data
  logger.info("%s: %s", config.dataset, datasets.describe(data))
  check_inputs(model_name, data.input_shape, data.input_dtype, config.dataset)
  model = build_model(model_name, data.num_classes, config.hidden)
  client_info = _client_info(federated)

  def save(directory, info, result, ours, local, series=None):
    results = results_lib.build_results(info, result, ours, local, client_info)
    results_lib.write_run_files(directory, results, result, series)
    if spec.task == "classification":  # the plots are of accuracies
      plots.write_plots_for_run_dir(directory)
    return results

  series = {} if epsilons is None else {"dp_epsilon": epsilons}
  note = (progress_lib.noting(progress, lambda r: f"epsilon {epsilons[r - 1]:.3g}")
          if epsilons is not None else contextlib.nullcontext())
  with metric_writer.RoundWriter(workdir, config.algorithm, spec.task, {
      f"{config.algorithm}/{k}": v for k, v in series.items()}) as log_round, note:
    result = run_algorithm(algorithms.make(config.algorithm, algorithm_config), model, data,
                           _engine_train(train, dp), on_round=log_round, checkpointer=checkpointer,
                           progress=progress, watchdog=watchdog)
  results_lib.write_timing(workdir, result)
  ours = results_lib.client_scores(result, spec.task)
  if is_reference:
    local = ours
  elif reference is not None:
    local = reference
  else:
    logger.info("training the LOCAL reference on the same split and seed")
    with metric_writer.RoundWriter(workdir, algorithms.REFERENCE, spec.task) as log_round:
      local_result = run_algorithm(algorithms.make(algorithms.REFERENCE), model, data, train,
                                   on_round=log_round, checkpointer=local_checkpointer,
                                   progress=progress, watchdog=watchdog)
    local = results_lib.client_scores(local_result, spec.task)
    # Kept as a LOCAL run of its own, so later runs can pass it as `reference`.
    save(os.path.join(workdir, algorithms.REFERENCE),
         {**run_info, "algorithm": algorithms.REFERENCE}, local_result, local, local)
    if not config.keep_checkpoints:
      checkpoint_lib.remove_checkpoints(os.path.join(checkpoint_root, algorithms.REFERENCE))

  info = dict(run_info)
  if algorithms.get(config.algorithm).presets:  # which variant ran (plots' labels)
    own = (algorithm_config.config if isinstance(algorithm_config, algorithms.Plugged)
           else algorithm_config)
    info[config.algorithm] = own._asdict()
  if isinstance(algorithm_config, algorithms.Plugged):
    info["plugins"] = {
        "ala": algorithm_config.ala and algorithm_config.ala._asdict(),
        "aggregation": algorithm_config.aggregation and algorithm_config.aggregation._asdict(),
        "attack": algorithm_config.attack and algorithm_config.attack._asdict(),
        "dp": dp and dp._asdict()}
  if dp is not None and epsilons is not None:
    final = float(epsilons[-1])
    info["dp_epsilon"] = final if math.isfinite(final) else None  # None: no noise
    info["dp"] = {**dp._asdict(), "epsilon": info["dp_epsilon"]}
  if federated.new_data is not None:
    info["new_clients"] = serve_new_clients(federated, algorithm_config, model, train,
                                            result, config.new_client_epochs, progress,
                                            watchdog)
  results = save(workdir, info, result, ours, local, series)
  if not config.keep_checkpoints:
    checkpoint_lib.remove_checkpoints(checkpoint_root)
  return results


def serve_new_clients(federated, config, model, train: TrainConfig, fedora_result,
                      epochs: int, progress: Progress | None | str = "auto",
                      watchdog: Watchdog | None = None) -> dict:
  """Trains FedAvg on the same clients, then serves the held-out ones (Algorithm 2)."""
  logger.info("training FedAvg on the same clients as the new-client baseline")
  fedavg_result = run_algorithm(algorithms.make("fedavg"), model, federated.data, train,
                                progress=progress, watchdog=watchdog)
  finetune_trainer = make_client_trainer(
      model.apply, make_optimizer(train.lr, train.momentum, train.weight_decay),
      epochs, train.batch_size, train.eval_batch_size)
  accuracy = new_clients.evaluate_new_clients(
      config, finetune_trainer, federated.data, fedora_result.final_state.algorithm,
      federated.new_data, fedavg_result.final_state.algorithm.server,
      root_keys(train.seed)["new_clients"])
  return results_lib.new_client_results(federated.new_client_ids,
                                        federated.partition.angles, accuracy, epochs)
