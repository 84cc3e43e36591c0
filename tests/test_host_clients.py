"""Clients held on the host: the same numbers as device-held clients, only the
sampled clients generated and moved, a sample scored a round, one line for bad input."""

import dataclasses

import jax
import numpy as np
import pytest

import tiny
from benchmarks import host as host_bench
from fedora_jax import algorithms
from fedora_jax.data import host_clients, synthetic
from fedora_jax.data.client_data import stack_clients
from fedora_jax.errors import ConfigError
from fedora_jax.host_rounds import sampled_ids
from fedora_jax.host_simulation import check_settings, eval_sample, run_host
from fedora_jax.models.mlp import MLP
from fedora_jax.rounds import num_sampled_clients
from fedora_jax.simulation import TrainConfig, root_keys, run_algorithm
from fedora_jax.train import ExperimentConfig, check_config

K = 12
# 51 samples a client (41 / 5 / 5): one size bucket, the device round's slot order.
CONFIG = synthetic.SyntheticConfig(size_mu=0.0, size_sigma=0.0)
TRAIN = TrainConfig(rounds=3, local_epochs=1, batch_size=16, lr=0.05, participation=0.25,
                    log_every=10**6)
MODEL = MLP(hidden=(8,), num_outputs=synthetic.NUM_CLASSES)


def _both(name: str, train: TrainConfig = TRAIN, **host_train):
  clients = synthetic.make_clients(CONFIG, K, seed=3)
  device = run_algorithm(algorithms.make(name), MODEL,
                         stack_clients(clients, synthetic.NUM_CLASSES), train, progress=None)
  host = run_host(algorithms.make(name), MODEL, host_clients.generated_synthetic(CONFIG, K, 3),
                  dataclasses.replace(train, client_data="host", **host_train), progress=None)
  return device, host


def test_generated_clients_are_synthetics_own():
  source = host_clients.generated_synthetic(CONFIG, 10**6, seed=3)
  made = synthetic.make_clients(CONFIG, 3, seed=3)
  for k in (0, 2):
    for ours, theirs in zip(source.client(k), made[k]):
      np.testing.assert_array_equal(ours, theirs)
  assert source.num_clients == 10**6


@pytest.mark.parametrize("name", ["fedavg", "fedavgm"])
def test_host_round_equals_device_round(name):
  device, host = _both(name)
  for field in ("train_loss", "local_steps", "val_loss", "val_score", "test_loss",
                "test_score", "bytes_up", "bytes_down"):
    np.testing.assert_allclose(getattr(host.history, field), getattr(device.history, field),
                               rtol=2e-5, atol=1e-6, err_msg=field)
  assert (host.history.local_steps > 0).sum() == TRAIN.rounds * 3  # 3 of 12 a round
  chex_server = jax.tree.map(np.asarray, (host.final_state.algorithm.server,
                                          device.final_state.algorithm.server))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
               *chex_server)


def test_only_sampled_and_scored_clients_are_generated():
  asked: list[int] = []
  source = host_clients.generated_synthetic(CONFIG, K, seed=3)
  recording = dataclasses.replace(source, client=lambda k: asked.append(k) or source.client(k))
  train = dataclasses.replace(TRAIN, client_data="host", eval_clients=2)
  result = run_host(algorithms.make("fedavg"), MODEL, recording, train, progress=None)
  # The last round scores every client, in order, after everything else.
  assert asked[-K:] == list(range(K))
  key, sampled = root_keys(train.seed)["train"], num_sampled_clients(train.participation, K)
  expected = [k for r in range(train.rounds)
              for k in np.asarray(sampled_ids(jax.random.fold_in(key, r), K, sampled))]
  expected += [k for r in range(1, train.rounds)
               for k in eval_sample(K, 2, train.seed, r)]
  assert sorted(asked[:-K]) == sorted(expected)
  scored = np.isfinite(result.history.val_score).sum(axis=1)
  np.testing.assert_array_equal(scored, [2, 2, K])
  trained = result.history.local_steps > 0
  assert np.isnan(result.history.train_loss[~trained]).all()


