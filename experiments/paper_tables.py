"""The other seed papers' tables, run here with the paper's number beside ours in every cell.

  python -m experiments.reproduce --table=coaching1 --data_dir=/path/to/data  # Table 1
  python -m experiments.reproduce --table=coaching2 --columns=mnist_0.1        # one cell
  python -m experiments.reproduce --table=fedala1 --seeds=3 --rounds=200
  python -m experiments.reproduce --table=fedala_ala
  python -m experiments.reproduce --table=confree2 --rows=local,fedala,fedala_confree

The tables are data: experiments/paper/{coaching,fedala,confree}_tables.json hold every
number the papers print (in percent, as printed), every setting a paper states with the
line it is on, and, where it states none, the value used here with where that came from
(the authors' code, PFLlib, or ours). Tables:
  coaching1   parameter coaching (Zhi et al., AAAI 2024) Table 1: 10 clients, all taking
              part, a random 10% of the data, Dirichlet alpha 0.1 / 0.3;
  coaching2   its Table 2: 100 clients over all the data, 10% sampled each round;
  fedala1     FedALA's (Zhang et al., AAAI 2023) main table: 20 clients, pathological and
              practical (Dirichlet) label skew, its 4-layer CNN;
  fedala_ala  FedALA's applicability table: each host with and without --ala, the
              improvement ours beside the paper's;
  confree2    ConFREE's Table 2: six hosts with and without --aggregation=confree at 20 /
              60 clients and 30% / 60% participation.
A table's columns are cells (a dataset with its partition, or a client count and
participation); --columns picks some (default: the table's default_columns, the data held
in shared/data with the paper's model); a column whose data or model this build lacks is
printed with the paper's numbers only and says why. Rows: --rows (default: every row that
runs here; a row whose algorithm or plug-in this build lacks is listed as not run, with the
reason). LOCAL always runs first, every other row's --reference; a row that changes a
setting LOCAL must share (another model, 2 local epochs) is scored against a LOCAL with its
settings, trained once by the first such row of the cell (row_reference).

The metric is the papers': the best accuracy over rounds, read from each run's per-round
test accuracies (history.npz, every client evaluated every round), over the rounds the
paper sampled (coaching: every round on MNIST / FMNIST, every 5th on CIFAR10, 10th on
CIFAR100); the mean over clients (coaching: "best mean accuracy") or weighted by test
samples (FedALA's and ConFREE's code: sum of correct over sum of test samples); mean and
population std over --seeds. Rows with a plug-in also report their improvement over the
host (ours: per seed, then averaged) beside the paper's (in a cell the paper did not run,
beside the gains of the paper cell its `imp_from` names: confree2's CIFAR-10 cells take
the poster's CIFAR-100 at the same C and P).

Each cell's settings are set by reproduce (flags); a run flag given on the command line
(--rounds, --lr, --num_clients, ...) overrides the table's value for every row and the
output names each such departure (fewer rounds than the paper ran included). The flags that
pick a column or a row (--dataset, --partition, --dirichlet_alpha, --classes_per_client,
--algorithm, --ala, --aggregation) are refused. Each row keeps its run directory
<workdir>/<column>/seed<s>/<row>: a killed sweep resumes, a row finished there is read
and not run again (with or without its checkpoints: main.finished_results), and a
directory holding other settings is refused before anything trains.

Writes <workdir>/<table>.md, <table>.json, <table>.csv (a line per cell and row),
<table>.png (per column, ours beside the paper per row) and <table>_curves.png (per column,
each row's accuracy per round, the metric's curve), named by the table because tables
share a workdir (fedala_ala's hosts are fedala1's rows); and each column's own
<workdir>/<column>/<table>.md, which a later command over other columns, or at other
rounds, leaves alone. With --finished_only nothing trains: the table holds the rows
finished in the workdir so far, and every column that has one (the whole table of cells
run by separate commands, as scripts/run_rows.sh runs them).
"""

import csv
import json
import os
import sys
from typing import NamedTuple

import numpy as np

from experiments import cli
from experiments import flags as run_flags
from fedora_jax import algorithms
from fedora_jax import settings as settings_lib
from fedora_jax import metrics
from fedora_jax import plots
from fedora_jax import results as results_lib
from fedora_jax import sweep
from fedora_jax.errors import ConfigError
from fedora_jax.models import MODELS

