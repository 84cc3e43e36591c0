"""Several runs as one compiled program: a leading run axis over the client axis.

Runs that differ only in values, not in shapes (their seeds; a float hyperparameter of
the algorithm or of client training; their data where the splits' layouts match) are
one `jit` of the round vmapped over a run axis. On an accelerator, where one run of
these small models leaves the chip mostly idle, S runs cost about what one costs; on a
CPU they share its cores as separate runs would.

  results = batch.run_batch(build, model, data, train, seeds=(0, 1, 2),
                            values={"mu": (0.01, 0.01, 0.1)})

`build(values, trainer) -> Algorithm` builds one run's algorithm from that run's values
(a dict of scalars, traced inside the program) around its client trainer; training
fields among `values` (lr, weight_decay) set the trainer's optimizer. A value that the
algorithm reads as a Python number (to pick a branch, to size an array) cannot vary
inside one program: `run_batch` says which in one line (`BatchError`), and the caller
runs those separately (fedora_jax/sweep.py does). Each run's result equals the run done
alone (`simulation.run_algorithm`) up to float summation order: vmapped matrix products
may add in another order (tests/test_batch.py says how close).
"""

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.algorithms.base import Algorithm, InitContext
from fedora_jax.checkpoint import Checkpointer, unstack_history
from fedora_jax.data.client_data import FederatedData
from fedora_jax.engine import sharding
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, RunInterrupted, TrainingDivergedError
from fedora_jax.progress import Progress
from fedora_jax.rounds import RoundMetrics, RoundState, build_test_evaluation, build_train_round
from fedora_jax.simulation import (RunResult, TrainConfig, _best_mean, _StageReporter,
                                   check_finite, client_conditions, client_trainer,
                                   due_for_test,
                                   initial_model, resolve_progress, root_keys, to_host)
from fedora_jax.watchdog import Watchdog
from fedora_jax import tree

logger = logging.getLogger("fedora_jax")

# Client-training fields a run of a batch may set to its own value: they enter the
# optimizer as numbers (momentum does not: optax's SGD branches on it).
TRAIN_VALUES = ("lr", "weight_decay")

BuildFn = Callable[[Mapping[str, jax.Array], ClientTrainer], Algorithm]


class BatchError(ConfigError):
  """The runs cannot share one program (a value read as a Python number, a shape)."""


class RunFailed(NamedTuple):
  """A run of a batch that diverged; the batch's other runs go on."""
  error: TrainingDivergedError


def _check_values(values: Mapping[str, Sequence[float]], num_runs: int) -> dict[str, np.ndarray]:
  checked = {}
  for name, given in values.items():
    column = np.asarray(given, np.float32)
    if column.shape != (num_runs,):
      raise ConfigError(f"batch value {name}: {num_runs} values (one a run) expected,"
                        f" got shape {column.shape}")
    checked[name] = column
  return checked


def _train_with(train: TrainConfig, values: Mapping[str, Any]) -> TrainConfig:
  """`train` with this run's training values (traced scalars inside the program)."""
  own = {k: v for k, v in values.items() if k in TRAIN_VALUES}
  return dataclasses.replace(train, **own) if own else train


def _stacked_buckets(datas: Sequence[FederatedData]) -> tuple:
  """The runs' client data stacked on a leading run axis; their layouts must match."""
  first = datas[0]
  for i, other in enumerate(datas[1:], 1):
    same = (other.num_clients == first.num_clients
            and all(np.array_equal(a, b) for a, b in zip(other.client_ids, first.client_ids))
            and str(jax.tree.structure(other.buckets)) == str(jax.tree.structure(first.buckets))
            and all(a.shape == b.shape for a, b in zip(jax.tree.leaves(other.buckets),
                                                        jax.tree.leaves(first.buckets))))
    if not same:
      raise BatchError(f"run {i}'s client data is laid out unlike run 0's (other client"
                       f" sizes or buckets): its data cannot share one program")
  return jax.tree.map(lambda *runs: np.stack([np.asarray(r) for r in runs]),
                      *[d.buckets for d in datas])


def _place(buckets: tuple, mesh, stacked: bool) -> tuple:
  """The buckets on `mesh`, clients split over its devices (behind the run axis if any)."""
  if not stacked:
    return sharding.place_buckets(buckets, mesh)
  spec = jax.sharding.PartitionSpec(None, sharding.CLIENT_AXIS)
  placed = []
  for bucket in buckets:
    size = sharding.padded_size(jax.tree.leaves(bucket)[0].shape[1], mesh.size)
    padded = jax.tree.map(lambda a, size=size: np.swapaxes(sharding.pad_clients(
        np.swapaxes(a, 0, 1), size), 0, 1), bucket)
    placed.append(sharding.put_global(padded, jax.sharding.NamedSharding(mesh, spec)))
  return tuple(placed)


