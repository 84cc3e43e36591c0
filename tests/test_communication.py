"""Bytes up and down: each algorithm's real messages, counted per client from
their shapes, times who took part; in the history, results.json, rounds.csv and
TensorBoard."""

import csv
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms, availability, communication, metric_writer
from fedora_jax import results as results_lib
from fedora_jax.engine import sharding
from fedora_jax.rounds import sampled_clients
from fedora_jax.simulation import TrainConfig, root_keys, run_algorithm
from tiny import default_config, tiny_data, tiny_model

SIZES = (5, 6, 9)
# The tiny MLP 4 -> 5 -> 3: Dense_0 (20 + 5 floats) and Dense_1 (15 + 3), 4 bytes each.
MODEL, BODY = 43 * 4, 25 * 4
FOMO_MODELS = 2   # FedFomo's M = 5 capped at the K - 1 = 2 other clients


def test_per_client_bytes_counts_one_row_of_each_leaf():
  stacked = {"w": jnp.zeros((7, 3, 4)), "ids": jnp.zeros((7, 2), jnp.int32),
             "mask": jnp.zeros((7, 5), bool), "nothing": ()}
  assert communication.per_client_bytes(stacked) == 48 + 8 + 5
  assert communication.per_client_bytes(()) == 0


def test_run_total():
  assert communication.run_total(np.array([[3, 0], [2, 2]], np.int32)) == 7
  assert communication.run_total(np.array([[-1, -1], [2, 2]], np.int32)) is None
  assert communication.run_total(None) is None


# Per client: (bytes down, bytes up). FedAvg, Ditto, FedALA: the global model both ways;
# FedRep: its body; FEDORA: the propagated model down, the trained model (read from the
# client state) up; pFedHN: the generated model down, the model delta up; FedFomo: M
# models and their ids down, the ids, weights and the trained model up.
EXPECTED = {"fedavg": (MODEL, MODEL), "ditto": (MODEL, MODEL), "fedala": (MODEL, MODEL),
            "fedrep": (BODY, BODY), "fedora": (MODEL, MODEL), "pfedhn": (MODEL, MODEL),
            "fedfomo": (FOMO_MODELS * (MODEL + 4), FOMO_MODELS * 8 + MODEL)}


def _run(name, rounds=1, **train_options):
  data, _ = tiny_data(SIZES)
  train = TrainConfig(rounds=rounds, local_epochs=2, batch_size=4, lr=0.1, log_every=0,
                      **train_options)
  return run_algorithm(algorithms.make(name, default_config(name)), tiny_model(), data,
                       train, mesh=sharding.client_mesh(jax.devices()[:1]), progress=None)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bytes_per_client_of_the_table_algorithms(name):
  history = _run(name).history
  down, up = EXPECTED[name]
  np.testing.assert_array_equal(history.bytes_down, [[down] * len(SIZES)])
  np.testing.assert_array_equal(history.bytes_up, [[up] * len(SIZES)])


def test_only_the_sampled_receive_and_only_the_arrived_send(tmp_path):
  result = _run("fedavg", rounds=2, participation=2 / 3, client_dropout=0.5)
  history = result.history
  key = root_keys(0)["train"]
  conditions = availability.build_conditions(dropout=0.5, num_clients=3)
  for r in range(2):
    round_key = jax.random.fold_in(key, r)
    sampled = np.asarray(sampled_clients(round_key, 3, 2))
    arrived = sampled & np.asarray(availability.draw(conditions, round_key, jnp.asarray(r),
                                                     3).arrives)
    np.testing.assert_array_equal(history.bytes_down[r], np.where(sampled, MODEL, 0))
    np.testing.assert_array_equal(history.bytes_up[r], np.where(arrived, MODEL, 0))
    np.testing.assert_array_equal(history.local_steps[r] > 0, arrived)

  totals = results_lib.communication_totals(result)
  assert totals == {"bytes_up": int(history.bytes_up.sum()),
                    "bytes_down": int(history.bytes_down.sum())}
  report = {"algorithm": "fedavg", "clients": [{"id": k} for k in range(3)], **totals}
  results_lib.write_run_files(str(tmp_path), report, result)
  with open(tmp_path / "rounds.csv") as f:
    rows = list(csv.DictReader(f))
  assert [int(row["bytes_up"]) for row in rows] == history.bytes_up.sum(axis=1).tolist()
  assert [int(row["bytes_down"]) for row in rows] == history.bytes_down.sum(axis=1).tolist()
  with np.load(tmp_path / "history.npz") as saved:
    np.testing.assert_array_equal(saved["bytes_up"], history.bytes_up)
  with open(tmp_path / "results.json") as f:
    assert json.load(f)["bytes_down"] == totals["bytes_down"]
  last = jax.tree.map(lambda a: a[-1], history)
  scalars = metric_writer.round_scalars(last, "fedavg")
  assert scalars["communication/bytes_up"] == float(last.bytes_up.sum())
  assert scalars["communication/bytes_down"] == float(last.bytes_down.sum())


def test_unknown_rounds_leave_the_total_unknown(tmp_path):
  result = _run("fedavg", rounds=2)
  history = result.history._replace(bytes_up=np.where(np.arange(2)[:, None] == 0, -1,
                                                      result.history.bytes_up))
  result = result._replace(history=history)
  assert results_lib.communication_totals(result)["bytes_up"] is None
  results_lib.write_run_files(str(tmp_path), {"clients": [{"id": 0}]}, result)
  with open(tmp_path / "rounds.csv") as f:
    rows = list(csv.DictReader(f))
  assert rows[0]["bytes_up"] == "" and int(rows[1]["bytes_up"]) == 3 * MODEL
