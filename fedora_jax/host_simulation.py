"""Runs an algorithm with its clients held on the host (`--client_data=host`).

Each round only the sampled clients' data goes to the device (host_rounds.py), stacked
and moved by a background thread while the previous round trains; a generated dataset
generates only those clients. The client state of the FedAvg-like algorithms this
serves is a placeholder for the round's slots, never one per client. Evaluation scores
`train.eval_clients` clients a round, drawn from the seed (None: all), and every client
in the last round, a chunk at a time, so a million clients never sit on the device at
once. Metrics come back [K] per round as run_algorithm's do: NaN (0 steps) for the
clients a round did not train or score. Dropout, stragglers and availability traces act
as in the device-held round (the same fates, read at the slots).
"""

import concurrent.futures
import time
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.data import host_clients as host_lib
from fedora_jax.data.client_data import ClientSplits
from fedora_jax.engine import batch_stats
from fedora_jax.errors import FieldError
from fedora_jax.host_rounds import (build_slot_evaluation, build_slot_round,
                                    init_slots, sampled_ids)
from fedora_jax.progress import Progress
from fedora_jax.rounds import RoundMetrics, RoundState, num_sampled_clients
from fedora_jax.simulation import (AlgorithmSource, RunResult, TrainConfig, build_algorithm,
                                   check_finite, client_conditions, client_trainer,
                                   resolve_progress, root_keys, to_host)

CLIENT_DATA = ("device", "host")
EVAL_CHUNK = 4096   # clients scored per call in the last round's evaluation of all K
_EVAL_STREAM = 0xE7A1  # keeps the evaluation sample's draws apart from other seeds' users


def check_settings(client_data: str, eval_clients: int | None) -> None:
  """One line for a bad --client_data or --eval_clients."""
  if client_data not in CLIENT_DATA:
    raise FieldError("train", "client_data",
                     f"must be one of {', '.join(CLIENT_DATA)}, got {client_data!r}")
  if eval_clients is not None and eval_clients < 1:
    raise FieldError("train", "eval_clients", f"must be >= 1, got {eval_clients}")
  if eval_clients is not None and client_data != "host":
    raise FieldError("train", "eval_clients", "takes --client_data=host (the device-held"
                     " round scores every client on the device)")


class Slots(NamedTuple):
  """Clients on the device as one bucket, and who they are."""
  ids: np.ndarray          # [S] client ids
  data: ClientSplits       # [S, ...] on the device


def _to_device(source: host_lib.HostClients, ids: np.ndarray) -> Slots:
  clients = source.take(ids)
  return Slots(ids=ids, data=jax.device_put(
      host_lib.stack_slots(clients, host_lib.slot_lengths(clients))))


def eval_sample(num_clients: int, eval_clients: int | None, seed: int,
                round_number: int) -> np.ndarray | None:
  """The clients a round scores, ascending; None: all of them."""
  if eval_clients is None or eval_clients >= num_clients:
    return None
  rng = np.random.default_rng([seed, round_number, _EVAL_STREAM])
  return np.sort(rng.choice(num_clients, eval_clients, replace=False))


def _chunks(ids: np.ndarray, size: int) -> Iterator[np.ndarray]:
  for start in range(0, len(ids), size):
    yield ids[start:start + size]


class _Prefetched(NamedTuple):
  train: Slots
  weights: jax.Array            # [M] float32
  scored: Slots | None          # the round's evaluation sample (None: all K, last round)


def run_host(algorithm: AlgorithmSource, model, clients: host_lib.HostClients,
             train: TrainConfig,
             on_round: Callable[[int, RoundMetrics], None] | None = None,
             progress: Progress | None | str = "auto") -> RunResult:
  """run_algorithm for host-held `clients`: train.rounds rounds, per-round per-client
  metrics [R, K]; the final state's client state is the slots' placeholder."""
  check_settings("host", train.eval_clients)
  trainer = client_trainer(model, clients, train)
  built = build_algorithm(algorithm, trainer)
  progress = resolve_progress(progress, train.log_every)
  progress.start(built.name, train.rounds, clients.task)
  try:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
      return _train(built, trainer, model, clients, train, on_round, progress, pool)
  finally:
    progress.close()


