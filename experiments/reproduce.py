"""Runs every row of a paper's table and prints ours beside the paper's numbers.

FEDORA's Tables 1, 3, 4 and 5 (below); the other seed papers' tables (parameter
coaching's Tables 1-2, FedALA's main and ALA tables, ConFREE's Table 2: --table=coaching1,
coaching2, fedala1, fedala_ala, confree2) are experiments/paper_tables.py's, whose
docstring says how they run.

  python -m experiments.reproduce --table=fedora1 --dataset=rmnist        # Table 1
  python -m experiments.reproduce --table=fedora1 --dataset=rfmnist --data_dir=...
  python -m experiments.reproduce --table=fedora3 --dataset=rmnist        # Table 3
  python -m experiments.reproduce --table=fedora4                         # Table 4
  python -m experiments.reproduce --table=fedora5                         # Table 5
  python -m experiments.reproduce --table=fedora1 --seeds=3 --rounds=100  # mean +- std

The tables (experiments/paper/fedora_tables.json, the paper's numbers as data):
  fedora1  Table 1, every method on balanced clients: rmnist, rfmnist, cifar10, yearbook,
           gtsrb (the paper's five image columns);
  fedora3  Table 3, every method with one client holding the rest of the training set
           (--setting=imbalanced): rmnist, rfmnist;
  fedora4  Table 4, FEDORA's client similarity replaced by a random, a parameter or a
           gradient similarity: rmnist, balanced;
  fedora5  Table 5, FEDORA with every lambda_k one constant (0.01, 0.1, 1, 10): rmnist,
           imbalanced.
A dataset the table does not report is refused. A column may run with flags of its own
(its "flags" in the JSON, each unless the command line gives it): CIFAR-10 runs the
calibrated protocol of docs/datasets.md, --split=authors --data_seed=42
--fixed_train_size=200, so that LOCAL lands at the paper's 0.7617. Every table also
runs LOCAL (the reference of R-Acc and PTR) and, beside the paper's FEDORA row,
`fedora_paper`: FEDORA's equations as printed (`--fedora_variant=paper`), compared with
the same paper row; the `fedora` row is the default, authors' variant, whose numbers the
paper reports.

The ablation rows of Tables 4 and 5 are the `fedora` row with one thing changed
(fedora_jax/algorithms/fedora.py): --fedora_similarity=random|parameters|gradients
(Table 4), or --fedora_lambda_rule=constant with --fedora_lambda_value=0.01|0.1|1|10
(Table 5). reproduce sets these flags row by row, so the command line leaves them out.

Every row is one `experiments.main` run on the same split and seed, LOCAL first, then each
algorithm measured against it (--reference), so R-Acc and PTR compare like with like.
Each row keeps its own run directory <workdir>/seed<s>/<row> with checkpoints: a killed
sweep rerun with the same command resumes where it stopped; a row directory holding a
run with other settings is refused before anything trains. --finished_only trains
nothing and writes the table of the rows finished so far (a sweep in progress, or cells
run by separate commands), each row's seeds those finished. All run flags (--rounds,
--lr, --<algorithm>_<field>, ...) pass through to every row.

Writes <workdir>/table.md, table.json, table.csv (a line per row: ours, mean and std over
seeds, the paper's, timing) and table.png (each metric ours beside the paper per row,
error bars over seeds). The imbalanced tables (3 and 5) add each row's mean R-Acc_k by
rotation distance from the large client, the paper's Figure 3 claim in numbers.
"""

import csv
import json
import os
import sys

from absl import app, flags

import numpy as np

from experiments import cli
from experiments import flags as run_flags
from experiments import paper_tables
from fedora_jax.algorithms import REFERENCE
from fedora_jax import metrics
from fedora_jax import plots
from fedora_jax import results as results_lib
from fedora_jax import settings as settings_lib
from fedora_jax import sweep
from fedora_jax.errors import ConfigError

FLAGS = run_flags.FLAGS
PAPER_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper",
                            "fedora_tables.json")
METRICS = ("acc", "r_acc", "ptr")


def load_paper_tables() -> dict:
  """The paper's tables by name (fedora1, ...), as experiments/paper/fedora_tables.json
  holds them."""
  with open(PAPER_TABLES) as f:
    return {name: table for name, table in json.load(f).items() if not name.startswith("_")}


TABLES = tuple(sorted(load_paper_tables()))


# The FEDORA settings an ablation row sets; reproduce owns them (the command leaves them
# out).
_ROW_FLAGS = ("fedora_similarity", "fedora_lambda_rule", "fedora_lambda_value")


