"""Acc, R-Acc, PTR and best-validation selection against hand-computed values."""

import types

import numpy as np
import pytest

from fedora_jax import metrics, results

# A run whose history counted no bytes: results.json's bytes_up / bytes_down are null.
_UNCOUNTED_RUN = types.SimpleNamespace(
    history=types.SimpleNamespace(bytes_up=None, bytes_down=None))


def test_summary_by_hand():
  acc = np.array([0.9, 0.6, 0.5, 0.8])
  local = np.array([0.6, 0.6, 0.625, 0.4])
  s = metrics.summarize(acc, local)
  assert np.isclose(s.acc, 0.7)
  # R-Acc per client: 0.5, 0, -0.2, 1.0 -> mean 0.325; PTR: 3 of 4 clients >= LOCAL.
  np.testing.assert_allclose(metrics.relative_accuracy(acc, local), [0.5, 0.0, -0.2, 1.0])
  assert np.isclose(s.r_acc, 0.325)
  assert np.isclose(s.ptr, 0.75)


def test_the_same_count_rounded_two_ways_is_a_tie():
  # 218 / 277 as a float32 division and through a float32 reciprocal: one bit apart, the
  # same 218 correct; 217 / 277 is one sample fewer. LOCAL's value as results.json keeps it
  # (6 decimals) ties too.
  n, c = np.float32(277), np.float32(218)
  divided, by_reciprocal = c / n, c * (np.float32(1) / n)
  assert divided != by_reciprocal
  acc = np.array([by_reciprocal, np.float32(217) / n, by_reciprocal])
  local = np.array([divided, divided, round(float(divided), 6)])
  np.testing.assert_array_equal(metrics.same_accuracy(acc, local), [True, False, True])
  s = metrics.summarize(acc, local)
  assert s.ptr == pytest.approx(2 / 3)
  np.testing.assert_array_equal(metrics.relative_accuracy(acc, local)[[0, 2]], [0.0, 0.0])
  assert s.r_acc == pytest.approx((-1 / 218) / 3, rel=1e-5)  # float32 counts


def test_zero_local_accuracy_is_left_out_of_r_acc():
  s = metrics.summarize(np.array([0.5, 0.2]), np.array([0.0, 0.1]))
  assert np.isclose(s.r_acc, 1.0)
  assert s.ptr == 1.0


def test_r_acc_is_undefined_where_local_scored_zero_and_shown_so():
  # Definition 3.2 divides by LOCAL's accuracy: client 0's R-Acc is undefined, the mean is
  # over the other two ((0.2 - 0.1) / 0.1 = 1, (0.3 - 0.4) / 0.4 = -0.25); PTR counts all 3.
  ours = results.ClientScores(final=np.array([0.5, 0.2, 0.3]),
                              best_val=np.array([0.5, 0.2, 0.3]), best_round=2)
  local = results.ClientScores(final=np.array([0.0, 0.1, 0.4]),
                               best_val=np.array([0.0, 0.1, 0.4]), best_round=1)
  info = {"dataset": "tiny", "algorithm": "fedavg", "setting": "balanced",
          "num_clients": 3, "seed": 0, "rounds": 2}
  report = results.build_results(info, _UNCOUNTED_RUN, ours, local, {"n_train": np.array([5, 6, 7])})
  assert [c["r_acc"] for c in report["clients"]] == [None, 1.0, -0.25]
  assert report["bytes_up"] is None and report["bytes_down"] is None
  assert report["r_acc"] == 0.375 and report["ptr"] == pytest.approx(2 / 3, abs=1e-6)
  table = results.format_table(report)
  assert "nan" not in table
  assert table.splitlines()[1].split()[4] == "n/a"             # client 0's r_acc cell
  assert table.count("R-Acc +0.3750 (over 2 of 3 clients; LOCAL scored 0 on the others)") == 2
  # Nowhere defined: no mean at all, not NaN.
  assert metrics.summarize(np.array([0.5, 0.0]), np.array([0.0, 0.0])).r_acc is None
  nowhere = results.build_results(info, _UNCOUNTED_RUN, ours._replace(final=np.zeros(3)),
                                  local._replace(final=np.zeros(3)),
                                  {"n_train": np.array([5, 6, 7])})
  assert "R-Acc n/a (over 0 of 3 clients" in results.format_table(nowhere)


