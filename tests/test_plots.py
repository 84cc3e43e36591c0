"""Run plots (fedora_jax.plots), TensorBoard events (fedora_jax.metric_writer), and both
left in --workdir by a two-round `python -m experiments.main`."""

import glob
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from tensorboardX.proto import event_pb2

from fedora_jax import metric_writer, plots
from fedora_jax.rounds import RoundMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--num_clients=4", "--rounds=2", "--local_epochs=1", "--hidden=16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
  with open(path, "rb") as f:
    assert f.read(8) == PNG_MAGIC, path
  assert os.path.getsize(path) > 1000, path


def synthetic_history(rounds=3, clients=4, seed=0):
  rng = np.random.default_rng(seed)
  return {"val_acc": rng.uniform(size=(rounds, clients)),
          "test_acc": rng.uniform(size=(rounds, clients)),
          "train_loss": rng.uniform(size=(rounds, clients))}


def synthetic_results(algorithm, r_acc):
  return {"algorithm": algorithm, "dataset": "rmnist", "setting": "balanced",
          "num_clients": len(r_acc), "seed": 0, "rounds": 3, "acc": 0.8, "r_acc": 0.01,
          "ptr": 0.5, "local_acc": 0.79, "best_val": {"round": 2},
          "clients": [{"id": k, "r_acc": r} for k, r in enumerate(r_acc)]}


def test_negative_transfer_bars_are_red_with_a_zero_line(tmp_path):
  r_acc = np.array([-0.1, 0.0, 0.2, np.nan, -0.01])
  fig = plots.relative_accuracy_figure(r_acc, "Acc / R-Acc / PTR")
  ax = fig.axes[0]
  bars = list(ax.patches)
  assert len(bars) == 5
  expected = [plots.NEGATIVE_COLOR, plots.POSITIVE_COLOR, plots.POSITIVE_COLOR,
              plots.UNDEFINED_COLOR, plots.NEGATIVE_COLOR]
  assert [b.get_facecolor() for b in bars] == [to_rgba(c) for c in expected]
  np.testing.assert_allclose([b.get_height() for b in bars], [-10.0, 0.0, 20.0, 0.0, -1.0])
  assert any(np.allclose(line.get_ydata(), 0.0) for line in ax.get_lines())
  assert ax.get_title() == "Acc / R-Acc / PTR"
  assert_png(plots.save_figure(fig, str(tmp_path / "bars.png")))


def test_relative_accuracy_title_has_the_headline_metrics():
  title = plots.relative_accuracy_title(synthetic_results("fedora", [0.1, -0.1]))
  assert "Acc 0.8000" in title and "R-Acc +1.00%" in title and "PTR 0.500" in title


def test_similarity_heatmap_and_graph_side_by_side_with_colour_bars(tmp_path):
  similarity = np.random.default_rng(0).uniform(size=(4, 4))
  fig = plots.similarity_figure(similarity, similarity * 2)
  heatmaps = [ax for ax in fig.axes if ax.images]
  assert len(heatmaps) == 2 and len(fig.axes) == 4  # two heatmaps, two colour bars
  np.testing.assert_allclose(heatmaps[1].images[0].get_array(), similarity * 2)
  assert_png(plots.save_figure(fig, str(tmp_path / "similarity.png")))
  assert len(plots.similarity_figure(similarity).axes) == 2


def test_relation_matrix_of_one_client_with_its_own_column_outlined(tmp_path):
  cube = np.random.default_rng(0).normal(size=(4, 3, 4))  # [client, layer, client]
  fig = plots.relation_figure(cube, client=2, client_ids=np.array([3, 5, 8, 9]))
  ax = fig.axes[0]
  np.testing.assert_allclose(ax.images[0].get_array(), cube[2])
  outline = [p for p in ax.patches if p.get_label() == "own column (j = i)"]
  assert len(outline) == 1 and outline[0].get_x() == 1.5 and outline[0].get_height() == 3
  assert [t.get_text() for t in ax.texts][:2] == [f"{cube[2, 0, 0]:.2f}", f"{cube[2, 0, 1]:.2f}"]
  assert ax.get_title() == "relation matrix of client 8: r[layer, client]"
  assert_png(plots.save_figure(fig, str(tmp_path / "relation.png")))


