"""Every algorithm and plug-in pairing (and the options that leave the engine's fast
paths: algorithm_matrix.OPTION_ROWS; dropout and stragglers: CONDITION_ROWS) on every
engine path: vmap on one device and client chunks on 2 CPU devices (chunks
under shard_map), both with partial participation. Two rounds each: finite metrics, the
right shapes, only the sampled clients trained, and the same per-client numbers on one
and two devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import algorithm_matrix
import tiny
from fedora_jax import algorithms, simulation
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from algorithm_matrix import FAST_COMPILE, SIZES

NUM_SHARDS = 8  # the rows run in this many processes (xdist spreads them; 4 ran 180-620 s)


def check_run(run: dict, label: str) -> None:
  """[rounds, K] metrics, finite (but the train loss of clients that sat a round out)."""
  for field, values in run.items():
    values = np.asarray(values, np.float64)
    assert values.shape == (2, len(SIZES)), (label, field, values.shape)
    if field != "train_loss":
      assert np.isfinite(values).all(), (label, field, values)


def check_agreement(runs: list[dict], label: str) -> None:
  """The same per-client numbers on both paths."""
  first, second = runs
  np.testing.assert_array_equal(first["local_steps"], second["local_steps"], err_msg=label)
  for field in ("val_loss", "test_acc", "train_loss"):
    np.testing.assert_allclose(first[field], second[field], rtol=2e-4, atol=2e-5,
                               err_msg=f"{label} {field}")


@pytest.fixture(scope="module")
def matrix_script():
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "algorithm_matrix.py")


@pytest.mark.parametrize("shard", range(NUM_SHARDS))
def test_partial_participation_on_one_and_two_devices(shard, matrix_script):
  env = dict(os.environ,
             XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}")
  proc = subprocess.run([sys.executable, matrix_script, str(shard), str(NUM_SHARDS)],
                        env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(proc.stdout.strip().splitlines()[-1])
  expected = algorithm_matrix.pairings()[shard::NUM_SHARDS]
  assert sorted(rows) == sorted(f"{n}+{p}" for n, p in expected)
  failed = {label: row for label, row in rows.items() if isinstance(row, str)}
  assert not failed, failed
  sampled = round(algorithm_matrix.PARTIAL * len(SIZES))
  for label, runs in rows.items():
    for run in runs:
      check_run(run, label)
    check_agreement(runs[:2], label)
    if algorithm_matrix.conditions_of(label.split("+", 1)[1]):
      if trains_unsampled(*label.split("+", 1)):  # every client trains and receives
        for run in runs:
          up = np.asarray(run["bytes_up"])
          assert ((up > 0).sum(axis=1) <= sampled).all() or run is runs[-1], (label, up)
        continue
      check_conditions(runs, sampled, label)
      continue
    check_sampled(runs[0], sampled, label)


def trains_unsampled(name: str, plugin: str) -> bool:
  """The row's Algorithm.trains_unsampled (a static field: any model's trainer builds it)."""
  model = tiny.tiny_model()
  trainer = make_client_trainer(model.apply, make_optimizer(0.1), 2, 4)  # run_path's
  return simulation.build_algorithm(
      algorithms.make(name, algorithm_matrix.config_of(name, plugin)), trainer).trains_unsampled


def check_sampled(run: dict, sampled: int, label: str) -> None:
  """Partial participation: the sampled clients trained, or every client where the
  algorithm trains them all (Algorithm.trains_unsampled, pFedMe's Algorithm 1); either
  way only the sampled ones uploaded."""
  name, plugin = label.split("+", 1)
  steps, up = np.asarray(run["local_steps"]), np.asarray(run["bytes_up"])
  trains_all = trains_unsampled(name, plugin)
  trained = len(SIZES) if trains_all else sampled
  assert ((steps > 0).sum(axis=1) == trained).all(), (label, steps)
  if trains_all:
    assert ((up > 0).sum(axis=1) <= sampled).all(), (label, up)


def check_conditions(runs: list[dict], sampled: int, label: str) -> None:
  """Dropout and stragglers: every sampled client received the broadcast (all of them at
  full participation, the third run); those that trained are those that sent."""
  for run, received in zip(runs, (sampled, sampled, len(SIZES))):
    down, up = np.asarray(run["bytes_down"]), np.asarray(run["bytes_up"])
    trained = np.asarray(run["local_steps"]) > 0
    assert ((down > 0).sum(axis=1) == received).all(), (label, down)
    np.testing.assert_array_equal(up > 0, trained, err_msg=label)
    assert (trained <= (down > 0)).all(), (label, trained, down)
