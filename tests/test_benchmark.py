"""experiments.benchmark: the FLOP count in closed form, the JSON report, the PyTorch loop."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import measure
from conftest import NEEDS_TORCH
from fedora_jax import algorithms, propagation
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.simulation import TrainConfig, prepare_run
from fedora_jax.models.cnn import CHANNEL_STATS, CNN
from tests.tiny import init_params, tiny_data, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TORCH = __import__("importlib").util.find_spec("torch") is not None


def test_flops_of_a_tiny_mlp_in_closed_form():
  # 4 -> 5 -> 3: forward matmul FLOPs per sample = 2 * (4*5 + 5*3) = 70.
  params = init_params(tiny_model(num_classes=3, hidden=(5,)), num_features=4)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)
  assert measure.dense_layer_shapes(stacked) == [(4, 5), (5, 3)]
  assert measure.dense_layer_shapes(params, stacked=False) == [(4, 5), (5, 3)]
  forward = measure.forward_flops_per_sample([(4, 5), (5, 3)])
  assert forward == 70
  num_params = measure.parameter_count(stacked)
  assert num_params == 4 * 5 + 5 + 5 * 3 + 3

  n_train, n_val, n_test = np.array([10, 6]), np.array([4, 4]), np.array([6, 6])
  fedora = algorithms.get("fedora")
  closed_form = fedora.round_cost(algorithms.default_config("fedora"))
  work = measure.round_work(closed_form, forward, n_train, n_val, n_test, local_epochs=2,
                            num_params=num_params)
  # Training: 3x forward per sample-step, 2 epochs over 16 samples. Evaluation: FEDORA
  # scores validation 3 times (theta_k, theta_hat_k, the round's own) and test once.
  # Server: one [2, 2] x [2, 43] product.
  assert work.train_sample_steps == 32 and work.eval_samples == 3 * 8 + 12
  assert work.server_flops == 2 * 2 * 2 * num_params
  assert work.flops == 3 * 70 * 32 + 70 * 36 + 2 * 2 * 2 * 43
  local = measure.round_work(algorithms.get("local").round_cost(None), forward, n_train,
                             n_val, n_test, 2, num_params)
  assert local.flops == 3 * 70 * 32 + 70 * (8 + 12)
  # Iterative propagation: one K x K x d product per step.
  steps = fedora.round_cost(algorithms.default_config("fedora", propagation_steps=10))
  iterative = measure.round_work(steps, forward, n_train, n_val, n_test, 2, num_params)
  assert iterative.server_flops == 10 * work.server_flops
  # Participation 1/2: one client of two trains (half the training and FEDORA's own two
  # validation passes, in expectation); both are evaluated and propagated.
  half = measure.round_work(closed_form, forward, n_train, n_val, n_test, 2, num_params,
                            num_trained=1)
  assert half.train_sample_steps == 16 and half.eval_samples == (1 + 1) * 8 + 12
  assert half.server_flops == work.server_flops
  assert half.flops == 3 * 70 * 16 + 70 * 28 + 2 * 2 * 2 * 43


def test_model_flops_count_matmuls_and_convolutions():
  # LeNet-5 on 32x32x3, by hand: conv1 28*28*16 outputs x 5*5*3 taps, conv2 10*10*32 x
  # 5*5*16, dense 800*120 + 120*84 + 84*10; 2 FLOPs per multiply-add.
  by_hand = 2 * (28 * 28 * 16 * 75 + 10 * 10 * 32 * 400 + 800 * 120 + 120 * 84 + 84 * 10)
  assert by_hand == 4_655_440
  image = np.zeros((1, 32, 32, 3), np.uint8)
  for conv in ("im2col", "xla"):  # a matmul over patches, or a convolution
    model = CNN(num_outputs=10, conv=conv)
    params = model.init(jax.random.key(0), image)
    assert measure.model_forward_flops(model.apply, params, image) == by_hand
  mlp = tiny_model(num_classes=3, hidden=(5,))
  params = init_params(mlp, num_features=4)
  assert measure.model_forward_flops(mlp.apply, params, np.zeros((1, 4))) == 70
  # A scan's body counts once per step; XLA's per-sample counts cover the matmuls.
  scanned = lambda p, x: jax.lax.scan(lambda h, _: (mlp.apply(p, h[:, :4])[:, :1] * h, None),
                                      x, None, length=3)[0]
  assert measure.model_forward_flops(scanned, params, np.zeros((1, 4))) == 3 * 70
  xla = measure.xla_flops_per_sample(mlp.apply, params, np.zeros((8, 4), np.float32))
  assert xla["eval"] >= 70 and xla["train"] > xla["eval"]


def test_matmul_peak_and_helpers():
  peaks = measure.matmul_peak({"square": (64, 64, 64), "batched": (3, 8, 16, 4)},
                                   repeats=1, seconds_per_shape=0.01)
  assert set(peaks) == {"square", "batched"}
  assert all(math.isfinite(v) and v > 0 for v in peaks.values())
  assert measure.peak_rss_bytes() > 0
  # K clients at 128 + 64 fit 60000 images up to K = 312; beyond, sizes halve.
  assert measure.client_sizes_that_fit(36, 60000, "balanced") == (128, 64)
  assert measure.client_sizes_that_fit(576, 60000, "balanced") == (64, 32)
  assert measure.client_sizes_that_fit(1152, 60000, "balanced") == (32, 16)
  assert measure.last_json_line('log\n{"a": 1}\n') == {"a": 1}


REQUIRED = ("round_seconds", "client_updates_per_second", "flops_per_second",
            "peak_flops_per_second", "compile_seconds", "peak_memory_bytes",
            "server_seconds", "server_fraction", "fraction_of_peak", "flops_per_round")


def test_benchmark_command_prints_a_json_report():
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--num_clients=2",
       "--local_epochs=1", "--hidden=8", "--repeats=2", "--warmup=0", "--json",
       "--peak_size=128", "--peak_repeats=1", "--participation=0.5",
       "--torch_repeats=1", "--torch_threads=1",
       "--train_per_client=64", "--val_per_client=32"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  for field in REQUIRED:
    value = report[field]
    assert math.isfinite(value) and value > 0, (field, value)
  assert report["num_clients"] == 2 and report["algorithm"] == "fedora"
  assert report["train_per_client"] == 64
  # Participation 1/2: one client trains, 1 epoch of one 64-sample batch.
  assert report["clients_trained_per_round"] == 1
  assert report["client_steps_per_round"] == 1
  assert np.isclose(report["client_updates_per_second"], 1 / report["round_seconds"])
  assert report["forward_flops_per_sample"] == 2 * (784 * 8 + 8 * 10)  # --hidden=8
  assert report["xla_flops_per_round_by_counts"] > 0
  # The sequential PyTorch loop, when the bench extra is installed.
  assert ("torch_round_seconds" in report) == HAS_TORCH
  if HAS_TORCH:
    assert report["torch_model"] == "mlp" and report["speedup_vs_torch"] > 0


def test_participation_sweep_times_each_fraction_in_one_process():
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--algorithm=fedavg",
       "--num_clients=4", "--local_epochs=1", "--hidden=8", "--repeats=2", "--warmup=0",
       "--json", "--participations=1.0,0.5", "--train_per_client=32",
       "--val_per_client=16"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report["sweep"] == "participations"
  assert set(report["round_seconds"]) == {"1.0", "0.5"}
  assert all(len(v) == 2 for v in report["round_seconds_all"].values())
  assert report["ratio_to_first"]["1.0"] == 1.0
  assert np.isclose(report["ratio_to_first"]["0.5"],
                    report["round_seconds"]["0.5"] / report["round_seconds"]["1.0"])
  bad = subprocess.run([sys.executable, "-m", "experiments.benchmark",
                        "--participations=1.0,0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode != 0 and "--participations takes fractions" in bad.stderr
  # The run's sweep flags, which experiments.main takes, are refused here, not ignored.
  seeds = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--seeds=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert seeds.returncode != 0 and "the benchmark times one run" in seeds.stderr
  assert "Traceback" not in bad.stderr


@pytest.mark.skipif(not HAS_TORCH, reason=NEEDS_TORCH)
def test_torch_reference_round_and_propagation():
  import torch  # pylint: disable=import-outside-toplevel
  from benchmarks import torch_loop  # pylint: disable=import-outside-toplevel
  data, _ = tiny_data([10, 12, 9])
  graph = np.array([[1.0, 0.5, 0.2], [0.5, 1.0, 0.7], [0.2, 0.7, 1.0]], np.float32)
  for pull, rule in (("prox", "paper"), ("decoupled", "authors")):
    reference = torch_loop.TorchFedora(data, graph, hidden=(5,), alpha=1.0,
                                            pull=pull, lambda_rule=rule, local_epochs=2,
                                            batch_size=4, lr=0.1, threads=1)
    # Make the clients differ, then check the solve against the JAX closed form.
    with torch.no_grad():
      for k, model in enumerate(reference.models):
        for p in model.parameters():
          p.add_(0.1 * k)
    theta = np.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach().numpy()
                      for m in reference.models])
    np.testing.assert_allclose(reference.propagate().numpy(),
                               propagation.propagate(theta, graph, alpha=1.0),
                               rtol=1e-4, atol=1e-5)
    before = theta.copy()
    metrics = reference.round()
    after = np.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach().numpy()
                      for m in reference.models])
    assert 0.0 <= metrics["val_acc"] <= 1.0 and 0.0 <= metrics["test_acc"] <= 1.0
    assert np.all(np.isfinite(after)) and not np.allclose(after, before)
  durations, server = torch_loop.time_torch_fedora(reference, repeats=2, warmup=0)
  assert len(durations) == 2 and all(d > 0 for d in durations) and server > 0


@pytest.mark.skipif(not HAS_TORCH, reason=NEEDS_TORCH)
def test_torch_reference_cnn_trains_the_sampled_clients():
  import torch  # pylint: disable=import-outside-toplevel
  from benchmarks import torch_loop  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)

  def images(n):  # 16x16 RGB: 16 -> 12 -> 6 -> 2 -> 1 through the CNN
    return (rng.integers(0, 256, (n, 16, 16, 3)).astype(np.uint8),
            rng.integers(0, 3, n).astype(np.int32))
  data = stack_clients([Client(*images(9), *images(4), *images(5)) for _ in range(3)], 3)
  graph = np.ones((3, 3), np.float32)
  reference = torch_loop.TorchFedora(data, graph, hidden=(), alpha=1.0, model="cnn",
                                          local_epochs=1, batch_size=4, lr=0.1, threads=1,
                                          participation=0.34, device="cpu")
  assert reference.num_trained == 1 and reference.device == "cpu"
  assert tuple(reference.clients[0].x_train.shape) == (9, 3, 16, 16)
  # Standardised per channel as fedora_jax.models.cnn does (NCHW here).
  mean, std = (np.asarray(v, np.float32) for v in CHANNEL_STATS[3])
  x = np.asarray(data.buckets[0].train.x[0, :9], np.float32) / 255.0
  np.testing.assert_allclose(reference.clients[0].x_train.numpy(),
                             ((x - mean) / std).transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-5)
  # Same layer shapes as the JAX CNN: conv 16 and 32 kernels of 5x5, dense 32 -> 120 -> 84.
  jax_cnn = CNN(num_outputs=3).init(jax.random.key(0), np.zeros((1, 16, 16, 3), np.uint8))
  assert (sum(p.numel() for p in reference.models[0].parameters())
          == measure.parameter_count(jax_cnn, stacked=False))
  flat = lambda: [torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()
                  for m in reference.models]
  before = flat()
  metrics = reference.round()
  changed = [not torch.equal(a, b) for a, b in zip(before, flat())]
  assert sum(changed) == 1  # one of three clients trained (participation 1/3)
  assert 0.0 <= metrics["val_acc"] <= 1.0 and 0.0 <= metrics["test_acc"] <= 1.0


def test_interleaved_rounds_times_each_compiled_run_in_turn():
  data, _ = tiny_data([6, 6, 6])
  model = tiny_model()
  train = TrainConfig(rounds=1, local_epochs=1, batch_size=4, log_every=0)
  config = algorithms.get("fedavg").config_class()
  runs = {str(cb): prepare_run(algorithms.make("fedavg", config), model, data,
                               dataclasses.replace(train, client_chunk=cb))
          for cb in (None, 2)}
  durations = measure.interleaved_rounds(runs, repeats=3, warmup=1)
  assert sorted(durations) == ["2", "None"]
  for times in durations.values():
    assert len(times) == 3 and all(t > 0 for t in times)


def test_benchmark_counts_the_run_s_model_when_the_personalised_model_is_more():
  # FedCP's personalised model is the model plus a global head and a policy network (a
  # FedCpModel, not a model of the run): FLOPs and parameters are the run's model's.
  data, _ = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))  # 4 -> 5 -> 3
  train = TrainConfig(rounds=1, local_epochs=1, batch_size=4, log_every=0)
  config = measure.BenchmarkConfig(
      algorithm="fedcp", algorithm_config=algorithms.get("fedcp").config_class(),
      dataset="tiny", num_clients=2, setting="balanced", train=train, repeats=1, warmup=0,
      peak_repeats=1, peak_size=16)
  report, _, _ = measure.run_benchmark(config, model, data, log=lambda message: None)
  assert report["forward_flops_per_sample"] == 2 * (4 * 5 + 5 * 3)
  assert report["num_params_per_client"] == 4 * 5 + 5 + 5 * 3 + 3
  assert report["round_seconds"] > 0 and report["server_seconds"] > 0


@pytest.mark.skipif(not HAS_TORCH, reason=NEEDS_TORCH)
def test_torch_cnn_is_the_jax_cnn():
  """Same weights, same uint8 images: the PyTorch loop's CNN (with its input
  standardisation) gives the JAX CNN's logits, so both loops train the same model."""
  import torch  # pylint: disable=import-outside-toplevel
  from benchmarks import torch_loop  # pylint: disable=import-outside-toplevel
  from fedora_jax.models.cnn import CNN  # pylint: disable=import-outside-toplevel
  images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
  model = CNN(num_outputs=10)
  params = model.init(jax.random.key(0), images)["params"]
  ours = np.asarray(model.apply({"params": params}, images))
  theirs = torch_loop.make_cnn(torch, (3, 32, 32), 10)
  convs = [m for m in theirs if isinstance(m, torch.nn.Conv2d)]
  denses = [m for m in theirs if isinstance(m, torch.nn.Linear)]
  assert sum(p.numel() for p in theirs.parameters()) == sum(
      a.size for a in jax.tree.leaves(params))
  with torch.no_grad():
    for module, name in zip(convs, ("Conv_0", "Conv_1")):
      module.weight.copy_(torch.from_numpy(
          np.asarray(params[name]["kernel"]).transpose(3, 2, 0, 1).copy()))  # HWIO -> OIHW
      module.bias.copy_(torch.from_numpy(np.array(params[name]["bias"])))
    for i, module in enumerate(denses):
      kernel = np.asarray(params[f"Dense_{i}"]["kernel"])
      if i == 0:  # JAX flattens (h, w, c), PyTorch (c, h, w)
        kernel = kernel.reshape(5, 5, 32, -1).transpose(2, 0, 1, 3).reshape(800, -1)
      module.weight.copy_(torch.from_numpy(kernel.T.copy()))
      module.bias.copy_(torch.from_numpy(np.array(params[f"Dense_{i}"]["bias"])))
    inputs = torch.from_numpy(torch_loop._inputs(images, "cnn"))  # pylint: disable=protected-access
    np.testing.assert_allclose(theirs(inputs).numpy(), ours, rtol=1e-4, atol=1e-4)


