"""Runs one algorithm on one federated dataset: build, compile once, loop over rounds."""

import dataclasses
import logging
import time
from typing import Any, Callable, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax import availability, tree
from fedora_jax.algorithms.base import Algorithm, InitContext
from fedora_jax.checkpoint import Checkpointer, unstack_history
from fedora_jax.data.client_data import FederatedData
from fedora_jax.data.host_clients import HostClients
from fedora_jax.engine.local_training import ClientTrainer, make_client_trainer, make_optimizer
from fedora_jax.engine import batch_stats, precision, sharding
from fedora_jax.progress import Progress, Silent, default_progress
from fedora_jax.watchdog import Watchdog
from fedora_jax.rounds import (RoundMetrics, RoundState, build_test_evaluation,
                               build_train_round)
from fedora_jax.errors import ConfigError, RunInterrupted, TrainingDivergedError

logger = logging.getLogger("fedora_jax")


# config.OUTSIDE, spelled out here below it.
_OUTSIDE = {"outside_identity": True}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Client training and run length (defaults: FEDORA authors' code). Fields marked
  _OUTSIDE change no number a run computes, so they are outside its identity
  (fedora_jax/config.py): how many rounds (a longer run extends a shorter one exactly),
  how often it logs and scores test, how the clients are batched (the numbers agree up
  to float rounding, as across devices)."""
  rounds: int = dataclasses.field(default=500, metadata=_OUTSIDE)
  local_epochs: int = 5
  batch_size: int = 64
  lr: float = 5e-3
  momentum: float = 0.9
  weight_decay: float = 5e-5
  seed: int = 0
  eval_batch_size: int = dataclasses.field(default=1024, metadata=_OUTSIDE)
  # The default progress: a log line every N rounds.
  log_every: int = dataclasses.field(default=50, metadata=_OUTSIDE)
  # None: every client's update at once (vmap); n: lax.map over chunks of n clients,
  # faster on CPUs (engine/buckets.py over_clients, models.default_client_chunk).
  client_chunk: int | None = dataclasses.field(default=None, metadata=_OUTSIDE)
  participation: float = 1.0  # fraction of clients sampled each round (rounds.py)
  # Test scored every N rounds, at the last round and at each round whose mean validation
  # score is the best so far, so the final and best-validation results stay exact; NaN
  # in the history's other rounds. 1: every round.
  eval_every: int = dataclasses.field(default=1, metadata=_OUTSIDE)
  # Each client's weight in the server's averages (rounds.py): "samples", its training
  # samples n_k (McMahan et al.), or "uniform", 1 for every client the round trained.
  client_weights: str = "samples"
  # Clients as they really are (fedora_jax/availability.py), drawn per round per client:
  # the probability a sampled client drops before uploading; a [rounds x K] 0/1 file of
  # who is online; the probability a client straggles and its speed ("uniform:LO,HI" or
  # a fraction: the share of its local steps it completes); a round deadline in units
  # of a full client's local-training time (0: none), past which stragglers drop.
  client_dropout: float = 0.0
  availability_trace: str | None = None
  stragglers: float = 0.0
  straggler_speed: str = availability.DEFAULT_SPEED
  round_deadline: float = 0.0
  # The model's arithmetic: "float32", or "bfloat16" with float32 parameters, gradients
  # and optimizer state (engine/precision.py).
  precision: str = "float32"
  # Where the clients' data live (host_simulation.py): "device", every client stacked on
  # the device; "host", in host memory (or generated), only a round's sampled clients
  # moved to the device. The same numbers either way, so outside the identity.
  client_data: str = dataclasses.field(default="device", metadata=_OUTSIDE)
  # Clients scored a round (host-held clients), drawn from the seed; the last round
  # scores all. None: every client every round.
  eval_clients: int | None = None


# What the runner takes: an Algorithm, or a function building one around the run's client
# trainer (algorithms.make(name, config) for a registered one; the trainer carries the
# run's model, optimizer and epochs, which an algorithm's client update calls).
AlgorithmSource = Algorithm | Callable[[ClientTrainer], Algorithm]


class RunResult(NamedTuple):
  algorithm: str
  history: RoundMetrics            # numpy, every field [R, K] (extra: dict of [R, K])
  artifacts: dict[str, np.ndarray]
  compile_seconds: float
  round_seconds: float             # median wall time of one round, after compilation
  total_seconds: float
  final_state: RoundState
  resumed_from_round: int = 0     # rounds restored from a checkpoint, not trained here


def root_keys(seed: int) -> dict[str, jax.Array]:
  """Independent streams from one seed: model init, algorithm init, training, new clients."""
  root = jax.random.key(seed)
  return {"init": jax.random.fold_in(root, 0), "algorithm": jax.random.fold_in(root, 1),
          "train": jax.random.fold_in(root, 2), "new_clients": jax.random.fold_in(root, 3)}


def initial_model(model, data: FederatedData, key: jax.Array):
  """The run's one initial model (no client axis), BatchNorm statistics folded into the
  parameters (engine/batch_stats.py)."""
  sample = jnp.asarray(data.buckets[0].train.x[0, :1])
  return batch_stats.fold(model.init(key, sample))


def shared_initial_params(model, data: FederatedData, key: jax.Array):
  """One initial model copied to every client ([K, ...] leaves), as in the authors' code."""
  return tree.broadcast_to_clients(initial_model(model, data, key), data.num_clients)


def jitted_init(algorithm, trainer, data: FederatedData, out_shardings=None):
  """algorithm.init, jitted: (one initial model, the placed buckets, key) -> its state.

  The model is copied to the K clients inside the jit, so an algorithm that keeps no
  per-client model (FedAvg) never holds K copies of it."""
  def init(params, buckets, key):
    return algorithm.init(InitContext(
        params=tree.broadcast_to_clients(params, data.num_clients),
        data=data._replace(buckets=buckets), trainer=trainer, key=key))
  return jax.jit(init, out_shardings=out_shardings)


_Tree = TypeVar("_Tree")


def to_host(metrics: _Tree) -> _Tree:
  """The round's metrics (any pytree) as numpy arrays on the host (waits for the round
  to finish)."""
  return jax.tree.map(np.asarray, jax.device_get(metrics))


def check_finite(metrics: RoundMetrics, round_number: int,
                 scored: np.ndarray | None = None,
                 divergence_hint: Callable[[dict, int], str | None] | None = None) -> None:
  """Raises TrainingDivergedError naming the round and the clients with NaN/Inf losses;
  `scored` [K] bool: the clients the round evaluated (None: all); `divergence_hint`: the
  algorithm's own reading of the round's metrics (Algorithm.divergence_hint)."""
  # Clients that sat the round out (--participation) report no train loss.
  trained = metrics.local_steps > 0
  scored = np.ones_like(trained) if scored is None else scored
  bad = (trained & ~np.isfinite(metrics.train_loss)) | (scored & ~np.isfinite(metrics.val_loss))
  if bad.any():
    clients = np.flatnonzero(bad).tolist()
    shown = ", ".join(map(str, clients[:10])) + (" ..." if len(clients) > 10 else "")
    hint = ((divergence_hint and divergence_hint(metrics.extra, round_number))
            or "lower --lr or check the data")
    raise TrainingDivergedError(
        f"NaN or Inf loss in round {round_number} at client(s) {shown}"
        f" ({len(clients)} of {len(bad)}); {hint}")


class PreparedRun(NamedTuple):
  """A run's compiled round and initial state (shared by run_algorithm and the benchmark)."""
  algorithm: Algorithm
  trainer: ClientTrainer
  keys: dict[str, jax.Array]
  buckets: tuple                  # the client data on the device
  state: RoundState               # after algorithm.init
  compiled: Any                   # train_round, AOT-compiled, state donated
  compile_seconds: float          # model and algorithm init plus lowering and compiling
  # With train.eval_every > 1: build_test_evaluation, AOT-compiled (the round then scores
  # validation only); else None.
  test_evaluation: Any = None


def client_trainer(model, data: FederatedData | HostClients,
                   train: TrainConfig) -> ClientTrainer:
  """The run's client trainer: `model` trained by SGD as `train` says (what an Algorithm
  built outside the registry closes over, to run as the runner's own would)."""
  return make_client_trainer(
      precision.compute_in(train.precision, model.apply),
      make_optimizer(train.lr, train.momentum, train.weight_decay),
      train.local_epochs, train.batch_size, train.eval_batch_size, task=data.task)


def client_conditions(train: TrainConfig,
                      num_clients: int) -> availability.ClientConditions | None:
  """The run's dropout, availability and stragglers, checked (its trace read); None when
  every one is off."""
  return availability.build_conditions(train.client_dropout, train.availability_trace,
                                       train.stragglers, train.straggler_speed,
                                       train.round_deadline, num_clients)


def build_algorithm(algorithm: AlgorithmSource, trainer: ClientTrainer) -> Algorithm:
  """`algorithm` itself, or what it builds around `trainer`."""
  if isinstance(algorithm, Algorithm):
    return algorithm
  if isinstance(algorithm, str) or not callable(algorithm):
    raise ConfigError(f"the runner takes an Algorithm or a function trainer -> Algorithm,"
                      f" not {algorithm!r} (a registered one: algorithms.make(name, config))")
  built = algorithm(trainer)
  if not isinstance(built, Algorithm):
    raise ConfigError(f"{algorithm!r} built {type(built).__name__}, not an Algorithm")
  return built


def prepare_run(algorithm: AlgorithmSource, model, data: FederatedData,
                train: TrainConfig, mesh=None) -> PreparedRun:
  """Builds `algorithm`'s initial state and the compiled train_round of a run, the
  client data split over `mesh` (default: `sharding.default_mesh`)."""
  trainer = client_trainer(model, data, train)
  return _prepare(build_algorithm(algorithm, trainer), trainer, model, data, train, mesh)


def _prepare(algorithm: Algorithm, trainer: ClientTrainer, model, data: FederatedData,
             train: TrainConfig, mesh) -> PreparedRun:
  keys = root_keys(train.seed)
  conditions = client_conditions(train, data.num_clients)  # before any work: a bad trace
  if mesh is None:
    mesh = sharding.default_mesh([len(ids) for ids in data.client_ids])
  buckets = sharding.place_buckets(data.buckets, mesh)

  start = time.perf_counter()
  # Outputs replicated: the [K, ...] state and metrics are small next to the data, and
  # every process then holds all of them (for checkpoints, results and new clients).
  everywhere = sharding.replicated(mesh)
  with jax.set_mesh(mesh):
    params = initial_model(model, data, keys["init"])
    init_state = jitted_init(algorithm, trainer, data, out_shardings=everywhere)
    state = RoundState(round=jnp.zeros((), jnp.int32),
                       algorithm=init_state(params, buckets, keys["algorithm"]))
    every_round = train.eval_every == 1
    train_round = jax.jit(build_train_round(algorithm, trainer, data, train.client_chunk,
                                            train.participation, evaluate_test=every_round,
                                            client_weights=train.client_weights,
                                            conditions=conditions),
                          donate_argnums=0,
                          out_shardings=everywhere)
    compiled = train_round.lower(state, buckets, keys["train"]).compile()
    test_evaluation = None
    if not every_round:
      test_evaluation = jax.jit(
          build_test_evaluation(algorithm, trainer, data, train.client_chunk),
          out_shardings=everywhere).lower(state, buckets).compile()
  compile_seconds = time.perf_counter() - start
  return PreparedRun(algorithm=algorithm, trainer=trainer, keys=keys, buckets=buckets,
                     state=state, compiled=compiled, compile_seconds=compile_seconds,
                     test_evaluation=test_evaluation)


def due_for_test(round_number: int, train: TrainConfig, val_score: np.ndarray | jax.Array,
                 best_mean_val: float, lower_is_better: bool = False) -> bool:
  """Whether round `round_number` (1-based) scores test under train.eval_every: every
  N-th round, the last, and a round whose mean validation score beats every earlier
  round's (strictly: metrics.best_validation_round takes the first on ties)."""
  return (round_number % train.eval_every == 0 or round_number == train.rounds
          or _improves(float(np.mean(val_score)), best_mean_val, lower_is_better))


def _improves(mean: float, best: float, lower_is_better: bool) -> bool:
  """Whether `mean` beats `best` strictly (NaN `best`: there is none yet)."""
  return bool(np.isnan(best) or (mean < best if lower_is_better else mean > best))


def run_algorithm(algorithm: AlgorithmSource, model, data: FederatedData,
                  train: TrainConfig,
                  on_round: Callable[[int, RoundMetrics], None] | None = None,
                  checkpointer: Checkpointer | None = None, mesh=None,
                  progress: Progress | None | str = "auto",
                  watchdog: Watchdog | None = None,
                  on_state: Callable[[int, RoundState], None] | None = None) -> RunResult:
  """Trains `algorithm` (an Algorithm, or algorithms.make(name, config)) for
  train.rounds rounds; returns per-round per-client metrics.

  With a checkpointer, starts from its latest checkpoint (state and the history of the
  rounds before it; `on_round` is not called for those) and saves as it goes.
  `progress` hears of the compile and every round (fedora_jax/progress.py; "auto": a
  bar in a terminal or notebook, else a line every train.log_every rounds; None:
  nothing). A `watchdog` (fedora_jax/watchdog.py, already entered) is told each stage,
  compiling and every round, with its time limit. Ctrl-C raises RunInterrupted, saying
  where the run was and which checkpoint is kept. `on_state(round, state)` sees the
  state after each round (a diagnostic's: verification/long.py compares models round by
  round); it must copy what it keeps, as the next round reuses the state's buffers.
  """
  trainer = client_trainer(model, data, train)
  algorithm = build_algorithm(algorithm, trainer)
  name = algorithm.name
  progress = resolve_progress(progress, train.log_every)
  progress.start(name, train.rounds, data.task)
  stages = _StageReporter(name, train.rounds, watchdog, checkpointer)
  try:
    return _train(algorithm, trainer, model, data, train, on_round, checkpointer, mesh,
                  progress, stages, on_state)
  except RunInterrupted:
    raise
  except KeyboardInterrupt as e:  # Ctrl-C: say where, and what is kept
    if checkpointer is not None:
      checkpointer.remove_unfinished()
    raise RunInterrupted(f"{stages.where} interrupted; {stages.note()}") from e
  finally:
    progress.close()
    if watchdog is not None:
      watchdog.idle()


def resolve_progress(progress: Progress | None | str, log_every: int) -> Progress:
  """"auto" -> progress.default_progress; None -> nothing reported."""
  if progress == "auto":
    return default_progress(log_every)
  if isinstance(progress, str):
    raise ConfigError(f"progress: \"auto\", None or a Progress, got {progress!r}")
  return Silent() if progress is None else progress


class _StageReporter:
  """Where a run is (`where`) and what stopping it there leaves to resume from (`note`),
  told to a watchdog, if any, with each stage's limit."""

  def __init__(self, name: str, rounds: int, watchdog: Watchdog | None,
               checkpointer: Checkpointer | None):
    self.name, self.rounds, self.watchdog = name, rounds, watchdog
    self.checkpointer = checkpointer
    self.saved_round: int | None = None
    self.where = f"{name}:"

  def note(self) -> str:
    if self.checkpointer is None:
      return "the run keeps no checkpoints"
    if self.saved_round is None:
      return "no checkpoint saved yet"
    return f"its checkpoint of round {self.saved_round} is kept"

  def compiling(self) -> None:
    self.where = f"{self.name}: compiling"
    if self.watchdog is not None:
      self.watchdog.stage(self.where, self.watchdog.limits.compile_seconds, self.note())

  def round(self, number: int, durations: list[float]) -> None:
    self.where = f"{self.name}: round {number} of {self.rounds}"
    if self.watchdog is not None:
      median = float(np.median(durations)) if durations else None
      self.watchdog.stage(self.where, self.watchdog.limits.round_limit(median),
                          self.note())

  def saved(self, number: int) -> None:
    self.saved_round = number


def _best_mean(history: list[RoundMetrics], lower_is_better: bool,
               best: float = np.nan) -> float:
  """The best mean validation score of `history`'s rounds and `best` (NaN: none yet)."""
  for metrics in history:
    mean = float(np.mean(metrics.val_score))
    if _improves(mean, best, lower_is_better):
      best = mean
  return best


def _train(algorithm: Algorithm, trainer: ClientTrainer, model, data, train, on_round,
           checkpointer, mesh, progress: Progress, stages: _StageReporter,
           on_state=None) -> RunResult:
  name = algorithm.name
  stages.compiling()
  prepared = _prepare(algorithm, trainer, model, data, train, mesh)
  keys, buckets = prepared.keys, prepared.buckets
  state, compiled, compile_seconds = (prepared.state, prepared.compiled,
                                      prepared.compile_seconds)

  history: list[RoundMetrics] = []
  durations: list[float] = []
  restored = (None if checkpointer is None else
              checkpointer.restore(state, compiled.out_info[1], train.rounds))
  if restored is not None:
    state, history = restored.state, unstack_history(restored.history)
    stages.saved(len(history))
    logger.info("%s: resuming after round %d of %d from %s", name, len(history),
                train.rounds, checkpointer.directory)
  resumed_from_round = len(history)
  progress.compiled(compile_seconds, resumed_from_round)
  lower_is_better = data.task == "regression"  # a regression's score is its MAE
  best_mean_val = _best_mean(history, lower_is_better)
  run_start = time.perf_counter()
  for r in range(resumed_from_round, train.rounds):
    stages.round(r + 1, durations)
    tic = time.perf_counter()
    state, metrics = compiled(state, buckets, keys["train"])
    metrics = to_host(metrics)  # also waits for the round to finish
    if prepared.test_evaluation is not None and due_for_test(
        r + 1, train, metrics.val_score, best_mean_val, lower_is_better):
      test = to_host(prepared.test_evaluation(state, buckets))
      metrics = metrics._replace(test_loss=test.loss, test_score=test.score)
    durations.append(time.perf_counter() - tic)
    check_finite(metrics, r + 1, divergence_hint=prepared.algorithm.divergence_hint)
    best_mean_val = _best_mean([metrics], lower_is_better, best_mean_val)
    history.append(metrics)
    if on_round is not None:
      on_round(r + 1, metrics)
    if on_state is not None:
      on_state(r + 1, state)
    if checkpointer is not None and checkpointer.due(r + 1, train.rounds):
      checkpointer.save(state, history)
      stages.saved(r + 1)
    progress.round_done(r + 1, metrics, float(np.median(durations)))
  total_seconds = time.perf_counter() - run_start

  stacked = jax.tree.map(lambda *rounds: np.stack(rounds), *history)
  artifacts = {k: np.asarray(v) for k, v in
               algorithm.artifacts(state.algorithm.server).items()}
  return RunResult(algorithm=name, history=stacked, artifacts=artifacts,
                   compile_seconds=compile_seconds,
                   round_seconds=float(np.median(durations)) if durations else 0.0,
                   total_seconds=total_seconds, final_state=state,
                   resumed_from_round=resumed_from_round)
