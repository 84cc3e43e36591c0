"""Sweeps: many runs, each in its own workdir, read where finished and trained otherwise.

  rows = sweep.grid({"dataset": "rmnist", "rounds": 50},
                    {"local": {"algorithm": "local"}, "fedavg": {"algorithm": "fedavg"},
                     "fedprox": {"algorithm": "fedprox", "fedprox_mu": 0.1}},
                    "runs/sweep", seeds=(0, 1))   # <workdir>/seed<s>/<name>
  outcomes = sweep.run_configs(rows)   # each row's results document (None: not finished)

A row's workdir holds one run (run_config.json records its config). Rerun, a sweep reads
the rows finished there (results.json of the row's rounds, timing.json and history.npz:
what a table reads, so a row brought back from another machine without its checkpoints
counts) and trains the others, resuming from their checkpoints. Several processes may
share a workdir: the process running or reading a row holds its lock (flock), and one
reaching a held row waits, then reads it. `check_rows` refuses, before anything trains,
a row whose workdir holds a run with other settings. A row may be scored against a LOCAL
run another row trained (`Row.references`). Rows not finished that differ only in values
(seeds, lr, an algorithm's float hyperparameter) train as one program (run_configs,
fedora_jax/train_batch.py), each into its own workdir; seeds_grid makes the rows of
--seeds and --sweep. The paper tables are sweeps (papers.py:
a table's specification, experiments/paper/*.json, -> rows -> the table's files).
"""

import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping, NamedTuple, Sequence
import uuid

import jax
import numpy as np

from fedora_jax import algorithms, batch
from fedora_jax import checkpoint as checkpoint_lib
from fedora_jax import results as results_lib
from fedora_jax import settings as settings_lib
from fedora_jax import train as train_lib
from fedora_jax import train_batch
from fedora_jax.config import ExperimentConfig
from fedora_jax.errors import ConfigError, TrainingDivergedError
from fedora_jax.sweep.row_runs import (FINISHED_ONLY_ROWS, SCORED_CLIENTS,  # noqa: F401
                                       BestRound, RowRun, not_finished, read_row_run,
                                       seed_unfinished, seeds_finished, seeds_unfinished)
from fedora_jax.watchdog import Watchdog

logger = logging.getLogger("fedora_jax")

# What a finished row leaves that a sweep reads: the row's numbers, its timing and, for
# the best-round metric of the other papers' tables, its per-round history.
FINISHED_RUN_FILES = ("results.json", "timing.json", "history.npz")
# Held (flock) by the process running or reading a row in its workdir.
ROW_LOCK = ".row.lock"
# A row that stalled (the watchdog) or diverged: recorded in its workdir with the sweep's
# id, so the sweep (a stalled one started again: a stalled runtime cannot be recovered in
# place) leaves it out as failed and goes on; a later sweep (another id) retries it.
STALLED_ROW = "stalled.json"
SWEEP_ENV = "FEDORA_JAX_SWEEP_ID"


class Row(NamedTuple):
  """One run of a sweep."""
  name: str                     # how the log names it: "row 2/3 fedavg seed 0"
  config: ExperimentConfig
  workdir: str
  # LOCAL runs' results.json it may be scored against: the first one finished (at its
  # rounds at least) when it trains; none finished: it trains its own LOCAL beside it.
  references: tuple[str, ...] = ()
  label: str | None = None      # its progress's label (default: its name)


class RowOutcome(NamedTuple):
  """A row's results document, or None where it is not finished (--finished_only) or
  failed; whether it was read rather than trained here; and, not finished, what it is
  instead ("not started", "stopped after round 30 of 50", "running in another
  process", "failed: ...")."""
  results: dict | None
  read: bool
  unfinished: str | None = None


def _auto_progress(label: str) -> Any:
  del label
  return "auto"


def _no_watchdog(on_stall: Callable[[str], None]) -> ContextManager[Watchdog | None]:
  del on_stall
  return contextlib.nullcontext(None)


def _raise_stall(row: Row, message: str) -> None:
  raise RuntimeError(f"{row.name}: {message}")


def _raise_diverged(row: Row, message: str) -> None:
  raise TrainingDivergedError(f"{row.name}: {message}")


