"""Several experiments trained as one compiled program (batch.py's run axis), each into
its own workdir with the files, checkpoints and results it would have alone.

  key = train_batch.batch_key(config)   # configs of equal keys may share one program
  documents = train_batch.train_batch([config0, config1], [workdir0, workdir1])

Configs may differ in their seeds (and so their data seeds: the splits must be laid out
alike, batch.py checks), lr and weight_decay, and the float hyperparameters of the
algorithm's own config; every other field is the program's shape or a Python branch.
A float the algorithm reads as a Python number is refused when the program is built
(batch.BatchError), before anything trains: the caller then runs the configs alone
(fedora_jax/sweep does). A run that needs its own LOCAL reference gets it from a second
program of the same runs' LOCALs. timing.json records each run's share of the
program's time (its seconds / the runs in it).
"""

import dataclasses
import json
import logging
from typing import Any, Callable, Mapping, Sequence

import jax

from fedora_jax import algorithms, batch
from fedora_jax import config as config_lib
from fedora_jax import results as results_lib
from fedora_jax import train as train_lib
from fedora_jax.config import ExperimentConfig
from fedora_jax.errors import ConfigError
from fedora_jax.progress import Progress
from fedora_jax.simulation import RunResult, resolve_progress
from fedora_jax.watchdog import Watchdog

logger = logging.getLogger("fedora_jax")

# A batch's runs sit in one program; what stands in for the values they may differ in.
_ANY = "<per run>"


def _own_floats(own: Any) -> list[str]:
  """The float fields of an algorithm's own config (a NamedTuple): the values a run of a
  batch may set to its own."""
  return [k for k, v in own._asdict().items() if isinstance(v, float)]


def batch_key(config: ExperimentConfig) -> str:
  """What runs sharing one program must have in common: the config resolved, with the
  values a run may hold on its own (seed, data seed, lr, weight_decay, the algorithm's
  float hyperparameters) and the LOCAL reference it is scored against left out."""
  config = config_lib.resolve(config)
  train_lib.check_config(config)
  config = train_lib.resolve_dp(config, train_lib.num_clients_of(config))
  algorithm = config.algorithm
  own = algorithm.config
  if hasattr(own, "_asdict"):
    own = own._replace(**{k: _ANY for k in _own_floats(own)})
  config = dataclasses.replace(
      config, reference=None,
      data=dataclasses.replace(config.data, data_seed=None),
      train=dataclasses.replace(config.train, seed=0, lr=0.0, weight_decay=0.0),
      algorithm=dataclasses.replace(algorithm, config=own))
  return json.dumps(config_lib.as_dict(config), sort_keys=True)


def batch_values(configs: Sequence[ExperimentConfig]) -> dict[str, list[float]]:
  """The values that differ between the (resolved) configs, each run's: lr and
  weight_decay (client training's), and the algorithm's own float fields (lr too where
  its config repeats it: one value sets both)."""
  values: dict[str, list[float]] = {}
  for name in batch.TRAIN_VALUES:
    column = [float(getattr(c.train, name)) for c in configs]
    if len(set(column)) > 1:
      values[name] = column
  own = configs[0].algorithm.config
  for name in _own_floats(own) if hasattr(own, "_asdict") else []:
    column = [float(getattr(c.algorithm.config, name)) for c in configs]
    if len(set(column)) > 1:
      values[name] = column
  return values


class _Writers:
  """Each run's TensorBoard writer (train.round_writer), opened at its first round, so a
  program refused before it trains leaves no event file behind."""

  def __init__(self, runs: Sequence[train_lib.PreparedRun], name: str | None = None):
    self.runs, self.name = runs, name
    self.opened: dict[int, Any] = {}

  def on_round(self, i: int) -> Callable[[int, Any], None]:
    def log(round_number: int, metrics: Any) -> None:
      if i not in self.opened:
        self.opened[i] = train_lib.round_writer(self.runs[i], self.name)
      self.opened[i](round_number, metrics)
    return log

  def close(self) -> None:
    for writer in self.opened.values():
      writer.close()


def _builder(config: ExperimentConfig) -> batch.BuildFn:
  """build(values, trainer) for run_batch: `config`'s algorithm and plug-ins, its own
  config's fields among `values` set to the run's (traced) value."""
  name = config.algorithm.name
  runnable = config_lib.runnable(config.algorithm)

  def build(values: Mapping[str, Any], trainer) -> algorithms.Algorithm:
    inner = runnable.config if isinstance(runnable, algorithms.Plugged) else runnable
    fields = getattr(inner, "_fields", ())
    own = inner._replace(**{k: v for k, v in values.items() if k in fields}) if any(
        k in fields for k in values) else inner
    if isinstance(runnable, algorithms.Plugged):
      return algorithms.build(name, runnable._replace(config=own), trainer)
    return algorithms.build(name, own, trainer)
  return build


def _share(result: RunResult | batch.RunFailed, runs: int) -> Any:
  """A run's share of its program's time: the program's seconds / its runs."""
  if isinstance(result, batch.RunFailed):
    return result
  return result._replace(compile_seconds=result.compile_seconds / runs,
                         round_seconds=result.round_seconds / runs,
                         total_seconds=result.total_seconds / runs)


