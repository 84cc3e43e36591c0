"""Times the production `train_round` and sets it beside the machine's matmul peak.

What it measures, for one algorithm on one federated dataset:
  - seconds per round: the AOT-compiled round of `simulation.prepare_run` (the very
    function `run_algorithm` calls, state donated, metrics fetched to the host), median
    over repeats after warm-up rounds;
  - model FLOPs per round, counted analytically (`round_work`): the forward FLOPs of one
    sample, read off the model's jaxpr (`model_forward_flops`: 2 x multiply-adds of
    every matmul and convolution, so an im2col or `lax.conv` CNN counts its
    convolutions; LeNet-5 on 32x32x3: 4.66 MFLOP), times 3 for each training
    sample-step (forward + backward) of the clients the round trains (round(f K) at
    participation f), times 1 for each evaluated sample, plus what the algorithm's
    registry entry declares beyond that (`round_cost`: FEDORA's lambda passes and
    propagation product). Only real (unpadded) samples count, so this is useful work,
    as in MFU; padding, gathers, the optimizer, activations and softmax are overhead. The model is
    the run's (`--model`) whatever the algorithm evaluates: where a personalised model
    is more than that (FedCP's second head and policy network), the count is a lower
    bound. Two XLA
    counts are reported beside it: the compiled round's `cost_analysis()`, which counts
    the body of a while loop / `lax.scan` once, not once per step (a lower bound, far
    below), and XLA's count of one batch's forward and forward + backward pass (per
    sample) times the same sample counts (`xla_flops_per_round_by_counts`: elementwise
    work included, the first layer's unneeded input gradient left out). The ratio to
    peak uses the analytic count. Client updates per second count the trained clients
    only;
  - the machine's matmul peak, measured in the same process: best FLOP/s of a jitted
    f32 matmul, square (2048^3) and at the model's own batched shapes;
  - compile seconds, peak memory (process max RSS; the device's peak_bytes_in_use where
    the backend reports it; XLA's buffer sizes of the compiled round);
  - the server step's share: the algorithm's `aggregate` + `broadcast` (FEDORA: the
    propagation Theta_hat = P Theta), jitted and timed on their own with the round's
    shardings and donation (`server_step`), and FEDORA's one-off init (subspaces,
    similarity, the K x K propagation matrix).
"""

import dataclasses
import functools
import json
import math
import os
import resource
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax import algorithms, tree
from fedora_jax.data.client_data import ClientData, FederatedData
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.rounds import client_keys, num_sampled_clients
from fedora_jax.engine import batch_stats, sharding
from fedora_jax.engine.sharding import constrain_to_clients
from fedora_jax.simulation import (PreparedRun, TrainConfig, to_host, prepare_run,
                                   initial_model, jitted_init)

# Validation passes a round makes beyond the engine's own evaluation (one pass over
# validation and test): FEDORA's client scores theta_k and theta_hat_k on its validation
# split to set lambda_k. Algorithms not listed are counted with none (a lower bound).


def random_cifar_client(rng: np.random.Generator, n: int) -> ClientData:
  """One client of n random CIFAR-shaped uint8 images and labels, all real: the data of
  the one-client step benchmarks (`benchmarks.resnet_step`, `benchmarks.cnn_step`)."""
  return ClientData(x=rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8),
                    y=rng.integers(0, 10, n).astype(np.int32), mask=np.ones(n, bool),
                    n=np.int32(n))


# --------------------------------------------------------------------------- FLOPs

def dense_layer_shapes(params: Any, stacked: bool = True) -> list[tuple[int, int]]:
  """(fan_in, fan_out) of every dense kernel in a params pytree ([K, in, out] if stacked)."""
  shapes = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = str(getattr(path[-1], "key", path[-1]))
    shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
    if name == "kernel" and len(shape) == 2:
      shapes.append((int(shape[0]), int(shape[1])))
  return shapes


def forward_flops_per_sample(layer_shapes: Sequence[tuple[int, int]]) -> int:
  """Matmul FLOPs of one sample's forward pass through dense layers: 2 * fan_in * fan_out."""
  return sum(2 * fan_in * fan_out for fan_in, fan_out in layer_shapes)


def _equation_flops(eqn) -> int:
  """2 x multiply-adds of one dot_general or convolution (0 for other primitives)."""
  out = eqn.outvars[0].aval.shape
  if eqn.primitive.name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
  if eqn.primitive.name == "conv_general_dilated":
    # Each output element is a dot over the kernel's window and its input features
    # (C_in / feature_group_count, as the kernel is stored).
    rhs = eqn.invars[1].aval.shape
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
    return 2 * math.prod(out) * math.prod(rhs[d] for d in rhs_spec[1:])
  return 0


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
      if hasattr(inner, "eqns"):
        yield inner


