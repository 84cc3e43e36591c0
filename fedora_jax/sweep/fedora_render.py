"""FEDORA's tables written: table.md (ours beside the paper's numbers, per row), table.csv,
table.png, and for the imbalanced tables each row's R-Acc by rotation distance from the
large client (the paper's Figure 3 claim in numbers)."""

import csv
import json
from typing import Any, cast

import numpy as np

from fedora_jax import metrics, plots
from fedora_jax import results as results_lib
from fedora_jax import sweep
from fedora_jax.algorithms import REFERENCE

METRICS = ("acc", "r_acc", "ptr")
# Our rows that have no paper row of their own -> the paper row they are compared with.
EXTRA_ROWS = {"fedora_paper": "fedora"}
# What each of them is, in the table's "paper's row" column.
EXTRA_NOTES = {"fedora_paper": "ours: the equations as printed"}


def _cell(value, std=None, signed=False) -> str:
  if value is None:
    return "—"
  value = round(value, 4) + 0.0  # no "-0.0000"
  text = f"{value:+.4f}" if signed else f"{value:.4f}"
  return text + (f" ± {std:.4f}" if std is not None else "")


def format_markdown(title: str, settings: str, rows: list[dict], seeds: int = 1,
                    unfinished: dict[str, list[str]] | None = None) -> str:
  """The table as markdown. `unfinished` (--finished_only): row -> what its seeds not
  finished are ("seed 1: not started"); a row with none finished is listed below."""
  unfinished = unfinished or {}
  lines = [f"# {title}", "", settings, "",
           "| algorithm | acc | r_acc | ptr | acc (best val) | paper_acc | paper_r_acc |"
           " paper_ptr | s/round | wall s | machine | paper's row |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    r_acc = None if r["algorithm"] == REFERENCE else r["r_acc"]
    ptr = None if r["algorithm"] == REFERENCE else r["ptr"]
    timing = results_lib.cost_cells(r)
    paper_row = r.get("paper_row") or "—"
    note = r.get("extra_note", EXTRA_NOTES.get(r["algorithm"]))
    if note:
      paper_row += f" ({note})"
    if r["seeds"] < seeds:  # --finished_only, a sweep in progress
      paper_row += (f"; ours: {sweep.seeds_finished(r['seeds'], seeds)}"
                    f"{sweep.seeds_unfinished(unfinished.get(r['algorithm']))}")
    lines.append(
        f"| {r['algorithm']} | {_cell(r['acc'], r['acc_std'])} |"
        f" {_cell(r_acc, r['r_acc_std'], signed=True)} | {_cell(ptr, r['ptr_std'])} |"
        f" {_cell(r.get('best_val_acc'), r.get('best_val_acc_std'))} |"
        f" {_cell(r['paper_acc'])} | {_cell(r['paper_r_acc'], signed=True)} |"
        f" {_cell(r['paper_ptr'])} | {timing} | {paper_row} |")
  shown = {r["algorithm"] for r in rows}
  left_out = [f"- {row}: {sweep.not_finished(why)}"
              for row, why in unfinished.items() if row not in shown]
  lines += [""] + left_out if left_out else []
  lines += ["", "acc: mean per-client test accuracy at the final round; acc (best val): at"
            " the round of best mean validation accuracy; r_acc: mean relative"
            " accuracy against LOCAL on the same split and seed; ptr: fraction of clients"
            " at or above LOCAL. paper_*: experiments/paper/fedora_tables.json; — : the"
            " paper prints none (LOCAL's R-Acc and PTR). s/round: median round time"
            " (rounds-weighted over the processes that trained the row, when extended"
            " from checkpoints); wall s: its compile and training time, summed over them;"
            " machine: what trained it (accelerator and count, or CPU devices and the"
            " cores the process could use; `cpu` or `gpu` alone: a row trained before"
            " timing.json named the machine)."]
  for r in rows:
    if r.get("paper_note"):
      lines.append(f"\npaper_acc of {r['algorithm']}: {r['paper_note']}.")
  return "\n".join(lines) + "\n"


def r_acc_by_distance(results_paths: list[str]) -> dict[str, list] | None:
  """{group: [clients, mean R-Acc_k over seeds]} for one row of an imbalanced table:
  metrics.relative_accuracy_by_distance on each seed's clients (results.json); None where
  the clients are not rotations."""
  per_seed = []
  for path in results_paths:
    with open(path) as f:
      clients = json.load(f)["clients"]
    if "angle" not in clients[0]:
      return None
    per_seed.append(metrics.relative_accuracy_by_distance(
        np.array([c["angle"] for c in clients]), np.array([c["n_train"] for c in clients]),
        np.array([np.nan if c["r_acc"] is None else c["r_acc"] for c in clients])))
  return {group: [per_seed[0][group][0],
                  metrics.defined_mean(np.array([np.nan if s[group][1] is None else s[group][1]
                                                 for s in per_seed]))]
          for group in metrics.ROTATION_DISTANCE_GROUPS}


def format_distance_section(rows: list[dict]) -> str:
  """table.md's check of the paper's Figure 3 claim, for the imbalanced tables."""
  counts = rows[0]["r_acc_by_distance"]
  lines = ["## R-Acc by rotation distance from the large client (the paper's Figure 3)", "",
           "Mean R-Acc_k of the other clients, by how far their rotation is from the large"
           " client's: near <= 30 degrees, middle 30-90, far >= 90 (the paper: Ditto and"
           " FedPer gain only on clients near the large one, FEDORA on all).", "",
           "| algorithm | " + " | ".join(f"{g} ({counts[g][0]} clients)"
                                          for g in metrics.ROTATION_DISTANCE_GROUPS) + " |",
           "|---|" + "---|" * len(metrics.ROTATION_DISTANCE_GROUPS)]
  for r in rows:
    if r["algorithm"] != REFERENCE:
      lines.append(f"| {r['algorithm']} | " + " | ".join(
          _cell(r["r_acc_by_distance"][g][1], signed=True)
          for g in metrics.ROTATION_DISTANCE_GROUPS) + " |")
  return "\n".join(lines) + "\n"


# table.csv: one line per row, ours (mean, std over seeds) and the paper's, then timing.
CSV_COLUMNS = ("algorithm", "seeds", *[f"{m}{s}" for m in METRICS for s in ("", "_std")],
               "best_val_acc", "best_val_acc_std", *[f"paper_{m}" for m in METRICS],
               "round_seconds", "wall_seconds",
               "machine", "paper_row", "paper_source")


def write_csv(path: str, rows: list[dict]) -> None:
  """table.csv: CSV_COLUMNS of every row, empty where there is no value (a single
  seed's std, a number the paper does not print)."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(CSV_COLUMNS)
    for r in rows:
      writer.writerow(["" if r.get(c) is None else r[c] for c in CSV_COLUMNS])


def plot(rows: list[dict], title: str, path: str) -> None:
  """table.png: each metric ours beside the paper's per row, error bars over seeds."""
  extra = {r["algorithm"]: r.get("beside") or EXTRA_ROWS[r["algorithm"]] for r in rows
           if r.get("beside") or r["algorithm"] in EXTRA_ROWS}
  plots.plot_reproduced_table(cast(Any, rows), title, path, extra)
