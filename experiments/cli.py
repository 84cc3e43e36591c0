"""What every command shares: devices and processes set up before JAX starts, clean
output (our messages as plain lines, a progress bar on a terminal, the libraries' and
XLA's logs at WARNING unless --verbose), and errors as one line with a non-zero exit
(experiments.main, reproduce and benchmark)."""

import contextlib
import logging
import os
import sys
import textwrap
from typing import Callable, Iterator

from absl import logging as absl_logging
import jax

from experiments import flags as run_flags
from fedora_jax import algorithms
from fedora_jax import progress as progress_lib
from fedora_jax import results as results_lib
from fedora_jax import sweep
from fedora_jax import watchdog as watchdog_lib
from fedora_jax.engine import sharding
from fedora_jax.errors import ConfigError, FedoraError, FieldError, RunInterrupted

FLAGS = run_flags.FLAGS


def configure_cpu_devices() -> None:
  """One JAX CPU device per core (or --cpu_devices), set before any backend starts.

  Each device then runs its share of the clients on its own core, which beat one device
  using both cores by 1.7x for FEDORA's round on a 2-core CPU (docs/performance.md).
  Left alone: multi-process runs (a process per host or core is the user's layout) and
  an XLA_FLAGS that already sets --xla_force_host_platform_device_count."""
  multi_process = FLAGS.distributed or FLAGS.num_processes is not None
  forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
  if FLAGS.cpu_devices is None and (multi_process or forced):
    return
  try:
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices or sharding.cpu_device_count())
  except RuntimeError as e:  # a backend already started (e.g. in a notebook)
    raise ConfigError(f"--cpu_devices must be set before JAX starts: {e}") from None


def initialize_distributed() -> None:
  """Starts jax.distributed when asked to, before anything touches a device."""
  explicit = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ConfigError("--coordinator_address, --num_processes and --process_id go"
                      " together (or use --distributed alone for auto-detection)")
  if FLAGS.num_processes is not None and FLAGS.process_id >= FLAGS.num_processes:
    raise ConfigError(f"--process_id={FLAGS.process_id} must be below"
                      f" --num_processes={FLAGS.num_processes}")
  if FLAGS.distributed or FLAGS.num_processes is not None:
    sharding.initialize_distributed(*explicit)


def shutdown_distributed() -> None:
  """Leaves a multi-process run together with the other processes (a no-op otherwise)."""
  if jax.process_count() > 1:
    jax.distributed.shutdown()


# Our loggers: their INFO records are the command's own messages.
OWN_LOGGERS = ("fedora_jax", "experiments")


def configure_logging(level: int = logging.INFO) -> None:
  """Our messages as plain lines on stderr, everything else at WARNING (absl, jax, orbax;
  XLA's C++ logs through TF_CPP_MIN_LOG_LEVEL, which XLA reads when its backend starts,
  so this runs before any device is touched). --verbose keeps absl's own format for
  every logger at INFO, C++ logs included; an explicit --verbosity or
  TF_CPP_MIN_LOG_LEVEL wins."""
  for name in OWN_LOGGERS:
    logging.getLogger(name).setLevel(level)
  if FLAGS.verbose:
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # 1: warnings and errors
  if not FLAGS["verbosity"].present:
    absl_logging.set_verbosity(absl_logging.WARNING)
  root = logging.getLogger()
  for handler in list(root.handlers):
    if isinstance(handler, absl_logging.ABSLHandler):
      root.removeHandler(handler)  # its lines carry timestamps and thread ids
  if not any(isinstance(h, progress_lib.LineHandler) for h in root.handlers):
    root.addHandler(progress_lib.LineHandler())


def use_progress_bar() -> bool:
  """A live bar where a person watches: stderr is a terminal, progress is wanted
  (--log_every > 0), this is process 0, and no --verbose C++ log lines would tear it."""
  return (sys.stderr.isatty() and FLAGS.log_every > 0 and not FLAGS.verbose
          and jax.process_index() == 0)


def progress_reporter(label: str | None = None) -> progress_lib.Progress:
  """A bar on a terminal, else a plain line every --log_every rounds; `label` names the
  runs (default: each run's algorithm)."""
  if use_progress_bar():
    return progress_lib.ProgressBar(label)
  return progress_lib.LogProgress(FLAGS.log_every, label)


def grouped_help(groups: dict[str, tuple[str, ...]], header: str) -> str:
  """The flags a first use needs, by group, with defaults: what --help shows after the
  command's docstring (absl prints the __main__ module's __doc__, %-formatted)."""
  lines = [""] + textwrap.wrap(header, 88)
  for group, names in groups.items():
    lines += ["", f"{group}:"]
    for name in names:
      lines += run_flags.flag_lines(name)
  return "\n".join(lines).replace("%", "%%") + "\n"


def stall_limits() -> watchdog_lib.StallLimits | None:
  """--stall_timeout and --compile_timeout as the watchdog's limits (None: no watchdog)."""
  if FLAGS.stall_timeout == 0:
    return None
  if not FLAGS.compile_timeout > 0:
    raise ConfigError(f"--compile_timeout must be > 0, got {FLAGS.compile_timeout}")
  return watchdog_lib.StallLimits(round_seconds=FLAGS.stall_timeout,
                                  compile_seconds=FLAGS.compile_timeout)


def exit_on_stall(message: str) -> None:
  """A command's answer to a stalled run: one line, exit status 75, and how to resume."""
  watchdog_lib.exit_process(f"{message}; rerun the same command to resume")


