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
  # Every client's LOCAL accuracy 0: R-Acc is undefined (None), the title says so.
  undefined = dict(synthetic_results("fedora", [0.1, -0.1]), r_acc=None)
  assert "R-Acc undefined" in plots.relative_accuracy_title(undefined)


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


def test_a_table_curve_panel_tells_every_row_apart():
  # fedala_ala's column has LOCAL and 18 rows: tab10 alone repeated colours past ten.
  curves = {"c": {"local": np.arange(3.0), **{f"row{i}": np.arange(3.0) + i
                                              for i in range(18)}}}
  lines = plots.table_curves_figure(curves, {"c": "column"}).axes[0].get_lines()
  styles = {(to_rgba(line.get_color()), line.get_linestyle())
            for line in lines}
  assert len(lines) == len(styles) == 19
  local = [line for line in lines if line.get_label() == "local"][0]
  assert (local.get_color(), local.get_linestyle()) == ("black", "--")
  assert len(set(plots.curve_styles(45))) == 45
  assert plots.curve_styles(3) == [("C0", "-"), ("C1", "-"), ("C2", "-")]
  with pytest.raises(ValueError, match="81 curves"):
    plots.curve_styles(81)


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


def table_rows():
  """Two rows of reproduce's summary (experiments/reproduce.py summarize), two seeds."""
  return [{"algorithm": "local", "seeds": 2, "acc": 0.70, "acc_std": 0.01,
           "acc_seeds": [0.69, 0.71], "r_acc": 0.0, "r_acc_std": 0.0, "r_acc_seeds": [0.0, 0.0],
           "ptr": 1.0, "ptr_std": 0.0, "ptr_seeds": [1.0, 1.0], "paper_acc": 0.7642,
           "paper_r_acc": None, "paper_ptr": None},
          {"algorithm": "fedora_paper", "seeds": 2, "acc": 0.75, "acc_std": 0.05,
           "acc_seeds": [0.70, 0.80], "r_acc": 0.02, "r_acc_std": 0.01,
           "r_acc_seeds": [0.01, 0.03], "ptr": 0.5, "ptr_std": None, "ptr_seeds": [0.5, None],
           "paper_acc": 0.8251, "paper_r_acc": 0.0806, "paper_ptr": 1.0}]


def test_reproduced_table_shows_ours_beside_the_paper_with_seed_error_bars(tmp_path):
  fig = plots.reproduced_table_figure(table_rows(), "Table 1", {"fedora_paper": "fedora"})
  panels = [ax for ax in fig.axes if ax.patches]
  assert len(panels) == 3  # Acc, R-Acc, PTR
  for ax, ours, paper in zip(panels, ([0.70, 0.75], [np.nan, 2.0], [np.nan, 0.5]),
                             ([0.7642, 0.8251], [np.nan, 8.06], [np.nan, 1.0])):
    bars = [b for b in ax.patches]
    heights = [b.get_height() for b in bars]
    np.testing.assert_allclose(heights, ours + paper)  # ours (left) then the paper's
    assert [b.get_facecolor() for b in bars[2:] if np.isfinite(b.get_height())] == [
        to_rgba(plots.PAPER_COLOR)] * int(np.isfinite(paper).sum())
  # Error bars: ours +- std over seeds; one dot per seed; LOCAL marked as the reference.
  acc = panels[0]
  caps = np.sort(np.concatenate([np.asarray(line.get_ydata(), float) for line in acc.lines
                                 if line.get_marker() == "_"]))
  np.testing.assert_allclose(caps, [0.69, 0.70, 0.71, 0.80])
  np.testing.assert_allclose(np.sort(np.asarray(acc.collections[-1].get_offsets(), float)[:, 1]),
                             [0.69, 0.70, 0.71, 0.80])
  assert "the reference" in [t.get_text() for t in panels[1].texts]
  assert [t.get_text() for t in panels[2].get_xticklabels()] == ["local", "fedora_paper*"]
  assert "fedora_paper*: compared with the paper's fedora row" in panels[2].get_xlabel()
  assert_png(plots.save_figure(fig, str(tmp_path / "table.png")))


def write_run(directory, algorithm, test_acc, local_acc, extra_info=None):
  """A run directory as fedora_jax/results.py writes it: [R, K] test accuracies."""
  from fedora_jax import results as results_lib  # pylint: disable=g-import-not-at-top
  from fedora_jax.simulation import RunResult  # pylint: disable=g-import-not-at-top
  test_acc, local_acc = np.asarray(test_acc, float), np.asarray(local_acc, float)
  rounds, k = test_acc.shape
  history = round_metrics(test_acc[0], np.zeros(k))._replace(extra={})
  history = history._replace(**{f: np.stack([getattr(history, f)] * rounds)
                                for f in history._fields
                                if f != "extra" and getattr(history, f) is not None})
  history = history._replace(test_score=test_acc, val_score=test_acc)
  result = RunResult(algorithm=algorithm, history=history, artifacts={},
                     compile_seconds=1.0, round_seconds=0.1, total_seconds=1.0,
                     final_state=None)
  ours = results_lib.ClientScores(test_acc[-1], test_acc[-1], rounds)
  local = results_lib.ClientScores(local_acc[-1], local_acc[-1], rounds)
  info = {"dataset": "rmnist", "algorithm": algorithm, "setting": "balanced",
          "num_clients": k, "seed": 0, "rounds": rounds, **(extra_info or {})}
  document = results_lib.build_results(info, result, ours, local,
                                       {"n_train": np.full(k, 128)})
  results_lib.write_run_files(str(directory), document, result)
  return document


