"""Figures of a finished run, written as PNG files next to its results.

  relative_accuracy.png  per-client R-Acc against LOCAL (FEDORA paper, Figure 3)
  similarity.png         FEDORA's client similarity and propagation graph, as heatmaps
  relation.png           coaching's relation matrix of client 0 (its Figure 2)
  accuracy_curves.png    mean validation and test accuracy per round (and LOCAL's)

Figures are built on `matplotlib.figure.Figure` directly, never through pyplot: saving
then always uses the Agg renderer, so nothing needs a display and the global backend
(e.g. a notebook's inline one) is left alone.

  python -m fedora_jax.plots RUN_DIR [RUN_DIR ...] [--out=PATH]  # runs overlaid: test
      accuracy per round (LOCAL dashed) and per-client R-Acc, labelled by algorithm
  python -m fedora_jax.plots --redraw RUN_DIR     # (re)draws the plots of a saved run
"""

import argparse
import json
import os
import sys
import textwrap
from typing import Mapping, NamedTuple

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator

from fedora_jax.algorithms import REFERENCE, variant_label
from fedora_jax.errors import ConfigError
from fedora_jax.results import plugin_labels, run_label, split_label

NEGATIVE_COLOR = "tab:red"    # R-Acc_k < 0: negative transfer
POSITIVE_COLOR = "tab:blue"   # R-Acc_k >= 0: at least as good as LOCAL (counts in PTR)
UNDEFINED_COLOR = "tab:gray"  # R-Acc_k undefined (LOCAL accuracy 0)

RELATIVE_ACCURACY_PNG = "relative_accuracy.png"
SIMILARITY_PNG = "similarity.png"
RELATION_PNG = "relation.png"  # coaching's relation matrix of one client
ACCURACY_CURVES_PNG = "accuracy_curves.png"
_LINESTYLES = ("-", "--", ":", "-.")


