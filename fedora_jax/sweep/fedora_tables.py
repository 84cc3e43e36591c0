"""FEDORA's Tables 1, 3, 4 and 5 (experiments/paper/fedora_tables.json) as sweeps.

Each table runs one dataset column: LOCAL (the reference of R-Acc and PTR) and every row
the paper prints, each one of our algorithms (RUNS: its settings), and beside the
paper's FEDORA row `fedora_paper`, FEDORA's equations as printed; Tables 4 and 5's
ablation rows are the `fedora` row with its similarity or lambda_k rule changed. A
column may run with settings of its own (its "flags": CIFAR-10's calibrated protocol)
unless the command line gives them. Where the paper leaves a rule open that moves some
rows (Table 3's client weights), the table states its rule ("weights_rule") and runs
those rows under the other reading too, `<row>_<suffix>` beside each ("other_reading").
Each row's workdir is <workdir>/seed<s>/<row>, and each row is scored against its seed's
LOCAL. The metric: the final round's Acc, R-Acc
and PTR, mean and std over seeds (fedora_render.py writes the table).
"""

import json
import os
from typing import Any, Mapping

import numpy as np

from fedora_jax import results as results_lib
from fedora_jax import sweep
from fedora_jax.algorithms import REFERENCE
from fedora_jax.config import ExperimentConfig
from fedora_jax.errors import ConfigError
from fedora_jax.settings import from_settings
from fedora_jax.sweep import fedora_render, paper_tables
from fedora_jax.sweep import tables
from fedora_jax.sweep.tables import PAPER_DIR, Request, Table, write_table

PAPER_TABLES = os.path.join(PAPER_DIR, "fedora_tables.json")
METRICS = ("acc", "r_acc", "ptr")


def evaluation_rule() -> str:
  """How every FEDORA table scores a row, and where that comes from."""
  with open(PAPER_TABLES) as f:
    return json.load(f)["_evaluation"]


def load_paper_tables() -> dict:
  """The paper's tables by name (fedora1, ...), as fedora_tables.json holds them."""
  with open(PAPER_TABLES) as f:
    return {name: table for name, table in json.load(f).items() if not name.startswith("_")}


TABLES = tuple(sorted(load_paper_tables()))

# The FEDORA settings an ablation row sets; the table owns them (the command leaves them
# out).
ROW_SETTINGS = ("fedora_similarity", "fedora_lambda_rule", "fedora_lambda_value")


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
EXTRA_ROWS = fedora_render.EXTRA_ROWS


def other_reading(table: str) -> dict | None:
  """The table's other reading of an open rule ({suffix, flags, what, why, rows}), if any."""
  return load_paper_tables()[table].get("other_reading")


def extra_rows(table: str) -> dict[str, str]:
  """The table's rows without a paper row of their own -> the paper row each sits by:
  EXTRA_ROWS, and `<row>_<suffix>` for each row of its other reading."""
  reading = other_reading(table)
  readings = {f"{row}_{reading['suffix']}": row for row in reading["rows"]} if reading else {}
  return {**EXTRA_ROWS, **readings}


def row_settings(table: str, row: str) -> dict[str, Any]:
  """A row's own settings: RUNS', or for an other-reading row its paper row's and the
  reading's flags."""
  if row in RUNS:
    return RUNS[row]
  reading = other_reading(table)
  assert reading is not None, row
  return {**RUNS[extra_rows(table)[row]], **reading["flags"]}


def table_rows(table: str) -> list[str]:
  """Every row the table prints, in the paper's order: LOCAL first (run as the reference
  even where the paper prints no LOCAL row), our extra rows after the row they sit by."""
  rows = [REFERENCE]
  for row in load_paper_tables()[table]["rows"]:
    if row != REFERENCE:
      rows.append(row)
    rows += [extra for extra, beside in extra_rows(table).items() if beside == row]
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


def column_settings(table: str, dataset: str, given: Mapping[str, Any]) -> dict[str, Any]:
  """The settings `dataset`'s column of `table` runs with (its "flags": CIFAR-10's
  calibrated protocol) that the command line's `given` settings leave out."""
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


def row_config(table: str, row: str, seed: int, base: Mapping[str, Any],
               given: Mapping[str, Any]) -> ExperimentConfig:
  """One row's config: the settings `base` (every flag's), the column's where the command
  line's `given` leaves them out, `given`, the row's own, the table's setting and `seed`."""
  dataset = given.get("dataset", base.get("dataset", "rmnist"))
  return from_settings({**base, **column_settings(table, dataset, given), **given,
                        **row_settings(table, row),
                        "setting": load_paper_tables()[table]["setting"], "seed": seed})


