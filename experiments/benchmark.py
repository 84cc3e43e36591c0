"""Times the production train_round; compares it with a sequential PyTorch loop.

  python -m experiments.benchmark --flagfile=experiments/configs/rmnist_authors.flags
  python -m experiments.benchmark --flagfile=experiments/configs/rmnist_authors.flags --json
  python -m experiments.benchmark --scale_clients=36,144,576,1152   # one process per K
  python -m experiments.benchmark --imbalance_check                  # balanced vs imbalanced
  python -m experiments.benchmark --client_chunks=vmap,1,2,4,8      # clients per lax.map chunk
  python -m experiments.benchmark --participations=1.0,0.1          # full vs sampled rounds
  python -m experiments.benchmark --eval_everys=1,10   # rounds scoring test vs validation only
  python -m experiments.benchmark --dataset=cifar10 --cnn_convs=im2col,banded   # CNN convs
  python -m experiments.benchmark --runs_per_program=1,3,8   # S seeds as one program

Takes every flag of experiments.main (same flags, same flagfiles) plus the ones below.
Reports seconds per round (median over --repeats after --warmup rounds), client updates
per second, model FLOP/s against the measured matmul peak, compile time, peak memory and
the server step's share; with PyTorch installed (`pip install -e '.[bench]'`) and
--algorithm=fedora, the same round as a sequential PyTorch loop over clients (same
model: the MLP, or on CIFAR-10 the CNN; on PyTorch's GPU when it sees one) and the
speedup:

  python -m experiments.benchmark --dataset=cifar10 --data_dir=<cifar10> --algorithm=fedora

See benchmarks/measure.py for how each number is measured. With --json the last
line printed is one JSON object.
"""

import dataclasses
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple

from absl import app, flags

import jax

import numpy as np

from experiments import flags as run_flags
from experiments.cli import run_command
from benchmarks import host as host_bench
from benchmarks import measure
from fedora_jax import algorithms, batch
from fedora_jax.data import datasets, host_clients
from fedora_jax.simulation import prepare_run, to_host
from fedora_jax.errors import ConfigError, FedoraError
from fedora_jax.models import build_model, check_inputs
from fedora_jax.models.cnn import CONVS
from fedora_jax.models.resnet import ResNet

FLAGS = run_flags.FLAGS

_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed rounds (the median is reported).",
                                lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed rounds after compilation.",
                               lower_bound=0)
_JSON = flags.DEFINE_bool("json", False, "Print the report as one JSON object, last line.")
_TORCH = flags.DEFINE_bool("torch", True, "Also time the sequential PyTorch FEDORA loop"
                           " (when torch is installed and --algorithm=fedora).")
_TORCH_REPEATS = flags.DEFINE_integer("torch_repeats", 5, "Timed PyTorch rounds.",
                                      lower_bound=1)
_THREADS = flags.DEFINE_list("torch_threads", ["all", "1"], "PyTorch thread counts to"
                             " time ('all': every core, as XLA's CPU backend uses); the"
                             " fastest is the baseline (on a busy machine OpenMP's threads"
                             " can make 'all' many times slower than 1).")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 2048, "Side of the square matmul timed for"
                                  " the peak.", lower_bound=16)
_PEAK_REPEATS = flags.DEFINE_integer("peak_repeats", 5, "Timed batches per matmul shape.",
                                     lower_bound=1)
_SERVER = flags.DEFINE_bool("server_timing", True, "Time the server step on its own.")
_TRAIN_PER_CLIENT = flags.DEFINE_integer(
    "train_per_client", None, "Training images per regular client (default 128, halved"
    " with --val_per_client until K clients fit in the training set).", lower_bound=1)
_VAL_PER_CLIENT = flags.DEFINE_integer("val_per_client", None, "Validation images per"
                                       " regular client (default 64, see above).",
                                       lower_bound=1)
