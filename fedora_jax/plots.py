"""Figures of a finished run, written as PNG files next to its results.

  relative_accuracy.png  per-client R-Acc against LOCAL (FEDORA paper, Figure 3)
  similarity.png         FEDORA's client similarity and propagation graph, as heatmaps
  relation.png           coaching's relation matrix of client 0 (its Figure 2)
  accuracy_curves.png    mean validation and test accuracy per round (and LOCAL's)

Figures are built on `matplotlib.figure.Figure` directly, never through pyplot: saving
then always uses the Agg renderer, so nothing needs a display and the global backend
(e.g. a notebook's inline one) is left alone.

  python -m fedora_jax.plots RUN_DIR     # (re)draws the plots of a saved run
"""

import json
import os
import sys
from typing import Mapping

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator

NEGATIVE_COLOR = "tab:red"    # R-Acc_k < 0: negative transfer
POSITIVE_COLOR = "tab:blue"   # R-Acc_k >= 0: at least as good as LOCAL (counts in PTR)
UNDEFINED_COLOR = "tab:gray"  # R-Acc_k undefined (LOCAL accuracy 0)

RELATIVE_ACCURACY_PNG = "relative_accuracy.png"
SIMILARITY_PNG = "similarity.png"
RELATION_PNG = "relation.png"  # coaching's relation matrix of one client
ACCURACY_CURVES_PNG = "accuracy_curves.png"


def bar_colors(r_acc: np.ndarray) -> list[str]:
  """One colour per client: red for negative transfer, grey where R-Acc is undefined."""
  return [UNDEFINED_COLOR if not np.isfinite(r) else NEGATIVE_COLOR if r < 0
          else POSITIVE_COLOR for r in r_acc]


def _label_clients(axis, client_ids: np.ndarray | None, max_ticks: int) -> None:
  """At most max_ticks integer ticks on a client axis, each named by the client's id
  (ids need not be 0..K-1: clients held out with --new_clients leave gaps)."""
  axis.set_major_locator(MaxNLocator(nbins=max_ticks, integer=True))
  if client_ids is not None:
    ids = [int(i) for i in client_ids]
    axis.set_major_formatter(FuncFormatter(
        lambda x, _: str(ids[int(x)]) if float(x).is_integer() and 0 <= x < len(ids) else ""))


def _run_label(results: Mapping) -> str:
  return (f"{results['algorithm']} on {results['dataset']} ({results['setting']},"
          f" {results['num_clients']} clients, seed {results['seed']})")


def relative_accuracy_figure(r_acc: np.ndarray, title: str = "",
                             client_ids: np.ndarray | None = None) -> Figure:
  """Bars of per-client R-Acc in %, negative transfer in red, with a zero line."""
  r_acc = np.asarray(r_acc, dtype=float)
  colors = bar_colors(r_acc)
  fig = Figure(figsize=(max(6.0, 0.22 * len(r_acc) + 2.0), 4.0), layout="constrained")
  ax = fig.add_subplot()
  heights = np.where(np.isfinite(r_acc), 100.0 * r_acc, 0.0)
  ax.bar(np.arange(len(r_acc)), heights, color=colors, width=0.8)
  ax.axhline(0.0, color="black", linewidth=0.8)
  ax.set_xlabel("client")
  ax.set_ylabel("R-Acc vs LOCAL (%)")
  ax.set_xlim(-0.6, len(r_acc) - 0.4)
  _label_clients(ax.xaxis, client_ids, max_ticks=40)  # one per client while they fit
  ax.tick_params(axis="x", labelsize=7)
  legend = [(POSITIVE_COLOR, ">= LOCAL"), (NEGATIVE_COLOR, "negative transfer"),
            (UNDEFINED_COLOR, "undefined (LOCAL acc 0)")]
  ax.legend(handles=[Patch(color=color, label=f"{label} ({colors.count(color)})")
                     for color, label in legend if color in colors or color != UNDEFINED_COLOR],
            loc="best", fontsize=8)
  ax.set_title(title, fontsize=9)
  return fig


def relative_accuracy_title(results: Mapping) -> str:
  """The run, the round, and its headline Acc / R-Acc / PTR."""
  return (f"{_run_label(results)}, final round {results['rounds']}\n"
          f"Acc {results['acc']:.4f} (LOCAL {results['local_acc']:.4f})"
          f"   R-Acc {100 * results['r_acc']:+.2f}%   PTR {results['ptr']:.3f}")