def _similarity_row(measure: str) -> dict:
  """Table 4: the fedora row with W built from another client similarity."""
  return {"algorithm": "fedora", "fedora_variant": "authors", "fedora_similarity": measure}


def _constant_lambda_row(value: float) -> dict:
  """Table 5: the fedora row with lambda_k = `value` for every client."""
  return {"algorithm": "fedora", "fedora_variant": "authors",
          "fedora_lambda_rule": "constant", "fedora_lambda_value": value}


# The paper's rows that run as one of our algorithms with its own (paper) defaults.
_BASELINES = ("local", "fedavg", "fedavg_ft", "fedprox", "fedprox_ft", "lg_fedavg",
              "fedper", "pfedhn", "apfl", "ditto", "ifca", "fesem", "fedfomo", "fedu",
              "fedamp")
# Each row's own settings (fedora_jax/settings.py's names, the flags').
RUNS = {**{row: {"algorithm": row} for row in _BASELINES},
        # The variant whose numbers the paper reports: the default of --algorithm=fedora.
        "fedora": {"algorithm": "fedora", "fedora_variant": "authors"},
        # Ours, not a paper row: the equations as printed, beside the paper's FEDORA row.
        "fedora_paper": {"algorithm": "fedora", "fedora_variant": "paper"},
        # Table 4's similarity measures and Table 5's constant lambda_k.
        "fedora_random_similarity": _similarity_row("random"),
        "fedora_parameter_similarity": _similarity_row("parameters"),
        "fedora_gradient_similarity": _similarity_row("gradients"),
        **{f"fedora_lambda_{value:g}": _constant_lambda_row(value)
           for value in (0.01, 0.1, 1.0, 10.0)}}
# Our rows that have no paper row of their own -> the paper row they are compared with.
EXTRA_ROWS = {"fedora_paper": "fedora"}

flags.DEFINE_enum("table", "fedora1", TABLES + paper_tables.TABLES,
                  "fedora1: Table 1 (balanced, every method); fedora3: Table 3 (imbalanced);"
                  " fedora4: Table 4 (FEDORA's similarity measure); fedora5: Table 5"
                  " (FEDORA with a constant lambda_k); coaching1, coaching2: parameter"
                  " coaching's Tables 1 and 2; fedala1: FedALA's main table; fedala_ala:"
                  " FedALA's ALA applicability table; confree2: ConFREE's Table 2.")
flags.DEFINE_integer("seeds", 1, "Run seeds --seed .. --seed+N-1 and report mean and std.",
                     lower_bound=1)
flags.DEFINE_list("rows", [], "Rows to run (default: every row of the table; LOCAL always"
                  " runs).")
flags.DEFINE_enum("scored_clients", "all", list(paper_tables.SCORED_CLIENTS),
                  "coaching1, coaching2, fedala1, fedala_ala, confree2: whose test accuracy"
                  " a round's mean takes: every client's (all), or only the clients sampled"
                  " to train that round (sampled: history.npz's local_steps > 0; differs"
                  " only under partial participation). The sampled view's files are"
                  " <table>_sampled.*, beside the default's; its rows are the same runs.")
flags.DEFINE_bool("finished_only", False, "Train nothing: the table of the rows already"
                  " finished in --workdir (a sweep in progress, or one whose cells ran as"
                  " separate commands); a row not finished, or running in another process"
                  " now, is left out, saying which (\"seed 1: stopped after round 30 of"
                  " 50\").")
flags.DEFINE_list("columns", [], "coaching1, coaching2, fedala1, fedala_ala, confree2: the"
                  " columns (cells) to run (default: the table's columns on the data held"
                  " in shared/data). FEDORA's tables run the --dataset column.")


def table_rows(table: str) -> list[str]:
  """Every row the table prints, in the paper's order: LOCAL first (run as the reference
  even where the paper prints no LOCAL row), our extra rows after the row they sit by."""
  rows = [REFERENCE]
  for row in load_paper_tables()[table]["rows"]:
    if row != REFERENCE:
      rows.append(row)
    rows += [extra for extra, beside in EXTRA_ROWS.items() if beside == row]
  return rows