_PROFILE = flags.DEFINE_string("profile_dir", None, "Also trace --repeats/2 rounds with"
                                " jax.profiler into this folder (TensorBoard / Perfetto),"
                                " save the compiled round's HLO there and print the"
                                " slowest XLA ops.")
_SCALE = flags.DEFINE_list("scale_clients", [], "Sweep: one benchmark process per K in"
                           " this list (no PyTorch), then a table.")
_IMBALANCE = flags.DEFINE_bool("imbalance_check", False, "Sweep: the balanced and the"
                               " imbalanced setting at --num_clients; compares the"
                               " imbalanced round with its SGD steps x the balanced"
                               " time per step.")

_CLIENT_CHUNKS = flags.DEFINE_list(
    "client_chunks", [], "Sweep: compile the round once per --client_chunk value in this"
    " list (0 or 'vmap': every client at once) and time them in turn in one process.")
_PARTICIPATIONS = flags.DEFINE_list(
    "participations", [], "Sweep: compile the round once per --participation value in"
    " this list and time them in turn in one process (ratios to the first).")

_EVAL_EVERYS = flags.DEFINE_list(
    "eval_everys", [], "Sweep: compile the round once per --eval_every value in this list"
    " and time them in turn in one process: 1 is a round that scores validation and test,"
    " any other value one that scores validation only (a run under --eval_every adds the"
    " test scoring in the rounds it is due).")
_RUNS = flags.DEFINE_list(
    "runs_per_program", [], "Sweep: S runs (seeds --seed.. --seed+S-1, the same data) as one"
    " compiled program (fedora_jax/batch.py) for each S listed, timed in turn; reports"
    " seconds a round per run against S = the first value.")
_RUNS_PER_STEP = run_flags.RUNS_PER_STEP  # with --runs_per_program
_CNN_CONVS = flags.DEFINE_list(
    "cnn_convs", [], "Sweep: compile the round once per convolution of the CNN"
    " (models/cnn.py: im2col, banded, xla) and time them in turn in one process.")

_SWEEP_FLAGS = ("profile_dir", "scale_clients", "imbalance_check", "json", "num_clients", "setting",
                "torch", "notorch", "noimbalance_check")


def log(message: str) -> None:
  print(message, file=sys.stderr if _JSON.value else sys.stdout, flush=True)


class Setup(NamedTuple):
  data: Any
  model: Any
  model_name: str  # "mlp" or "cnn"
  hidden: tuple
  train: Any
  config: Any
  train_per_client: int | None  # None: the partition decides each client's size
  val_per_client: int | None


def _setup() -> Setup:
  """The run's data (sized to fit K clients), model, train and algorithm configs."""
  spec = datasets.get_spec(FLAGS.dataset)
  num_clients = FLAGS.num_clients or spec.num_clients
  data_seed = FLAGS.seed if FLAGS.data_seed is None else FLAGS.data_seed
  experiment = run_flags.experiment_config()
  partition = experiment.data.partition
  if partition.kind != "rotation" and (_TRAIN_PER_CLIENT.value or _VAL_PER_CLIENT.value):
    raise ConfigError("--train_per_client / --val_per_client size the rotation partition's"
                      f" clients; for --partition={partition.kind} use --fixed_train_size /"
                      " --fixed_val_size")
  if partition.kind == "rotation":  # FEDORA's fixed sizes, shrunk until K clients fit
    train_per_client, val_per_client = _TRAIN_PER_CLIENT.value, _VAL_PER_CLIENT.value
    if train_per_client is None or val_per_client is None:
      source = datasets.load_source(FLAGS.dataset, FLAGS.data_dir, FLAGS.data_source)
      fit = measure.client_sizes_that_fit(num_clients, len(source.x_train),
                                               FLAGS.setting)
      train_per_client = train_per_client or fit[0]
      val_per_client = val_per_client or fit[1]
    partition = partition._replace(train_per_client=train_per_client,
                                   val_per_client=val_per_client)
  federated = datasets.build_federated_dataset(
      FLAGS.dataset, FLAGS.data_dir, num_clients, FLAGS.setting, data_seed,
      FLAGS.max_pad_ratio, data_source=FLAGS.data_source, partition_config=partition)
  data = federated.data
  log(f"{FLAGS.dataset} {FLAGS.setting}: {datasets.describe(data)}")
  hidden = experiment.model.hidden
  model_name = FLAGS.model or spec.model
  check_inputs(model_name, data.input_shape, data.input_dtype, FLAGS.dataset)
  model = build_model(model_name, data.num_classes, hidden)
  train = experiment.train
  return Setup(data=data, model=model, model_name=model_name, hidden=hidden,
               train=train, config=experiment.algorithm.config,
               train_per_client=partition.train_per_client,
               val_per_client=partition.val_per_client)