def row_workdir(workdir: str, seed: int, row: str) -> str:
  return os.path.join(workdir, f"seed{seed}", row)


def row_label(row: str, seed: int, number: int, total: int) -> str:
  """How a row's progress bar (or log lines) is named: "row 3/8 fedavg seed 0"."""
  return f"row {number}/{total} {row} seed {seed}"


def plan(table: str, rows: list[str], workdir: str, first_seed: int, seeds: int,
         base: Mapping[str, Any], given: Mapping[str, Any]) -> list[tuple[int, str, sweep.Row]]:
  """The sweep's rows (seed, row, its run), seed by seed, LOCAL first: each scored
  against its seed's LOCAL."""
  keys = [(seed, row) for seed in range(first_seed, first_seed + seeds) for row in rows]
  return [(seed, row, sweep.Row(
      row_label(row, seed, number, len(keys)), row_config(table, row, seed, base, given),
      row_workdir(workdir, seed, row), references=() if row == REFERENCE else (
          os.path.join(row_workdir(workdir, seed, REFERENCE), "results.json"),)))
          for number, (seed, row) in enumerate(keys, 1)]


def summarize(row: str, runs: list[sweep.RowRun], paper: dict,
              extra: Mapping[str, str] = EXTRA_ROWS, extra_note: str | None = None) -> dict:
  """Mean (and std over seeds) of a row's metrics beside the paper's numbers; `extra`:
  the table's rows without a paper row -> the row each sits by, `extra_note` what this
  one is, if it is one."""
  entry: dict[str, Any] = {"algorithm": row, "seeds": len(runs)}
  for m in METRICS:
    values = np.array([np.nan if getattr(r, m) is None else getattr(r, m) for r in runs],
                      float)
    entry[m] = None if np.isnan(values).all() else round(float(np.nanmean(values)), 4)
    entry[f"{m}_std"] = round(float(np.nanstd(values)), 4) if len(runs) > 1 else None
    entry[f"{m}_seeds"] = [None if np.isnan(v) else round(float(v), 4) for v in values]
  best = np.array([_best_val_acc(r.results) for r in runs], float)
  known = best[~np.isnan(best)]
  entry["best_val_acc"] = round(float(known.mean()), 4) if len(known) else None
  entry["best_val_acc_std"] = round(float(known.std()), 4) if len(known) > 1 else None
  entry.update(_paper_columns(row, paper, extra))
  if row in extra:
    entry["beside"] = extra[row]
    entry["extra_note"] = extra_note or fedora_render.EXTRA_NOTES[row]
  entry["round_seconds"] = round(float(np.median([r.round_seconds for r in runs])), 4)
  entry["wall_seconds"] = round(float(sum(r.wall_seconds for r in runs)), 1)
  entry["machine"] = results_lib.joined_machines(r.machine for r in runs)
  entry["results"] = [r.results for r in runs]
  return entry


def _best_val_acc(results_path: str) -> float:
  """Acc at the run's round of best mean validation accuracy (results.json's best_val)."""
  with open(results_path) as f:
    return json.load(f)["best_val"]["acc"]


def _paper_columns(row: str, paper: dict, extra: Mapping[str, str]) -> dict:
  entry = paper.get(extra.get(row, row), {})
  columns = {f"paper_{m}": entry.get(m) for m in METRICS}
  columns["paper_row"] = entry.get("label")
  columns["paper_source"] = entry.get("source")
  if entry.get("note"):
    columns["paper_note"] = entry["note"]
  if row in extra:
    columns["paper_source"] = f"{columns['paper_source']} (ours: not a paper row)"
  return columns


def table_summary(table: str, runs: dict[str, list[sweep.RowRun]], paper: dict) -> list[dict]:
  """The rows we ran in the paper's order, each (mean over seeds) beside the paper's."""
  extra, reading = extra_rows(table), other_reading(table)
  return [summarize(row, runs[row], paper, extra,
                    reading["what"] if reading and row not in EXTRA_ROWS else None)
          for row in table_rows(table) if runs.get(row)]


def rule_statement(table: str) -> str:
  """The table's evaluation rule, its rule where the paper leaves one open, and that
  rule's other reading."""
  paper_table, reading = load_paper_tables()[table], other_reading(table)
  parts = [evaluation_rule()]
  if "weights_rule" in paper_table:
    parts.append(f"weights rule: {paper_table['weights_rule']}")
  if reading:
    parts.append(f"<row>_{reading['suffix']}: {reading['what']}, beside the rows it moves"
                 f" ({reading['why']})")
  return "; ".join(parts)