def similarity_figure(similarity: np.ndarray, graph: np.ndarray | None = None,
                      title: str = "", client_ids: np.ndarray | None = None) -> Figure:
  """Heatmaps (client x client) of the similarity and, beside it, the propagation graph."""
  panels = [("similarity (sum of cos of principal angles)", similarity)]
  if graph is not None:
    panels.append(("propagation graph W", graph))
  fig = Figure(figsize=(5.2 * len(panels), 4.6), layout="constrained")
  for i, (name, matrix) in enumerate(panels):
    ax = fig.add_subplot(1, len(panels), i + 1)
    image = ax.imshow(np.asarray(matrix), cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.85)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("client")
    ax.set_ylabel("client")
    _label_clients(ax.xaxis, client_ids, max_ticks=8)
    _label_clients(ax.yaxis, client_ids, max_ticks=8)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig


def relation_figure(relation_cube: np.ndarray, client: int = 0, title: str = "",
                    client_ids: np.ndarray | None = None) -> Figure:
  """Knowledge-aware coaching's relation matrix of one client (Zhi et al., AAAI 2024,
  Figure 2): its weight r_ij^l on every client j (columns) at every layer l (rows, layer
  0 nearest the input, as fedora_jax.algorithms.layers orders them). The client's own
  column is outlined; with few cells each carries its value."""
  matrix = np.asarray(relation_cube)[client]              # [L, K]
  num_layers, num_clients = matrix.shape
  fig = Figure(figsize=(max(5.0, min(12.0, 1.5 + 0.6 * num_clients)),
                        1.6 + 0.5 * num_layers), layout="constrained")
  ax = fig.add_subplot(1, 1, 1)
  image = ax.imshow(matrix, cmap="viridis", aspect="auto", interpolation="nearest")
  fig.colorbar(image, ax=ax, shrink=0.9, label="r (weight on client j)")
  if num_layers * num_clients <= 200:
    low, high = image.get_clim()
    for (l, j), value in np.ndenumerate(matrix):
      light = (value - low) / max(high - low, 1e-12) > 0.6  # dark text on the light end
      ax.text(j, l, f"{value:.2f}", ha="center", va="center", fontsize=7,
              color="black" if light else "white")
  ax.add_patch(Rectangle((client - 0.5, -0.5), 1.0, num_layers, fill=False,
                         edgecolor="tab:red", linewidth=2.0, label="own column (j = i)"))
  ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.25 if num_layers < 4 else -0.12),
            fontsize=7, frameon=False)
  name = client if client_ids is None else client_ids[client]
  ax.set_title(f"relation matrix of client {name}: r[layer, client]", fontsize=9)
  ax.set_xlabel("client j")
  ax.set_ylabel("layer (0: input)")
  ax.set_yticks(range(num_layers))
  _label_clients(ax.xaxis, client_ids, max_ticks=12)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig


def accuracy_curves_figure(history: Mapping[str, np.ndarray],
                           local_history: Mapping[str, np.ndarray] | None = None,
                           best_round: int | None = None, title: str = "") -> Figure:
  """Mean (over clients) validation and test accuracy per round; LOCAL's test dashed."""
  fig = Figure(figsize=(7.0, 4.2), layout="constrained")
  ax = fig.add_subplot()
  # Markers only where there are few rounds, so that short runs still show points.
  marker = "o" if len(history["test_acc"]) <= 30 else None
  for key, label in (("val_acc", "validation"), ("test_acc", "test")):
    curve = np.asarray(history[key]).mean(axis=1)
    ax.plot(np.arange(1, len(curve) + 1), curve, label=label, marker=marker, markersize=3)
  if local_history is not None:
    local = np.asarray(local_history["test_acc"]).mean(axis=1)
    ax.plot(np.arange(1, len(local) + 1), local, color="black", linestyle="--",
            linewidth=1.0, label="LOCAL test", marker=marker, markersize=3)
  if best_round is not None:
    ax.axvline(best_round, color="gray", linestyle=":", linewidth=1.0,
               label=f"best validation (round {best_round})")
  ax.set_xlabel("round")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
  ax.set_ylabel("mean accuracy over clients")
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right", fontsize=8)
  ax.set_title(title, fontsize=9)
  return fig


def save_figure(fig: Figure, path: str) -> str:
  fig.savefig(path, dpi=120)
  return path