def load_paper_rows(table: str, dataset: str) -> dict:
  """Row -> {acc, r_acc, ptr, label, source}: the paper's numbers for `dataset`'s column
  of `table`; a ConfigError if the paper does not report that dataset there."""
  tables = load_paper_tables()
  paper = tables[table]
  if dataset not in paper["datasets"]:
    raise ConfigError(f"--table={table}: Table {paper['table']} reports"
                      f" {', '.join(paper['datasets'])}, not {dataset}")
  column = paper["datasets"][dataset]
  rows = {row: {**values, "label": paper["rows"][row],
                "source": f"Table {paper['table']}, {paper['rows'][row]} row,"
                          f" {column['column']}"}
          for row, values in column["values"].items()}
  if "local_from" in column:  # the table prints no LOCAL row; one of the same setting
    other = tables[column["local_from"]["table"]]
    rows[REFERENCE] = {**other["datasets"][dataset]["values"][REFERENCE], "label": "LOCAL",
                     "source": f"Table {other['table']}, LOCAL row, {column['column']}",
                     "note": f"Table {paper['table']} prints no LOCAL row; this is Table"
                             f" {other['table']}'s: {column['local_from']['why']}"}
  return rows


def column_settings(table: str, dataset: str, given: dict) -> dict[str, object]:
  """The settings `dataset`'s column of `table` runs with (its "flags" in
  experiments/paper/fedora_tables.json: CIFAR-10's calibrated protocol) that the command
  line's `given` settings leave out."""
  column = load_paper_tables()[table]["datasets"][dataset]
  return {name: value for name, value in column.get("flags", {}).items() if name not in given}


def check_rows(rows: list[str], table: str) -> list[str]:
  """The rows to run, in the table's order with LOCAL first; a ConfigError naming the
  rows a table has for an unknown one."""
  known = table_rows(table)
  unknown = [r for r in rows if r not in known]
  if unknown:
    raise ConfigError(f"--table={table} has no row {', '.join(unknown)}; its rows:"
                      f" {', '.join(known)}")
  wanted = set(rows) or set(known)
  # LOCAL is every other row's reference, so it always runs first.
  return [REFERENCE] + [r for r in known if r in wanted and r != REFERENCE]


def row_config(table: str, row: str, seed: int, base: dict, given: dict):
  """One row's config: the flags' settings (`base`, the command line's `given`), the
  column's where the command line leaves them out, the row's own, the table's setting
  and this seed."""
  paper_table = load_paper_tables()[table]
  dataset = given.get("dataset", base.get("dataset"))
  return settings_lib.from_settings({
      **base, **column_settings(table, dataset, given), **given, **RUNS[row],
      "setting": paper_table["setting"], "seed": seed})


def row_workdir(workdir: str, seed: int, row: str) -> str:
  return os.path.join(workdir, f"seed{seed}", row)


def row_label(row: str, seed: int, number: int, total: int) -> str:
  """How a row's progress bar (or log lines) is named: "row 3/8 fedavg seed 0"."""
  return f"row {number}/{total} {row} seed {seed}"


def run_row(row: sweep.Row, options: sweep.Options) -> tuple[dict | None, str | None]:
  """One row, read where finished and trained otherwise (with options.train False, only
  read). Returns its numbers, and None; or None and what it is instead ("not started":
  sweep.read_if_finished)."""
  results, read, unfinished = sweep.run_or_read(row, options)
  if results is None:
    return None, unfinished
  if read:
    results = results_lib.resummarize(results)  # written before a metric changed, maybe
  with open(os.path.join(row.workdir, "timing.json")) as f:
    timing = json.load(f)
  return {**{m: results[m] for m in METRICS},
          **results_lib.run_cost(timing, results.get("platform")),
          "results": os.path.join(row.workdir, "results.json")}, None


def _paper_entry(row: str, paper: dict) -> dict:
  return paper.get(EXTRA_ROWS.get(row, row), {})


def summarize(row: str, runs: list[dict], paper: dict) -> dict:
  """Mean (and std over seeds) of a row's metrics beside the paper's numbers."""
  entry = {"algorithm": row, "seeds": len(runs)}
  for m in METRICS:
    values = np.array([np.nan if r[m] is None else r[m] for r in runs], float)
    entry[m] = None if np.isnan(values).all() else round(float(np.nanmean(values)), 4)
    entry[f"{m}_std"] = round(float(np.nanstd(values)), 4) if len(runs) > 1 else None
    entry[f"{m}_seeds"] = [None if np.isnan(v) else round(float(v), 4) for v in values]
  entry.update(_paper_columns(row, paper))
  entry["round_seconds"] = round(float(np.median([r["round_seconds"] for r in runs])), 4)
  entry["wall_seconds"] = round(float(sum(r["wall_seconds"] for r in runs)), 1)
  entry["machine"] = results_lib.joined_machines(r["machine"] for r in runs)
  entry["results"] = [r["results"] for r in runs]
  return entry