def check_request(request: Request) -> None:
  """One-line ConfigErrors for what a FEDORA table decides itself."""
  if request.scored_clients != "all":
    raise ConfigError(f"--scored_clients picks whose accuracy {', '.join(paper_tables.TABLES)}"
                      f" average each round; --table={request.table} reports every client's")
  if request.columns:
    raise ConfigError(f"--columns picks the cells of {', '.join(paper_tables.TABLES)};"
                      f" --table={request.table} runs the --dataset column")
  if "fedora_variant" in request.given:
    raise ConfigError("reproduce picks each FEDORA row's variant (fedora: authors,"
                      " fedora_paper: paper); leave out --fedora_variant")
  reading = other_reading(request.table)
  if reading and set(reading["flags"]) & set(request.given):
    raise ConfigError(f"--table={request.table} runs its rows under both readings of"
                      f" {', '.join(f'--{name}' for name in reading['flags'])}; leave it out")
  owned = [f"--{name}" for name in ROW_SETTINGS if name in request.given]
  if owned:
    raise ConfigError(f"reproduce sets {', '.join(owned)} row by row (Tables 4 and 5's"
                      " ablations); leave them out")


def reproduce(request: Request, options: sweep.Options = sweep.Options()) -> Table:
  """Runs (or reads) every row of the table's column and writes the table (table.md,
  .json, .csv, .png) into the workdir."""
  check_request(request)
  dataset = request.given.get("dataset", request.base.get("dataset", "rmnist"))
  paper_table = load_paper_tables()[request.table]
  paper = load_paper_rows(request.table, dataset)
  column_flags = column_settings(request.table, dataset, request.given)
  rows = check_rows(list(request.rows), request.table)
  setting = paper_table["setting"]
  workdir = request.workdir or os.path.join("runs", f"reproduce_{request.table}_{dataset}")
  first_seed = tables.first_seed(request)
  planned = plan(request.table, rows, workdir, first_seed, request.seeds, request.base,
                 request.given)
  sweep.check_rows([row_run for _, _, row_run in planned])
  runs: dict[str, list[sweep.RowRun]] = {row: [] for row in rows}
  unfinished: dict[str, list[str]] = {row: [] for row in rows}  # "seed 1: not started"
  outcomes = sweep.run_configs([row_run for _, _, row_run in planned], options)
  for (seed, row, row_run), (results, _, why) in zip(planned, outcomes):
    if results is None:
      unfinished[row].append(sweep.seed_unfinished(seed, why or ""))
    else:
      runs[row].append(sweep.read_row_run(row_run.workdir, results=results))
  if not any(runs.values()):
    raise ConfigError(f"--finished_only: no row of --table={request.table} is finished in"
                      f" {workdir} (for these rows and seeds)")
  train = planned[0][2].config.train
  column = paper_table["datasets"][dataset]["column"]
  title = f"FEDORA Table {paper_table['table']} ({column}): {paper_table['caption']}"
  settings = (f"{dataset}, {setting}, {request.seeds} seed(s) from"
              f" {first_seed}, {train.rounds} rounds, {train.local_epochs} local epochs,"
              f" batch {train.batch_size}, lr {train.lr}; `{request.command}`")
  if request.finished_only:
    settings += f"; {sweep.FINISHED_ONLY_ROWS}"
  rule = rule_statement(request.table)
  settings += f"; {rule}"
  if column_flags:
    why = paper_table["datasets"][dataset]["flags_why"]
    settings += (f"; the column's own flags: "
                 f"{' '.join(f'--{k}={v}' for k, v in column_flags.items())} ({why})")
  summary = table_summary(request.table, runs, paper)
  for entry in summary if setting == "imbalanced" else []:
    entry["r_acc_by_distance"] = fedora_render.r_acc_by_distance(entry["results"])
  by_distance = bool(summary) and all(r.get("r_acc_by_distance") for r in summary)
  document = {"table": request.table, "title": title, "dataset": dataset,
              "setting": setting, "rounds": train.rounds,
              "seeds": list(range(first_seed, first_seed + request.seeds)),
              "command": request.command, "rule": rule, "rows": summary,
              "unfinished": {row: why for row, why in unfinished.items() if why}}
  markdown = fedora_render.format_markdown(title, settings, summary, request.seeds,
                                           document["unfinished"])
  if by_distance:
    markdown += "\n" + fedora_render.format_distance_section(summary)
  out = os.path.join(workdir, "table")
  write_table(out, document, markdown)
  fedora_render.write_csv(f"{out}.csv", summary)
  fedora_render.plot(summary, f"{title}\n{dataset}, {setting}, {len(document['seeds'])}"
                     f" seed(s), {train.rounds} rounds", f"{out}.png")
  return Table(document, markdown, workdir)
