"""The other papers' tables written: <table>.md (per column run, each row ours beside the
paper's, with its best round, final accuracy and cost; the paper's numbers of the columns
not run), <table>.csv, <table>.png and <table>_curves.png."""

import csv
from typing import Any, cast

import numpy as np

from fedora_jax import results as results_lib
from fedora_jax import sweep
from fedora_jax.sweep.paper_specs import (cell_flags, row_problem, settings_flags,
                                          table_rows, why_not_run)


def _rounded(value: Any, places: int = 2) -> float | None:
  return None if value is None or not np.isfinite(value) else round(float(value) + 0.0, places)


def _best(run: sweep.RowRun) -> float:
  """The row's best-round accuracy (a fraction): read_row_run with a BestRound sets it."""
  return cast(float, run.best)


def summarize_cell(table: dict, column: str, runs: dict[str, list[sweep.RowRun]],
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
    ours = [100 * _best(r) for r in runs.get(row, [])]
    entry: dict[str, Any] = {"row": row, "label": spec["label"] if spec else None,
             "paper_row": spec is not None, "seeds": len(ours),
             "acc": _rounded(np.mean(ours)) if ours else None,
             "acc_std": _rounded(np.std(ours)) if len(ours) > 1 else None,
             "acc_seeds": [_rounded(v) for v in ours],
             "paper_acc": paper.get(row, {}).get("mean"),
             "paper_std": paper.get(row, {}).get("std")}
    if spec and spec.get("reading_of"):  # the row read under the table's other rule
      entry["reading_of"] = spec["reading_of"]
    entry["diff"] = (_rounded(entry["acc"] - entry["paper_acc"])
                     if entry["acc"] is not None and entry["paper_acc"] is not None else None)
    host = spec.get("improves") if spec else None
    if host:
      pairs = list(zip(runs.get(row, []), runs.get(host, [])))
      entry["improves"] = host
      entry["imp"] = (_rounded(np.mean([100 * (_best(a) - _best(b)) for a, b in pairs]))
                      if pairs else None)
      entry["paper_imp"] = paper_imps.get(row, {}).get("imp")
    if ours:
      row_runs = runs[row]
      entry.update(
          best_round=[r.best_round for r in row_runs], rounds=len(row_runs[0].per_round),
          final_acc=_rounded(100 * np.mean([cast(float, r.final) for r in row_runs])),
          round_seconds=round(float(np.median([r.round_seconds for r in row_runs])), 4),
          wall_seconds=round(float(sum(r.wall_seconds for r in row_runs)), 1),
          machine=results_lib.joined_machines(r.machine for r in row_runs),
          results=[r.results for r in row_runs])
    else:
      entry["not_run"] = row_problem(table, row) or (
          sweep.not_finished(unfinished.get(row)) if row in runs else "not asked for (--rows)")
    if seeds and 0 < len(ours) < seeds:
      entry["partial"] = (sweep.seeds_finished(len(ours), seeds)
                          + sweep.seeds_unfinished(unfinished.get(row)))
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


def rounds_note(table: dict, column: str, rounds: int) -> str:
  paper_rounds: Any = cell_flags(table, column).get("rounds")
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


def _other_reading(entries: list[dict], row: str) -> str:
  """The cell 'other reading' of `row`: the number of the row read under the other rule
  (a row whose spec says reading_of: row), with what it reads, or why it has none."""
  others = [e for e in entries if e.get("reading_of") == row]
  if not others:
    return ""
  cells = []
  for e in others:
    value = _cell(e["acc"], e["acc_std"]) if e["acc"] is not None else "not run"
    cells.append(f"{e['label']}: {value}" + (f" ({e['partial']})" if "partial" in e else ""))
  return "; ".join(cells)


def format_markdown(title: str, table: dict, summary: dict[str, list[dict]],
                    settings: list[str], rounds: dict[str, int],
                    scored_clients: str = "all", not_run: dict[str, str] | None = None) -> str:
  """<table>.md: the settings, one table per column run (every row, ours beside the
  paper), then the paper's numbers of the columns not run, each with why (`not_run`;
  default why_not_run)."""
  lines = [f"# {title}", ""] + [f"- {s}" for s in settings] + [""]
  has_imp = any("improves" in spec for spec in table["rows"].values())
  # Rows read under the table's other rule show in their row's column 'other reading'.
  has_other = any("reading_of" in spec for spec in table["rows"].values())
  for column, entries in summary.items():
    lines += [f"## {column_heading(table, column)}", "",
              f"{rounds_note(table, column, rounds[column])}; paper:"
              f" {table['columns'][column]['paper_column']}{_imp_from_note(table, column)}",
              "",
              "| row | ours | paper | ours − paper |"
              + (" other reading |" if has_other else "")
              + (" ours imp | paper imp |" if has_imp else "")
              + " best round | final | s/round | wall s | machine | paper's row |",
              "|---|---|---|---|" + ("---|" if has_other else "")
              + ("---|---|" if has_imp else "") + "---|---|---|---|---|---|"]
    for e in entries:
      if e.get("reading_of"):
        continue
      label = e["label"] or "— (ours: the LOCAL reference, not a paper row)"
      if "not_run" in e:
        label += f"; not run: {e['not_run']}"
      if "partial" in e:
        label += f"; {e['partial']}"
      imp = (f" {_cell(e.get('imp'), signed=True)} | {_cell(e.get('paper_imp'), signed=True)} |"
             if has_imp else "")
      best_round = ",".join(map(str, e.get("best_round", []))) or "—"
      timing = results_lib.cost_cells(e) if "round_seconds" in e else "— | — | —"
      other = f" {_other_reading(entries, e['row']) or '—'} |" if has_other else ""
      lines.append(f"| {e['row']} | {_cell(e['acc'], e['acc_std'])} |"
                   f" {_cell(e['paper_acc'], e['paper_std'])} | {_cell(e['diff'], signed=True)} |"
                   f"{other}{imp} {best_round} | {_cell(e.get('final_acc'))} | {timing} | {label} |")
    lines.append("")
  others = [c for c in table["columns"] if c not in summary]
  if others:
    lines += ["## The paper's numbers of the columns not run here", "",
              "| row | " + " | ".join(table["columns"][c]["label"] for c in others) + " |",
              "|---|" + "---|" * len(others)]
    for row in [r for r, spec in table["rows"].items() if "reading_of" not in spec]:
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
      f"{'' if scored_clients == 'all' else f' ({sweep.SCORED_CLIENTS[scored_clients]})'}"
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


def setting_lines(table: dict, overrides: dict[str, Any], others: dict[str, Any],
                  first_seed: int, seeds: int, command: str, scored_clients: str = "all",
                  finished_only: bool = False) -> list[str]:
  """The table's settings with their sources, then what this run changed."""
  lines = []
  for s in table["settings"]:
    value = f" -> `--{s['flag']}={s['value']}`" if "flag" in s else ""
    lines.append(f"{s['setting']}: {s['paper'] if s['paper'] is not None else 'not stated'}"
                 f"{value} ({s['source']})")
  evaluation = table.get("evaluation")
  if evaluation:
    lines.append(f"evaluation rule, every row: {evaluation['rule']}"
                 + (f"; {evaluation['other']}" if evaluation.get("other") else ""))
  runs = table["metric"].get("runs")
  lines.append(f"seeds: {seeds} from {first_seed}"
               + (f" (the paper: {runs} runs)" if runs else ""))
  if scored_clients != "all":
    lines.append(f"clients scored each round: {sweep.SCORED_CLIENTS[scored_clients]} ->"
                 f" `--scored_clients={scored_clients}` (a reading the paper does not"
                 " state; the default scores every client every round)")
  if finished_only:
    lines.append(sweep.FINISHED_ONLY_ROWS)
  for name, value in overrides.items():
    lines.append(f"DEPARTURE from the table's settings: {_flag_text(name, value)} (command"
                 " line)")
  for name, value in others.items():
    lines.append(f"DEPARTURE: {_flag_text(name, value)} (command line; the table leaves it"
                 " at its default)")
  lines.append(f"command: `{command}`")
  return lines


def _flag_text(name: str, value) -> str:
  if isinstance(value, (list, tuple)):
    value = ",".join(map(str, value))
  return f"--{name}={value}"