def single_run() -> dict:
  setup = _setup()
  data, train, config = setup.data, setup.train, setup.config
  bench_config = measure.BenchmarkConfig(
      algorithm=FLAGS.algorithm, algorithm_config=config, dataset=FLAGS.dataset,
      num_clients=data.num_clients, setting=FLAGS.setting, train=train,
      repeats=_REPEATS.value, warmup=_WARMUP.value, time_server=_SERVER.value,
      peak_repeats=_PEAK_REPEATS.value, peak_size=_PEAK_SIZE.value,
      profile_dir=_PROFILE.value)
  report, final_state, prepared = measure.run_benchmark(bench_config, setup.model,
                                                              data, log)
  report.update(train_per_client=setup.train_per_client,
                val_per_client=setup.val_per_client, hidden=list(setup.hidden),
                fedora_variant=FLAGS.fedora_variant)

  torch_loop = _TORCH.value and algorithms.get(FLAGS.algorithm).torch_loop
  if torch_loop and train.eval_every > 1:
    log("no PyTorch pairing under --eval_every > 1: the loop scores test every round")
  elif torch_loop:
    if importlib.util.find_spec("torch") is None:
      log("PyTorch not installed (pip install -e '.[bench]'): no sequential baseline")
    else:
      report.update(torch_baseline(data, setup.model_name, setup.hidden, train, config,
                                   np.array(final_state.algorithm.server.graph),
                                   prepared, final_state))
  return report


def torch_baseline(data, model_name, hidden, train, config, graph, prepared, state) -> dict:
  """The sequential PyTorch round, each of its rounds paired with one of ours.

  Same model (the MLP or the CNN), on PyTorch's GPU when it sees one, else its CPU.
  On the CPU each --torch_threads count runs one warm-up and one probe round; the
  fastest count is then timed in --torch_repeats pairs (one JAX round, one PyTorch
  round), and the speedup is the median of the per-pair ratios.
  """
  from benchmarks import torch_loop  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  device = torch_loop.pick_device(torch)
  counts = []
  for value in _THREADS.value if device == "cpu" else [str(torch.get_num_threads())]:
    count = os.cpu_count() if value == "all" else int(value)
    if count not in counts:
      counts.append(count)
  references, probes = {}, {}
  for threads in counts:
    references[threads] = torch_loop.TorchFedora(
        data, graph, hidden, alpha=config.alpha, lambda_rule=config.lambda_rule,
        lambda_eps=config.lambda_eps, pull=config.pull, local_epochs=train.local_epochs,
        batch_size=train.batch_size, lr=train.lr, momentum=train.momentum,
        weight_decay=train.weight_decay, eval_batch_size=train.eval_batch_size,
        seed=train.seed, threads=threads, model=model_name, device=device,
        participation=train.participation)
    durations, _ = torch_loop.time_torch_fedora(references[threads], 1, warmup=1)
    probes[threads] = durations[0]
    log(f"PyTorch sequential loop ({model_name}, {device}), {threads} thread(s): probe"
        f" round {durations[0] * 1e3:.1f} ms")
  best = min(probes, key=probes.get)
  reference = references[best]
  torch.set_num_threads(best)
  reference.server_seconds = 0.0
  ours, theirs, _ = measure.paired_rounds(prepared, state, reference.round,
                                               _TORCH_REPEATS.value)
  ratios = [t / o for o, t in zip(ours, theirs)]
  torch_seconds = float(np.median(theirs))
  speedup = float(np.median(ratios))
  log(f"PyTorch sequential loop ({torch.__version__}, {model_name}, {device}, {best}"
      f" thread(s)): median {torch_seconds * 1e3:.1f} ms per round, paired JAX rounds"
      f" {np.median(ours) * 1e3:.1f} ms -> JAX is {speedup:.2f}x faster (median of"
      f" {len(ratios)} paired ratios)")
  return {"torch_round_seconds": torch_seconds,
          "torch_round_seconds_all": [float(d) for d in theirs],
          "paired_round_seconds_all": [float(d) for d in ours],
          "torch_server_seconds": reference.server_seconds / len(theirs),
          "torch_threads": best, "torch_version": torch.__version__,
          "torch_device": device, "torch_model": model_name,
          "torch_probe_seconds_by_threads": {str(t): v for t, v in probes.items()},
          "speedup_vs_torch": speedup,
          "speedup_vs_torch_of_medians": torch_seconds / float(np.median(ours))}