def curve_styles(count: int) -> list[tuple]:
  """(colour, line style) for `count` curves in one axes, no two alike: tab10 while ten
  suffice, tab20 up to twenty (tab10 alone gave a table's 11th row the 1st row's colour),
  then tab20 again with the next line style."""
  palette = ([f"C{i}" for i in range(10)] if count <= 10
             else list(matplotlib.color_sequences["tab20"]))
  if count > len(palette) * len(_LINESTYLES):
    raise ValueError(f"{count} curves: at most {len(palette) * len(_LINESTYLES)} are"
                     " told apart by colour and line style")
  return [(palette[i % len(palette)], _LINESTYLES[i // len(palette)]) for i in range(count)]


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
  """The run, the round, and its headline Acc / R-Acc / PTR (R-Acc undefined, None, where
  every client's LOCAL accuracy is 0)."""
  r_acc = "undefined" if results["r_acc"] is None else f"{100 * results['r_acc']:+.2f}%"
  return (f"{run_label(dict(results))}, final round {results['rounds']}\n"
          f"Acc {results['acc']:.4f} (LOCAL {results['local_acc']:.4f})"
          f"   R-Acc {r_acc}   PTR {results['ptr']:.3f}")


def similarity_figure(similarity: np.ndarray, graph: np.ndarray | None = None,
                      title: str = "", client_ids: np.ndarray | None = None) -> Figure:
  """Heatmaps (client x client) of the similarity and, beside it, the propagation graph."""
  panels = [("similarity (sum of cos of principal angles)", similarity,
             "sum of the cosines: 0 to p, p for the same subspace")]
  if graph is not None:
    panels.append(("propagation graph W", graph,
                   "edge weight (the authors' variant: exp(10 w), top-2 a row)"))
  fig = Figure(figsize=(5.2 * len(panels), 4.6), layout="constrained")
  for i, (name, matrix, meaning) in enumerate(panels):
    ax = fig.add_subplot(1, len(panels), i + 1)
    image = ax.imshow(np.asarray(matrix), cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.85, label=meaning)
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


def mean_per_round(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(rounds, means): the 1-based rounds of a per-round [R, K] score that hold values and
  their means over clients; a round scored by no client (test under --eval_every) is
  left out."""
  means = np.asarray(values, np.float64).mean(axis=1)
  rounds = np.arange(1, len(means) + 1)
  kept = ~np.isnan(means)
  return rounds[kept], means[kept]


def _marker(curve: np.ndarray) -> str | None:
  """Markers only on curves of few points, so that short or sparse ones still show."""
  return "o" if len(curve) <= 30 else None


def accuracy_curves_figure(history: Mapping[str, np.ndarray],
                           local_history: Mapping[str, np.ndarray] | None = None,
                           best_round: int | None = None, title: str = "") -> Figure:
  """Mean (over clients) validation and test accuracy per round; LOCAL's test dashed."""
  fig = Figure(figsize=(7.0, 4.2), layout="constrained")
  ax = fig.add_subplot()
  for key, label in (("val_acc", "validation"), ("test_acc", "test")):
    rounds, curve = mean_per_round(history[key])
    ax.plot(rounds, curve, label=label, marker=_marker(curve), markersize=3)
  if local_history is not None:
    rounds, local = mean_per_round(local_history["test_acc"])
    ax.plot(rounds, local, color="black", linestyle="--", linewidth=1.0, label="LOCAL test",
            marker=_marker(local), markersize=3)
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


OURS_COLOR = "tab:blue"
PAPER_COLOR = "tab:orange"
# reproduce's table panels: metric, axis label, scale (R-Acc in %).
TABLE_PANELS = (("acc", "Acc: mean client test accuracy", 1.0),
                ("r_acc", "R-Acc vs LOCAL (%)", 100.0),
                ("ptr", "PTR: share of clients >= LOCAL", 1.0))


def _values(rows: list[Mapping], key: str, scale: float = 1.0) -> np.ndarray:
  return np.array([np.nan if r.get(key) is None else scale * r[key] for r in rows], float)


def reproduced_table_figure(rows: list[Mapping], title: str = "",
                            extra_rows: Mapping[str, str] | None = None) -> Figure:
  """experiments/reproduce.py's table as a picture: one panel per metric (Acc, R-Acc,
  PTR), every row ours (mean over seeds, error bar: their std, dots: each seed) beside
  the paper's number. LOCAL has no R-Acc or PTR bars (it is their reference; the paper
  prints none); `extra_rows` (row -> the paper row it is compared with) are starred."""
  extra_rows = extra_rows or {}
  names = [r["algorithm"] + ("*" if r["algorithm"] in extra_rows else "") for r in rows]
  x = np.arange(len(rows))
  annotate = len(rows) <= 10  # values on the bars while they fit
  fig = Figure(figsize=(max(7.0, 0.55 * len(rows) + 2.5), 9.0), layout="constrained")
  axes = fig.subplots(len(TABLE_PANELS), 1, sharex=True)
  for ax, (metric, label, scale) in zip(axes, TABLE_PANELS):
    ours, paper = _values(rows, metric, scale), _values(rows, f"paper_{metric}", scale)
    errors = np.nan_to_num(_values(rows, f"{metric}_std", scale))
    if metric != "acc":  # LOCAL against itself: R-Acc 0, PTR 1 by definition
      is_local = np.array([r["algorithm"] == REFERENCE for r in rows])
      ours[is_local] = np.nan
      for xi in x[is_local]:
        ax.text(xi, 0.5, "the reference", transform=ax.get_xaxis_transform(),
                ha="center", va="center", fontsize=7, color="gray")
    # One seed has no spread: no error bars (their caps would read as a value).
    several = any(r.get(f"{metric}_std") is not None for r in rows)
    ax.bar(x - 0.2, ours, 0.4, color=OURS_COLOR,
           yerr=np.where(np.isfinite(ours), errors, 0.0) if several else None, capsize=3,
           label="ours (mean ± std over seeds)" if several else "ours")
    ax.bar(x + 0.2, paper, 0.4, color=PAPER_COLOR, label="paper")
    seeds_x, seeds_y = [], []
    for i, r in enumerate(rows):
      values = [scale * v for v in r.get(f"{metric}_seeds") or [] if v is not None]
      if len(values) > 1 and np.isfinite(ours[i]):
        seeds_x += [x[i] - 0.2] * len(values)
        seeds_y += values
    if seeds_x:
      ax.scatter(seeds_x, seeds_y, s=9, color="black", zorder=3, label="ours, one seed")
    if annotate:  # each value just past its bar's end (and error bar)
      for offset, bar_values, spread in ((-0.2, ours, errors), (0.2, paper, 0 * errors)):
        for xi, v, e in zip(x + offset, bar_values, spread):
          if np.isfinite(v):
            text = f"{round(v, 1) + 0.0:+.1f}" if metric == "r_acc" else f"{v:.3f}"
            ax.annotate(text,
                        (xi, v + e if v >= 0 else v - e), xytext=(0, 2 if v >= 0 else -8),
                        textcoords="offset points", ha="center", fontsize=6.5)
    finite = np.concatenate([ours[np.isfinite(ours)] + errors[np.isfinite(ours)],
                             ours[np.isfinite(ours)] - errors[np.isfinite(ours)],
                             paper[np.isfinite(paper)], seeds_y])
    if metric == "acc":
      if REFERENCE in [r["algorithm"] for r in rows]:
        ax.axhline(ours[[r["algorithm"] for r in rows].index(REFERENCE)], color="black",
                   linestyle="--", linewidth=0.8, label="ours, LOCAL")
      if finite.size:
        ax.set_ylim(max(0.0, finite.min() - 0.1), min(1.0, finite.max() + 0.06))
    elif metric == "r_acc":
      ax.axhline(0.0, color="black", linewidth=0.8)
      if finite.size:
        pad = 0.15 * max(np.abs(finite).max(), 1.0)
        ax.set_ylim(min(0.0, finite.min()) - pad, max(0.0, finite.max()) + pad)
    else:
      ax.set_ylim(0.0, 1.1)
    ax.set_ylabel(label, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=7)
  axes[-1].set_xticks(x, names, rotation=45 if len(rows) > 4 else 0,
                      ha="right" if len(rows) > 4 else "center")
  note = [f"{row}*: compared with the paper's {paper_row} row"
          for row, paper_row in extra_rows.items()
          if row in [r["algorithm"] for r in rows]]
  if note:
    axes[-1].set_xlabel("; ".join(note), fontsize=7)
  # A paper caption is long: wrapped to the figure's width (about 13 characters an inch).
  width = int(13 * fig.get_figwidth())
  fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")),
               fontsize=9)
  return fig


def plot_reproduced_table(rows: list[Mapping], title: str, path: str,
                          extra_rows: Mapping[str, str] | None = None) -> str:
  return save_figure(reproduced_table_figure(rows, title, extra_rows), path)


def _wrapped_title(fig: Figure, title: str) -> None:
  """A long caption wrapped to the figure's width (about 13 characters an inch)."""
  width = int(13 * fig.get_figwidth())
  fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")),
               fontsize=9)


def paper_cells_figure(cells: Mapping[str, list[Mapping]], labels: Mapping[str, str],
                       title: str = "") -> Figure:
  """The other papers' tables (fedora_jax/sweep/paper_tables.py) as a picture: one panel
  per column run (a dataset and partition, or a client count and participation), each
  row's accuracy in %
  ours (mean over seeds, error bar: their std, dots: each seed) beside the paper's.
  `cells`: column -> its rows (sweep.paper_render.summarize_cell); `labels`: column -> title."""
  columns = list(cells)
  fig = Figure(figsize=(max(7.0, 0.5 * max(len(r) for r in cells.values()) + 2.5),
                        3.2 * len(columns) + 1.2), layout="constrained")
  axes = np.atleast_1d(fig.subplots(len(columns), 1, squeeze=False)[:, 0])
  for ax, column in zip(axes, columns):
    rows = cells[column]
    x = np.arange(len(rows))
    ours, paper = _values(rows, "acc"), _values(rows, "paper_acc")
    errors = np.nan_to_num(_values(rows, "acc_std"))
    several = any(r.get("acc_std") is not None for r in rows)
    ax.bar(x - 0.2, ours, 0.4, color=OURS_COLOR, capsize=3,
           yerr=np.where(np.isfinite(ours), errors, 0.0) if several else None,
           label="ours (mean ± std over seeds)" if several else "ours")
    ax.bar(x + 0.2, paper, 0.4, color=PAPER_COLOR, label="paper")
    seeds_x = [x[i] - 0.2 for i, r in enumerate(rows) for _ in r.get("acc_seeds") or []
               if len(r.get("acc_seeds") or []) > 1]
    seeds_y = [v for r in rows for v in r.get("acc_seeds") or []
               if len(r.get("acc_seeds") or []) > 1]
    if seeds_x:
      ax.scatter(seeds_x, seeds_y, s=9, color="black", zorder=3, label="ours, one seed")
    for xi, (value, reference) in enumerate(zip(ours, paper)):
      for offset, v in ((-0.2, value), (0.2, reference)):
        if np.isfinite(v) and len(rows) <= 16:
          ax.annotate(f"{v:.1f}", (xi + offset, v), xytext=(0, 2),
                      textcoords="offset points", ha="center", fontsize=6)
      if not np.isfinite(value):
        ax.text(xi, 0.5, "not run", transform=ax.get_xaxis_transform(), ha="center",
                va="center", fontsize=7, color="gray", rotation=90)
    finite = np.concatenate([ours[np.isfinite(ours)], paper[np.isfinite(paper)]])
    ax.set_ylim(max(0.0, finite.min() - 10) if finite.size else 0.0, 105)
    ax.set_xticks(x, [r["row"] for r in rows], rotation=45 if len(rows) > 4 else 0,
                  ha="right" if len(rows) > 4 else "center", fontsize=7)
    ax.set_ylabel("accuracy, %", fontsize=8)
    ax.set_title(textwrap.fill(labels.get(column, column), 110), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
  handles, names = axes[0].get_legend_handles_labels()
  fig.legend(handles, names, loc="outside lower center", ncols=len(names), fontsize=7)
  _wrapped_title(fig, title)
  return fig


def table_curves_figure(curves: Mapping[str, Mapping[str, np.ndarray]],
                        labels: Mapping[str, str], title: str = "") -> Figure:
  """Each row's accuracy (%) per round, one panel per column: the curves the best-round
  metric is read from. `curves`: column -> row -> [R] (mean over seeds)."""
  columns = list(curves)
  fig = Figure(figsize=(9.0, 3.2 * len(columns) + 1.2), layout="constrained")
  axes = np.atleast_1d(fig.subplots(len(columns), 1, squeeze=False)[:, 0])
  for ax, column in zip(axes, columns):
    rows = [row for row in curves[column] if row != REFERENCE]
    styles = dict(zip(rows, curve_styles(len(rows))))
    styles[REFERENCE] = ("black", "--")
    for row, values in curves[column].items():
      rounds = np.arange(1, len(values) + 1)
      color, linestyle = styles[row]
      ax.plot(rounds, values, label=row, color=color, linestyle=linestyle,
              marker="." if len(values) <= 20 else None, linewidth=1.0)
    ax.set_xlabel("round", fontsize=8)
    ax.set_ylabel("accuracy, %", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(textwrap.fill(labels.get(column, column), 110), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncols=2, loc="lower right")
  _wrapped_title(fig, title)
  return fig


def write_run_plots(workdir: str, results: Mapping, history: Mapping[str, np.ndarray],
                    artifacts: Mapping[str, np.ndarray],
                    local_history: Mapping[str, np.ndarray] | None = None) -> list[str]:
  """Writes the run's PNGs into workdir; returns their paths.

  `results` is the results.json document, `history` the per-round [R, K] arrays
  (history.npz), `artifacts` the algorithm's arrays (FEDORA: similarity, graph).
  """
  label = run_label(dict(results))
  written = []
  # results.json lists clients in the order of the history's and artifacts' client axis.
  client_ids = np.array([c["id"] for c in results["clients"]])
  # A LOCAL run is its own reference: every R-Acc is 0, so the bars would say nothing;
  # a run without a reference (--reference=none) has none.
  if results["algorithm"] != REFERENCE and results["r_acc"] is not None:
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
  history = _load_npz(os.path.join(workdir, "history.npz"))
  if history is None:
    raise ConfigError(f"{workdir}: no history.npz (a run's per-round history)")
  return write_run_plots(workdir, results, history, artifacts,
                         _load_npz(os.path.join(workdir, REFERENCE, "history.npz")))


class SavedRun(NamedTuple):
  """A finished run as its directory holds it."""
  directory: str
  results: dict                                   # results.json
  history: dict[str, np.ndarray]                  # history.npz: [R, K] per key
  local_history: dict[str, np.ndarray] | None     # <dir>/local/history.npz, if kept there


def score_key(results: Mapping) -> str:
  """The per-client score's name: acc, or mae for a regression (fedora_jax/results.py)."""
  return "mae" if results.get("task") == "regression" else "acc"


def load_saved_run(directory: str) -> SavedRun:
  """The run in `directory`; a one-line ConfigError when it is not a finished run's."""
  if not os.path.isdir(directory):
    raise ConfigError(f"{directory}: no such directory")
  path = os.path.join(directory, "results.json")
  try:
    with open(path) as f:
      results = json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"{directory}: no results.json (not a finished run's directory)"
                      ) from None
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path}: not a results.json ({e})") from None
  missing = [k for k in ("algorithm", "clients", "rounds") if k not in results]
  if not isinstance(results, dict) or missing:
    raise ConfigError(f"{path}: not a results.json (no {', '.join(missing) or 'object'})")
  test = f"test_{score_key(results)}"
  try:
    history = _load_npz(os.path.join(directory, "history.npz"))
  except (OSError, ValueError) as e:
    raise ConfigError(f"{directory}/history.npz: unreadable ({e})") from None
  if history is None or test not in history:
    raise ConfigError(f"{directory}: no {test} in a history.npz (a run's per-round history)")
  local = None
  try:
    local = _load_npz(os.path.join(directory, REFERENCE, "history.npz"))
  except (OSError, ValueError):
    pass  # LOCAL's curve is an extra: the comparison goes on without it
  if local is not None and test not in local:
    local = None
  return SavedRun(directory, results, history, local)


def saved_run_label(results: Mapping) -> str:
  """The algorithm, its variant (where it has presets) and the plug-ins: "fedora
  (authors)", "fedavg + ala"."""
  label = results["algorithm"]
  fields = results.get(label)  # the config of an algorithm with presets (train.py)
  variant = variant_label(label, fields) if isinstance(fields, Mapping) else None
  if variant is not None:
    label += f" ({variant})"
  return " + ".join([label, *plugin_labels(results.get("plugins") or {})])


def _unique_labels(runs: list[SavedRun]) -> list[str]:
  """Each run's label, with its seed, then its data, then its directory where the
  labels so far are shared."""
  labels = [saved_run_label(run.results) for run in runs]
  for extra in (lambda r: f"seed {r.results.get('seed')}",
                lambda r: f"{r.results.get('dataset')} {r.results.get('setting')}",
                lambda r: os.path.basename(os.path.normpath(r.directory))):
    shared = {label for label in labels if labels.count(label) > 1}
    labels = [f"{label}, {extra(run)}" if label in shared else label
              for label, run in zip(labels, runs)]
  return labels


def comparison_figure(runs: list[SavedRun], title: str = "") -> Figure:
  """Several runs in one figure: mean test score per round (each run's LOCAL reference
  dashed in its colour, where its directory keeps one), and per-client R-Acc (R-MAE)
  against each run's own LOCAL."""
  tasks = {score_key(run.results) for run in runs}
  if len(tasks) > 1:
    raise ConfigError("cannot overlay classification and regression runs (accuracy"
                      " against MAE); pass runs of one kind")
  score = tasks.pop()
  labels = _unique_labels(runs)
  # a run's LOCAL is dashed in its colour, so runs differ by colour alone
  palette = [color for color, _ in curve_styles(min(len(runs), 20))]
  colors = [palette[i % len(palette)] for i in range(len(runs))]
  fig = Figure(figsize=(13.0, 4.8), layout="constrained")
  curves, clients = fig.subplots(1, 2, width_ratios=(1.0, 1.3))
  drawn_locals: list[np.ndarray] = []
  for run, label, color in zip(runs, labels, colors):
    rounds, curve = mean_per_round(run.history[f"test_{score}"])
    final = run.results.get(score)
    ours = f"{label}: {score} {final:.4f}" if isinstance(final, (int, float)) else label
    curves.plot(rounds, curve, color=color, marker=_marker(curve), markersize=3, label=ours)
    if run.local_history is not None:
      rounds, local = mean_per_round(run.local_history[f"test_{score}"])
      if not any(np.array_equal(local, seen) for seen in drawn_locals):  # shared LOCAL once
        drawn_locals.append(local)
        curves.plot(rounds, local, color=color, linestyle="--", linewidth=1.0)
  if drawn_locals:
    curves.plot([], [], color="gray", linestyle="--", linewidth=1.0,
                label="LOCAL reference (dashed, the run's colour)")
  curves.set_xlabel("round")
  curves.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
  curves.set_ylabel("mean test MAE over clients" if score == "mae"
                    else "mean test accuracy over clients")
  curves.grid(alpha=0.3)
  curves.legend(fontsize=7, loc="best")
  curves.set_title("mean test MAE per round" if score == "mae"
                   else "mean test accuracy per round", fontsize=9)

  # A LOCAL run is its own reference (R-Acc 0 everywhere): nothing to show on the right.
  relative = [(run, label, color) for run, label, color in zip(runs, labels, colors)
              if run.results["algorithm"] != REFERENCE]
  width = 0.8 / max(len(relative), 1)
  all_ids = sorted({c["id"] for run, _, _ in relative for c in run.results["clients"]})
  position = {client: i for i, client in enumerate(all_ids)}
  for i, (run, label, color) in enumerate(relative):
    ids = [c["id"] for c in run.results["clients"]]
    values = np.array([np.nan if c.get(f"r_{score}") is None else 100.0 * c[f"r_{score}"]
                       for c in run.results["clients"]])
    x = np.array([position[k] for k in ids]) - 0.4 + width * (i + 0.5)
    mean = run.results.get(f"r_{score}")
    text = f"{label}: R-{score.capitalize()} {100 * mean:+.2f}%" if isinstance(
        mean, (int, float)) else label
    if len(all_ids) * len(relative) <= 240:
      clients.bar(x, np.nan_to_num(values), width, color=color, label=text)
    else:  # too many bars to tell apart: a point per client
      clients.plot(x, values, "o", markersize=3, color=color, label=text)
  clients.axhline(0.0, color="black", linewidth=0.8)
  if relative:
    clients.set_xlim(-0.6, len(all_ids) - 0.4)
    _label_clients(clients.xaxis, np.array(all_ids), max_ticks=40)
    clients.tick_params(axis="x", labelsize=7)
    clients.legend(fontsize=7, loc="best")
  else:
    clients.text(0.5, 0.5, "only LOCAL runs: R-Acc is 0 by definition",
                 transform=clients.transAxes, ha="center", fontsize=8)
  clients.set_xlabel("client")
  clients.set_ylabel(f"R-{score.capitalize()} vs LOCAL (%)")
  clients.grid(axis="y", alpha=0.3)
  clients.set_title("per-client relative score against each run's LOCAL (below 0:"
                    " negative transfer)", fontsize=9)
  fig.suptitle(title or _shared_setting(runs), fontsize=10)
  return fig


def _shared_setting(runs: list[SavedRun]) -> str:
  """What the runs have in common, for the figure's title."""
  parts: list[str] = []
  for describe in (lambda r: r.get("dataset"), split_label,
                   lambda r: r.get("num_clients") and f"{r['num_clients']} clients",
                   lambda r: r.get("rounds") and f"{r['rounds']} rounds",
                   lambda r: r.get("seed") is not None and f"seed {r['seed']}"):
    values = {describe(run.results) for run in runs}
    value = describe(runs[0].results)
    if len(values) == 1 and value:
      parts.append(str(value))
  return ", ".join(parts)


def compare_runs(directories: list[str], out: str) -> str:
  """Draws comparison_figure of the runs in `directories` to `out`; returns its path."""
  runs = [load_saved_run(directory) for directory in directories]
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  return save_figure(comparison_figure(runs), out)


USAGE = """\
python -m fedora_jax.plots RUN_DIR [RUN_DIR ...] [--out=PATH]
    overlays the runs' accuracy curves and per-client R-Acc in one figure
    (default --out: comparison.png in the first RUN_DIR)
python -m fedora_jax.plots --redraw RUN_DIR [RUN_DIR ...]
    (re)draws each run's own plots into its directory"""


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m fedora_jax.plots", usage=USAGE,
                                   description=__doc__.split("\n")[0])
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument("--out", default=None,
                      help="where the comparison figure goes (a .png path; default:"
                           " comparison.png in the first RUN_DIR)")
  parser.add_argument("--redraw", action="store_true",
                      help="redraw each run's own plots instead of comparing them")
  args = parser.parse_args(argv)
  try:
    if args.redraw:
      for run_dir in args.run_dirs:
        load_saved_run(run_dir)  # the same one-line errors
        for path in write_plots_for_run_dir(run_dir):
          print(path)
    else:
      out = args.out or os.path.join(args.run_dirs[0], "comparison.png")
      print(compare_runs(args.run_dirs, out))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except OSError as e:  # e.g. --out in a folder we cannot write
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
