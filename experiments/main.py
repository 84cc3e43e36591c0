"""Runs one pFL algorithm on one federated dataset and reports the paper's metrics.

  python -m experiments.main --dataset=rmnist             # FEDORA, the authors' code's form
  python -m experiments.main --dataset=rmnist --fedora_variant=paper  # equations as printed

A thin command over `fedora_jax.train.train_and_evaluate`: the flags become an
ExperimentConfig, and run_config.json records them so a rerun resumes from checkpoints.
Writes results.json, clients.csv, rounds.csv, history.npz, flags.txt and the algorithm's
arrays (FEDORA: similarity.npy; coaching: relation_cube.npy) to --workdir with PNG plots
and per-round TensorBoard events in <workdir>/tensorboard/<algorithm>, the LOCAL
reference it trained to <workdir>/local/, and prints the summary (--per_client: and each
client's scores).
On a terminal each run shows a live progress bar; otherwise a line every --log_every rounds.
"""

import contextlib
import fcntl
import functools
import json
import logging
import os
import sys
import time
from typing import Callable, NamedTuple
import uuid

from absl import app

import jax

from experiments import cli
from experiments import flags as run_flags
from fedora_jax import algorithms
from fedora_jax import checkpoint as checkpoint_lib
from fedora_jax import progress as progress_lib
from fedora_jax import results as results_lib
from fedora_jax import train
from fedora_jax.errors import FedoraError

FLAGS = run_flags.FLAGS
logger = logging.getLogger("experiments")


def run(progress: progress_lib.Progress | None = None,
        on_stall: Callable[[str], None] = cli.exit_on_stall,
        row: str | None = None) -> dict:
  """The run the flags describe; returns its results document. `progress` reports its
  rounds (default: cli.progress_reporter(), a bar on a terminal); `on_stall` is told
  when the watchdog finds it stalled (--stall_timeout; default: one line and exit).
  Prints its summary (each client's scores too with --per_client), or, as a sweep's
  `row`, one line."""
  config = run_flags.experiment_config()
  workdir = FLAGS.workdir or train.default_workdir(config)
  with cli.watching(on_stall) as watchdog:
    results = train.train_and_evaluate(config, workdir, progress or cli.progress_reporter(),
                                       watchdog)
  own = workdir if jax.process_index() == 0 else os.path.join(
      workdir, f"process{jax.process_index()}")
  for directory in (own, os.path.join(own, algorithms.REFERENCE)):
    if os.path.isfile(os.path.join(directory, "results.json")):
      with open(os.path.join(directory, "flags.txt"), "w") as f:
        f.write(FLAGS.flags_into_string())
  if row is not None:
    print(f"{row}: {results_lib.format_row(results)}  ({own})", flush=True)
    return results
  if FLAGS.per_client:
    print(results_lib.format_clients(results))
  print(results_lib.format_summary(results))
  if "new_clients" in results:
    print(results_lib.format_new_clients(results["new_clients"]))
  print(f"results in {own}" + ("" if FLAGS.per_client else
                                " (each client's in clients.csv, or with --per_client)"))
  return results


# What a finished run leaves that a sweep reads (reproduce: the row's numbers, its timing
# and, for the other papers' best-round metric, its per-round history).
FINISHED_RUN_FILES = ("results.json", "timing.json", "history.npz")


def finished_results(workdir: str) -> dict | None:
  """The results document in `workdir` if it holds the finished run the flags describe:
  its run_config.json records these settings, its results.json these --rounds, and its
  timing and history are there. `reproduce` reads such a row instead of running it again,
  so a row brought back from another machine without its checkpoints counts, and a
  restarted sweep does not recompile its finished rows. None otherwise; a ConfigError if
  the workdir holds a run with other settings."""
  if not all(os.path.isfile(os.path.join(workdir, f)) for f in FINISHED_RUN_FILES):
    return None
  try:
    with open(os.path.join(workdir, "results.json")) as f:
      results = json.load(f)
  except (OSError, ValueError):
    return None  # half-written: the run writes it again
  if not isinstance(results, dict) or results.get("rounds") != FLAGS.rounds:
    return None
  if not train.check_workdir(workdir, run_flags.experiment_config()):
    return None
  return results


# Held (flock) by the process running or reading a row in its workdir.
ROW_LOCK = ".row.lock"


@contextlib.contextmanager
def row_claimed(workdir: str, wait: bool = True):
  """Holds `workdir`'s row for this process, yielding True. Another `reproduce` process
  sharing the workdir (several side by side on one machine) waits here until this one is
  done, then reads the finished row instead of training it a second time; with
  wait=False it gets False at once instead. A multi-process run's processes run each row
  together, so they take no lock."""
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


# A row that stalled (--stall_timeout) in a sweep: recorded in its workdir, so that the
# sweep, started again in the same process (os.execv: a stalled runtime cannot be
# recovered in place), leaves it out as failed and goes on with the next row. The record
# names its sweep (SWEEP_ENV, kept across the re-executions): a later sweep retries it.
STALLED_ROW = "stalled.json"
SWEEP_ENV = "FEDORA_JAX_SWEEP_ID"