def test_server_step_is_the_propagation_of_the_new_client_states():
  data, _ = tiny_data([6, 7, 5])
  model = tiny_model()
  train = TrainConfig(rounds=1, local_epochs=1, batch_size=4, log_every=0)
  config = algorithms.get("fedora").config_class()
  prepared = prepare_run(algorithms.make("fedora", config), model, data, train)
  state = prepared.state
  step, client_results = measure.server_step(prepared, state, data)
  zeros, uploads = client_results()
  assert all(float(jnp.abs(a).max()) == 0.0 for a in jax.tree.leaves(zeros))
  # Distinct client models, as the client step would hand them over.
  rng = np.random.default_rng(0)
  new_clients = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), zeros)
  expected_clients = jax.tree.map(np.asarray, new_clients)
  messages, aggregated = step(new_clients, uploads)  # donates new_clients
  server = state.algorithm.server
  kappa = propagation.kappa_from_alpha(config.alpha)
  for got, theta, kept in zip(jax.tree.leaves(messages), jax.tree.leaves(expected_clients),
                              jax.tree.leaves(aggregated.clients)):
    flat = theta.reshape(3, -1)
    np.testing.assert_allclose(
        np.asarray(got).reshape(3, -1),
        propagation.propagate(flat, server.graph, kappa=kappa), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(kept, theta)  # FEDORA's aggregate keeps the states
  durations = measure.time_server(prepared, state, data, repeats=2)
  assert len(durations) == 2 and all(d > 0 for d in durations)