class Options(NamedTuple):
  """How a sweep's rows run. The commands give a bar or log lines per row, a watchdog,
  and a stalled or diverged row recorded as failed (experiments/cli.py)."""
  train: bool = True  # False (--finished_only): read the finished rows, train none
  progress: Callable[[str], Any] = _auto_progress  # a row's label -> its progress
  # on_stall -> the watchdog watching a row's run, entered (yields None: none).
  watching: Callable[[Callable[[str], None]], ContextManager[Watchdog | None]] = _no_watchdog
  on_stall: Callable[[Row, str], None] = _raise_stall  # told on the watchdog's thread
  # A row whose run diverged (NaN or Inf), recorded as failed: raise, or say so and go on.
  on_diverged: Callable[[Row, str], None] = _raise_diverged
  # Rows that differ only in values (seeds, lr, ...) as one program (run_configs).
  batch_runs: bool = True
  runs_per_step: int | None = None  # batch.prepare_batch's (None: its default)


def configs(base: Mapping[str, Any], overrides: Sequence[Mapping[str, Any]]
            ) -> list[ExperimentConfig]:
  """One config per override: flat settings (fedora_jax/settings.py) on top of `base`."""
  return [settings_lib.from_settings({**base, **override}) for override in overrides]


def grid(base: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]], workdir: str,
         seeds: Sequence[int] = (0,)) -> list[Row]:
  """One row per seed and named override (flat settings on top of `base`), seed by seed
  in the overrides' order, in <workdir>/seed<s>/<name>; a LOCAL row ("algorithm":
  "local") listed first is the reference of the seed's other rows."""
  rows = []
  for seed in seeds:
    local = None
    for name, override in overrides.items():
      config = settings_lib.from_settings({**base, **override, "seed": seed})
      directory = os.path.join(workdir, f"seed{seed}", name)
      rows.append(Row(f"{name} seed {seed}", config, directory,
                      () if local is None else (os.path.join(local, "results.json"),)))
      if local is None and config.algorithm.name == algorithms.REFERENCE:
        local = directory
  return rows


def seeds_grid(base: Mapping[str, Any], values: Mapping[str, Sequence[Any]], seed: int = 0,
               seeds: int = 1, workdir: str | None = None) -> list[Row]:
  """The runs of seeds seed .. seed+seeds-1 for each combination of `values` (setting
  name -> its values, on top of the flat settings `base`), a combination's seeds
  together: each in train.default_workdir, or with `workdir` in
  <workdir>[/<name>=<value>,...][/seed<s>] (one run: `workdir` itself). Combinations
  that differ only in values the run axis takes train as one program (run_configs); the
  others (an algorithm, a shape) one program each. Where the algorithm is swept with
  LOCAL among its values, LOCAL's run is the reference of the other algorithms' runs of
  its seed and other values, so it trains once."""
  names = list(values)
  rows, keys = [], []
  local_of: dict[tuple, str] = {}  # (the other values, seed) -> LOCAL's workdir
  for combination in itertools.product(*(values[n] for n in names)):
    chosen = dict(zip(names, combination))
    name = ",".join(f"{n}={v}" for n, v in chosen.items())
    others = tuple((n, repr(v)) for n, v in chosen.items() if n != "algorithm")
    for s in range(seed, seed + seeds):
      config = settings_lib.from_settings({**base, **chosen, "seed": s})
      parts = [name] if name else []
      if seeds > 1:
        parts.append(f"seed{s}")
      directory = (train_lib.default_workdir(config) if workdir is None
                   else os.path.join(workdir, *parts))
      is_local = config.algorithm.name == algorithms.REFERENCE
      if "algorithm" in chosen and is_local:
        local_of[others, s] = directory
      rows.append(Row(" ".join([name or config.algorithm.name, f"seed {s}"]), config,
                      directory))
      keys.append(None if is_local else (others, s))
  return [row._replace(references=(os.path.join(local_of[key], "results.json"),))
          if key in local_of else row for row, key in zip(rows, keys)]


SPREAD_METRICS = (("acc", "Acc"), ("mae", "MAE"), ("r_acc", "R-Acc"), ("ptr", "PTR"))