def default_runs_per_step() -> int | None:
  """One run at a time on CPUs, all at once (None: vmapped) elsewhere. On a CPU the
  vmapped runs' working set outgrows the caches, and there are no idle lanes for them to
  fill, as an accelerator has (measured: docs/performance.md, "several runs as one
  program")."""
  return 1 if jax.default_backend() == "cpu" else None


def _over_runs(fn: Callable[..., Any], in_axes: tuple, runs_per_step: int | None):
  """`fn` over the leading run axis of the arguments whose in_axes is 0: all runs at once
  (vmap), or `runs_per_step` at a time (lax.map over chunks of the runs), which holds a
  chunk's activations at a time, not every run's."""
  if runs_per_step is None:
    return jax.vmap(fn, in_axes=in_axes)

  def mapped(*args):
    def one(run_args):
      given = iter(run_args)
      return fn(*(next(given) if axis == 0 else arg for arg, axis in zip(args, in_axes)))
    return jax.lax.map(one, tuple(a for a, axis in zip(args, in_axes) if axis == 0),
                       batch_size=runs_per_step)
  return mapped


def _traced_build(name: str, error: Exception) -> BatchError:
  return BatchError(f"{name}: a value that differs between the runs is read as a Python"
                    f" number ({type(error).__name__}); run these separately")


class PreparedBatch(NamedTuple):
  algorithm: Algorithm             # run 0's, built with concrete values (name, artifacts)
  buckets: tuple
  state: RoundState                # every leaf [S, ...]
  train_keys: jax.Array            # [S]
  values: dict[str, jax.Array]     # each [S]
  compiled: Any
  test_evaluation: Any
  compile_seconds: float
  state_sharding: Any              # where the state lives (a restored one is put there)


def prepare_batch(build: BuildFn, model, data: FederatedData | Sequence[FederatedData],
                  train: TrainConfig, seeds: Sequence[int],
                  values: Mapping[str, Sequence[float]] | None = None,
                  mesh=None, runs_per_step: int | None = None) -> PreparedBatch:
  """The batch's initial state [S, ...] and its compiled round (state donated), the
  runs' rounds `runs_per_step` at a time (_over_runs; default `default_runs_per_step`)."""
  datas = None if isinstance(data, FederatedData) else list(data)
  layout = data if isinstance(data, FederatedData) else list(data)[0]
  num_runs = len(seeds)
  if num_runs < 1:
    raise ConfigError("a batch needs at least one run")
  if runs_per_step is not None and runs_per_step < 1:
    raise ConfigError(f"runs_per_step must be >= 1, got {runs_per_step}")
  runs_per_step = runs_per_step or default_runs_per_step()
  if datas is not None and len(datas) != num_runs:
    raise ConfigError(f"a batch of {num_runs} runs was given {len(datas)} datasets")
  checked = _check_values(values or {}, num_runs)
  fixed = [k for k in checked if k in TrainConfig.__dataclass_fields__
           and k not in TRAIN_VALUES and len(set(checked[k].tolist())) > 1]
  if fixed:
    raise BatchError(f"train.{fixed[0]} differs between the runs, and only"
                     f" {', '.join(TRAIN_VALUES)} may within one program; run these"
                     f" separately")
  stacked = datas is not None and len(datas) > 1
  host_buckets = _stacked_buckets(datas) if datas is not None and stacked else layout.buckets

  def trainer_for(run_values) -> ClientTrainer:
    return client_trainer(model, layout, _train_with(train, run_values))

  def algorithm_for(run_values) -> Algorithm:
    return build(run_values, trainer_for(run_values))

  # Each run's algorithm built once with its own values: their checks run now, as the
  # traced build below skips them (errors.traced).
  algorithm = [algorithm_for({k: float(v[s]) for k, v in checked.items()})
               for s in range(num_runs)][0]
  if mesh is None:
    mesh = sharding.default_mesh([len(ids) for ids in layout.client_ids])
  buckets = _place(host_buckets, mesh, stacked)
  data_axis = 0 if stacked else None
  run_keys = [root_keys(int(seed)) for seed in seeds]  # each run's keys, as run alone
  keys = {name: jnp.stack([k[name] for k in run_keys]) for name in ("init", "algorithm",
                                                                   "train")}
  run_values = {k: jnp.asarray(v) for k, v in checked.items()}

  def init_one(init_key, algorithm_key, values_k, buckets_k):
    algorithm_k = algorithm_for(values_k)
    layout_k = layout._replace(buckets=buckets_k)
    params = initial_model(model, layout_k, init_key)
    state = algorithm_k.init(InitContext(
        params=tree.broadcast_to_clients(params, layout.num_clients),
        data=layout_k, trainer=trainer_for(values_k), key=algorithm_key))
    return RoundState(round=jnp.zeros((), jnp.int32), algorithm=state)

  every_round = train.eval_every == 1
  # Dropout and stragglers (availability.py): drawn from each run's own round keys.
  conditions = client_conditions(train, layout.num_clients)

  def round_one(state, buckets_k, key, values_k):
    trainer = trainer_for(values_k)
    return build_train_round(algorithm_for(values_k), trainer, layout, train.client_chunk,
                             train.participation, evaluate_test=every_round,
                             client_weights=train.client_weights,
                             conditions=conditions)(state, buckets_k, key)

  def test_one(state, buckets_k, values_k):
    return build_test_evaluation(algorithm_for(values_k), trainer_for(values_k), layout,
                                 train.client_chunk)(state, buckets_k)

  everywhere = sharding.replicated(mesh)
  start = time.perf_counter()
  try:
    with jax.set_mesh(mesh):
      init = jax.jit(jax.vmap(init_one, in_axes=(0, 0, 0, data_axis)),
                     out_shardings=everywhere)
      state = init(keys["init"], keys["algorithm"], run_values, buckets)
      batched_round = jax.jit(_over_runs(round_one, (0, data_axis, 0, 0), runs_per_step),
                              donate_argnums=0, out_shardings=everywhere)
      compiled = batched_round.lower(state, buckets, keys["train"], run_values).compile()
      test_evaluation = None
      if not every_round:
        test_evaluation = jax.jit(_over_runs(test_one, (0, data_axis, 0), runs_per_step),
                                  out_shardings=everywhere).lower(
                                      state, buckets, run_values).compile()
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
          jax.errors.TracerIntegerConversionError,
          jax.errors.TracerArrayConversionError) as e:
    raise _traced_build(algorithm.name, e) from e
  return PreparedBatch(algorithm=algorithm, buckets=buckets, state=state,
                       train_keys=keys["train"], values=run_values, compiled=compiled,
                       state_sharding=everywhere,
                       test_evaluation=test_evaluation,
                       compile_seconds=time.perf_counter() - start)


