"""The client axis over devices and processes: padding, and identical per-client results
on 1 and 4 (fake CPU) devices and on 1 and 2 processes."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fedora_jax.engine import sharding
from fedora_jax.engine.buckets import map_over_buckets
import tiny
from algorithm_matrix import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_padded_size_rounds_up_to_the_device_count():
  assert [sharding.padded_size(k, 4) for k in (1, 4, 5, 36, 37)] == [4, 4, 8, 36, 40]
  assert sharding.padded_size(7, 1) == 7


def test_pad_clients_repeats_the_last_client():
  tree = {"x": np.arange(6).reshape(3, 2), "n": np.array([5, 6, 7])}
  padded = sharding.pad_clients(tree, 5)
  np.testing.assert_array_equal(padded["x"], [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]])
  np.testing.assert_array_equal(padded["n"], [5, 6, 7, 7, 7])
  assert sharding.pad_clients(tree, 3)["x"] is not None


def test_padded_buckets_give_the_unpadded_results():
  data, _ = tiny.tiny_data([3, 3, 9, 9, 9])  # two buckets: 2 and 3 clients
  assert len(data.buckets) == 2
  padded = tuple(sharding.pad_clients(b, 4) for b in data.buckets)
  scale = np.arange(1.0, 6.0)

  def fn(s, splits):
    return s * (splits.train.x * splits.train.mask[:, None]).sum()
  expected = map_over_buckets(fn, (scale,), data.buckets, data.client_ids, data.num_clients)
  got = map_over_buckets(fn, (scale,), padded, data.client_ids, data.num_clients)
  assert got.shape == (5,)
  np.testing.assert_allclose(got, expected, rtol=1e-6)


_FOUR_DEVICES = textwrap.dedent("""
    import dataclasses, json, sys
    import jax, numpy as np
    sys.path[:0] = [{root!r}, {tests!r}]
    from fedora_jax import algorithms
    from fedora_jax.engine import sharding
    from fedora_jax.simulation import TrainConfig, run_algorithm
    import tiny

    assert jax.device_count() == 4, jax.devices()
    data, _ = tiny.tiny_data([6, 6, 6, 6, 6, 16, 16])  # buckets of 5 and 2 clients
    model = tiny.tiny_model()
    train = TrainConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.1, log_every=0)
    report = {{"default_mesh": [sharding.default_mesh(sizes).size
                                for sizes in ([36], [5, 2], [35, 1])]}}
    # FedBN on a BatchNorm model: the running averages carried through shard_map chunks.
    for name, model in (("fedavg", model), ("fedora", model), ("fedbn", tiny.TinyBN())):
      config = algorithms.get(name).config_class()
      runs = {{}}
      # vmap, and chunks of 2 clients (each device loops over its own: shard_map).
      for client_chunk in (None, 2):
        for count in (1, 4):
          mesh = sharding.client_mesh(jax.devices()[:count])
          chunked = dataclasses.replace(train, client_chunk=client_chunk)
          placed = sharding.place_buckets(data.buckets, mesh)  # as prepare_run places them
          shards = [len(b.train.x.sharding.device_set) for b in placed]
          slots = [b.train.x.shape[0] for b in placed]
          history = run_algorithm(algorithms.make(name, config), model, data, chunked,
                                  mesh=mesh).history
          runs[client_chunk, count] = (shards, slots, history)
      (s1, k1, h1), (s4, k4, _) = runs[None, 1], runs[None, 4]
      report[name] = {{
          "shards": [s1, s4], "slots": [k1, k4],
          "max_diff": max(float(np.max(np.abs(getattr(h1, f) - getattr(h, f))))
                          for (_, _, h) in runs.values()
                          for f in ("train_loss", "val_loss", "val_score", "test_score"))}}
      # 4 of 7 clients a round: the sampled ones run in M slots across both buckets (a
      # small client may take the large bucket's slot), vmapped on 1 device and in chunks
      # under shard_map on 4 (slots padded per bucket); unsampled train losses are NaN.
      partial = [run_algorithm(algorithms.make(name, config), model, data,
                               dataclasses.replace(train, client_chunk=chunk,
                                                   participation=0.5),
                               mesh=sharding.client_mesh(jax.devices()[:count])).history
                 for chunk, count in ((None, 1), (2, 4))]
      report[name]["partial_diff"] = max(
          float(np.max(np.abs(np.nan_to_num(getattr(partial[0], f), nan=9.0)
                              - np.nan_to_num(getattr(partial[1], f), nan=9.0))))
          for f in ("train_loss", "val_loss", "val_score", "test_score"))
      report[name]["partial_steps"] = (partial[0].local_steps > 0).sum(axis=1).tolist()
    print(json.dumps(report))
""")


@pytest.mark.slow
def test_one_and_four_devices_give_the_same_per_client_results():
  """Vmapped and in chunks of clients, on 1 and on 4 devices: the same numbers."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}")
  script = _FOUR_DEVICES.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report.pop("default_mesh") == [4, 2, 1]  # at most the smallest bucket's clients
  for name, entry in report.items():
    assert entry["shards"] == [[1, 1], [4, 4]], (name, entry)
    assert entry["slots"] == [[5, 2], [8, 4]], (name, entry)  # padded to multiples of 4
    assert entry["max_diff"] < 1e-5, (name, entry)
    assert entry["partial_diff"] < 1e-5, (name, entry)
    assert entry["partial_steps"] == [4, 4, 4], (name, entry)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_the_single_process_results(tmp_path):
  """experiments.main as two jax.distributed processes on a loopback coordinator, against
  the same command in one process. The two-process run stops after round 1 and resumes
  from the checkpoint both processes saved into one folder."""
  # --client_chunk=0: one CPU device would otherwise default to chunks of clients, two
  # to vmap (models.default_client_chunk); both sides run the same program here.
  fast = ["--algorithm=fedavg", "--num_clients=5", "--local_epochs=1", "--hidden=16",
          "--log_every=0", "--client_chunk=0"]
  main = [sys.executable, "-m", "experiments.main", *fast]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  single = subprocess.run([*main, "--rounds=2", "--checkpoint_every=0",
                           f"--workdir={tmp_path / 'one'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-3000:]
  for rounds in (1, 2):
    address = f"127.0.0.1:{_free_port()}"
    workers = [subprocess.Popen(
        [*main, f"--rounds={rounds}", "--checkpoint_every=1",
         f"--workdir={tmp_path / 'two'}", f"--coordinator_address={address}",
         "--num_processes=2", f"--process_id={i}"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for worker in workers:
      _, stderr = worker.communicate(timeout=600)
      assert worker.returncode == 0, stderr[-3000:]
  assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["1", "2"]
  assert not (tmp_path / "two" / "process1" / "checkpoints").exists()

  def clients(path):
    results = json.loads(path.read_text())
    return results, [(c["acc"], c["local_acc"]) for c in results["clients"]]
  one, expected = clients(tmp_path / "one" / "results.json")
  two, got = clients(tmp_path / "two" / "results.json")
  _, got_other = clients(tmp_path / "two" / "process1" / "results.json")
  # One process: a CPU device per core (--cpu_devices); several: one device each.
  assert (one["processes"], one["devices"]) == (1, sharding.cpu_device_count())
  assert (two["processes"], two["devices"]) == (2, 2)
  assert got == expected and got_other == expected