def test_split_label_names_the_partition_beside_the_setting():
  # Rotated data (no partition, or kind rotation) is FEDORA's setting alone; a label
  # split says which, with its alpha or classes a client, so a Dirichlet run's titles
  # do not read "balanced" only.
  assert results.split_label({"setting": "imbalanced"}) == "imbalanced"
  assert results.split_label({"setting": "balanced", "partition": {"kind": "rotation"}}) \
      == "balanced"
  dirichlet = {"kind": "dirichlet", "dirichlet_alpha": 0.1, "classes_per_client": 2}
  assert results.split_label({"setting": "balanced", "partition": dirichlet}) \
      == "Dirichlet alpha=0.1, balanced"
  pathological = {"kind": "pathological", "dirichlet_alpha": 0.5, "classes_per_client": 2}
  assert results.split_label({"setting": "imbalanced", "partition": pathological}) \
      == "pathological, 2 classes a client, imbalanced"
  assert results.split_label({"setting": "balanced", "partition": {"kind": "iid"}}) \
      == "iid, balanced"


def test_best_validation_round_takes_the_first_best_mean():
  val = np.array([[0.1, 0.3], [0.5, 0.1], [0.2, 0.4], [0.4, 0.2]])
  assert metrics.best_validation_round(val) == 2


def test_rotation_distance_and_r_acc_by_distance_from_the_large_client_by_hand():
  np.testing.assert_allclose(metrics.rotation_distance([0, 170, 190, 350, 180], 180),
                             [180, 10, 10, 170, 0])
  angles = [180, 0, 150, 210, 120, 270, 90]   # client 0 holds the most samples
  n_train = [900, 10, 10, 10, 10, 10, 10]
  r_acc = [0.5, -0.1, 0.2, 0.4, 0.1, np.nan, 0.3]
  # Distances from 180 degrees: 180, 30, 30, 60, 90, 90 for clients 1-6; client 0 is left out.
  assert metrics.relative_accuracy_by_distance(angles, n_train, r_acc) == {
      "near": (2, pytest.approx(0.3)), "middle": (1, pytest.approx(0.1)),
      "far": (3, pytest.approx(0.1))}  # client 5's undefined R-Acc is left out of the mean
  assert metrics.relative_accuracy_by_distance([0, 180], [5, 1], [0.0, 0.2])["near"] == (
      0, None)


def test_the_summary_names_plug_ins_and_participation_and_clients_print_apart():
  ours = results.ClientScores(final=np.array([0.5, 0.2]), best_val=np.array([0.5, 0.2]),
                              best_round=2)
  local = results.ClientScores(final=np.array([0.4, 0.2]), best_val=np.array([0.4, 0.2]),
                               best_round=1)
  info = {"dataset": "rmnist", "algorithm": "fedavg", "setting": "balanced",
          "num_clients": 2, "seed": 3, "rounds": 5, "train": {"participation": 0.5},
          "plugins": {"ala": {"eta": 1.0}, "aggregation": None}}
  report = results.build_results(info, _UNCOUNTED_RUN, ours, local, {"n_train": np.array([5, 6])})
  summary = results.format_summary(report).splitlines()
  assert summary[0] == ("fedavg+ala on rmnist (balanced, 2 clients, seed 3, participation"
                        " 0.5), 5 rounds:")
  assert summary[1].split()[:5] == ["final", "round", "5:", "Acc", "0.3500"]
  assert len(results.format_clients(report).splitlines()) == 3  # a header and 2 clients
  assert results.format_row(report) == "Acc 0.3500  R-Acc +0.1250  PTR 1.0000  (LOCAL 0.3000)"