def _passthrough_args() -> list[str]:
  """This command's arguments minus the sweep's own (each child gets its K / setting)."""
  kept = []
  for arg in sys.argv[1:]:
    name = arg.lstrip("-").split("=", 1)[0]
    if name not in _SWEEP_FLAGS:
      kept.append(arg)
  return kept


def child_run(extra: list[str]) -> dict:
  command = [sys.executable, "-m", "experiments.benchmark", *_passthrough_args(), *extra,
             "--json", "--notorch"]
  log("$ " + " ".join(command[1:]))
  # LAPACK (the SVDs of FEDORA's init) through multi-threaded OpenBLAS crawls on a busy
  # machine; the round itself does not use it. Children run it single-threaded unless
  # the caller chose.
  env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}
  done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
  if done.returncode != 0:
    raise FedoraError(f"benchmark child failed ({done.returncode}): {done.stderr[-2000:]}")
  return measure.last_json_line(done.stdout)


def scale_sweep(clients: list[int]) -> dict:
  rows = []
  for k in clients:
    rows.append(child_run([f"--num_clients={k}", f"--setting={FLAGS.setting}"]))
  header = (f"{'K':>6} {'train/val':>9} {'ms/round':>9} {'ms/client':>9}"
            f" {'us/client-step':>14} {'GFLOP/s':>8} {'%peak':>6} {'RSS MiB':>8}"
            f" {'compile s':>9}")
  log(header)
  for r in rows:
    log(f"{r['num_clients']:>6} {r['train_per_client']:>4}/{r['val_per_client']:<4}"
        f" {r['round_seconds'] * 1e3:>9.1f} {r['round_seconds'] * 1e3 / r['num_clients']:>9.3f}"
        f" {r['seconds_per_client_step'] * 1e6:>14.1f} {r['flops_per_second'] / 1e9:>8.1f}"
        f" {100 * r['fraction_of_peak']:>6.1f} {r['peak_memory_bytes'] / 2**20:>8.0f}"
        f" {r['compile_seconds']:>9.1f}")
  return {"sweep": "scale_clients", "setting": FLAGS.setting, "runs": rows}


