"""Runs every row of a FEDORA paper table and prints ours beside the paper's numbers.

  python -m experiments.reproduce --table=fedora1 --dataset=rmnist        # Table 1
  python -m experiments.reproduce --table=fedora3 --dataset=rmnist        # Table 3
  python -m experiments.reproduce --table=fedora1 --seeds=3 --rounds=100  # mean +- std

Every row is one `experiments.main` run on the same split and seed, LOCAL first, then each
algorithm measured against it (--reference), so R-Acc and PTR compare like with like.
Each row keeps its own run directory <workdir>/seed<s>/<row> with checkpoints: a killed
sweep rerun with the same command resumes where it stopped. All run flags (--rounds,
--lr, --<algorithm>_<field>, ...) pass through to every row.

Writes <workdir>/table.md, table.json and table.png. The paper's numbers are data, in
experiments/paper/fedora_tables.json, each with the table it comes from.
"""

import json
import logging
import os
import sys

from absl import app, flags

import numpy as np

from experiments import flags as run_flags
from experiments import main as main_lib
from fedora_jax import plots
from fedora_jax.errors import ConfigError

FLAGS = run_flags.FLAGS
PAPER_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper",
                            "fedora_tables.json")

# Table 1 / Table 3 rows, in the paper's order; "fedora_authors" is FEDORA as the
# authors' public code runs it, the row that shows where the paper's number comes from.
ROWS = ("local", "fedavg", "fedavg_ft", "fedprox", "fedprox_ft", "lg_fedavg", "fedper",
        "pfedhn", "apfl", "ditto", "ifca", "fesem", "fedfomo", "fedu", "fedamp", "fedora",
        "fedora_authors")
TABLES = {"fedora1": "balanced", "fedora3": "imbalanced"}
METRICS = ("acc", "r_acc", "ptr")

flags.DEFINE_enum("table", "fedora1", sorted(TABLES),
                  "fedora1: Table 1 (balanced); fedora3: Table 3 (imbalanced).")
flags.DEFINE_integer("seeds", 1, "Run seeds --seed .. --seed+N-1 and report mean and std.",
                     lower_bound=1)
flags.DEFINE_list("rows", list(ROWS), "Rows to run (default: all of the table's).")


def load_paper_rows(table: str, dataset: str) -> dict:
  with open(PAPER_TABLES) as f:
    tables = json.load(f)
  return tables[table]["datasets"].get(dataset, {}).get("rows", {})


def row_algorithm(row: str) -> tuple[str, str]:
  """The registry algorithm and FEDORA variant a row runs."""
  if row == "fedora_authors":
    return "fedora", "authors"
  return row, "paper"


def run_row(row: str, seed: int, workdir: str, reference: str | None) -> dict:
  """One row: experiments.main with this row's algorithm, its own workdir and LOCAL."""
  algorithm, variant = row_algorithm(row)
  FLAGS.algorithm, FLAGS.fedora_variant, FLAGS.seed = algorithm, variant, seed
  FLAGS.workdir = os.path.join(workdir, f"seed{seed}", row)
  FLAGS.reference = reference
  logging.info("table row %s, seed %d -> %s", row, seed, FLAGS.workdir)
  results = main_lib.run()
  with open(os.path.join(FLAGS.workdir, "timing.json")) as f:
    timing = json.load(f)
  # Over every process that trained this row (a sweep extended from checkpoints); files
  # written before timing.json had segments know only their own process.
  return {**{m: results[m] for m in METRICS},
          "wall_seconds": timing.get("seconds_all", timing["train_seconds"]),
          "round_seconds": timing.get("round_seconds_all", timing["round_seconds"]),
          "results": os.path.join(FLAGS.workdir, "results.json")}


def summarize(row: str, runs: list[dict], paper: dict) -> dict:
  """Mean (and std over seeds) of a row's metrics beside the paper's numbers."""
  entry = {"algorithm": row, "seeds": len(runs)}
  for m in METRICS:
    values = np.array([np.nan if r[m] is None else r[m] for r in runs], float)
    entry[m] = None if np.isnan(values).all() else round(float(np.nanmean(values)), 4)
    entry[f"{m}_std"] = round(float(np.nanstd(values)), 4) if len(runs) > 1 else None
  for m in METRICS:
    entry[f"paper_{m}"] = paper.get(row, {}).get(m)
  entry["paper_source"] = paper.get(row, {}).get("source")
  entry["round_seconds"] = round(float(np.median([r["round_seconds"] for r in runs])), 4)
  entry["wall_seconds"] = round(float(sum(r["wall_seconds"] for r in runs)), 1)
  entry["results"] = [r["results"] for r in runs]
  return entry