@pytest.mark.parametrize("client_data, eval_clients, message", [
    ("gpu", None, "client_data must be one of device, host"),
    ("host", 0, "eval_clients must be >= 1"),
    ("device", 5, "eval_clients takes --client_data=host")])
def test_bad_settings_are_one_line(client_data, eval_clients, message):
  with pytest.raises(ConfigError, match=message) as raised:
    check_settings(client_data, eval_clients)
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name, why", [
    ("ditto", "scores a model per client"), ("scaffold", "keeps state per client"),
    ("fedlc", "reads every client's data when it starts"),
    ("fedcross", "broadcast deals among the sampled clients")])
def test_algorithms_needing_per_client_state_are_refused(name, why):
  source = host_clients.generated_synthetic(CONFIG, K, seed=3)
  train = dataclasses.replace(TRAIN, client_data="host")
  with pytest.raises(ConfigError, match=why) as raised:
    run_host(algorithms.make(name), MODEL, source, train, progress=None)
  assert "\n" not in str(raised.value) and "--client_data=host" in str(raised.value)


def test_dropout_and_stragglers_as_on_the_device():
  """The same fates (availability.draw over all K) read at the slots: who arrives, how
  far a straggler gets, and a round nobody arrives at."""
  train = dataclasses.replace(TRAIN, client_dropout=0.4, stragglers=0.5, rounds=4)
  device, host = _both("fedavg", train)
  assert (device.history.local_steps == 0).sum() > train.rounds * (K - 3)  # some dropped
  steps = device.history.local_steps
  assert ((steps > 0) & (steps < steps.max())).any()  # some straggled
  for field in ("train_loss", "local_steps", "val_score", "bytes_up", "bytes_down"):
    np.testing.assert_allclose(getattr(host.history, field), getattr(device.history, field),
                               rtol=2e-5, atol=1e-6, err_msg=field)


def test_stored_clients_in_size_buckets_equal_device():
  """Clients of 3 to 40 samples: three size buckets on the device, one padded slot
  bucket a round on the host; equal up to summation order."""
  data, clients = tiny.tiny_data((3, 4, 9, 20, 5, 40, 11, 6))
  model = tiny.tiny_model()
  train = dataclasses.replace(TRAIN, participation=0.5, batch_size=4)
  device = run_algorithm(algorithms.make("fedavg"), model, data, train, progress=None)
  host = run_host(algorithms.make("fedavg"), model, host_clients.stored(clients, 3),
                  dataclasses.replace(train, client_data="host"), progress=None)
  for field in ("train_loss", "local_steps", "val_loss", "test_score"):
    np.testing.assert_allclose(getattr(host.history, field), getattr(device.history, field),
                               rtol=1e-4, atol=1e-6, err_msg=field)


def test_a_full_run_refuses_host_held_clients_in_one_line():
  for train, message in ((TrainConfig(client_data="host"), "a model per client"),
                         (TrainConfig(eval_clients=3), "takes --client_data=host")):
    with pytest.raises(ConfigError, match=message) as raised:
      check_config(ExperimentConfig(train=train))
    assert "\n" not in str(raised.value)


def test_benchmark_times_the_rounds_between_warmup_and_the_last():
  assert host_bench.round_durations([3.0, 4.5, 5.0], 1.0) == [2.0, 1.5, 0.5]
  report = host_bench.run_host_benchmark(
      "fedavg", None, MODEL, host_clients.generated_synthetic(CONFIG, K, 3),
      dataclasses.replace(TRAIN, eval_clients=4), repeats=2, warmup=1, log=lambda m: None)
  assert len(report["round_seconds_each"]) == 2 and report["round_seconds"] > 0
  assert report["clients_trained_per_round"] == 3 and report["peak_memory_bytes"] > 0
  assert 0.0 <= report["final_mean_val_score"] <= 1.0