def imbalance_sweep() -> dict:
  k = FLAGS.num_clients or datasets.get_spec(FLAGS.dataset).num_clients
  balanced = child_run([f"--num_clients={k}", "--setting=balanced"])
  imbalanced = child_run([f"--num_clients={k}", "--setting=imbalanced"])
  per_step = balanced["round_seconds"] / balanced["client_steps_per_round"]
  predicted = imbalanced["client_steps_per_round"] * per_step
  ratio = imbalanced["round_seconds"] / predicted
  log(f"balanced: {balanced['round_seconds'] * 1e3:.1f} ms for"
      f" {balanced['client_steps_per_round']} client SGD steps"
      f" ({per_step * 1e6:.1f} us per step)")
  log(f"imbalanced: {imbalanced['round_seconds'] * 1e3:.1f} ms for"
      f" {imbalanced['client_steps_per_round']} steps; predicted from the steps"
      f" {predicted * 1e3:.1f} ms; measured / predicted = {ratio:.2f}")
  return {"sweep": "imbalance_check", "num_clients": k, "balanced": balanced,
          "imbalanced": imbalanced, "round_seconds": imbalanced["round_seconds"],
          "predicted_round_seconds": predicted, "imbalanced_ratio": ratio}


def _positive_int(text: str, flag: str = "--client_chunks") -> int:
  if not text.isdigit() or int(text) < 1:
    what = "'vmap', 0 or positive integers" if flag == "--client_chunks" else "positive integers"
    raise ConfigError(f"{flag} takes {what}, got {text!r}")
  return int(text)


def _interleaved_sweep(field: str, trains: dict[str, Any],
                       models: Callable[[Any], dict] | None = None) -> dict:
  """The same round compiled once per TrainConfig in `trains` (labelled by the value of
  its `field`; `models(the run's model)` -> value -> that value's model), timed in turn
  in one process so every variant sees the same load."""
  setup = _setup()
  variants = None if models is None else models(setup.model)
  runs = {}
  for value, train in trains.items():
    model = setup.model if variants is None else variants[value]
    runs[value] = prepare_run(algorithms.make(FLAGS.algorithm, setup.config), model, setup.data,
                              dataclasses.replace(setup.train, **train))
    log(f"{field}={value}: compiled in {runs[value].compile_seconds:.2f} s")
  durations = measure.interleaved_rounds(runs, _REPEATS.value, _WARMUP.value)
  medians = {value: float(np.median(d)) for value, d in durations.items()}
  first = next(iter(trains))
  for value, seconds in medians.items():
    log(f"{field}={value:>5}: {seconds * 1e3:8.1f} ms per round (median of"
        f" {len(durations[value])}), {seconds / medians[first]:.3f}x the round at"
        f" {field}={first}")
  fastest = min(medians, key=medians.get)
  log(f"fastest: {field}={fastest}")
  return {"sweep": field + "s", "algorithm": FLAGS.algorithm,
          "dataset": FLAGS.dataset, "num_clients": setup.data.num_clients,
          "platform": jax.default_backend(), "num_devices": jax.device_count(),
          "round_seconds": medians,
          "round_seconds_all": {v: [float(x) for x in d] for v, d in durations.items()},
          "ratio_to_first": {v: m / medians[first] for v, m in medians.items()},
          "peak_memory_bytes": measure.peak_rss_bytes(), "fastest": fastest}


def client_chunk_sweep(values: list[str]) -> dict:
  return _interleaved_sweep("client_chunk", {
      v: {"client_chunk": None if v in ("0", "vmap") else _positive_int(v)} for v in values})


def cnn_conv_sweep(values: list[str]) -> dict:
  def models(model):
    if not hasattr(model, "conv") or isinstance(model, ResNet):
      raise ConfigError("--cnn_convs compares the convolutions of the CNNs (cnn,"
                        " coaching_cnn, fedavg_cnn); this run's model has none")
    return {v: model.clone(conv=v) for v in values}
  unknown = set(values) - set(CONVS)
  if unknown:
    raise ConfigError(f"--cnn_convs takes {', '.join(CONVS)}, got {', '.join(sorted(unknown))}")
  return _interleaved_sweep("conv", {v: {} for v in values}, models)