def reproduced_table_figure(rows: list[Mapping], title: str = "") -> Figure:
  """Acc per algorithm (with its std over seeds), the paper's Acc beside it where known,
  LOCAL's Acc as a dashed line: the picture of experiments/reproduce.py's table."""
  names = [r["algorithm"] for r in rows]
  ours = np.array([np.nan if r["acc"] is None else r["acc"] for r in rows], float)
  errors = np.array([r.get("acc_std") or 0.0 for r in rows], float)
  paper = np.array([np.nan if r.get("paper_acc") is None else r["paper_acc"] for r in rows],
                   float)
  x = np.arange(len(rows))
  fig = Figure(figsize=(max(6.0, 0.5 * len(rows) + 2.0), 4.0), layout="constrained")
  ax = fig.add_subplot()
  ax.bar(x - 0.2, ours, 0.4, yerr=errors, label="ours", color=POSITIVE_COLOR)
  ax.bar(x + 0.2, paper, 0.4, label="paper", color="tab:orange")
  if "local" in names:
    ax.axhline(ours[names.index("local")], color="black", linestyle="--", linewidth=0.8,
               label="ours, LOCAL")
  finite = np.concatenate([ours[np.isfinite(ours)], paper[np.isfinite(paper)]])
  if finite.size:
    ax.set_ylim(max(0.0, finite.min() - 0.1), min(1.0, finite.max() + 0.05))
  ax.set_xticks(x, names, rotation=45, ha="right")
  ax.set_ylabel("mean client test accuracy")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  return fig


def plot_reproduced_table(rows: list[Mapping], title: str, path: str) -> str:
  return save_figure(reproduced_table_figure(rows, title), path)


def write_run_plots(workdir: str, results: Mapping, history: Mapping[str, np.ndarray],
                    artifacts: Mapping[str, np.ndarray],
                    local_history: Mapping[str, np.ndarray] | None = None) -> list[str]:
  """Writes the run's PNGs into workdir; returns their paths.

  `results` is the results.json document, `history` the per-round [R, K] arrays
  (history.npz), `artifacts` the algorithm's arrays (FEDORA: similarity, graph).
  """
  label = _run_label(results)
  written = []
  # results.json lists clients in the order of the history's and artifacts' client axis.
  client_ids = np.array([c["id"] for c in results["clients"]])
  # A LOCAL run is its own reference: every R-Acc is 0, so the bars would say nothing.
  if results["algorithm"] != "local":
    r_acc = np.array([np.nan if c["r_acc"] is None else c["r_acc"]
                      for c in results["clients"]])
    fig = relative_accuracy_figure(r_acc, relative_accuracy_title(results), client_ids)
    written.append(save_figure(fig, os.path.join(workdir, RELATIVE_ACCURACY_PNG)))
  if "similarity" in artifacts:
    fig = similarity_figure(artifacts["similarity"], artifacts.get("graph"), label,
                            client_ids)
    written.append(save_figure(fig, os.path.join(workdir, SIMILARITY_PNG)))
  if "relation_cube" in artifacts:
    fig = relation_figure(artifacts["relation_cube"], 0, label, client_ids)
    written.append(save_figure(fig, os.path.join(workdir, RELATION_PNG)))
  fig = accuracy_curves_figure(history, local_history, results["best_val"]["round"], label)
  written.append(save_figure(fig, os.path.join(workdir, ACCURACY_CURVES_PNG)))
  return written


def _load_npz(path: str) -> dict[str, np.ndarray] | None:
  if not os.path.isfile(path):
    return None
  with np.load(path) as npz:
    return dict(npz)


def write_plots_for_run_dir(workdir: str) -> list[str]:
  """Draws the plots of a run saved in workdir (results.json, history.npz, *.npy).

  LOCAL's curve comes from <workdir>/local/history.npz, where a run keeps the LOCAL
  reference it trained.
  """
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  artifacts = {name: np.load(os.path.join(workdir, f"{name}.npy"))
               for name in ("similarity", "graph", "relation_cube")
               if os.path.isfile(os.path.join(workdir, f"{name}.npy"))}
  return write_run_plots(workdir, results, _load_npz(os.path.join(workdir, "history.npz")),
                         artifacts, _load_npz(os.path.join(workdir, "local", "history.npz")))


if __name__ == "__main__":
  for run_dir in sys.argv[1:] or ["."]:
    for path in write_plots_for_run_dir(run_dir):
      print(path)