FLAGS = run_flags.FLAGS
PAPER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper")
PAPER_FILES = ("coaching_tables.json", "fedala_tables.json", "confree_tables.json")
# --scored_clients: whose accuracies a round's mean takes (-> the metric's text).
SCORED_CLIENTS = {"all": "every client", "sampled": "only the clients sampled to train that round"}

# The flags that say which cell or row a run is: reproduce sets them, never the command.
COLUMN_FLAGS = ("dataset", "partition", "dirichlet_alpha", "classes_per_client")
ROW_FLAGS = ("algorithm", "ala", "aggregation")  # and the row algorithm's own <name>_<field>
# Run flags that leave what a row computes alone (where files are, how fast, how loud);
# any other one on the command line is reported as a departure from the paper.
def neutral(flag: str) -> bool:
  """Whether a run flag leaves what a row computes alone: not a setting of the config
  (--workdir, --verbose), one outside a run's identity (--data_dir, --client_chunk), or
  the seed and the data's format, which reproduce reports otherwise."""
  return (flag not in settings_lib.names() or settings_lib.outside(flag)
          or flag in ("seed", "data_source"))
REFERENCE_ROW = algorithms.REFERENCE
# What --finished_only's tables say of their rows (here and in reproduce's FEDORA tables).
FINISHED_ONLY_ROWS = ("rows: those finished in the workdir, read; none trained"
                      " (`--finished_only`: a sweep in progress)")


def seeds_finished(finished: int, seeds: int) -> str:
  return f"only {finished} of {seeds} seeds finished"


def seed_unfinished(seed: int, why: str) -> str:
  return f"seed {seed}: {why}"


def seeds_unfinished(whys: list[str] | None) -> str:
  """What a row's seeds not finished are, to follow its text: " (seed 1: not started)"."""
  return f" ({'; '.join(whys)})" if whys else ""


def not_finished(whys: list[str] | None) -> str:
  """A row with no seed finished: "not finished in the workdir (seed 0: not started)"."""
  return f"not finished in the workdir{seeds_unfinished(whys)}"


def load_tables() -> dict[str, dict]:
  """Table name -> the table as experiments/paper/*_tables.json hold it, each row given
  as {"row_of": table} resolved to that table's row of the same name."""
  tables = {}
  for name in PAPER_FILES:
    with open(os.path.join(PAPER_DIR, name)) as f:
      tables.update({k: v for k, v in json.load(f).items() if not k.startswith("_")})
  for table in tables.values():
    table["rows"] = {row: shared_row(tables, row, spec) for row, spec in table["rows"].items()}
  return tables


def shared_row(tables: dict[str, dict], row: str, spec: dict) -> dict:
  """A row another table also prints (fedala_ala's hosts are fedala1's rows): that row,
  its label, algorithm, flags and line, so the two run and are read alike; its note
  follows this table's own."""
  if "row_of" not in spec:
    return spec
  source = tables[spec["row_of"]]["rows"][row]
  notes = [n for n in (spec.get("note"), source.get("note")) if n]
  return {**source, **({"note": "; ".join(notes)} if notes else {})}


TABLES = tuple(load_tables())


def settings_flags(settings: list[dict]) -> dict[str, object]:
  """flag -> value of the settings that map to a flag."""
  return {s["flag"]: s["value"] for s in settings if "flag" in s}


def cell_flags(table: dict, column: str) -> dict[str, object]:
  """Every flag a run of the cell sets: the table's settings, then the column's."""
  spec = table["columns"][column]
  return {**settings_flags(table["settings"]), "dataset": spec["dataset"],
          **settings_flags(spec["settings"])}


def row_flags(table: dict, column: str, row: str) -> dict[str, object]:
  """The row's own flags in the cell: its algorithm, its plug-ins, its hyperparameters.
  A host with a plug-in runs with its host row's flags too, so the two differ by the
  plug-in alone."""
  spec = table["rows"].get(row, {"algorithm": row})
  host = table["rows"][spec["improves"]].get("flags", {}) if "improves" in spec else {}
  return {"algorithm": spec["algorithm"], **host, **spec.get("flags", {}),
          **table["columns"][column].get("row_flags", {}).get(row, {})}