def _run_program(runs: Sequence[train_lib.PreparedRun], build: batch.BuildFn,
                 train, values: dict[str, list[float]], checkpointers, on_round,
                 progress: Progress, watchdog: Watchdog | None,
                 runs_per_step: int | None) -> list[Any]:
  datas = [r.federated.data for r in runs]
  same_data = all(d is datas[0] for d in datas)
  results = batch.run_batch(build, runs[0].model, datas[0] if same_data else datas, train,
                            [r.config.train.seed for r in runs], values,
                            checkpointers=checkpointers, on_round=on_round,
                            progress=progress, watchdog=watchdog,
                            runs_per_step=runs_per_step)
  return [_share(result, len(runs)) for result in results]


def _checkpointers(given: Sequence[Any]) -> list[Any] | None:
  """Every run's checkpointer, or None where the runs save none (checkpoint_every=0)."""
  return None if any(c is None for c in given) else list(given)


def _latest(checkpointer) -> int | None:
  return None if checkpointer is None else checkpointer.latest_round()


def _train_locals(runs: Sequence[train_lib.PreparedRun], progress: Progress,
                  watchdog: Watchdog | None, runs_per_step: int | None) -> list[Any]:
  """The runs' own LOCAL references as one program (they share the runs' data and
  training, so they batch where the runs did)."""
  local = dataclasses.replace(runs[0].config,
                              algorithm=config_lib.AlgorithmConfig(algorithms.REFERENCE))
  local = config_lib.resolve(local)
  logger.info("training the %d runs' LOCAL references as one program", len(runs))
  writers = _Writers(runs, algorithms.REFERENCE)
  try:
    return _run_program(runs, _builder(local), runs[0].config.train,
                        batch_values([r.config for r in runs]),
                        _checkpointers([r.local_checkpointer for r in runs]),
                        [writers.on_round(i) for i in range(len(runs))], progress,
                        watchdog, runs_per_step)
  finally:
    writers.close()


def train_batch(configs: Sequence[ExperimentConfig], workdirs: Sequence[str],
                progress: Progress | None | str = "auto", watchdog: Watchdog | None = None,
                runs_per_step: int | None = None,
                on_failed: Callable[[int, Exception], None] | None = None) -> list[dict | None]:
  """Trains the configs (equal batch_key) as one program, each into its workdir (as
  train.train_and_evaluate would: resumed from its checkpoints, which must be of one
  round); returns their results documents. A run that diverges is told to `on_failed`
  (index, error) and its document is None, the others go on; without on_failed its
  error is raised once the others are written. batch.BatchError, before anything
  trains, where they cannot share one program."""
  if len(configs) != len(workdirs):
    raise ConfigError(f"{len(configs)} configs were given {len(workdirs)} workdirs")
  keys = {batch_key(c) for c in configs}
  if len(keys) > 1:
    raise batch.BatchError("the configs differ in more than seeds, lr, weight_decay and"
                           " the algorithm's float hyperparameters; run them separately")
  progress = resolve_progress(progress, configs[0].train.log_every)
  built: dict = {}
  runs = [train_lib.prepare_run(c, w, built) for c, w in zip(configs, workdirs)]
  first = runs[0]
  writers = _Writers(runs)
  try:
    with train_lib.noting_epsilon(first, progress):
      results = _run_program(runs, _builder(first.config), train_lib.engine_train(first),
                             batch_values([r.config for r in runs]),
                             _checkpointers([r.checkpointer for r in runs]),
                             [writers.on_round(i) for i in range(len(runs))], progress,
                             watchdog, runs_per_step)
  finally:
    writers.close()
  failed = {i: r.error for i, r in enumerate(results) if isinstance(r, batch.RunFailed)}
  for i, result in enumerate(results):
    if i not in failed:  # written now, as a run alone writes it before its LOCAL
      results_lib.write_timing(runs[i].workdir, result)
  needing = [i for i, r in enumerate(runs) if r.needs_local and i not in failed]
  saved = {_latest(runs[i].local_checkpointer) for i in needing}
  if len(needing) > 1 and len(saved) == 1:  # one program resumes from one round
    trained = _train_locals([runs[i] for i in needing], progress, watchdog, runs_per_step)
  else:
    trained = [train_lib.train_local(runs[i], progress, watchdog) for i in needing]
  locals_ = dict(zip(needing, trained))
  for i, local in locals_.items():
    if isinstance(local, batch.RunFailed):
      failed[i] = local.error
  documents: list[dict | None] = []
  for i, run in enumerate(runs):
    documents.append(None if i in failed else train_lib.finish_run(
        run, results[i], locals_.get(i), progress, watchdog))
  for i, error in failed.items():
    if on_failed is None:
      raise error
    on_failed(i, error)
  return documents


def can_batch() -> bool:
  """Whether this process batches runs: a multi-process run trains each row together in
  every process, one at a time."""
  return jax.process_count() == 1