def spread_table(rows: Sequence[Row], outcomes: Sequence[RowOutcome]) -> list[dict]:
  """Per combination (rows named "<combination> seed <s>", seeds_grid's): the seeds
  finished, and mean and std (population) of the final round's Acc, MAE, R-Acc and PTR
  over them."""
  groups: dict[str, list[dict]] = {}
  for row, outcome in zip(rows, outcomes):
    documents = groups.setdefault(row.name.rsplit(" seed ", 1)[0], [])
    if outcome.results is not None:
      documents.append(outcome.results)
  table = []
  for name, documents in groups.items():
    entry: dict[str, Any] = {"run": name, "seeds_finished": len(documents)}
    for key, _ in SPREAD_METRICS:
      column = [d[key] for d in documents if d.get(key) is not None]
      if column:
        entry[key] = {"mean": float(np.mean(column)), "std": float(np.std(column)),
                      "values": [float(v) for v in column]}
    table.append(entry)
  return table


def spread(rows: Sequence[Row], outcomes: Sequence[RowOutcome]) -> list[str]:
  """spread_table's combinations, a line each: "<name>: N seeds finished: Acc m +- s"."""
  lines = []
  for entry in spread_table(rows, outcomes):
    cells = [f"{label} {entry[key]['mean']:.4f} +- {entry[key]['std']:.4f}"
             for key, label in SPREAD_METRICS if key in entry]
    lines.append(f"{entry['run']}: {entry['seeds_finished']} seeds finished:"
                 f" {'  '.join(cells)}")
  return lines


def write_spread(rows: Sequence[Row], outcomes: Sequence[RowOutcome], out: str,
                 command: str = "") -> None:
  """spread_table as <out>.json and a Markdown table, <out>.md (the command quoted)."""
  table = spread_table(rows, outcomes)
  labels = [(key, label) for key, label in SPREAD_METRICS
            if any(key in entry for entry in table)]
  lines = ([f"`{command}`", ""] if command else []) + [
      "| run | seeds | " + " | ".join(label for _, label in labels) + " |",
      "|---|---:|" + "---:|" * len(labels)]
  for entry in table:
    cells = [(f"{entry[key]['mean']:.4f}" + (f" ± {entry[key]['std']:.4f}"
                                            if entry["seeds_finished"] > 1 else ""))
             if key in entry else "" for key, _ in labels]
    lines.append(f"| {entry['run']} | {entry['seeds_finished']} | " + " | ".join(cells)
                 + " |")
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(f"{out}.json", "w") as f:
    json.dump({"command": command, "runs": table}, f, indent=2)
  with open(f"{out}.md", "w") as f:
    f.write("\n".join(lines) + "\n")


def check_rows(rows: Sequence[Row]) -> None:
  """Bad hyperparameters, and a row's workdir holding a run with other settings (say,
  from before a default changed), fail now, not an hour into the sweep."""
  for row in rows:
    train_lib.check_config(row.config)
    train_lib.check_workdir(row.workdir, row.config)


def finished_results(row: Row) -> dict | None:
  """The results document in the row's workdir if it holds the row's run finished: its
  run_config.json records the row's config, its results.json the row's rounds, and its
  timing and history are there. None otherwise; a ConfigError if the workdir holds a run
  with other settings."""
  if not all(os.path.isfile(os.path.join(row.workdir, f)) for f in FINISHED_RUN_FILES):
    return None
  try:
    with open(os.path.join(row.workdir, "results.json")) as f:
      results = json.load(f)
  except (OSError, ValueError):
    return None  # half-written: the run writes it again
  if not isinstance(results, dict) or results.get("rounds") != row.config.train.rounds:
    return None
  if not train_lib.check_workdir(row.workdir, row.config):
    return None
  return results


@contextlib.contextmanager
def row_claimed(workdir: str, wait: bool = True) -> Iterator[bool]:
  """Holds `workdir`'s row for this process, yielding True. Another process sharing the
  workdir waits here until this one is done, then reads the finished row instead of
  training it a second time; with wait=False it gets False at once instead. A
  multi-process run's processes run each row together, so they take no lock."""
  if jax.process_count() > 1:
    yield True
    return
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, ROW_LOCK), "a") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if not wait:
        yield False
        return
      logger.info("%s: another process is running this row; waiting for it", workdir)
      fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield True
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


_SWEEP_ID = os.environ.get(SWEEP_ENV) or uuid.uuid4().hex


def sweep_id() -> str:
  """This sweep's id: inherited from SWEEP_ENV in a re-execution, else this process's."""
  return _SWEEP_ID


def reexecution_env() -> dict[str, str]:
  """The environment for re-executing this sweep: this one's, with the sweep's id.

  Only the re-execution gets the id: in os.environ it would reach every program this
  process starts, and a later sweep started from it would take the stalled rows of this
  one as its own and leave them out instead of retrying them."""
  return dict(os.environ, **{SWEEP_ENV: sweep_id()})