def owned_flags(table: dict) -> tuple[str, ...]:
  """Every flag the table sets in some cell or row."""
  names = set(ROW_FLAGS)
  for column in table["columns"]:
    names.update(cell_flags(table, column))
    for row in table_rows(table):
      names.update(row_flags(table, column, row))
  return tuple(sorted(names))


def table_rows(table: dict) -> list[str]:
  """The rows in the paper's order, the LOCAL reference first (ours where the paper has
  no LOCAL row)."""
  return [REFERENCE_ROW] + [r for r in table["rows"] if r != REFERENCE_ROW]


def column_problem(table: dict, column: str) -> str | None:
  """Why the column cannot run in this build (None: it can): no dataset here, or a model
  not registered."""
  spec = table["columns"][column]
  if spec["dataset"] is None:
    return spec.get("note", "no --dataset here")
  model = cell_flags(table, column).get("model")
  if model is not None and model not in MODELS:
    return f"needs --model={model}, which this build does not register"
  return None


def row_problem(table: dict, row: str) -> str | None:
  """Why the row cannot run in this build (None: it can): its algorithm is not registered,
  or it does not take the row's plug-in."""
  if row == REFERENCE_ROW and row not in table["rows"]:
    return None
  spec = table["rows"][row]
  if spec["algorithm"] not in algorithms.REGISTRY:
    return f"{spec['algorithm']} is not registered in this build"
  flags = spec.get("flags", {})
  try:
    algorithms.check_plugins(spec["algorithm"], True if flags.get("ala") else None,
                             True if flags.get("aggregation") == "confree" else None)
  except ConfigError as e:
    return str(e)
  return None


def why_not_run(table: dict, column: str) -> str:
  """Why a column of the table was not run: it cannot run here, or its note, or it was
  not asked for."""
  return (column_problem(table, column) or table["columns"][column].get("note")
          or "not asked for (--columns)")


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


def check_command_line(table_name: str, table: dict, given: dict) -> dict[str, object]:
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


def other_given_flags(table: dict, given: dict) -> dict[str, object]:
  """Settings the command line gives that the table does not set (name -> value): each
  changes every row (say --hidden, --data_fraction where the paper uses all the data)."""
  owned = set(owned_flags(table))
  return {name: value for name, value in given.items()
          if name not in owned and not neutral(name)}


def row_config(table: dict, column: str, row: str, seed: int, base: dict, given: dict):
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
        directory = os.path.join(directory, algorithms.REFERENCE)
      found.append(os.path.join(directory, "results.json"))
  return tuple(found)


def row_workdir(workdir: str, column: str, seed: int, row: str) -> str:
  return os.path.join(workdir, column, f"seed{seed}", row)


class RowRun(NamedTuple):
  """One row's run in one cell, as its run directory holds it."""
  per_round: np.ndarray   # [R] the metric's accuracy over clients each round
  best: float             # the best over the sampled rounds (a fraction)
  best_round: int         # 1-based
  final: float            # the last round's
  round_seconds: float
  wall_seconds: float
  machine: str            # what trained it (results.machines)
  results: str            # results.json


def read_row_run(directory: str, weighting: str, sample_every: int,
                 scored_clients: str = "all") -> RowRun:
  """The row's best-round accuracy from its per-round test accuracies (history.npz) and
  clients' test sizes (results.json), with its timing. `scored_clients`: "all" averages
  every client each round; "sampled" only the clients that trained that round (their
  local steps in history.npz), which differs from "all" under partial participation."""
  with open(os.path.join(directory, "results.json")) as f:
    results = json.load(f)
  with np.load(os.path.join(directory, "history.npz")) as history:
    test_acc = history["test_acc"]
    scored = None
    if scored_clients == "sampled":
      if "local_steps" not in history:
        raise ConfigError(f"{directory}: history.npz has no local_steps, so the clients"
                          " each round sampled are not known; run the row again")
      scored = history["local_steps"] > 0
      if not scored.any(axis=1).all():
        raise ConfigError(f"{directory}: a round trained no client, so"
                          " --scored_clients=sampled has nothing to score in it")
  n_test = np.array([c["n_test"] for c in results["clients"]])
  per_round = metrics.accuracy_per_round(test_acc, n_test, weighting, scored)
  if np.isnan(per_round).any():
    raise ConfigError(f"{directory}: test was not scored every round (--eval_every > 1),"
                      " and this table's metric is the best round's; run the row again")
  best_round, best = metrics.best_sampled_round(per_round, sample_every)
  with open(os.path.join(directory, "timing.json")) as f:
    timing = json.load(f)
  return RowRun(per_round=per_round, best=best, best_round=best_round,
                final=float(per_round[-1]),
                **results_lib.run_cost(timing, results.get("platform")),
                results=os.path.join(directory, "results.json"))


