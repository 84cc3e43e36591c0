"""The other seed papers' tables as sweeps (paper_specs.py: the tables as data).

  python -m experiments.reproduce --table=coaching1 --data_dir=/path/to/data  # Table 1
  python -m experiments.reproduce --table=coaching2 --columns=mnist_0.1        # one cell
  python -m experiments.reproduce --table=confree2 --rows=local,fedala,fedala_confree

Columns: `columns` (default: the table's default_columns, the data held in shared/data
with the paper's model); a column whose data or model this build lacks keeps the
paper's numbers only, saying why. Rows: `rows` (default: every row that runs here).
LOCAL runs first in each cell, every other row's reference; a row that changes a setting
LOCAL must share (another model, 2 local epochs) is scored against a LOCAL with its
settings, trained once by the first such row of the cell (row_references).

The metric is the papers': the best accuracy over the rounds the paper sampled, from each
run's per-round test accuracies (sweep.BestRound), the mean over clients or weighted by
test samples, mean and population std over the seeds; a row with a plug-in also reports
its improvement over its host. A row's settings: the cell's, the row's, then the command
line's (`given`, each named in the table as a departure from the paper's); those that
pick a column or a row are refused. Each row's workdir is <workdir>/<column>/seed<s>/<row>.
Writes <workdir>/<table>.{md,json,csv,png} and <table>_curves.png, named by the table
because tables share a workdir (fedala_ala's hosts are fedala1's rows), and each column's
own <workdir>/<column>/<table>.md.
"""

import os
from typing import Any, Mapping, NamedTuple, cast

import numpy as np

from fedora_jax import plots
from fedora_jax import results as results_lib
from fedora_jax import settings as settings_lib
from fedora_jax import sweep
from fedora_jax.config import ExperimentConfig
from fedora_jax.errors import ConfigError
from fedora_jax.sweep import paper_render, paper_specs, tables
from fedora_jax.sweep.paper_specs import (COLUMN_FLAGS, REFERENCE_ROW, ROW_FLAGS,
                                          cell_flags, column_problem, load_tables,
                                          owned_flags, row_flags, row_problem, table_rows,
                                          why_not_run)
from fedora_jax.sweep.tables import Request, Table

TABLES = paper_specs.TABLES


def neutral(setting: str) -> bool:
  """Whether a setting leaves what a row computes alone: outside a run's identity
  (--data_dir, --client_chunk), or the seed and the data's format, which the table
  reports otherwise. Any other the command line gives is a departure from the paper."""
  return settings_lib.outside(setting) or setting in ("seed", "data_source")


def _check_wanted(table_name: str, kind: str, wanted: list[str], known: list[str],
                  problem_of) -> None:
  """A one-line ConfigError for a wanted column or row (`kind`) the table lacks, or one
  that `problem_of` says cannot run here."""
  unknown = [w for w in wanted if w not in known]
  if unknown:
    raise ConfigError(f"--table={table_name} has no {kind} {', '.join(unknown)}; its"
                      f" {kind}s: {', '.join(known)}")
  for name in wanted:
    problem = problem_of(name)
    if problem:
      raise ConfigError(f"--table={table_name} {kind} {name} cannot run here: {problem}")


def pick_columns(table_name: str, table: dict, wanted: list[str]) -> list[str]:
  """The columns to run, in the table's order: `wanted`, else its default columns; a
  one-line ConfigError for an unknown column or one that cannot run here."""
  known = list(table["columns"])
  _check_wanted(table_name, "column", wanted, known, lambda c: column_problem(table, c))
  chosen = set(wanted) or {c for c in table["default_columns"]
                           if column_problem(table, c) is None}
  return [c for c in known if c in chosen]


def pick_rows(table_name: str, table: dict, wanted: list[str]) -> list[str]:
  """The rows to run, LOCAL first: `wanted`, else every row that runs here; a one-line
  ConfigError for an unknown row or one that cannot run here."""
  known = table_rows(table)
  _check_wanted(table_name, "row", wanted, known, lambda r: row_problem(table, r))
  chosen = set(wanted) or {r for r in known if row_problem(table, r) is None}
  return [REFERENCE_ROW] + [r for r in known if r in chosen and r != REFERENCE_ROW]