def participation_sweep(values: list[str]) -> dict:
  try:
    fractions = {v: float(v) for v in values}
  except ValueError:
    raise ConfigError(f"--participations takes fractions in (0, 1], got {values}") from None
  if not all(0.0 < f <= 1.0 for f in fractions.values()):
    raise ConfigError(f"--participations takes fractions in (0, 1], got {values}")
  return _interleaved_sweep("participation",
                            {v: {"participation": f} for v, f in fractions.items()})


def eval_every_sweep(values: list[str]) -> dict:
  if not all(v.isdigit() and int(v) >= 1 for v in values):
    raise ConfigError(f"--eval_everys takes integers >= 1, got {','.join(values)}")
  return _interleaved_sweep("eval_every", {v: {"eval_every": int(v)} for v in values})


def runs_sweep(values: list[str]) -> dict:
  """Seconds a round per run with S runs in one program (batch.prepare_batch), each S
  compiled once and timed in turn so that all see the same load."""
  sizes = [_positive_int(v, "--runs_per_program") for v in values]
  setup = _setup()

  def build(values, trainer):
    del values  # the runs differ in seed only
    return algorithms.build(FLAGS.algorithm, setup.config, trainer)
  prepared = {}
  for size in sizes:
    seeds = [FLAGS.seed + s for s in range(size)]
    prepared[size] = batch.prepare_batch(build, setup.model, setup.data, setup.train, seeds,
                                         runs_per_step=_RUNS_PER_STEP.value)
    log(f"S={size}: compiled in {prepared[size].compile_seconds:.2f} s")
  states = {size: p.state for size, p in prepared.items()}
  durations: dict[int, list[float]] = {size: [] for size in sizes}
  for r in range(_WARMUP.value + _REPEATS.value):
    for size, p in prepared.items():
      tic = time.perf_counter()
      states[size], metrics = p.compiled(states[size], p.buckets, p.train_keys, p.values)
      to_host(metrics)
      if r >= _WARMUP.value:
        durations[size].append(time.perf_counter() - tic)
  per_run = {size: float(np.median(d)) / size for size, d in durations.items()}
  first = sizes[0]
  for size in sizes:
    log(f"S={size:>3}: {per_run[size] * size * 1e3:9.1f} ms a round, {per_run[size] * 1e3:8.2f}"
        f" ms per run ({per_run[size] / per_run[first]:.3f}x S={first}'s per run)")
  return {"sweep": "runs_per_program", "algorithm": FLAGS.algorithm,
          "runs_per_step": _RUNS_PER_STEP.value,
          "dataset": FLAGS.dataset, "num_clients": setup.data.num_clients,
          "platform": jax.default_backend(), "num_devices": jax.device_count(),
          "device_kind": jax.devices()[0].device_kind,
          "round_seconds": {s: float(np.median(d)) for s, d in durations.items()},
          "round_seconds_per_run": per_run,
          "per_run_ratio_to_first": {s: v / per_run[first] for s, v in per_run.items()},
          "compile_seconds": {s: p.compile_seconds for s, p in prepared.items()},
          "xla_memory": {s: measure.xla_memory(p.compiled) for s, p in prepared.items()},
          "peak_memory_bytes": measure.peak_rss_bytes(),
          "device_peak_bytes": measure.device_peak_bytes()}


def host_run() -> dict:
  """--client_data=host: run_host's rounds timed (benchmarks/host.py); no device data."""
  experiment = run_flags.experiment_config()
  data = experiment.data
  spec = datasets.get_spec(data.dataset)
  num_clients = data.num_clients or spec.num_clients
  data_seed = FLAGS.seed if data.data_seed is None else data.data_seed
  clients = host_clients.from_dataset(data.dataset, data.data_dir, num_clients, data.setting,
                                      data_seed, data.data_source, data.partition)
  sample = clients.client(0).x_train
  model_name = FLAGS.model or spec.model
  check_inputs(model_name, sample.shape[1:], sample.dtype, data.dataset)
  model = build_model(model_name, clients.num_classes, experiment.model.hidden)
  return {**host_bench.run_host_benchmark(FLAGS.algorithm, experiment.algorithm.config, model,
                                          clients, experiment.train, _REPEATS.value,
                                          _WARMUP.value, log),
          "dataset": data.dataset}