def _rounded(value: float | None, places: int = 2) -> float | None:
  return None if value is None or not np.isfinite(value) else round(float(value) + 0.0, places)


def summarize_cell(table: dict, column: str, runs: dict[str, list[RowRun]],
                   seeds: int | None = None,
                   unfinished: dict[str, list[str]] | None = None) -> list[dict]:
  """Every row of the table in one cell, in its order: ours (percent, mean and population
  std over the seeds it has; None where it did not run) beside the paper's, with the
  improvement over its host for a plug-in row. A row of `runs` with fewer than `seeds`
  runs (a sweep in progress, read with --finished_only) says so, and what its other
  seeds are (`unfinished`: "seed 1: not started")."""
  unfinished = unfinished or {}
  paper = table["columns"][column]["values"]
  # A cell the paper did not run may borrow its plug-in gains from one it did (imp_from).
  imp_from = table["columns"][column].get("imp_from")
  paper_imps = table["columns"][imp_from]["values"] if imp_from else paper
  entries = []
  for row in table_rows(table):
    spec = table["rows"].get(row)
    ours = [100 * r.best for r in runs.get(row, [])]
    entry = {"row": row, "label": spec["label"] if spec else None,
             "paper_row": spec is not None, "seeds": len(ours),
             "acc": _rounded(np.mean(ours)) if ours else None,
             "acc_std": _rounded(np.std(ours)) if len(ours) > 1 else None,
             "acc_seeds": [_rounded(v) for v in ours],
             "paper_acc": paper.get(row, {}).get("mean"),
             "paper_std": paper.get(row, {}).get("std")}
    entry["diff"] = (_rounded(entry["acc"] - entry["paper_acc"])
                     if entry["acc"] is not None and entry["paper_acc"] is not None else None)
    host = spec.get("improves") if spec else None
    if host:
      pairs = list(zip(runs.get(row, []), runs.get(host, [])))
      entry["improves"] = host
      entry["imp"] = (_rounded(np.mean([100 * (a.best - b.best) for a, b in pairs]))
                      if pairs else None)
      entry["paper_imp"] = paper_imps.get(row, {}).get("imp")
    if ours:
      row_runs = runs[row]
      entry.update(
          best_round=[r.best_round for r in row_runs], rounds=len(row_runs[0].per_round),
          final_acc=_rounded(100 * np.mean([r.final for r in row_runs])),
          round_seconds=round(float(np.median([r.round_seconds for r in row_runs])), 4),
          wall_seconds=round(float(sum(r.wall_seconds for r in row_runs)), 1),
          machine=results_lib.joined_machines(r.machine for r in row_runs),
          results=[r.results for r in row_runs])
    else:
      entry["not_run"] = row_problem(table, row) or (
          not_finished(unfinished.get(row)) if row in runs else "not asked for (--rows)")
    if seeds and 0 < len(ours) < seeds:
      entry["partial"] = seeds_finished(len(ours), seeds) + seeds_unfinished(unfinished.get(row))
    entries.append(entry)
  return entries


def _imp_from_note(table: dict, column: str) -> str:
  imp_from = table["columns"][column].get("imp_from")
  return (f"; paper imp: the paper's {table['columns'][imp_from]['label']} gains"
          if imp_from else "")


def _cell(mean, std=None, signed=False) -> str:
  if mean is None:
    return "—"
  text = f"{mean:+.2f}" if signed else f"{mean:.2f}"
  return text + (f" ± {std:.2f}" if std is not None else "")