def check_command_line(table_name: str, table: dict,
                       given: Mapping[str, Any]) -> dict[str, Any]:
  """The settings the command line gives (`given`) that override the table's (name ->
  value); a one-line ConfigError for one that picks a column or a row."""
  named = [name for name in COLUMN_FLAGS + ROW_FLAGS if name in given]
  if named:
    raise ConfigError(
        f"--table={table_name} sets {', '.join('--' + n for n in named)} itself, per column"
        " and row; pick columns with --columns (its columns:"
        f" {', '.join(table['columns'])}) and rows with --rows")
  if given.get("eval_every", 1) > 1:
    raise ConfigError(
        f"--eval_every: --table={table_name}'s metric is the best test accuracy over the"
        " rounds, so every round scores test; leave --eval_every at 1")
  return {name: given[name] for name in owned_flags(table)
          if name not in COLUMN_FLAGS + ROW_FLAGS and name in given}


def other_given_flags(table: dict, given: Mapping[str, Any]) -> dict[str, Any]:
  """Settings the command line gives that the table does not set (name -> value): each
  changes every row (say --hidden, --data_fraction where the paper uses all the data)."""
  owned = set(owned_flags(table))
  return {name: value for name, value in given.items()
          if name not in owned and not neutral(name)}


def row_config(table: dict, column: str, row: str, seed: int, base: Mapping[str, Any],
               given: Mapping[str, Any]) -> ExperimentConfig:
  """One row's config in one cell: the flags' settings (`base`), the cell's, the row's,
  then the command line's (`given`), and this seed."""
  return settings_lib.from_settings({**base, **cell_flags(table, column),
                                     **row_flags(table, column, row), **given, "seed": seed})


def local_settings(table: dict, column: str, row: str) -> tuple:
  """What a LOCAL reference must share with the row's run (results.REFERENCE_FLAGS), as
  the table sets it in the cell."""
  flags = {**cell_flags(table, column), **row_flags(table, column, row)}
  return tuple(flags.get(name) for name in results_lib.REFERENCE_FLAGS)


def row_references(table: dict, column: str, row: str, rows: list[str], seed: int,
                   workdir: str) -> tuple[str, ...]:
  """The LOCAL runs the row may be scored against (sweep.Row.references: the first
  finished by then serves), those of the cell and seed with the settings the row must
  share (local_settings): the cell's LOCAL, and the LOCAL an earlier row of `rows` with
  those settings trained beside it. So a row that changes such a setting (the coaching
  tables' FedBN on coaching_cnn_bn, the PFLlib tables' FedRep and FedPAC at 2 local
  epochs) trains its own LOCAL once, and FedRep, FedPAC and their plug-in rows share one.
  None for LOCAL itself; none finished: the row trains its own, so R-Acc always compares
  like with like."""
  if row == REFERENCE_ROW:
    return ()
  mine = local_settings(table, column, row)
  found = []
  for earlier in rows[:rows.index(row)]:
    if local_settings(table, column, earlier) == mine:
      directory = row_workdir(workdir, column, seed, earlier)
      if earlier != REFERENCE_ROW:
        directory = os.path.join(directory, REFERENCE_ROW)
      found.append(os.path.join(directory, "results.json"))
  return tuple(found)


def row_workdir(workdir: str, column: str, seed: int, row: str) -> str:
  return os.path.join(workdir, column, f"seed{seed}", row)


class CellRuns(NamedTuple):
  """column -> row -> its runs, one per seed; and, with --finished_only, column -> row ->
  what its seeds not finished are instead ("seed 1: not started")."""
  runs: dict[str, dict[str, list[sweep.RowRun]]]
  unfinished: dict[str, dict[str, list[str]]]


class Planned(NamedTuple):
  column: str
  seed: int
  row: str
  run: sweep.Row


def plan_rows(table: dict, columns: list[str], rows: list[str], first_seed: int,
              seeds: int, workdir: str, base: Mapping[str, Any],
              given: Mapping[str, Any]) -> list[Planned]:
  """Every row in every cell, LOCAL first in each."""
  keys = [(c, s, r) for c in columns for s in range(first_seed, first_seed + seeds)
          for r in rows]
  planned = []
  for number, (column, seed, row) in enumerate(keys, 1):
    label = f"{column} row {number}/{len(keys)} {row} seed {seed}"
    planned.append(Planned(column, seed, row, sweep.Row(
        label, row_config(table, column, row, seed, base, given),
        row_workdir(workdir, column, seed, row),
        row_references(table, column, row, rows, seed, workdir))))
  return planned