@contextlib.contextmanager
def watching(on_stall: Callable[[str], None] = exit_on_stall
             ) -> Iterator[watchdog_lib.Watchdog | None]:
  """The watchdog the flags ask for, running (None with --stall_timeout=0)."""
  limits = stall_limits()
  if limits is None:
    yield None
    return
  with watchdog_lib.Watchdog(limits, on_stall) as watchdog:
    yield watchdog


def fail_row_and_go_on(row: sweep.Row, message: str) -> None:
  """A sweep's answer to a stalled row: recorded as failed in its workdir, and the sweep
  started again in this process (a stalled runtime cannot be recovered in place), which
  reads the finished rows, leaves this one out and runs the rest."""
  try:
    sweep.record_stall(row.workdir, message)
  except OSError as e:  # unrecorded, it would stall again on every restart
    exit_on_stall(f"{message} (and the row could not be recorded as failed: {e})")
  say_left_out(row, message)
  os.execve(sys.executable, sys.orig_argv, sweep.reexecution_env())


def say_left_out(row: sweep.Row, message: str) -> None:
  """One error line: the row failed (stalled, diverged) and the sweep goes on."""
  sys.stdout.flush()
  sys.stderr.write(("\n" if sys.stderr.isatty() else "")  # below a progress bar
                   + f"error: {row.name}: {message}; the row is left out as failed and the"
                   " sweep goes on (a later run of the same command retries it)\n")
  sys.stderr.flush()


def sweep_options(finished_only: bool = False) -> sweep.Options:
  """How the commands run a sweep's rows: a bar or log lines each, the watchdog the flags
  ask for, and a stalled or diverged row left out as failed (a stall in a multi-process
  run, whose processes run each row together, ends it with one line instead)."""
  on_stall = ((lambda row, message: exit_on_stall(message)) if jax.process_count() > 1
              else fail_row_and_go_on)
  return sweep.Options(train=not finished_only, progress=progress_reporter,
                       watching=watching, on_stall=on_stall, on_diverged=say_left_out,
                       batch_runs=FLAGS.batch_runs,
                       runs_per_step=FLAGS.runs_per_step)


def run_rows(rows: list[sweep.Row]) -> list[dict | None]:
  """Several runs (--seeds, --sweep) through the sweep module, as one program where they
  can share one: each run's summary printed, then mean +- std over each one's seeds
  (with --workdir, also in <workdir>/sweep.md and .json)."""
  sweep.check_rows(rows)
  outcomes = sweep.run_configs(rows, sweep_options())
  for row, outcome in zip(rows, outcomes):
    if outcome.results is not None:
      report_run(outcome.results, row.workdir)
  for line in sweep.spread(rows, outcomes):
    print(line)
  if FLAGS.workdir and jax.process_index() == 0:
    out = os.path.join(FLAGS.workdir, "sweep")
    sweep.write_spread(rows, outcomes, out, " ".join(["python -m", *sys.orig_argv[2:]]))
    print(f"table in {out}.md")
  return [outcome.results for outcome in outcomes]


def print_algorithm_help(name: str) -> None:
  """--help_algorithm=NAME: the algorithm's flags, or one error line and exit status 1."""
  try:
    print(run_flags.algorithm_help(name))
  except FedoraError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def report_run(results: dict, workdir: str) -> None:
  """Writes flags.txt beside the run's results (and its LOCAL reference's) and prints
  its summary (--per_client: each client's scores first)."""
  own = workdir if jax.process_index() == 0 else os.path.join(
      workdir, f"process{jax.process_index()}")
  for directory in (own, os.path.join(own, algorithms.REFERENCE)):
    if os.path.isfile(os.path.join(directory, "results.json")):
      with open(os.path.join(directory, "flags.txt"), "w") as f:
        f.write(FLAGS.flags_into_string())
  if FLAGS.per_client:
    print(results_lib.format_clients(results))
  print(results_lib.format_summary(results))
  if "new_clients" in results:
    print(results_lib.format_new_clients(results["new_clients"]))
  print(f"results in {own}" + ("" if FLAGS.per_client else
                                " (each client's in clients.csv, or with --per_client)"))


def run_command(argv, run_fn: Callable[[], object], resume_hint: str | None = None,
                log_level: int = logging.INFO) -> None:
  """Runs `run_fn` as a command: one-line errors and a non-zero exit, never a traceback
  unless --verbose; Ctrl-C says where it stopped, and `resume_hint` how to go on."""
  if len(argv) > 1:
    print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
    sys.exit(1)
  configure_logging(log_level)
  try:
    configure_cpu_devices()
    initialize_distributed()
    run_fn()
    shutdown_distributed()
  except FieldError as e:
    print(f"error: {run_flags.as_flag_error(e)}", file=sys.stderr)
    sys.exit(1)
  except FedoraError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt as e:  # RunInterrupted says where, and what is kept
    stopped = str(e) if isinstance(e, RunInterrupted) else "interrupted"
    # On a terminal the ^C and a progress bar hold the line.
    print(("\n" if sys.stderr.isatty() else "") + f"error: {stopped}"
          + (f"; {resume_hint}" if resume_hint else ""), file=sys.stderr)
    sys.exit(130)
  except Exception as e:  # pylint: disable=broad-except
    if FLAGS.verbose:
      raise
    print(f"error: unexpected {type(e).__name__}: {e} (run with --verbose for the"
          " traceback)", file=sys.stderr)
    sys.exit(2)