def test_accuracy_curves_show_local_mean_test_accuracy(tmp_path):
  history, local = synthetic_history(seed=0), synthetic_history(seed=1)
  fig = plots.accuracy_curves_figure(history, local, best_round=2)
  lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
  np.testing.assert_allclose(lines["test"].get_ydata(), history["test_acc"].mean(axis=1))
  np.testing.assert_allclose(lines["validation"].get_ydata(), history["val_acc"].mean(axis=1))
  np.testing.assert_allclose(lines["LOCAL test"].get_ydata(), local["test_acc"].mean(axis=1))
  assert "best validation (round 2)" in lines
  assert_png(plots.save_figure(fig, str(tmp_path / "curves.png")))


def test_write_run_plots_writes_what_the_run_has(tmp_path):
  artifacts = {"similarity": np.eye(4), "graph": np.eye(4)}
  results = synthetic_results("fedora", [0.1, -0.1, 0.0, None])
  written = plots.write_run_plots(str(tmp_path), results, synthetic_history(), artifacts,
                                  synthetic_history(seed=1))
  assert sorted(os.path.basename(p) for p in written) == sorted(
      [plots.RELATIVE_ACCURACY_PNG, plots.SIMILARITY_PNG, plots.ACCURACY_CURVES_PNG])
  for path in written:
    assert_png(path)
  # LOCAL against itself has nothing to show as R-Acc, and no similarity.
  local_dir = tmp_path / "local"
  local_dir.mkdir()
  written = plots.write_run_plots(str(local_dir), synthetic_results("local", [0.0] * 4),
                                  synthetic_history(), {})
  assert [os.path.basename(p) for p in written] == [plots.ACCURACY_CURVES_PNG]


def read_events(logdir):
  """{tag: [(step, value)]} of scalars and {tag: [step]} of histograms, from the TFRecord
  framing (u64 length, u32 crc, payload, u32 crc) of every event file in logdir."""
  scalars, histograms = {}, {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        if value.HasField("histo"):
          histograms.setdefault(value.tag, []).append(event.step)
        else:
          scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars, histograms


def round_metrics(test_acc, lam):
  k = len(test_acc)
  return RoundMetrics(train_loss=np.full(k, 2.0), local_steps=np.full(k, 3),
                      val_loss=np.full(k, 1.5), val_score=np.full(k, 0.25),
                      test_loss=np.full(k, 1.0), test_score=np.asarray(test_acc),
                      extra={"lambda": np.asarray(lam)})


def test_round_writer_logs_client_means_and_algorithm_extras(tmp_path):
  with metric_writer.RoundWriter(str(tmp_path), "fedora") as on_round:
    on_round(1, round_metrics([0.5, 0.7], [1.0, 3.0]))
    on_round(2, round_metrics([0.6, 0.8], [0.0, 1.0]))
  assert on_round.logdir == os.path.join(str(tmp_path), "tensorboard", "fedora")
  scalars, histograms = read_events(on_round.logdir)
  assert set(scalars) == {"train/loss", "val/loss", "val/accuracy", "test/loss",
                          "test/accuracy", "fedora/lambda"}
  assert [s for s, _ in scalars["test/accuracy"]] == [1, 2]
  np.testing.assert_allclose([v for _, v in scalars["test/accuracy"]], [0.6, 0.7], rtol=1e-6)
  np.testing.assert_allclose([v for _, v in scalars["fedora/lambda"]], [2.0, 0.5])
  np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [2.0, 2.0])
  assert histograms == {"test/client_accuracy": [1, 2]}


@pytest.mark.slow
def test_cli_run_leaves_plots_and_tensorboard_events(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "experiments.main", "--dataset=rmnist",
                         f"--workdir={workdir}", *FAST], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in (plots.RELATIVE_ACCURACY_PNG, plots.SIMILARITY_PNG, plots.ACCURACY_CURVES_PNG):
    assert_png(workdir / name)
  assert_png(workdir / "local" / plots.ACCURACY_CURVES_PNG)
  fedora, _ = read_events(workdir / "tensorboard" / "fedora")
  local, _ = read_events(workdir / "tensorboard" / "local")
  assert [s for s, _ in fedora["test/accuracy"]] == [1, 2]
  assert [s for s, _ in fedora["fedora/lambda"]] == [1, 2]
  assert [s for s, _ in local["test/accuracy"]] == [1, 2]
  assert "fedora/lambda" not in local


def test_coaching_run_draws_its_relation_matrix(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "experiments.main", "--algorithm=coaching",
                         "--dataset=rmnist", f"--workdir={workdir}", *FAST], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  cube = np.load(workdir / "relation_cube.npy")
  assert cube.shape == (4, 2, 4) and np.all(np.isfinite(cube))  # --hidden=16: two layers
  assert_png(workdir / plots.RELATION_PNG)