def run_at(state_or_metrics: Any, run: int) -> Any:
  """Run `run`'s slice of a batch's state or metrics (host arrays)."""
  return jax.tree.map(lambda a: a[run], state_or_metrics)


def run_batch(build: BuildFn, model, data: FederatedData | Sequence[FederatedData],
              train: TrainConfig, seeds: Sequence[int],
              values: Mapping[str, Sequence[float]] | None = None,
              checkpointers: Sequence[Checkpointer] | None = None,
              on_round: Sequence[Callable[[int, RoundMetrics], None]] | None = None,
              progress: Progress | None | str = "auto", watchdog: Watchdog | None = None,
              mesh=None, runs_per_step: int | None = None) -> list[RunResult | RunFailed]:
  """Trains S = len(seeds) runs as one program for train.rounds rounds; run s has seed
  seeds[s], the values values[name][s] and (given one dataset a run) data[s].

  Each run has its own checkpointer and on_round, if given; they must hold checkpoints
  of the same round (a sweep groups runs by it). A run whose loss turns NaN is a
  RunFailed in the list, the others go on. Otherwise as simulation.run_algorithm."""
  num_runs = len(seeds)
  for given, what in ((checkpointers, "checkpointers"), (on_round, "on_round")):
    if given is not None and len(given) != num_runs:
      raise ConfigError(f"a batch of {num_runs} runs was given {len(given)} {what}")
  progress = resolve_progress(progress, train.log_every)
  label = f"{num_runs} runs"
  stages = _StageReporter(label, train.rounds, watchdog, None)
  try:
    stages.compiling()
    prepared = prepare_batch(build, model, data, train, seeds, values, mesh, runs_per_step)
    name = prepared.algorithm.name
    progress.start(f"{name} ({label})", train.rounds, _task(data))
    return _train_batch(prepared, train, seeds, checkpointers, on_round, progress, stages,
                        _task(data))
  except RunInterrupted:
    raise
  except KeyboardInterrupt as e:
    raise RunInterrupted(f"{stages.where} interrupted; the runs' checkpoints up to their"
                         f" last save are kept") from e
  finally:
    progress.close()
    if watchdog is not None:
      watchdog.idle()


def _task(data) -> str:
  return (data if isinstance(data, FederatedData) else data[0]).task