def _cell(value, std=None, signed=False) -> str:
  if value is None:
    return "—"
  value = round(value, 4) + 0.0  # no "-0.0000"
  text = f"{value:+.4f}" if signed else f"{value:.4f}"
  return text + (f" ± {std:.4f}" if std is not None else "")


def format_markdown(title: str, settings: str, rows: list[dict]) -> str:
  lines = [f"# {title}", "", settings, "",
           "| algorithm | acc | r_acc | ptr | paper_acc | paper_r_acc | paper_ptr |"
           " s/round | wall s |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    r_acc = None if r["algorithm"] == "local" else r["r_acc"]
    ptr = None if r["algorithm"] == "local" else r["ptr"]
    lines.append(
        f"| {r['algorithm']} | {_cell(r['acc'], r['acc_std'])} |"
        f" {_cell(r_acc, r['r_acc_std'], signed=True)} | {_cell(ptr, r['ptr_std'])} |"
        f" {_cell(r['paper_acc'])} | {_cell(r['paper_r_acc'], signed=True)} |"
        f" {_cell(r['paper_ptr'])} | {r['round_seconds']:.3f} | {r['wall_seconds']:.0f} |")
  lines += ["", "acc: mean per-client test accuracy at the final round; r_acc: mean relative"
            " accuracy against LOCAL on the same split and seed; ptr: fraction of clients"
            " at or above LOCAL. — : the paper's number is not in"
            " experiments/paper/fedora_tables.json. s/round: median round time (rounds-"
            "weighted over the processes that trained the row, when extended from"
            " checkpoints); wall s: its compile and training time, summed over them."]
  return "\n".join(lines) + "\n"


def command_line() -> str:
  return " ".join(["python -m experiments.reproduce", *sys.argv[1:]])


def check_rows(rows: list[str]) -> list[str]:
  unknown = [r for r in rows if r not in ROWS]
  if unknown:
    raise ConfigError(f"unknown --rows {', '.join(unknown)}; known: {', '.join(ROWS)}")
  # LOCAL is every other row's reference, so it always runs first.
  return ["local"] + [r for r in ROWS if r in rows and r != "local"]


def reproduce() -> dict:
  rows = check_rows(FLAGS.rows)
  FLAGS.setting = TABLES[FLAGS.table]
  for row in rows:  # bad hyperparameters fail now, not an hour into the sweep
    algorithm, variant = row_algorithm(row)
    FLAGS.fedora_variant = variant
    run_flags.plugged_config(algorithm)
  workdir = FLAGS.workdir or os.path.join("runs", f"reproduce_{FLAGS.table}_{FLAGS.dataset}")
  paper = load_paper_rows(FLAGS.table, FLAGS.dataset)
  first_seed = FLAGS.seed
  runs = {row: [] for row in rows}
  for seed in range(first_seed, first_seed + FLAGS.seeds):
    for row in rows:
      reference = None if row == "local" else runs["local"][-1]["results"]
      runs[row].append(run_row(row, seed, workdir, reference))
  with open(PAPER_TABLES) as f:
    title = json.load(f)[FLAGS.table]["title"]
  summary = [summarize(row, runs[row], paper) for row in rows]
  settings = (f"{FLAGS.dataset}, {FLAGS.setting}, {summary[0]['seeds']} seed(s) from"
              f" {first_seed}, {FLAGS.rounds} rounds, {FLAGS.local_epochs} local epochs,"
              f" batch {FLAGS.batch_size}, lr {FLAGS.lr}; `{command_line()}`")
  document = {"table": FLAGS.table, "title": title, "dataset": FLAGS.dataset,
              "setting": FLAGS.setting, "rounds": FLAGS.rounds,
              "seeds": list(range(first_seed, first_seed + FLAGS.seeds)),
              "command": command_line(), "rows": summary}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "table.json"), "w") as f:
    json.dump(document, f, indent=2)
  markdown = format_markdown(title, settings, summary)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(markdown)
  plots.plot_reproduced_table(summary, title, os.path.join(workdir, "table.png"))
  print(markdown)
  print(f"table in {workdir}")
  return document


def main(argv):
  main_lib.run_command(argv, reproduce,
                       "interrupted (rerun the same command to resume the sweep)")


if __name__ == "__main__":
  app.run(main)