def stall_record(workdir: str) -> dict | None:
  try:
    with open(os.path.join(workdir, STALLED_ROW)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) and "message" in record else None


def record_stall(workdir: str, message: str) -> None:
  """Records the row in `workdir` as stalled in this sweep (raises OSError if it cannot)."""
  record = {"sweep": sweep_id(), "message": message,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  temporary = os.path.join(workdir, STALLED_ROW + ".tmp")
  with open(temporary, "w") as f:
    json.dump(record, f)
  os.replace(temporary, os.path.join(workdir, STALLED_ROW))


def _reference(row: Row) -> str | None:
  """The first of the row's LOCAL references finished at its rounds or more."""
  for path in row.references:
    try:
      with open(path) as f:
        if json.load(f).get("rounds", 0) >= row.config.train.rounds:
          return path
    except (OSError, ValueError):
      continue
  return None


def run_or_read(row: Row, options: Options = Options()) -> RowOutcome:
  """The row, read if it is finished in its workdir and trained otherwise, the row
  claimed meanwhile (row_claimed); with options.train False, only read (read_if_finished)."""
  if not options.train:
    return read_if_finished(row)
  with row_claimed(row.workdir):
    done = _finished_or_failed(row)
    return done if done is not None else _train_or_fail([row], options)[0]


def _finished_or_failed(row: Row) -> RowOutcome | None:
  """The claimed row read if finished, or left out if it stalled in this sweep; None:
  it is to train."""
  results = finished_results(row)
  if results is not None:
    logger.info("%s: finished in %s, read", row.name, row.workdir)
    return RowOutcome(results, read=True)
  stalled = stall_record(row.workdir)
  if stalled is not None and stalled.get("sweep") == sweep_id():
    why = f"failed: {stalled['message']}"
    logger.info("%s: %s; left out", row.name, why)
    return RowOutcome(None, read=True, unfinished=why)
  return None


def _trained(row: Row, results: dict) -> RowOutcome:
  logger.info("%s: %s  (%s)", row.name, results_lib.format_row(results), row.workdir)
  if stall_record(row.workdir) is not None:  # an earlier sweep's failure, finished now
    os.remove(os.path.join(row.workdir, STALLED_ROW))
  return RowOutcome(results, read=False)


def _train_or_fail(rows: Sequence[Row], options: Options) -> list[RowOutcome]:
  """_train_rows; where a run diverges, the rows it leaves unfinished (a program's runs
  that diverged) recorded as failed in this sweep, as a stalled row is, and
  options.on_diverged told; the others' finished results kept."""
  try:
    return _train_rows(rows, options)
  except TrainingDivergedError as e:
    outcomes = []
    for row in rows:
      results = finished_results(row)
      if results is not None:
        outcomes.append(RowOutcome(results, read=False))
        continue
      record_stall(row.workdir, str(e))
      options.on_diverged(row, str(e))
      outcomes.append(RowOutcome(None, read=False, unfinished=f"failed: {e}"))
    return outcomes


def _train_rows(rows: Sequence[Row], options: Options) -> list[RowOutcome]:
  """Claimed rows not finished, trained: one alone, several (of one batch_key) as one
  program (train_batch.py), or each alone where they turn out unable to share one."""
  configs = [dataclasses.replace(row.config, reference=_reference(row)) for row in rows]
  if len(rows) == 1:
    row = rows[0]
    logger.info("%s -> %s", row.name, row.workdir)
    with options.watching(lambda message: options.on_stall(row, message)) as watchdog:
      results = train_lib.train_and_evaluate(configs[0], row.workdir,
                                             options.progress(row.label or row.name),
                                             watchdog)
    return [_trained(row, results)]
  label = f"{len(rows)} runs ({rows[0].name} .. {rows[-1].name})"
  logger.info("%s as one program -> %s", label, ", ".join(row.workdir for row in rows))

  def on_stall(message: str) -> None:  # they stalled together: each recorded as failed
    for row in rows[:-1]:
      with contextlib.suppress(OSError):
        record_stall(row.workdir, message)
    options.on_stall(rows[-1], message)
  try:
    with options.watching(on_stall) as watchdog:
      documents = train_batch.train_batch(configs, [row.workdir for row in rows],
                                          options.progress(label), watchdog,
                                          options.runs_per_step)
  except batch.BatchError as e:  # found before anything trained
    logger.info("%s: %s; each runs alone", label, e)
    return [outcome for row in rows for outcome in _train_rows([row], options)]
  # A run that diverged raised (as it would alone) once the others were written.
  return [_trained(row, results) for row, results in zip(rows, documents) if results]


def read_if_finished(row: Row) -> RowOutcome:
  """The row if it is finished in its workdir; trains nothing. A row not there, not
  finished, or held by a process running it now (its files may be half written) has no
  results, and `unfinished` says which."""
  results, why = None, "not started"
  if os.path.isdir(row.workdir):
    with row_claimed(row.workdir, wait=False) as claimed:
      if not claimed:
        why = "running in another process"
      else:
        results = finished_results(row)
        saved = None if results else checkpoint_lib.rounds_saved(row.workdir)
        if saved is not None:  # a run of fewer rounds than the row's is stopped short
          why = f"stopped after round {saved} of {row.config.train.rounds}"
        elif checkpoint_lib.holds_a_run(row.workdir):
          why = "not finished, no checkpoint saved"
        stalled = None if results else stall_record(row.workdir)
        if stalled is not None:
          why = f"failed: {stalled['message']}"
  logger.info("%s: %s", row.name, f"finished in {row.workdir}, read" if results
              else f"{why}; left out")
  return RowOutcome(results, read=True, unfinished=None if results else why)


def run_configs(rows: Sequence[Row], options: Options = Options()) -> list[RowOutcome]:
  """Every row, read where finished and trained otherwise: the one place a sweep's
  configs become runs. Rows not finished that differ only in values the run axis takes
  (train_batch.batch_key: seeds, lr, weight_decay, the algorithm's float
  hyperparameters) train as one program (options.batch_runs), each into its own
  workdir; the LOCAL rows first, as other rows are scored against them (Row.references)."""
  if not (options.train and options.batch_runs and train_batch.can_batch()):
    return [run_or_read(row, options) for row in rows]
  outcomes: dict[int, RowOutcome] = {}
  local = [algorithms.canonical_name(row.config.algorithm.name) == algorithms.REFERENCE
           for row in rows]
  for phase in (True, False):
    for group in _batches(rows, [i for i in range(len(rows)) if local[i] == phase]):
      outcomes.update(_run_group(rows, group, options))
  return [outcomes[i] for i in range(len(rows))]


def _batches(rows: Sequence[Row], indices: Sequence[int]) -> list[list[int]]:
  """The rows grouped by what one program needs them to share: batch_key and the round
  of their latest checkpoint (one program resumes from one round), in order. A row
  scored against the LOCAL another row of its group (or a later one) trains goes in a
  group after it, as it would run after it alone."""
  groups: list[list[int]] = []
  group_of_key: dict[Any, int] = {}
  group_of: dict[int, int] = {}
  for i in indices:
    try:
      key: Any = (train_batch.batch_key(rows[i].config),
                  checkpoint_lib.rounds_saved(rows[i].workdir))
    except ConfigError:  # a bad row fails alone, where a sweep without batches reaches it
      key = ("alone", i)
    group = group_of_key.get(key)
    scored_by = [g for j, g in group_of.items() for path in rows[i].references
                 if path.startswith(rows[j].workdir.rstrip(os.sep) + os.sep)]
    if group is None or any(g >= group for g in scored_by):
      groups.append([])
      group = group_of_key[key] = len(groups) - 1
    groups[group].append(i)
    group_of[i] = group
  return groups


def _run_group(rows: Sequence[Row], group: Sequence[int],
               options: Options) -> dict[int, RowOutcome]:
  """A group's rows: each read if finished, the rest claimed and trained together; a
  row another process holds is run (or, finished there, read) alone after it."""
  outcomes: dict[int, RowOutcome] = {}
  held: list[int] = []
  with contextlib.ExitStack() as stack:
    to_train = []
    for i in group:
      if not stack.enter_context(row_claimed(rows[i].workdir, wait=False)):
        held.append(i)
        continue
      done = _finished_or_failed(rows[i])
      if done is None:
        to_train.append(i)
      else:
        outcomes[i] = done
    if to_train:
      trained = _train_or_fail([rows[i] for i in to_train], options)
      outcomes.update(zip(to_train, trained))
  for i in held:
    outcomes[i] = run_or_read(rows[i], options)
  return outcomes