def _restore(prepared: PreparedBatch, checkpointers, rounds: int):
  """The runs' state and history from their checkpoints (all of one round), if any."""
  if checkpointers is None:
    return prepared.state, [[] for _ in range(len(prepared.train_keys))]
  saved = [c.latest_round() for c in checkpointers]
  if len(set(saved)) > 1:
    raise BatchError(f"the runs of a batch hold checkpoints of different rounds ({saved});"
                     f" run them in batches of one round each")
  if saved[0] is None:
    return prepared.state, [[] for _ in checkpointers]
  one_round = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                           prepared.compiled.out_info[1])
  restored = [c.restore(run_at(prepared.state, s), one_round, rounds)
              for s, c in enumerate(checkpointers)]
  state = jax.tree.map(lambda *runs: np.stack([np.asarray(r) for r in runs]),
                       *[r.state for r in restored])
  state = jax.device_put(state, prepared.state_sharding)
  return state, [unstack_history(r.history) for r in restored]


def _train_batch(prepared: PreparedBatch, train: TrainConfig, seeds, checkpointers,
                 on_round, progress: Progress, stages: _StageReporter,
                 task: str) -> list[RunResult | RunFailed]:
  state, histories = _restore(prepared, checkpointers, train.rounds)
  num_runs = len(seeds)
  resumed_from_round = len(histories[0])
  progress.compiled(prepared.compile_seconds, resumed_from_round)
  lower_is_better = task == "regression"
  best = [_best_mean(h, lower_is_better) for h in histories]
  failed: dict[int, TrainingDivergedError] = {}
  durations: list[float] = []
  start = time.perf_counter()
  for r in range(resumed_from_round, train.rounds):
    stages.round(r + 1, durations)
    tic = time.perf_counter()
    state, metrics = prepared.compiled(state, prepared.buckets, prepared.train_keys,
                                       prepared.values)
    metrics = to_host(metrics)
    if prepared.test_evaluation is not None:
      metrics = _scored_where_due(prepared, state, metrics, r + 1, train, best,
                                  lower_is_better)
    durations.append(time.perf_counter() - tic)
    for s in range(num_runs):
      if s in failed:
        continue
      own = run_at(metrics, s)
      try:
        check_finite(own, r + 1, divergence_hint=prepared.algorithm.divergence_hint)
      except TrainingDivergedError as e:
        failed[s] = TrainingDivergedError(f"run {s} (seed {seeds[s]}): {e}")
        logger.warning("%s", failed[s])
        continue
      best[s] = _best_mean([own], lower_is_better, best[s])
      histories[s].append(own)
      if on_round is not None:
        on_round[s](r + 1, own)
    if checkpointers is not None and checkpointers[0].due(r + 1, train.rounds):
      host_state = jax.device_get(state)
      for s, checkpointer in enumerate(checkpointers):
        if s not in failed:
          checkpointer.save(run_at(host_state, s), histories[s])
      stages.saved(r + 1)
    progress.round_done(r + 1, metrics, float(np.median(durations)))
  total_seconds = time.perf_counter() - start
  algorithm = prepared.algorithm
  results: list[RunResult | RunFailed] = []
  for s in range(num_runs):
    if s in failed:
      results.append(RunFailed(failed[s]))
      continue
    final = run_at(state, s)
    results.append(RunResult(
        algorithm=algorithm.name,
        history=jax.tree.map(lambda *rounds: np.stack(rounds), *histories[s]),
        artifacts={k: np.asarray(v) for k, v in
                   algorithm.artifacts(final.algorithm.server).items()},
        compile_seconds=prepared.compile_seconds,
        round_seconds=float(np.median(durations)) if durations else 0.0,
        total_seconds=total_seconds, final_state=final,
        resumed_from_round=resumed_from_round))
  return results


def _scored_where_due(prepared: PreparedBatch, state, metrics: RoundMetrics, round_number: int,
                      train: TrainConfig, best: list[float],
                      lower_is_better: bool) -> RoundMetrics:
  """Test scores for the runs due this round (simulation.due_for_test), NaN for the
  others, as each run's history would hold alone."""
  due = np.array([due_for_test(round_number, train, metrics.val_score[s], best[s],
                               lower_is_better) for s in range(len(best))])
  if not due.any():
    return metrics
  test = to_host(prepared.test_evaluation(state, prepared.buckets, prepared.values))
  mask = due[:, None]
  return metrics._replace(
      test_loss=cast(Any, np.where(mask, test.loss, metrics.test_loss)),
      test_score=cast(Any, np.where(mask, test.score, metrics.test_score)))