def run() -> dict:
  # The run's sweep flags, shared with experiments.main, time nothing here: refused, not
  # dropped (--runs_per_program times runs as one program).
  if FLAGS.seeds != 1 or FLAGS.sweep or not FLAGS.batch_runs:
    raise ConfigError("the benchmark times one run: --seeds, --sweep and --batch_runs are"
                      " experiments.main's; --runs_per_program=1,3,8 times S runs as one"
                      " program")
  if FLAGS.client_data == "host":
    report = host_run()
    log(host_bench.summary(report))
  elif _RUNS.value:
    report = runs_sweep(_RUNS.value)
  elif _SCALE.value:
    try:
      clients = [int(k) for k in _SCALE.value]
    except ValueError:
      raise ConfigError(f"--scale_clients must be integers, got {_SCALE.value}") from None
    report = scale_sweep(clients)
  elif _IMBALANCE.value:
    report = imbalance_sweep()
  elif _CLIENT_CHUNKS.value:
    report = client_chunk_sweep(_CLIENT_CHUNKS.value)
  elif _PARTICIPATIONS.value:
    report = participation_sweep(_PARTICIPATIONS.value)
  elif _EVAL_EVERYS.value:
    report = eval_every_sweep(_EVAL_EVERYS.value)
  elif _CNN_CONVS.value:
    report = cnn_conv_sweep(_CNN_CONVS.value)
  else:
    report = single_run()
    log(summary(report))
  if _JSON.value:
    print(json.dumps(report), flush=True)
  return report


def summary(r: dict) -> str:
  lines = [
      f"{r['algorithm']} on {r['dataset']} ({r['setting']}, K={r['num_clients']},"
      f" {r['platform']} x{r['mesh_devices']}, client_chunk {r['client_chunk'] or 'vmap'}):",
      f"  round        {r['round_seconds'] * 1e3:.1f} ms (median of {r['repeats']}"
      f"{'' if r['round_scores_test'] else '; validation only, test on demand'}),"
      f" {r['client_updates_per_second']:.1f} client updates/s"
      f" ({r['clients_trained_per_round']} trained clients a round)",
      f"  throughput   {r['flops_per_round'] / 1e9:.1f} GFLOP a round (analytic; XLA by"
      f" sample counts {r.get('xla_flops_per_round_by_counts', math.nan) / 1e9:.1f}),"
      f" {r['flops_per_second'] / 1e9:.1f} GFLOP/s ="
      f" {100 * r['fraction_of_peak']:.1f}% of the measured matmul peak"
      f" {r['peak_flops_per_second'] / 1e9:.1f} GFLOP/s",
      f"  compile      {r['compile_seconds']:.2f} s;  peak RSS"
      f" {r['peak_memory_bytes'] / 2**20:.0f} MiB;"
      f"  {r['page_faults_per_round']:.0f} page faults per round",
  ]
  if "server_seconds" in r:
    lines.append(f"  server step  {r['server_seconds'] * 1e3:.2f} ms per round"
                 f" ({100 * r['server_fraction']:.1f}%); init {r['init_seconds'] * 1e3:.1f} ms")
  if "torch_round_seconds" in r:
    lines.append(f"  PyTorch loop {r['torch_round_seconds'] * 1e3:.1f} ms per round"
                 f" ({r['torch_model']}, {r['torch_device']}) -> JAX speedup"
                 f" {r['speedup_vs_torch']:.2f}x")
  return "\n".join(lines)


def main(argv):
  run_command(argv, run, log_level=logging.WARNING)


if __name__ == "__main__":
  app.run(main)