def _rounds_note(table: dict, column: str, rounds: int) -> str:
  paper_rounds = cell_flags(table, column).get("rounds")
  # The table's value, the paper's where it states one, else its authors' code's.
  settings = table["settings"] + table["columns"][column]["settings"]
  stated = [s for s in settings if s.get("flag") == "rounds"]
  whose = "the paper's" if stated and stated[-1].get("paper") is not None else \
      "the authors' code's"
  if paper_rounds is not None and rounds < paper_rounds:
    return f"{rounds} rounds, FEWER than {whose} {paper_rounds}"
  return f"{rounds} rounds ({whose}: {paper_rounds})"


def column_heading(table: dict, column: str) -> str:
  spec = table["columns"][column]
  flags = ", ".join(f"--{k}={v}" for k, v in settings_flags(spec["settings"]).items())
  return f"{spec['label']} (`--dataset={spec['dataset']}`, {flags})"


def format_markdown(title: str, table: dict, summary: dict[str, list[dict]],
                    settings: list[str], rounds: dict[str, int],
                    scored_clients: str = "all", not_run: dict[str, str] | None = None) -> str:
  """<table>.md: the settings, one table per column run (every row, ours beside the
  paper), then the paper's numbers of the columns not run, each with why (`not_run`;
  default why_not_run)."""
  lines = [f"# {title}", ""] + [f"- {s}" for s in settings] + [""]
  has_imp = any("improves" in spec for spec in table["rows"].values())
  for column, entries in summary.items():
    lines += [f"## {column_heading(table, column)}", "",
              f"{_rounds_note(table, column, rounds[column])}; paper:"
              f" {table['columns'][column]['paper_column']}{_imp_from_note(table, column)}",
              "",
              "| row | ours | paper | ours − paper |"
              + (" ours imp | paper imp |" if has_imp else "")
              + " best round | final | s/round | wall s | machine | paper's row |",
              "|---|---|---|---|" + ("---|---|" if has_imp else "") + "---|---|---|---|---|---|"]
    for e in entries:
      label = e["label"] or "— (ours: the LOCAL reference, not a paper row)"
      if "not_run" in e:
        label += f"; not run: {e['not_run']}"
      if "partial" in e:
        label += f"; {e['partial']}"
      imp = (f" {_cell(e.get('imp'), signed=True)} | {_cell(e.get('paper_imp'), signed=True)} |"
             if has_imp else "")
      best_round = ",".join(map(str, e.get("best_round", []))) or "—"
      timing = results_lib.cost_cells(e) if "round_seconds" in e else "— | — | —"
      lines.append(f"| {e['row']} | {_cell(e['acc'], e['acc_std'])} |"
                   f" {_cell(e['paper_acc'], e['paper_std'])} | {_cell(e['diff'], signed=True)} |"
                   f"{imp} {best_round} | {_cell(e.get('final_acc'))} | {timing} | {label} |")
    lines.append("")
  others = [c for c in table["columns"] if c not in summary]
  if others:
    lines += ["## The paper's numbers of the columns not run here", "",
              "| row | " + " | ".join(table["columns"][c]["label"] for c in others) + " |",
              "|---|" + "---|" * len(others)]
    for row, spec in table["rows"].items():
      cells = []
      for c in others:
        value = table["columns"][c]["values"].get(row, {})
        text = _cell(value.get("mean"), value.get("std"))
        if "imp" in value:
          text += f" ({value['imp']:+.2f})"
        cells.append(text)
      lines.append(f"| {row} | " + " | ".join(cells) + " |")
    why = not_run or {}
    lines += [""] + [f"- {table['columns'][c]['label']}: {why.get(c) or why_not_run(table, c)}"
                     for c in others] + [""]
  row_notes = [f"- {row}: {spec['note']}" for row, spec in table["rows"].items()
               if spec.get("note")]
  if row_notes:
    lines += ["Rows run other than at their algorithm's defaults:", ""] + row_notes + [""]
  over_clients = ("plain mean over clients" if table["metric"]["clients"] == "mean"
                  else "test-sample-weighted mean over clients")
  lines += [
      f"ours: {table['metric']['name']} in %, the best over the rounds the paper sampled of"
      f" the {over_clients}"
      f"{'' if scored_clients == 'all' else f' ({SCORED_CLIENTS[scored_clients]})'}"
      " of per-client test accuracy (history.npz), mean ± population std over seeds; paper:"
      f" {table['paper']}, {table['table']} (shared/papers/{table['text']}, lines"
      f" {table['lines']}); imp: the row's accuracy minus its host's (ours: per seed, then"
      " averaged); best round: per seed; final: the last round's, mean over seeds; s/round:"
      " median round time; wall s: compile and training time, summed over seeds; machine:"
      " what trained it (results.machines)."]
  return "\n".join(lines) + "\n"