def two_runs(tmp_path):
  from fedora_jax.algorithms import fedora  # pylint: disable=g-import-not-at-top
  local_acc = [[0.5, 0.5, 0.5], [0.6, 0.6, 0.6]]
  fedora_dir, fedavg_dir = tmp_path / "fedora", tmp_path / "fedavg"
  write_run(fedora_dir, "fedora", [[0.5, 0.6, 0.7], [0.7, 0.5, 0.9]], local_acc,
            {"fedora": fedora.config_for_variant("authors")._asdict()})
  write_run(fedora_dir / "local", "local", local_acc, local_acc)  # the LOCAL it trained
  write_run(fedavg_dir, "fedavg", [[0.4, 0.4, 0.4], [0.5, 0.6, 0.6]], local_acc,
            {"plugins": {"ala": {"eta": 1.0}, "aggregation": None}})
  return fedora_dir, fedavg_dir


def test_comparison_overlays_curves_and_per_client_r_acc(tmp_path):
  runs = [plots.load_saved_run(str(d)) for d in two_runs(tmp_path)]
  fig = plots.comparison_figure(runs)
  curves, clients = fig.axes
  lines = {line.get_label(): line for line in curves.get_lines()}
  fedora_line = lines["fedora (authors): acc 0.7000"]
  np.testing.assert_allclose(fedora_line.get_ydata(), [0.6, 0.7])
  np.testing.assert_allclose(lines["fedavg + ala: acc 0.5667"].get_ydata(), [0.4, 0.5667],
                             atol=1e-4)
  dashed = [line for line in curves.get_lines() if line.get_linestyle() == "--"
            and len(line.get_ydata())]
  assert len(dashed) == 1 and dashed[0].get_color() == fedora_line.get_color()
  np.testing.assert_allclose(dashed[0].get_ydata(), [0.5, 0.6])
  # Per-client R-Acc in %, a bar per client per run: (acc - local) / local.
  heights = [b.get_height() for b in clients.patches]
  np.testing.assert_allclose(heights, [100 * (0.7 / 0.6 - 1), 100 * (0.5 / 0.6 - 1), 50.0,
                                       100 * (0.5 / 0.6 - 1), 0.0, 0.0], atol=1e-3)
  assert fig.texts[0].get_text() == "rmnist, balanced, 3 clients, 2 rounds, seed 0"
  # The same algorithm twice: the seed (then the data, the directory) tells them apart.
  twice = [runs[0], runs[0]._replace(results={**runs[0].results, "seed": 1})]
  labels = [line.get_label() for line in plots.comparison_figure(twice).axes[0].get_lines()]
  assert [label for label in labels if label.startswith("fedora")] == [
      "fedora (authors), seed 0: acc 0.7000",
                    "fedora (authors), seed 1: acc 0.7000"]
  fedora_block = {**runs[0].results["fedora"], "similarity": "random"}
  assert plots.saved_run_label({"algorithm": "fedora", "fedora": fedora_block}) == (
      "fedora (authors; similarity=random)")


def run_plots(*args):
  return subprocess.run([sys.executable, "-m", "fedora_jax.plots", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


def test_plots_command_writes_the_comparison_or_says_what_is_wrong(tmp_path):
  fedora_dir, fedavg_dir = two_runs(tmp_path)
  out = tmp_path / "figures" / "both.png"
  proc = run_plots(str(fedora_dir), str(fedavg_dir), f"--out={out}")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == str(out)
  assert_png(out)
  proc = run_plots(str(fedora_dir), str(fedavg_dir))  # no --out: beside the first run
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == str(fedora_dir / "comparison.png")
  assert_png(fedora_dir / "comparison.png")
  (tmp_path / "empty").mkdir()
  (tmp_path / "garbled").mkdir()
  (tmp_path / "garbled" / "results.json").write_text("{not json")
  for bad, message in [(tmp_path / "nope", "no such directory"),
                       (tmp_path / "empty", "no results.json"),
                       (tmp_path / "garbled", "not a results.json")]:
    proc = run_plots(str(fedora_dir), str(bad), f"--out={tmp_path / 'x.png'}")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith(f"error: {bad}") and message in proc.stderr
  assert not (tmp_path / "x.png").exists()
  # --redraw: each run's own plots, into its directory.
  proc = run_plots("--redraw", str(fedavg_dir))
  assert proc.returncode == 0, proc.stderr
  assert_png(fedavg_dir / plots.ACCURACY_CURVES_PNG)