def jaxpr_flops(jaxpr) -> int:
  """Matmul and convolution FLOPs of a jaxpr, nested calls included; a scan's body
  counts `length` times, a while loop's once (its trip count is not static)."""
  total = 0
  for eqn in jaxpr.eqns:
    total += _equation_flops(eqn)
    repeats = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    total += repeats * sum(jaxpr_flops(inner) for inner in _sub_jaxprs(eqn))
  return total


def model_forward_flops(apply_fn: Callable, params: Any, sample: Any) -> int:
  """Forward FLOPs per sample of `apply_fn(params, x)`: every matmul and convolution in
  its jaxpr (an im2col convolution is a matmul, `lax.conv` a convolution: both count),
  for one sample `x` [1, ...] and one client's (unstacked) params.

  Training is counted as 3x this (forward, then the input and the weight gradients of
  every layer), the usual MFU convention. The exact backward skips the first layer's
  input gradient (nothing needs it), so XLA's own count of a training step is a little
  lower (LeNet-5 on 32x32x3: 4.66 MFLOP forward, 3x = 14.0, XLA 12.3-12.7 with its
  elementwise work; the MLP 784-128-128-10: 0.236, 3x = 0.708, XLA 0.508). The
  gradient's jaxpr is not used: its transposed convolutions include the zero padding.
  """
  return jaxpr_flops(jax.make_jaxpr(apply_fn)(params, sample).jaxpr)


def xla_flops_per_sample(apply_fn: Callable, params: Any, batch: Any) -> dict[str, float]:
  """XLA's own count (`cost_analysis`) of one forward and one forward + backward pass
  over `batch` [B, ...], per sample. Unlike the analytic count it includes elementwise
  work (activations, pooling, input scaling); it is a check on the analytic count."""
  size = tree.leading_size(batch)
  forward = jax.jit(lambda p, x: jnp.sum(apply_fn(p, x)))
  backward = jax.jit(jax.grad(lambda p, x: jnp.sum(apply_fn(p, x))))
  counts = {}
  for name, fn in (("eval", forward), ("train", backward)):
    flops = xla_cost(fn.lower(params, batch).compile()).get("flops")
    if flops is not None:
      counts[name] = flops / size
  return counts