def sweep_id() -> str:
  """This sweep's id, the same in its re-executions."""
  return os.environ.setdefault(SWEEP_ENV, uuid.uuid4().hex)


def _stall_record(workdir: str) -> dict | None:
  try:
    with open(os.path.join(workdir, STALLED_ROW)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) and "message" in record else None


def fail_row_and_go_on(workdir: str, name: str, message: str) -> None:
  """A sweep's on_stall: records the row as failed and starts the sweep again, which
  reads the finished rows, leaves this one out and runs the rest."""
  record = {"sweep": sweep_id(), "message": message,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  try:
    with open(os.path.join(workdir, STALLED_ROW + ".tmp"), "w") as f:
      json.dump(record, f)
    os.replace(os.path.join(workdir, STALLED_ROW + ".tmp"),
               os.path.join(workdir, STALLED_ROW))
  except OSError as e:  # unrecorded, it would stall again on every restart
    cli.exit_on_stall(f"{message} (and the row could not be recorded as failed: {e})")
  sys.stdout.flush()
  sys.stderr.write(("\n" if sys.stderr.isatty() else "")  # below a progress bar
                   + f"error: {name}: {message}; the row is left out as failed and the"
                   " sweep goes on (a later run of the same command retries it)\n")
  sys.stderr.flush()
  os.execv(sys.executable, sys.orig_argv)


class RowOutcome(NamedTuple):
  """A reproduce row: its results document, or None where --finished_only finds it not
  finished; whether it was read from a finished run rather than trained here; and for
  a row not finished, what it is instead ("not started", "stopped after round 30 of
  50", "running in another process")."""
  results: dict | None
  read: bool
  unfinished: str | None = None


def run_or_read(name: str, label: str | None, train: bool = True) -> RowOutcome:
  """The row the flags describe, in --workdir, read if it is finished there and run
  otherwise, with the row claimed meanwhile (row_claimed). `name` names it in the log,
  `label` its progress. With train=False (--finished_only) nothing runs: a row not
  finished has no results and says why (read_if_finished)."""
  if not train:
    return read_if_finished(name)
  with row_claimed(FLAGS.workdir):
    results = finished_results(FLAGS.workdir)
    if results is not None:
      logger.info("%s: finished in %s, read", name, FLAGS.workdir)
      return RowOutcome(results, read=True)
    stalled = _stall_record(FLAGS.workdir)
    if stalled is not None and stalled.get("sweep") == sweep_id():
      why = f"failed: {stalled['message']}"
      logger.info("%s: %s; left out", name, why)
      return RowOutcome(None, read=True, unfinished=why)
    logger.info("%s -> %s", name, FLAGS.workdir)
    on_stall = (cli.exit_on_stall if jax.process_count() > 1 else
                functools.partial(fail_row_and_go_on, FLAGS.workdir, name))
    results = run(cli.progress_reporter(label), on_stall, row=name)
    if stalled is not None:  # an earlier sweep's failure, retried and finished now
      os.remove(os.path.join(FLAGS.workdir, STALLED_ROW))
    return RowOutcome(results, read=False)


def read_if_finished(name: str) -> RowOutcome:
  """The row the flags describe if it is finished in --workdir; trains nothing. A row not
  there, not finished, or held by a process running it now (its files may be half
  written) has no results, and `unfinished` says which."""
  results, why = None, "not started"
  if os.path.isdir(FLAGS.workdir):
    with row_claimed(FLAGS.workdir, wait=False) as claimed:
      if not claimed:
        why = "running in another process"
      else:
        results = finished_results(FLAGS.workdir)
        saved = None if results else checkpoint_lib.rounds_saved(FLAGS.workdir)
        if saved is not None:  # a run of fewer --rounds than the table's is stopped short
          why = f"stopped after round {saved} of {FLAGS.rounds}"
        elif checkpoint_lib.holds_a_run(FLAGS.workdir):
          why = "not finished, no checkpoint saved"
        stalled = None if results else _stall_record(FLAGS.workdir)
        if stalled is not None:
          why = f"failed: {stalled['message']}"
  logger.info("%s: %s", name, f"finished in {FLAGS.workdir}, read" if results
              else f"{why}; left out")
  return RowOutcome(results, read=True, unfinished=None if results else why)


# What --help lists after the docstring above.
__doc__ += cli.grouped_help({  # pylint: disable=redefined-builtin
    "data": ("dataset", "data_dir", "num_clients", "setting"),
    "model and training": ("model", "rounds", "local_epochs", "lr", "batch_size",
                           "participation", "seed"),
    "algorithm": ("algorithm", "help_algorithm", "ala", "aggregation"),
    "output": ("workdir", "log_every", "checkpoint_every", "stall_timeout"),
    "devices": ("cpu_devices",),
}, "The flags of a first run (--helpfull: all of them, each algorithm's as"
   " --<algorithm>_<field>; --help_algorithm=NAME: one algorithm's):")


def main(argv):
  if FLAGS.help_algorithm:
    try:
      print(run_flags.algorithm_help(FLAGS.help_algorithm))
    except FedoraError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)
    return
  cli.run_command(argv, run, "rerun the same command to resume")


if __name__ == "__main__":
  app.run(main)