def _train(algorithm, trainer, model, source: host_lib.HostClients, train: TrainConfig,
           on_round, progress: Progress, pool) -> RunResult:
  num_clients = source.num_clients
  num_sampled = num_sampled_clients(train.participation, num_clients)
  keys = root_keys(train.seed)
  pick = jax.jit(lambda key: sampled_ids(key, num_clients, num_sampled))

  def prefetch(r: int) -> _Prefetched:  # round r's data (0-based), on a worker thread
    ids = np.asarray(pick(jax.random.fold_in(keys["train"], r)))
    slots = _to_device(source, ids)
    weights = (np.ones(len(ids), np.float32) if train.client_weights == "uniform" else
               np.asarray(jax.device_get(slots.data.train.n), np.float32))
    scored = eval_sample(num_clients, train.eval_clients, train.seed, r + 1)
    last = r + 1 == train.rounds
    return _Prefetched(slots, jnp.asarray(weights),
                       None if last or scored is None else _to_device(source, scored))

  start = time.perf_counter()
  upcoming = pool.submit(prefetch, 0)
  first = upcoming.result()
  sample = jnp.asarray(first.train.data.train.x[0, :1])
  params = batch_stats.fold(model.init(keys["init"], sample))
  state = RoundState(round=jnp.zeros((), jnp.int32),
                     algorithm=init_slots(algorithm, trainer, params, num_sampled,
                                          keys["algorithm"]))
  conditions = client_conditions(train, num_clients)  # a trace read and checked against K
  slot_round = jax.jit(build_slot_round(algorithm, train.client_chunk, num_clients,
                                        conditions), donate_argnums=0)
  evaluate = jax.jit(build_slot_evaluation(algorithm, trainer, train.client_chunk,
                                           ("val", "test")))
  compile_seconds = time.perf_counter() - start  # the first round's compile counts as its time
  progress.compiled(compile_seconds, 0)

  history: list[RoundMetrics] = []
  durations: list[float] = []
  run_start = time.perf_counter()
  for r in range(train.rounds):
    tic = time.perf_counter()
    ready = upcoming.result()
    if r + 1 < train.rounds:  # the next round's clients move while this one trains
      upcoming = pool.submit(prefetch, r + 1)
    state, out = slot_round(state, ready.train.data, jnp.asarray(ready.train.ids),
                            ready.weights, keys["train"])
    if ready.scored is None:
      scored = _evaluate_all(evaluate, state, source, pool)
    else:
      scored = (ready.scored.ids, to_host(evaluate(state, ready.scored.data)))
    metrics = _round_metrics(num_clients, ready.train.ids, to_host(out), *scored)
    durations.append(time.perf_counter() - tic)
    check_finite(metrics, r + 1, scored=np.isin(np.arange(num_clients), scored[0]),
                 divergence_hint=algorithm.divergence_hint)
    history.append(metrics)
    if on_round is not None:
      on_round(r + 1, metrics)
    progress.round_done(r + 1, metrics, float(np.median(durations)))
  total_seconds = time.perf_counter() - run_start
  stacked = jax.tree.map(lambda *rounds: np.stack(rounds), *history)
  artifacts = {k: np.asarray(v) for k, v in
               algorithm.artifacts(state.algorithm.server).items()}
  return RunResult(algorithm=algorithm.name, history=stacked, artifacts=artifacts,
                   compile_seconds=compile_seconds,
                   round_seconds=float(np.median(durations)) if durations else 0.0,
                   total_seconds=total_seconds, final_state=state)


def _evaluate_all(evaluate, state: RoundState, source: host_lib.HostClients, pool):
  """(ids, (val, test)) of every client, EVAL_CHUNK at a time, the next chunk moving
  while this one is scored."""
  everyone = np.arange(source.num_clients)
  chunks = list(_chunks(everyone, EVAL_CHUNK))
  results = []
  upcoming = pool.submit(_to_device, source, chunks[0])
  for i in range(len(chunks)):
    slots = upcoming.result()
    if i + 1 < len(chunks):
      upcoming = pool.submit(_to_device, source, chunks[i + 1])
    results.append(to_host(evaluate(state, slots.data)))
  return everyone, jax.tree.map(lambda *parts: np.concatenate(parts), *results)


def _round_metrics(num_clients: int, trained: np.ndarray, out, scored: np.ndarray,
                   splits) -> RoundMetrics:
  """The round's [K] metrics: the slots' training and the scored clients' evaluation put
  in client order, NaN (0 steps, 0 bytes) for the others."""
  def put(ids, values):
    values = np.asarray(values)
    fill = np.nan if np.issubdtype(values.dtype, np.inexact) else 0
    full = np.full((num_clients,) + values.shape[1:], fill, values.dtype)
    full[ids] = values
    return full
  val, test = splits
  return RoundMetrics(
      train_loss=put(trained, out.train_loss), local_steps=put(trained, out.local_steps),
      val_loss=put(scored, val.loss), val_score=put(scored, val.score),
      test_loss=put(scored, test.loss), test_score=put(scored, test.score),
      extra={k: put(trained, v) for k, v in out.extra.items()},
      bytes_up=put(trained, out.bytes_up), bytes_down=put(trained, out.bytes_down))