CSV_COLUMNS = ("column", "row", "label", "seeds", "acc", "acc_std", "paper_acc",
               "paper_std", "diff", "imp", "paper_imp", "best_round", "rounds", "final_acc",
               "round_seconds", "wall_seconds", "machine", "not_run")


def write_csv(path: str, summary: dict[str, list[dict]]) -> None:
  """<table>.csv: a line per (column, row), empty where there is no value."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(CSV_COLUMNS)
    for column, entries in summary.items():
      for e in entries:
        e = {**e, "column": column,
             "best_round": ";".join(map(str, e.get("best_round", []))) or None}
        writer.writerow(["" if e.get(c) is None else e[c] for c in CSV_COLUMNS])


def table_title(table_name: str, table: dict, columns: list[str]) -> str:
  not_run = [table["columns"][c]["label"] for c in table["columns"] if c not in columns]
  title = f"{table['short']}, {table['table']} (--table={table_name}): {table['caption']}"
  if not_run:
    ran = ", ".join(table["columns"][c]["label"] for c in columns)
    title += (f" Columns this command ran: {ran}; the paper's numbers only here (run by"
              f" another command, or not at all): {', '.join(not_run)}.")
  return title


def setting_lines(table: dict, overrides: dict[str, object], others: dict[str, object],
                  first_seed: int, seeds: int, scored_clients: str = "all",
                  finished_only: bool = False) -> list[str]:
  """The table's settings with their sources, then what this run changed."""
  lines = []
  for s in table["settings"]:
    value = f" -> `--{s['flag']}={s['value']}`" if "flag" in s else ""
    lines.append(f"{s['setting']}: {s['paper'] if s['paper'] is not None else 'not stated'}"
                 f"{value} ({s['source']})")
  runs = table["metric"].get("runs")
  lines.append(f"seeds: {seeds} from {first_seed}"
               + (f" (the paper: {runs} runs)" if runs else ""))
  if scored_clients != "all":
    lines.append(f"clients scored each round: {SCORED_CLIENTS[scored_clients]} ->"
                 f" `--scored_clients={scored_clients}` (a reading the paper does not"
                 " state; the default scores every client every round)")
  if finished_only:
    lines.append(FINISHED_ONLY_ROWS)
  for name, value in overrides.items():
    lines.append(f"DEPARTURE from the table's settings: {_flag_text(name, value)} (command"
                 " line)")
  for name, value in others.items():
    lines.append(f"DEPARTURE: {_flag_text(name, value)} (command line; the table leaves it"
                 " at its default)")
  lines.append(f"command: `{command_line()}`")
  return lines


def _flag_text(name: str, value) -> str:
  if isinstance(value, (list, tuple)):
    value = ",".join(map(str, value))
  return f"--{name}={value}"


def command_line() -> str:
  return " ".join(["python -m experiments.reproduce", *sys.argv[1:]])


class CellRuns(NamedTuple):
  """column -> row -> its runs, one per seed; and, with --finished_only, column -> row ->
  what its seeds not finished are instead ("seed 1: not started")."""
  runs: dict[str, dict[str, list[RowRun]]]
  unfinished: dict[str, dict[str, list[str]]]


class Planned(NamedTuple):
  column: str
  seed: int
  row: str
  run: sweep.Row