def parameter_count(params: Any, stacked: bool = True) -> int:
  return sum(int(np.prod(leaf.shape[1:] if stacked else leaf.shape))
             for leaf in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class RoundWork:
  """What one round computes, in samples and FLOPs (real samples only)."""
  train_sample_steps: int   # sum over trained clients of epochs * n_train
  eval_samples: int         # samples passed forward without a gradient
  forward_flops: int        # per sample
  server_flops: int
  flops: int                # 3 * forward * train + forward * eval + server


def round_work(cost: algorithms.RoundCost, forward_flops: int, n_train: np.ndarray,
               n_val: np.ndarray, n_test: np.ndarray, local_epochs: int, num_params: int = 0,
               num_trained: int | None = None) -> RoundWork:
  """Analytic model FLOPs of one round (see the module docstring).

  `num_trained`: clients trained per round (round(f K) at participation f; default
  all). Only their training and their own validation passes (FEDORA's lambda) count,
  each client's share being the expectation over the uniform sampling (M / K of the
  total); every client is still evaluated on validation and test, and FEDORA's
  propagation still reads every client's model.
  """
  num_clients = len(n_train)
  trained = num_clients if num_trained is None else num_trained
  share = trained / num_clients
  train = int(round(share * local_epochs * np.sum(n_train)))
  evaluated = int(round((1 + share * cost.extra_validation_passes) * np.sum(n_val)
                        + np.sum(n_test)))
  server = num_clients * num_clients * num_params * cost.server_pair_products
  flops = 3 * forward_flops * train + forward_flops * evaluated + server
  return RoundWork(train_sample_steps=train, eval_samples=evaluated,
                   forward_flops=forward_flops, server_flops=server, flops=flops)


# --------------------------------------------------------------------------- timing

def _median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(fn())
  durations = []
  for _ in range(repeats):
    tic = time.perf_counter()
    jax.block_until_ready(fn())
    durations.append(time.perf_counter() - tic)
  return durations


def matmul_peak(shapes: dict[str, tuple[int, ...]], repeats: int = 5,
                seconds_per_shape: float = 0.3) -> dict[str, float]:
  """Best f32 FLOP/s of a jitted matmul per shape: (m, k, n) or (batch, m, k, n).

  Each call is repeated until it has run ~seconds_per_shape, `repeats` times; best wins.
  """
  results = {}
  key = jax.random.key(0)
  for name, shape in shapes.items():
    *batch, m, k, n = shape
    a = jax.random.normal(key, (*batch, m, k), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(key, 1), (*batch, k, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    tic = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    one = max(time.perf_counter() - tic, 1e-6)
    inner = max(1, min(1000, int(seconds_per_shape / repeats / one)))
    best = math.inf
    for _ in range(repeats):
      tic = time.perf_counter()
      for _ in range(inner):
        out = matmul(a, b)
      jax.block_until_ready(out)
      best = min(best, (time.perf_counter() - tic) / inner)
    results[name] = 2.0 * math.prod(batch) * m * k * n / best
  return results


def model_matmul_shapes(layer_shapes: Sequence[tuple[int, int]], num_clients: int,
                        batch_size: int, square: int = 2048) -> dict[str, tuple[int, ...]]:
  """The square reference and the round's own batched matmuls (largest layer)."""
  fan_in, fan_out = max(layer_shapes, key=lambda s: s[0] * s[1])
  return {
      f"square_{square}": (square, square, square),
      f"forward_{num_clients}x{batch_size}x{fan_in}x{fan_out}":
          (num_clients, batch_size, fan_in, fan_out),
      f"weight_grad_{num_clients}x{fan_in}x{batch_size}x{fan_out}":
          (num_clients, fan_in, batch_size, fan_out),
  }


def peak_rss_bytes() -> int:
  """Max resident set size of this process so far (Linux reports KiB, macOS bytes)."""
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(rss if sys.platform == "darwin" else rss * 1024)


def device_peak_bytes() -> int | None:
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return None if not stats else stats.get("peak_bytes_in_use")


def time_rounds(prepared: PreparedRun, repeats: int, warmup: int):
  """Runs the compiled round warmup + repeats times as run_algorithm does; wall times."""
  state, durations, metrics = prepared.state, [], None
  for r in range(warmup + repeats):
    tic = time.perf_counter()
    state, metrics = prepared.compiled(state, prepared.buckets, prepared.keys["train"])
    metrics = to_host(metrics)  # also waits for the round to finish
    if r >= warmup:
      durations.append(time.perf_counter() - tic)
  return durations, state, metrics


def paired_rounds(prepared: PreparedRun, state, other_round: Callable[[], Any],
                  repeats: int):
  """Alternates one production round with one `other_round()`; both lists of wall times.

  On a shared machine the load drifts; pairs see the same load, so the median of the
  per-pair ratios is steadier than a ratio of two medians taken minutes apart.
  """
  ours, theirs = [], []
  for _ in range(repeats):
    tic = time.perf_counter()
    state, metrics = prepared.compiled(state, prepared.buckets, prepared.keys["train"])
    metrics = to_host(metrics)
    ours.append(time.perf_counter() - tic)
    tic = time.perf_counter()
    other_round()
    theirs.append(time.perf_counter() - tic)
  return ours, theirs, state


def interleaved_rounds(runs: dict[str, PreparedRun], repeats: int,
                       warmup: int) -> dict[str, list[float]]:
  """Wall times of `repeats` rounds of each compiled run, taken in turn (one round of
  each per pass) so that all of them see the same drift in load."""
  states = {name: run.state for name, run in runs.items()}
  durations: dict[str, list[float]] = {name: [] for name in runs}
  for r in range(warmup + repeats):
    for name, run in runs.items():
      tic = time.perf_counter()
      states[name], metrics = run.compiled(states[name], run.buckets, run.keys["train"])
      to_host(metrics)
      if r >= warmup:
        durations[name].append(time.perf_counter() - tic)
  return durations


def server_step(prepared: PreparedRun, state, data: FederatedData):
  """The server's per-round part on its own, laid out as in the round.

  What the round does between two client steps: the client step leaves each device with
  its own clients' new states and uploads; `aggregate` turns them into the new state,
  which the round returns replicated on every device (so each device receives every
  client's model: the upload); the next round's `broadcast` then computes each device's
  clients' messages (FEDORA: its rows of Theta_hat = P Theta). The new states and
  uploads are donated, as the round donates its state, so an aggregate that keeps them
  (FEDORA's) copies nothing.

  Returns `step(new_clients, uploads) -> (messages, aggregated state)`, jitted, and
  `client_results()`: zeros of the client step's output shapes, split over the devices
  as it leaves them (the server's cost does not depend on their values).
  """
  algorithm = prepared.algorithm  # `state`: a live one (prepared.state was donated)
  weights = jnp.asarray(data.split_sizes("train"), jnp.float32)
  num_clients = data.num_clients
  mesh = jax.tree.leaves(prepared.buckets)[0].sharding.mesh
  everywhere = sharding.replicated(mesh)
  per_client = (sharding.client_sharding(mesh) if num_clients % mesh.size == 0
                else everywhere)
  server, clients = state.algorithm

  def client_phase(server, clients, buckets, key):
    messages = algorithm.broadcast(server, clients)
    step = lambda c, m, k, splits: algorithm.client_update(c, m, splits, k)
    return map_over_buckets(step, (clients, messages, client_keys(key, num_clients)),
                            buckets, data.client_ids, num_clients)

  out_shape = jax.eval_shape(client_phase, server, clients, prepared.buckets,
                             prepared.keys["train"])
  client_results = jax.jit(
      lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           (out_shape.state, out_shape.upload)),
      out_shardings=per_client)

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def step(server, new_clients, uploads):
    aggregated = jax.lax.with_sharding_constraint(
        algorithm.aggregate(server, new_clients, uploads, weights), everywhere)
    messages = constrain_to_clients(algorithm.broadcast(aggregated.server,
                                                        aggregated.clients))
    return messages, aggregated

  def run(new_clients, uploads):
    with jax.set_mesh(mesh):
      return step(server, new_clients, uploads)

  def make_results():
    with jax.set_mesh(mesh):
      return jax.block_until_ready(client_results())

  return run, make_results


def time_server(prepared: PreparedRun, state, data: FederatedData,
                repeats: int) -> list[float]:
  """Wall times of `server_step` (fresh, untimed inputs for each call; one warm-up)."""
  step, client_results = server_step(prepared, state, data)
  durations = []
  for r in range(repeats + 1):
    new_clients, uploads = client_results()
    tic = time.perf_counter()
    jax.block_until_ready(step(new_clients, uploads))
    if r:
      durations.append(time.perf_counter() - tic)
  return durations


def time_init(prepared: PreparedRun, model, data: FederatedData, repeats: int) -> float:
  """Median seconds of the algorithm's jitted init (FEDORA: subspaces and similarity)."""
  algorithm, trainer = prepared.algorithm, prepared.trainer
  params = initial_model(model, data, prepared.keys["init"])
  init_state = jitted_init(algorithm, trainer, data)
  return float(np.median(_median_seconds(
      lambda: init_state(params, prepared.buckets, prepared.keys["algorithm"]), repeats)))


def xla_cost(compiled) -> dict[str, float]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return {k: float(v) for k, v in (cost or {}).items()
          if k in ("flops", "bytes accessed", "transcendentals")}


def xla_memory(compiled) -> dict[str, int]:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return {}
  if stats is None:
    return {}
  return {f"xla_{field}": int(getattr(stats, field)) for field in
          ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
           "alias_size_in_bytes") if hasattr(stats, field)}


# --------------------------------------------------------------------------- the benchmark

@dataclasses.dataclass
class BenchmarkConfig:
  algorithm: str
  algorithm_config: Any
  dataset: str
  num_clients: int
  setting: str
  train: TrainConfig
  repeats: int = 10
  warmup: int = 2
  time_server: bool = True
  peak_repeats: int = 5
  peak_size: int = 2048
  profile_dir: str | None = None  # also trace rounds with jax.profiler, list top ops


def run_benchmark(config: BenchmarkConfig, model, data: FederatedData,
                  log: Callable[[str], None] = print):
  """Compiles and times the production round; returns the report (a JSON-able dict),
  the state after the timed rounds and the PreparedRun (to time more rounds)."""
  train = config.train
  prepared = prepare_run(algorithms.make(config.algorithm, config.algorithm_config), model,
                         data, train)
  log(f"compiled train_round in {prepared.compile_seconds:.2f} s")
  faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  durations, final_state, metrics = time_rounds(prepared, config.repeats, config.warmup)
  # Minor page faults: XLA:CPU allocates a round's temporaries afresh each call, and the
  # kernel zeroes every page first touched (glibc.malloc.hugetlb=1 cuts their number).
  faults_per_round = ((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
                      / (config.warmup + config.repeats))
  round_seconds = float(np.median(durations))
  rss_after_rounds = peak_rss_bytes()
  log(f"round: median {round_seconds * 1e3:.1f} ms over {len(durations)}"
      f" (min {min(durations) * 1e3:.1f}, max {max(durations) * 1e3:.1f})")

  # The FLOPs and matmul shapes are the run's model's: its parameters as the run starts
  # them. (An algorithm's personalised model need not be one: FedCP's is the model with a
  # second head and a policy network, scored by its own evaluate.)
  one_client = initial_model(model, data, prepared.keys["init"])
  layers = dense_layer_shapes(one_client, stacked=False)
  first = data.buckets[0].train
  apply = batch_stats.model_apply(model.apply)  # folded BatchNorm statistics, if any
  forward = model_forward_flops(apply, one_client, first.x[0, :1])
  num_params = parameter_count(one_client, stacked=False)
  trained = (data.num_clients if prepared.algorithm.trains_unsampled  # pFedMe: every client
             else num_sampled_clients(train.participation, data.num_clients))
  # With --eval_every > 1 the compiled round scores validation only (test on demand).
  scores_test = prepared.test_evaluation is None
  n_test = data.split_sizes("test") if scores_test else np.zeros(data.num_clients, int)
  cost = algorithms.get(config.algorithm).round_cost(config.algorithm_config)
  work = round_work(cost, forward, data.split_sizes("train"), data.split_sizes("val"),
                    n_test, train.local_epochs, num_params, num_trained=trained)
  flops_per_second = work.flops / round_seconds
  client_steps = int(np.sum(metrics.local_steps))
  xla_per_sample = xla_flops_per_sample(
      apply, one_client, first.x[0, :min(train.batch_size, first.x.shape[1])])

  # The round's batched matmuls: the clients it trains side by side (all K would make
  # this probe, not the round, the run's peak memory at 10,000 clients).
  peaks = matmul_peak(model_matmul_shapes(layers, trained, train.batch_size,
                                          config.peak_size),
                      repeats=config.peak_repeats)
  peak = max(peaks.values())
  report: dict[str, Any] = {
      "algorithm": config.algorithm, "dataset": config.dataset,
      "num_clients": data.num_clients, "setting": config.setting,
      "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
      "num_devices": jax.device_count(), "cpu_count": os.cpu_count(),
      # the devices the clients are split over (sharding.default_mesh may use fewer)
      "mesh_devices": len(jax.tree.leaves(prepared.buckets)[0].sharding.device_set),
      "client_chunk": train.client_chunk,
      "jax_version": jax.__version__,
      "round_seconds": round_seconds,
      "round_scores_test": scores_test,
      "round_seconds_min": float(min(durations)),
      "round_seconds_all": [float(d) for d in durations],
      # Only the clients a round trains (round(f K) at participation f).
      "clients_trained_per_round": trained,
      "participation": train.participation,
      "client_updates_per_second": trained / round_seconds,
      "client_steps_per_round": client_steps,
      "seconds_per_client_step": round_seconds / max(client_steps, 1),
      "flops_per_round": work.flops,
      "train_sample_steps_per_round": work.train_sample_steps,
      "eval_samples_per_round": work.eval_samples,
      "forward_flops_per_sample": forward,
      "num_params_per_client": num_params,
      "flops_per_second": flops_per_second,
      "peak_flops_per_second": peak,
      "matmul_flops_per_second": peaks,
      "fraction_of_peak": flops_per_second / peak,
      "flops_counted_by": "analytic: the matmuls and convolutions of the model's jaxpr,"
                          " 3x per training sample-step of the trained clients, 1x per"
                          " evaluated sample, + the server's propagation",
      "compile_seconds": prepared.compile_seconds,
      "peak_memory_bytes": rss_after_rounds,
      "page_faults_per_round": faults_per_round,
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
      "device_peak_bytes_in_use": device_peak_bytes(),
      "repeats": config.repeats, "warmup": config.warmup,
      "local_epochs": train.local_epochs, "batch_size": train.batch_size,
  }
  cost = xla_cost(prepared.compiled)
  if "flops" in cost:
    report["xla_flops_per_round"] = cost["flops"]
    report["xla_flops_note"] = ("XLA's cost analysis of the compiled round counts each"
                                " while / scan body once, not once per step: a lower bound")
  if {"train", "eval"} <= set(xla_per_sample):
    # XLA's count of one batch's forward (+ backward) pass times the round's samples.
    report["xla_flops_per_train_sample"] = xla_per_sample["train"]
    report["xla_flops_per_eval_sample"] = xla_per_sample["eval"]
    report["xla_flops_per_round_by_counts"] = (
        xla_per_sample["train"] * work.train_sample_steps
        + xla_per_sample["eval"] * work.eval_samples + work.server_flops)
  report.update(xla_memory(prepared.compiled))
  log(f"model FLOPs/round {work.flops / 1e9:.2f} G -> {flops_per_second / 1e9:.1f} GFLOP/s;"
      f" matmul peak {peak / 1e9:.1f} GFLOP/s"
      f" ({', '.join(f'{k} {v / 1e9:.1f}' for k, v in peaks.items())});"
      f" {100 * flops_per_second / peak:.1f}% of peak")

  if config.time_server:
    server = time_server(prepared, final_state, data, config.repeats)
    server_seconds = float(np.median(server))
    report["server_seconds"] = server_seconds
    report["server_fraction"] = server_seconds / round_seconds
    report["init_seconds"] = time_init(prepared, model, data, max(1, config.repeats // 3))
    log(f"server step (broadcast + aggregate) {server_seconds * 1e3:.2f} ms ="
        f" {100 * server_seconds / round_seconds:.1f}% of the round;"
        f" one-off init {report['init_seconds'] * 1e3:.1f} ms")
  report["peak_memory_bytes"] = max(report["peak_memory_bytes"], peak_rss_bytes())
  if config.profile_dir:
    final_state, ops = profile_rounds(prepared, final_state, max(1, config.repeats // 2),
                                      config.profile_dir)
    report["profile_top_ops"] = ops
    hlo_path = os.path.join(config.profile_dir, "train_round.hlo.txt")
    with open(hlo_path, "w") as f:
      f.write(prepared.compiled.as_text())
    total = sum(op["ms_per_round"] for op in ops)
    log(f"profile (trace in {config.profile_dir}, HLO in {hlo_path}); top ops,"
        f" ms per round (sum {total:.1f}):")
    for op in ops:
      log(f"  {op['ms_per_round']:9.2f} ms  x{op['calls_per_round']:<5.0f} {op['op']}")
  return report, final_state, prepared


def client_sizes_that_fit(num_clients: int, num_train_images: int, setting: str,
                          train_per_client: int = 128, val_per_client: int = 64):
  """Halves the paper's 128 / 64 per client until K clients fit in the training set."""
  regular = num_clients - 1 if setting == "imbalanced" else num_clients
  while (regular * (train_per_client + val_per_client) > num_train_images
         and val_per_client > 1):
    train_per_client, val_per_client = train_per_client // 2, val_per_client // 2
  return train_per_client, val_per_client


def last_json_line(text: str) -> dict[str, Any]:
  for line in reversed(text.strip().splitlines()):
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
      return json.loads(line)
  raise ValueError("no JSON line in the output")


def profile_rounds(prepared: PreparedRun, state, rounds: int, directory: str,
                   top: int = 25) -> tuple[Any, list[dict[str, Any]]]:
  """Traces `rounds` rounds with jax.profiler; returns the state and the top XLA ops.

  Each op: name, milliseconds per round, calls per round (from the Perfetto trace that
  jax.profiler writes beside the TensorBoard one; ops are the compiled round's HLO
  instruction names, so `compiled.as_text()` says what each is). Host-side Python
  frames and the executor's own spans are left out.
  """
  import glob  # pylint: disable=import-outside-toplevel
  import gzip  # pylint: disable=import-outside-toplevel
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    for _ in range(rounds):
      state, metrics = prepared.compiled(state, prepared.buckets, prepared.keys["train"])
      metrics = to_host(metrics)
  traces = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"),
                            recursive=True), key=os.path.getmtime)
  if not traces:
    return state, []
  with gzip.open(traces[-1]) as f:
    events = json.load(f).get("traceEvents", [])
  totals: dict[str, float] = {}
  counts: dict[str, int] = {}
  for event in events:
    name = event.get("name", "")
    if (event.get("ph") != "X" or name.startswith("$") or "ThunkExecutor" in name
        or "ThreadPool" in name or name.startswith("np.") or "::" in name):
      continue
    totals[name] = totals.get(name, 0.0) + event.get("dur", 0.0)
    counts[name] = counts.get(name, 0) + 1
  ranked = sorted(totals, key=totals.get, reverse=True)[:top]
  return state, [{"op": name, "ms_per_round": totals[name] / 1e3 / rounds,
                  "calls_per_round": counts[name] / rounds} for name in ranked]
