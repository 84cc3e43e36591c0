"""The library's entry point: one experiment from a config to its results files.

  from fedora_jax import train
  results = train.train_and_evaluate(train.ExperimentConfig(), "runs/x")  # fedora, rmnist

trains the algorithm, the LOCAL reference its R-Acc and PTR are measured against (unless
`reference` names a LOCAL run's results.json), and for FEDORA's Algorithm 2 the FedAvg
baseline of the held-out clients; writes results.json, timing.json, clients.csv,
rounds.csv, history.npz, the algorithm's arrays, plots and TensorBoard events to
`workdir` (the LOCAL run to `workdir/local`); returns the results document.
`python -m experiments.main` builds an ExperimentConfig from its flags and calls this.
The workdir's run_config.json records the config (fedora_jax/config.py): the same run,
from the command line or from Python, resumes from its checkpoints.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from fedora_jax import algorithms, availability
from fedora_jax import progress as progress_lib
from fedora_jax import checkpoint as checkpoint_lib
from fedora_jax import config as config_lib
from fedora_jax import metric_writer, new_clients, plots
from fedora_jax import results as results_lib
from fedora_jax.config import (AlgorithmConfig, DataConfig, ExperimentConfig,  # noqa: F401
                               ModelConfig, NewClientsConfig)
from fedora_jax.data import datasets
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.host_simulation import check_settings as check_host_settings
from fedora_jax.models import build_model, check_inputs
from fedora_jax.progress import Progress
from fedora_jax.algorithms import dp as dp_lib
from fedora_jax.algorithms import robust
from fedora_jax.rounds import CLIENT_WEIGHTS, num_sampled_clients
from fedora_jax.simulation import (TrainConfig, resolve_progress, root_keys,
                                   run_algorithm)
from fedora_jax.watchdog import Watchdog

logger = logging.getLogger("fedora_jax")


def check_config(config: ExperimentConfig) -> None:
  """One-line ConfigErrors for a bad combination, before any data is loaded."""
  config = config_lib.resolve(config)
  if config.algorithm.dp is not None:
    config = resolve_dp(config, num_clients_of(config))
  name, own = config.algorithm.name, config.algorithm.config
  if not 0.0 < config.train.participation <= 1.0:
    raise FieldError("train", "participation",
                     f"must be in (0, 1], got {config.train.participation}")
  if config.train.eval_every < 1:
    raise FieldError("train", "eval_every", f"must be >= 1, got {config.train.eval_every}")
  check_host_settings(config.train.client_data, config.train.eval_clients)
  if config.train.client_data == "host":
    raise FieldError("train", "client_data", "host: a full run scores R-Acc against a LOCAL"
                     " reference, a model per client, which host-held clients do not keep;"
                     " run them with host_simulation.run_host or experiments.benchmark")
  availability.check_settings(config.train.client_dropout, config.train.stragglers,
                              config.train.straggler_speed, config.train.round_deadline,
                              config.train.availability_trace)
  if config.train.client_weights not in CLIENT_WEIGHTS:
    raise FieldError("train", "client_weights", f"must be one of {', '.join(CLIENT_WEIGHTS)},"
                     f" got {config.train.client_weights!r}")
  if any(w < 1 for w in config.model.hidden):
    raise FieldError("experiment", "hidden",
                     f"widths must be >= 1, got {','.join(map(str, config.model.hidden))}")
  # A training field an algorithm's config repeats (FEDORA's, Ditto's, APFL's lr) has
  # one source: a config built without this run's TrainConfig must still agree with it.
  for field in algorithms.get(name).train_fields:
    ours, theirs = getattr(config.train, field), getattr(own, field)
    if ours != theirs:
      raise ConfigError(f"the {name} config's {field}={theirs!r} differs from"
                        f" train.{field}={ours!r}; build it with"
                        f" algorithms.default_config({name!r}, train)")
  # Built once around a stand-in model, so every algorithm's own checks of its
  # hyperparameters (and its plug-ins') run now.
  train = config.train
  stand_in = algorithms.stand_in_trainer(train.lr, train.momentum, train.weight_decay,
                                         train.local_epochs, train.batch_size)
  algorithms.build(name, config_lib.runnable(config.algorithm), stand_in)
  _check_attackers(config)
  if config.new_clients.count:
    check_new_clients = algorithms.get(name).new_clients
    if check_new_clients is None:
      serving = [n for n, r in algorithms.REGISTRY.items() if r.new_clients]
      raise FieldError("experiment", "new_clients",
                       f"serves clients held out of training, which {name} does"
                       f" not; use it with {' or '.join(serving)} (FEDORA's Algorithm 2)")
    check_new_clients(own)
    task = datasets.get_spec(config.data.dataset).task
    if task != "classification":
      raise FieldError("experiment", "new_clients",
                       f"reports accuracies; {config.data.dataset} is a {task}")


def _check_attackers(config: ExperimentConfig) -> None:
  """One line where a robust rule cannot tolerate the run's attackers among a round's
  sampled clients (robust.check_tolerance), or label_flip meets data without classes."""
  aggregation, attack = config.algorithm.aggregation, config.algorithm.attack
  task = datasets.get_spec(config.data.dataset).task
  if attack is not None and attack.attack == "label_flip" and task != "classification":
    raise ConfigError(f"--attack=label_flip flips class labels; {config.data.dataset} is a"
                      f" {task}")
  clients = config.data.num_clients or datasets.get_spec(config.data.dataset).num_clients
  if isinstance(aggregation, robust.RobustConfig) and clients is not None:
    robust.check_tolerance(aggregation, attack.fraction if attack is not None else 0.0,
                           num_sampled_clients(config.train.participation, clients))


def num_clients_of(config: ExperimentConfig) -> int:
  """K: the config's, else the dataset's."""
  return config.data.num_clients or datasets.default_num_clients(config.data.dataset,
                                                                 config.data.data_dir)


def resolve_dp(config: ExperimentConfig, num_clients: int) -> ExperimentConfig:
  """The config with its DP settings fixed for this run (dp.resolve: the expected cohort
  of `num_clients` clients, the noise multiplier of a target epsilon), so a run's record
  holds the noise it trains with: the same target over more rounds is another run."""
  dp, train = config.algorithm.dp, config.train
  if dp is None:
    return config
  resolved = _resolved_dp(dp, train.rounds, num_clients, train.participation,
                          num_sampled_clients(train.participation, num_clients))
  return dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm,
                                                                   dp=resolved))


@functools.lru_cache(maxsize=16)
def _resolved_dp(dp: dp_lib.DpConfig, rounds: int, num_clients: int, participation: float,
                 sampled: int) -> dp_lib.DpConfig:
  return dp_lib.resolve(dp, rounds, num_clients, participation, sampled)


def _engine_train(config: ExperimentConfig) -> TrainConfig:
  """The TrainConfig the run's engine takes: with Poisson DP sampling every client
  trains each round and the plug-in draws who counts (participation is its rate)."""
  dp = config.algorithm.dp
  if dp is not None and dp.sampling == "poisson":
    return dataclasses.replace(config.train, participation=1.0)
  return config.train


def default_workdir(config: ExperimentConfig) -> str:
  """runs/<dataset>_<setting>_<algorithm>_seed<seed>_<hash>: the hash is of the config's
  identity (config.identity: all but its rounds, the data's folder and the like), so a
  run with any other setting gets its own folder, and the same config, or more rounds
  of it, resumes in the same one."""
  identity = config_lib.identity(config)
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
  data = config.data
  return os.path.join("runs", f"{data.dataset}_{data.setting}_{identity['algorithm']['name']}"
                              f"_seed{config.train.seed}_{digest}")


def _run_info(config: ExperimentConfig, num_clients: int) -> dict:
  """results.json's description of the run (its keys and order are the file format);
  `config` resolved."""
  data = config.data
  partition = data.partition
  spec = datasets.get_spec(data.dataset)
  train = config.train
  info = {"dataset": data.dataset, "algorithm": config.algorithm.name,
          "setting": data.setting, "num_clients": num_clients, "seed": train.seed,
          "data_seed": data.data_seed, "rounds": train.rounds, "model": config.model.name,
          "hidden": list(config.model.hidden), "devices": jax.device_count(),
          "processes": jax.process_count(), "platform": jax.default_backend(),
          "train": _train_info(train)}
  if spec.task != "classification":
    info["task"] = spec.task  # results name MAE in place of accuracy
  if data.data_source != "files":
    info["data_source"] = data.data_source
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
                       "round_deadline", "precision", "client_data", "eval_clients")


def _train_info(train: TrainConfig) -> dict:
  """results.json's `train`: every TrainConfig field, those of _OMITTED_AT_DEFAULT only
  when they are not at their defaults."""
  info = dataclasses.asdict(train)
  defaults = TrainConfig()
  for name in _OMITTED_AT_DEFAULT:
    if info[name] == getattr(defaults, name):
      del info[name]
  return info


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


def open_workdir(workdir: str, config: ExperimentConfig,
                 checkpoint_root: str) -> checkpoint_lib.Checkpointer | None:
  """Claims `workdir` for the run `config` describes (run_config.json records the config;
  a workdir holding another run is refused) and returns its Checkpointer."""
  return checkpoint_lib.open_run(
      workdir, config_lib.record(config),
      lambda recorded: config_lib.differences(recorded, config), config.train.rounds,
      config.checkpoint_every, checkpoint_root)


def check_workdir(workdir: str, config: ExperimentConfig) -> bool:
  """Whether `workdir` records the run `config` describes; a ConfigError if it holds
  another run; writes nothing (a sweep checks every row first)."""
  return checkpoint_lib.check_workdir(workdir, config_lib.record(config),
                                      lambda recorded: config_lib.differences(recorded, config))


# --reference=none: no LOCAL reference (R-Acc and PTR null), for a run of so many clients
# that a model per client does not fit, such as pfl-research's 1,000-client benchmark.
NO_REFERENCE = "none"


class PreparedRun(NamedTuple):
  """A run ready to train (prepare_run): its workdir claimed, its data and model built,
  its LOCAL reference read if it has one. train_and_evaluate trains one; train_batch.py
  several as one program, each finished into its own workdir (finish_run)."""
  config: ExperimentConfig      # resolved, its DP settings fixed
  workdir: str                  # this process's
  checkpoint_root: str
  run_info: dict                # results.json's description of the run
  reference: results_lib.ClientScores | None  # config.reference's LOCAL scores, if given
  checkpointer: checkpoint_lib.Checkpointer | None
  local_checkpointer: checkpoint_lib.Checkpointer | None  # its own LOCAL's (needs_local)
  federated: Any
  model: Any
  client_info: dict
  epsilons: Any                 # DP's epsilon after each round, or None

  @property
  def needs_local(self) -> bool:
    """Whether it trains its own LOCAL reference (given none, and not LOCAL itself)."""
    return (self.config.algorithm.name != algorithms.REFERENCE and self.reference is None
            and self.config.reference != NO_REFERENCE)

  @property
  def series(self) -> dict:
    return {} if self.epsilons is None else {"dp_epsilon": self.epsilons}

  @property
  def task(self) -> str:
    return datasets.get_spec(self.config.data.dataset).task


def _build_data(config: ExperimentConfig, num_clients: int):
  data_config = config.data
  assert data_config.data_seed is not None  # resolved
  return datasets.build_federated_dataset(
      data_config.dataset, data_config.data_dir, num_clients, data_config.setting,
      data_config.data_seed, data_config.max_pad_ratio, config.new_clients.count,
      data_source=data_config.data_source, partition_config=data_config.partition,
      public_size=data_config.public_size or 0)


def prepare_run(config: ExperimentConfig, workdir: str | None = None,
                built: dict | None = None) -> PreparedRun:
  """Everything before training: the config checked and resolved, the workdir claimed
  (a workdir holding another run is refused; checkpoints found to resume), the data and
  model built. `built` (a dict kept by the caller) shares the data between runs of the
  same split."""
  check_config(config)
  config = config_lib.resolve(config)
  name = config.algorithm.name
  num_clients = num_clients_of(config)
  config = resolve_dp(config, num_clients)
  dp = config.algorithm.dp
  # DP's epsilon after each round (accounting.py): rounds.csv, TensorBoard, the progress.
  epsilons = None if dp is None else dp_lib.epsilons(dp, config.train.rounds, num_clients)
  model_name = config.model.name
  workdir = workdir or default_workdir(config)
  # Every process computes the same results: process 0 writes them to the workdir, the
  # others to workdir/process<i> (no two writers), and all save into the workdir's
  # checkpoints (orbax's multi-process saves: one folder, process 0 finalizes).
  checkpoint_root = workdir
  if jax.process_index() > 0:
    workdir = os.path.join(workdir, f"process{jax.process_index()}")
  run_info = _run_info(config, num_clients)
  reference = None
  is_reference = name == algorithms.REFERENCE  # LOCAL: its own reference
  if config.reference not in (None, "", NO_REFERENCE) and not is_reference:
    reference = results_lib.load_reference(config.reference, run_info)
  # Before any work: refuse a workdir holding another run, and find checkpoints to resume.
  checkpointer = open_workdir(workdir, config, checkpoint_root)
  local_checkpointer = None
  if not is_reference and reference is None and config.reference != NO_REFERENCE:
    local_checkpointer = open_workdir(os.path.join(workdir, algorithms.REFERENCE),
                                      config_lib.reference_config(config),
                                      os.path.join(checkpoint_root, algorithms.REFERENCE))

  assert config.data.data_seed is not None and model_name is not None  # resolved
  key = repr((config.data, num_clients, config.new_clients.count))
  built = {} if built is None else built
  if key not in built:
    built[key] = _build_data(config, num_clients)
  federated = built[key]
  run_info["data"] = federated.source.name  # e.g. "CIFAR-10 (JPEG copy)"
  data = federated.data
  logger.info("%s: %s", config.data.dataset, datasets.describe(data))
  check_inputs(model_name, data.input_shape, data.input_dtype, config.data.dataset)
  model = build_model(model_name, data.num_classes, config.model.hidden)
  return PreparedRun(config, workdir, checkpoint_root, run_info, reference, checkpointer,
                     local_checkpointer, federated, model, _client_info(federated),
                     epsilons)


def algorithm_of(run: PreparedRun):
  """The run's algorithm as run_algorithm takes it (trainer -> Algorithm)."""
  return algorithms.make(run.config.algorithm.name,
                         config_lib.runnable(run.config.algorithm))


def engine_train(run: PreparedRun) -> TrainConfig:
  return _engine_train(run.config)


def round_writer(run: PreparedRun, name: str | None = None) -> metric_writer.RoundWriter:
  """The run's TensorBoard writer (its on_round), or its LOCAL reference's (name)."""
  if name is not None:
    return metric_writer.RoundWriter(run.workdir, name, run.task)
  name = run.config.algorithm.name
  return metric_writer.RoundWriter(run.workdir, name, run.task, {
      f"{name}/{k}": v for k, v in run.series.items()})


def noting_epsilon(run: PreparedRun, progress: Progress):
  """Within the block, the progress ends each round's report with DP's epsilon."""
  epsilons = run.epsilons
  if epsilons is None:
    return contextlib.nullcontext()
  return progress_lib.noting(progress, lambda r: f"epsilon {epsilons[r - 1]:.3g}")


def train_local(run: PreparedRun, progress: Progress | None | str = "auto",
                watchdog: Watchdog | None = None):
  """The run's own LOCAL reference, trained (resumed from its checkpoints)."""
  logger.info("training the LOCAL reference on the same split and seed")
  with round_writer(run, algorithms.REFERENCE) as log_round:
    return run_algorithm(algorithms.make(algorithms.REFERENCE), run.model,
                         run.federated.data, run.config.train, on_round=log_round,
                         checkpointer=run.local_checkpointer, progress=progress,
                         watchdog=watchdog)


def _save(run: PreparedRun, directory, info, result, ours, local, series=None) -> dict:
  results = results_lib.build_results(info, result, ours, local, run.client_info)
  results_lib.write_run_files(directory, results, result, series)
  if run.task == "classification":  # the plots are of accuracies
    plots.write_plots_for_run_dir(directory)
  return results


def finish_run(run: PreparedRun, result, local_result=None,
               progress: Progress | None | str = "auto",
               watchdog: Watchdog | None = None) -> dict:
  """Everything after training: the run's files (and its LOCAL reference's, given
  `local_result`, which a run that needs_local needs), FEDORA's new clients
  served, checkpoints removed unless kept; returns the results document."""
  config, name = run.config, run.config.algorithm.name
  checkpoint_root = run.checkpoint_root
  ours = results_lib.client_scores(result, run.task)
  if name == algorithms.REFERENCE:
    local = ours
  elif run.reference is not None:
    local = run.reference
  elif config.reference == NO_REFERENCE:  # no LOCAL: R-Acc and PTR are null
    local = results_lib.ClientScores(np.full_like(ours.final, np.nan),
                                     np.full_like(ours.best_val, np.nan), ours.best_round)
  else:
    assert local_result is not None, "a run without a reference trains its own LOCAL"
    local = results_lib.client_scores(local_result, run.task)
    # Kept as a LOCAL run of its own, so later runs can pass it as `reference`.
    _save(run, os.path.join(run.workdir, algorithms.REFERENCE),
          {**run.run_info, "algorithm": algorithms.REFERENCE}, local_result, local, local)
    if not config.keep_checkpoints:
      checkpoint_lib.remove_checkpoints(os.path.join(checkpoint_root, algorithms.REFERENCE))

  info = dict(run.run_info)
  own = config.algorithm.config
  dp = config.algorithm.dp
  if algorithms.get(name).presets:  # which variant ran (plots' labels)
    info[name] = own._asdict()
  if config_lib.plugins(config.algorithm):
    attack = config.algorithm.attack
    # attack and dp only where they are on: the files of runs without them as they were
    info["plugins"] = {
        "ala": config.algorithm.ala and config.algorithm.ala._asdict(),
        "aggregation": config.algorithm.aggregation and config.algorithm.aggregation._asdict(),
        **({"attack": attack._asdict()} if attack else {}),
        **({"dp": dp._asdict()} if dp else {})}
  if dp is not None and run.epsilons is not None:
    final = float(run.epsilons[-1])
    info["dp_epsilon"] = final if math.isfinite(final) else None  # None: no noise
    info["dp"] = {**dp._asdict(), "epsilon": info["dp_epsilon"]}
  if run.federated.new_data is not None:
    info["new_clients"] = serve_new_clients(run.federated, own, run.model, config.train,
                                            result, config.new_clients.epochs, progress,
                                            watchdog)
  results = _save(run, run.workdir, info, result, ours, local, run.series)
  if not config.keep_checkpoints:
    checkpoint_lib.remove_checkpoints(checkpoint_root)
  return results


def train_and_evaluate(config: ExperimentConfig, workdir: str | None = None,
                       progress: Progress | None | str = "auto",
                       watchdog: Watchdog | None = None) -> dict:
  """Runs the experiment `config` into `workdir` (default `default_workdir`); returns the
  results document (results.json) and prints nothing. A workdir holding checkpoints of
  the same run (its run_config.json: config.identity) resumes from them.

  `progress` reports every run it trains, the LOCAL reference included ("auto": a bar in
  a terminal or notebook, else a line every config.train.log_every rounds; None:
  nothing; fedora_jax/progress.py). A `watchdog`
  (fedora_jax/watchdog.py, entered) watches every run's compilation and rounds.
  """
  progress = resolve_progress(progress, config.train.log_every)  # one for every run
  run = prepare_run(config, workdir)
  with round_writer(run) as log_round, noting_epsilon(run, progress):
    result = run_algorithm(algorithm_of(run), run.model, run.federated.data,
                           engine_train(run), on_round=log_round,
                           checkpointer=run.checkpointer, progress=progress,
                           watchdog=watchdog)
  # Written now, so a process stopped later (in its LOCAL reference) keeps its times.
  results_lib.write_timing(run.workdir, result)
  local_result = train_local(run, progress, watchdog) if run.needs_local else None
  return finish_run(run, result, local_result, progress, watchdog)


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