def _paper_columns(row: str, paper: dict) -> dict:
  entry = _paper_entry(row, paper)
  columns = {f"paper_{m}": entry.get(m) for m in METRICS}
  columns["paper_row"] = entry.get("label")
  columns["paper_source"] = entry.get("source")
  if entry.get("note"):
    columns["paper_note"] = entry["note"]
  if row in EXTRA_ROWS:
    columns["paper_source"] = f"{columns['paper_source']} (ours: not a paper row)"
  return columns


def table_summary(table: str, runs: dict[str, list[dict]], paper: dict) -> list[dict]:
  """The rows we ran in the paper's order, each (mean over seeds) beside the paper's."""
  return [summarize(row, runs[row], paper) for row in table_rows(table) if runs.get(row)]


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
           "| algorithm | acc | r_acc | ptr | paper_acc | paper_r_acc | paper_ptr |"
           " s/round | wall s | machine | paper's row |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    r_acc = None if r["algorithm"] == REFERENCE else r["r_acc"]
    ptr = None if r["algorithm"] == REFERENCE else r["ptr"]
    timing = results_lib.cost_cells(r)
    paper_row = r.get("paper_row") or "—"
    if r["algorithm"] in EXTRA_ROWS:
      paper_row += " (ours: the equations as printed)"
    if r["seeds"] < seeds:  # --finished_only, a sweep in progress
      paper_row += (f"; ours: {paper_tables.seeds_finished(r['seeds'], seeds)}"
                    f"{paper_tables.seeds_unfinished(unfinished.get(r['algorithm']))}")
    lines.append(
        f"| {r['algorithm']} | {_cell(r['acc'], r['acc_std'])} |"
        f" {_cell(r_acc, r['r_acc_std'], signed=True)} | {_cell(ptr, r['ptr_std'])} |"
        f" {_cell(r['paper_acc'])} | {_cell(r['paper_r_acc'], signed=True)} |"
        f" {_cell(r['paper_ptr'])} | {timing} | {paper_row} |")
  shown = {r["algorithm"] for r in rows}
  left_out = [f"- {row}: {paper_tables.not_finished(why)}"
              for row, why in unfinished.items() if row not in shown]
  lines += [""] + left_out if left_out else []
  lines += ["", "acc: mean per-client test accuracy at the final round; r_acc: mean relative"
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
        [c["angle"] for c in clients], [c["n_train"] for c in clients],
        [np.nan if c["r_acc"] is None else c["r_acc"] for c in clients]))
  return {group: [per_seed[0][group][0],
                  metrics.defined_mean([np.nan if s[group][1] is None else s[group][1]
                                        for s in per_seed])]
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
               *[f"paper_{m}" for m in METRICS], "round_seconds", "wall_seconds",
               "machine", "paper_row", "paper_source")


def write_csv(path: str, rows: list[dict]) -> None:
  """table.csv: CSV_COLUMNS of every row, empty where there is no value (a single
  seed's std, a number the paper does not print)."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(CSV_COLUMNS)
    for r in rows:
      writer.writerow(["" if r.get(c) is None else r[c] for c in CSV_COLUMNS])


def command_line() -> str:
  return " ".join(["python -m experiments.reproduce", *sys.argv[1:]])


def plan(table: str, rows: list[str], workdir: str, first_seed: int, seeds: int,
         base: dict, given: dict) -> list[tuple[int, str, sweep.Row]]:
  """The sweep's rows (seed, row, its run), seed by seed, LOCAL first: each scored
  against its seed's LOCAL."""
  plan_ = [(seed, row) for seed in range(first_seed, first_seed + seeds) for row in rows]
  return [(seed, row, sweep.Row(
      row_label(row, seed, number, len(plan_)), row_config(table, row, seed, base, given),
      row_workdir(workdir, seed, row), references=() if row == REFERENCE else (
          os.path.join(row_workdir(workdir, seed, REFERENCE), "results.json"),)))
          for number, (seed, row) in enumerate(plan_, 1)]