def run_cells(table: dict, plan: list[Planned], scored_clients: str,
              options: sweep.Options) -> CellRuns:
  """Each row of `plan` run, or read where it is finished; with options.train False,
  only read, and a row not finished has no run but says why."""
  runs: dict[str, dict[str, list[sweep.RowRun]]] = {
      p.column: {q.row: [] for q in plan} for p in plan}
  unfinished: dict[str, dict[str, list[str]]] = {p.column: {q.row: [] for q in plan}
                                                 for p in plan}
  outcomes = sweep.run_configs([p.run for p in plan], options)
  for (column, seed, row, row_run), outcome in zip(plan, outcomes):
    if outcome.results is None:  # --finished_only: not finished
      unfinished[column][row].append(sweep.seed_unfinished(seed, outcome.unfinished or ""))
      continue
    metric = sweep.BestRound(table["metric"]["clients"],
                             table["columns"][column]["sample_every"], scored_clients)
    runs[column][row].append(sweep.read_row_run(row_run.workdir, metric))
  return CellRuns(runs, unfinished)


def reproduce(request: Request, options: sweep.Options = sweep.Options()) -> Table:
  """Runs the table's rows in its columns and writes the table. Scored over only each
  round's sampled clients, its files are <table>_sampled.*, beside the default's. With
  request.finished_only it trains nothing: the table of the rows finished in the workdir
  (a sweep in progress), leaving out the columns with none."""
  table_name, seeds, scored_clients = request.table, request.seeds, request.scored_clients
  table = load_tables()[table_name]
  overrides = check_command_line(table_name, table, request.given)
  columns = pick_columns(table_name, table, list(request.columns))
  rows = pick_rows(table_name, table, list(request.rows))
  workdir = request.workdir or os.path.join("runs", f"reproduce_{table_name}")
  first_seed = tables.first_seed(request)
  plan = plan_rows(table, columns, rows, first_seed, seeds, workdir, request.base,
                   request.given)
  sweep.check_rows([p.run for p in plan])
  runs, unfinished = run_cells(table, plan, scored_clients, options)
  columns = [c for c in columns if any(runs[c].values())]
  if not columns:
    raise ConfigError(f"--finished_only: no row of --table={table_name} is finished in"
                      f" {workdir} (for these columns, rows and seeds)")
  not_run = {c: ("no row finished in the workdir (--finished_only)" if c in runs
                 else why_not_run(table, c)) for c in table["columns"] if c not in columns}
  summary = {c: paper_render.summarize_cell(table, c, runs[c], seeds, unfinished[c])
             for c in columns}
  rounds = {c: len(next(r for r in runs[c].values() if r)[0].per_round) for c in columns}
  title = paper_render.table_title(table_name, table, columns)
  settings = paper_render.setting_lines(
      table, overrides, other_given_flags(table, request.given), first_seed, seeds,
      request.command, scored_clients, request.finished_only)
  document = {"table": table_name, "title": title, "settings": settings,
              "seeds": list(range(first_seed, first_seed + seeds)),
              "command": request.command, "metric": table["metric"],
              "scored_clients": scored_clients,
              "columns": {c: {"label": table["columns"][c]["label"],
                              "heading": paper_render.column_heading(table, c),
                              "rounds": rounds[c],
                              "paper_rounds": cell_flags(table, c).get("rounds"),
                              "rows": summary[c]} for c in columns},
              "finished_only": request.finished_only, "not_run": not_run}
  name = table_name if scored_clients == "all" else f"{table_name}_{scored_clients}"
  out = os.path.join(workdir, name)
  markdown = paper_render.format_markdown(title, table, summary, settings, rounds,
                                          scored_clients, not_run)
  tables.write_table(out, document, markdown)
  for c in columns:
    with open(os.path.join(workdir, c, f"{name}.md"), "w") as f:
      f.write(paper_render.format_markdown(
          paper_render.table_title(table_name, table, [c]), table, {c: summary[c]},
          settings, rounds, scored_clients))
  paper_render.write_csv(f"{out}.csv", summary)
  labels = {c: f"{paper_render.column_heading(table, c).replace('`', '')};"
               f" {paper_render.rounds_note(table, c, rounds[c])}" for c in columns}
  plots.save_figure(plots.paper_cells_figure(cast(Any, summary), labels, title),
                    f"{out}.png")
  curves = {c: {r: np.mean([100 * run.per_round for run in runs[c][r]], axis=0)
                for r in rows if runs[c][r]} for c in columns}
  plots.save_figure(plots.table_curves_figure(curves, labels, title), f"{out}_curves.png")
  return Table(document, markdown, f"{out}.md (each column's in <column>/{name}.md)")