def plan_rows(table: dict, columns: list[str], rows: list[str], first_seed: int,
              seeds: int, workdir: str, base: dict, given: dict) -> list[Planned]:
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
  runs: dict[str, dict[str, list[RowRun]]] = {p.column: {q.row: [] for q in plan}
                                              for p in plan}
  unfinished: dict[str, dict[str, list[str]]] = {p.column: {q.row: [] for q in plan}
                                                 for p in plan}
  for column, seed, row, row_run in plan:
    outcome = sweep.run_or_read(row_run, options)
    if outcome.results is None:  # --finished_only: not finished
      unfinished[column][row].append(seed_unfinished(seed, outcome.unfinished))
      continue
    spec = table["columns"][column]
    runs[column][row].append(read_row_run(row_run.workdir, table["metric"]["clients"],
                                          spec["sample_every"], scored_clients))
  return CellRuns(runs, unfinished)


def reproduce(table_name: str, wanted_columns: list[str], wanted_rows: list[str],
              seeds: int, scored_clients: str = "all", finished_only: bool = False) -> dict:
  """Runs the table's rows in its columns; writes and prints the table. Scored over only
  each round's sampled clients, its files are <table>_sampled.*, beside the default's.
  With `finished_only` it trains nothing: the table of the rows finished in the workdir
  (a sweep in progress), leaving out the columns with none."""
  table = load_tables()[table_name]
  base, given = run_flags.settings(), run_flags.given_settings()
  overrides = check_command_line(table_name, table, given)
  columns = pick_columns(table_name, table, wanted_columns)
  rows = pick_rows(table_name, table, wanted_rows)
  workdir = FLAGS.workdir or os.path.join("runs", f"reproduce_{table_name}")
  first_seed = FLAGS.seed
  plan = plan_rows(table, columns, rows, first_seed, seeds, workdir, base, given)
  sweep.check_rows([p.run for p in plan])
  runs, unfinished = run_cells(table, plan, scored_clients, cli.sweep_options(finished_only))
  columns = [c for c in columns if any(runs[c].values())]
  if not columns:
    raise ConfigError(f"--finished_only: no row of --table={table_name} is finished in"
                      f" {workdir} (for these columns, rows and seeds)")
  not_run = {c: ("no row finished in the workdir (--finished_only)" if c in runs
                 else why_not_run(table, c)) for c in table["columns"] if c not in columns}
  summary = {c: summarize_cell(table, c, runs[c], seeds, unfinished[c]) for c in columns}
  rounds = {c: len(next(r for r in runs[c].values() if r)[0].per_round) for c in columns}
  title = table_title(table_name, table, columns)
  settings = setting_lines(table, overrides, other_given_flags(table, given), first_seed,
                           seeds, scored_clients, finished_only)
  document = {"table": table_name, "title": title, "settings": settings,
              "seeds": list(range(first_seed, first_seed + seeds)),
              "command": command_line(), "metric": table["metric"],
              "scored_clients": scored_clients,
              "columns": {c: {"label": table["columns"][c]["label"],
                              "heading": column_heading(table, c), "rounds": rounds[c],
                              "paper_rounds": cell_flags(table, c).get("rounds"),
                              "rows": summary[c]} for c in columns},
              "finished_only": finished_only, "not_run": not_run}
  os.makedirs(workdir, exist_ok=True)
  name = table_name if scored_clients == "all" else f"{table_name}_{scored_clients}"
  out = os.path.join(workdir, name)
  with open(f"{out}.json", "w") as f:
    json.dump(document, f, indent=2)
  markdown = format_markdown(title, table, summary, settings, rounds, scored_clients, not_run)
  with open(f"{out}.md", "w") as f:
    f.write(markdown)
  for c in columns:
    with open(os.path.join(workdir, c, f"{name}.md"), "w") as f:
      f.write(format_markdown(table_title(table_name, table, [c]), table, {c: summary[c]},
                              settings, rounds, scored_clients))
  write_csv(f"{out}.csv", summary)
  labels = {c: f"{column_heading(table, c).replace('`', '')}; {_rounds_note(table, c, rounds[c])}"
            for c in columns}
  plots.save_figure(plots.paper_cells_figure(summary, labels, title), f"{out}.png")
  curves = {c: {r: np.mean([100 * run.per_round for run in runs[c][r]], axis=0)
                for r in rows if runs[c][r]} for c in columns}
  plots.save_figure(plots.table_curves_figure(curves, labels, title), f"{out}_curves.png")
  print(markdown)
  print(f"table in {out}.md (each column's in <column>/{name}.md)")
  return document