def reproduce() -> dict:
  if FLAGS.table in paper_tables.TABLES:
    return paper_tables.reproduce(FLAGS.table, FLAGS.columns, FLAGS.rows, FLAGS.seeds,
                                  FLAGS.scored_clients, FLAGS.finished_only)
  if FLAGS.scored_clients != "all":
    raise ConfigError(f"--scored_clients picks whose accuracy {', '.join(paper_tables.TABLES)}"
                      f" average each round; --table={FLAGS.table} reports every client's")
  if FLAGS.columns:
    raise ConfigError(f"--columns picks the cells of {', '.join(paper_tables.TABLES)};"
                      f" --table={FLAGS.table} runs the --dataset column")
  if FLAGS["fedora_variant"].present:
    raise ConfigError("reproduce picks each FEDORA row's variant (fedora: authors,"
                      " fedora_paper: paper); leave out --fedora_variant")
  given = [f"--{name}" for name in _ROW_FLAGS if FLAGS[name].present]
  if given:
    raise ConfigError(f"reproduce sets {', '.join(given)} row by row (Tables 4 and 5's"
                      " ablations); leave them out")
  paper_table = load_paper_tables()[FLAGS.table]
  paper = load_paper_rows(FLAGS.table, FLAGS.dataset)
  base, given = run_flags.settings(), run_flags.given_settings()
  column_flags = column_settings(FLAGS.table, FLAGS.dataset, given)
  rows = check_rows(FLAGS.rows, FLAGS.table)
  setting = paper_table["setting"]
  workdir = FLAGS.workdir or os.path.join("runs", f"reproduce_{FLAGS.table}_{FLAGS.dataset}")
  first_seed = FLAGS.seed
  planned = plan(FLAGS.table, rows, workdir, first_seed, FLAGS.seeds, base, given)
  sweep.check_rows([row_run for _, _, row_run in planned])
  runs: dict[str, list] = {row: [] for row in rows}
  unfinished: dict[str, list] = {row: [] for row in rows}  # "seed 1: not started"
  options = cli.sweep_options(FLAGS.finished_only)
  for seed, row, row_run in planned:
    run, why = run_row(row_run, options)
    if run is not None:
      runs[row].append(run)
    else:
      unfinished[row].append(paper_tables.seed_unfinished(seed, why))
  train = planned[0][2].config.train
  if not any(runs.values()):
    raise ConfigError(f"--finished_only: no row of --table={FLAGS.table} is finished in"
                      f" {workdir} (for these rows and seeds)")
  summary = table_summary(FLAGS.table, runs, paper)
  for row in summary if setting == "imbalanced" else []:
    row["r_acc_by_distance"] = r_acc_by_distance(row["results"])
  by_distance = bool(summary) and all(r.get("r_acc_by_distance") for r in summary)
  column = paper_table["datasets"][FLAGS.dataset]["column"]
  title = f"FEDORA Table {paper_table['table']} ({column}): {paper_table['caption']}"
  settings = (f"{FLAGS.dataset}, {setting}, {FLAGS.seeds} seed(s) from"
              f" {first_seed}, {train.rounds} rounds, {train.local_epochs} local epochs,"
              f" batch {train.batch_size}, lr {train.lr}; `{command_line()}`")
  if FLAGS.finished_only:
    settings += f"; {paper_tables.FINISHED_ONLY_ROWS}"
  if column_flags:
    why = paper_table["datasets"][FLAGS.dataset]["flags_why"]
    settings += (f"; the column's own flags: "
                 f"{' '.join(f'--{k}={v}' for k, v in column_flags.items())} ({why})")
  document = {"table": FLAGS.table, "title": title, "dataset": FLAGS.dataset,
              "setting": setting, "rounds": train.rounds,
              "seeds": list(range(first_seed, first_seed + FLAGS.seeds)),
              "command": command_line(), "rows": summary,
              "unfinished": {row: why for row, why in unfinished.items() if why}}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "table.json"), "w") as f:
    json.dump(document, f, indent=2)
  markdown = format_markdown(title, settings, summary, FLAGS.seeds, document["unfinished"])
  if by_distance:
    markdown += "\n" + format_distance_section(summary)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(markdown)
  write_csv(os.path.join(workdir, "table.csv"), summary)
  plots.plot_reproduced_table(
      summary, f"{title}\n{FLAGS.dataset}, {setting}, {len(document['seeds'])}"
      f" seed(s), {train.rounds} rounds", os.path.join(workdir, "table.png"), EXTRA_ROWS)
  print(markdown)
  print(f"table in {workdir}")
  return document


# What --help lists after the docstring above.
__doc__ += cli.grouped_help({  # pylint: disable=redefined-builtin
    "the table": ("table", "dataset", "columns", "rows", "seeds", "seed", "rounds"),
    "where": ("data_dir", "workdir", "finished_only"),
    "output": ("log_every", "stall_timeout"),
}, "The flags of a sweep (--helpfull: all of them; every run flag passes through to each"
   " row):")


def main(argv):
  cli.run_command(argv, reproduce, "rerun the same command to resume the sweep")


if __name__ == "__main__":
  app.run(main)
