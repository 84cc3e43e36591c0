"""How a run reports its rounds as they finish: plain log lines, or a live terminal bar.

`simulation.run_algorithm` tells a Progress when a run starts (before it compiles), when
it has compiled, after every round and when it stops (finished or not):

  LogProgress  a line every `log_every` rounds (to the "fedora_jax" logger, or stderr);
  ProgressBar  a tqdm bar (round, s/round, ETA, mean validation and test score), for a
               terminal or, as a widget, a notebook;
  Silent       nothing.
`default_progress` picks the bar where a person watches (a terminal, a notebook) and the
lines elsewhere: the library's default; passing `progress=None` silences a run.
`noting` adds a run's own words to each round's report (DP's epsilon so far).

LineHandler writes log records through tqdm, so a line logged while a bar is open lands
above it instead of tearing it.
"""

import contextlib
import logging
import os
import sys
from typing import Any, Callable, Iterator, Protocol, TextIO

import jax
import numpy as np

from fedora_jax.rounds import RoundMetrics

logger = logging.getLogger("fedora_jax")


class Progress(Protocol):
  """What run_algorithm reports to; one object may report several runs in turn."""

  def start(self, run: str, rounds: int, task: str) -> None:
    """A run of algorithm `run` for `rounds` rounds begins (it compiles next)."""

  def compiled(self, seconds: float, first_round: int) -> None:
    """Compiled in `seconds`; rounds 1..first_round were restored from a checkpoint."""

  def round_done(self, round_number: int, metrics: RoundMetrics,
                 seconds_per_round: float) -> None:
    """Round `round_number` (1-based) finished; seconds_per_round: median so far."""

  def close(self) -> None:
    """The run stopped: after its last round, or on an error or Ctrl-C."""


def score_name(task: str) -> str:
  return "mae" if task == "regression" else "acc"


# A run's own words after a round's scores: round number (1-based) -> text.
Note = Callable[[int], str]


@contextlib.contextmanager
def noting(progress: Progress, note: Note) -> Iterator[None]:
  """Within the block, `progress` ends each round's report with note(round) (a Progress
  without a `note` attribute reports as it would)."""
  if not hasattr(progress, "note"):
    yield
    return
  before = progress.note
  progress.note = note
  try:
    yield
  finally:
    progress.note = before


def _noted(note: Note | None, round_number: int) -> str:
  return "" if note is None else f", {note(round_number)}"


def format_mean(values: np.ndarray | jax.Array) -> str:
  """The mean over the clients scored (NaN: not scored; --eval_clients scores a sample)
  to 4 places; "n/a" for a round that scored none (test under --eval_every)."""
  values = np.asarray(values)
  scored = values[~np.isnan(values)]
  return f"{float(np.mean(scored)):.4f}" if scored.size else "n/a"


def format_seconds(seconds: float) -> str:
  """12 s, 3:07, 1:02:03: the ETA the way a clock shows it."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds} s"
  hours, rest = divmod(seconds, 3600)
  return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _StderrLog:
  """A logger's `info` as plain lines on stderr (for a library run with no logging set)."""

  def info(self, message: str, *args) -> None:
    print(message % args, file=sys.stderr, flush=True)


class Silent:
  """Reports nothing."""

  def start(self, run: str, rounds: int, task: str) -> None:
    del run, rounds, task

  def compiled(self, seconds: float, first_round: int) -> None:
    del seconds, first_round

  def round_done(self, round_number: int, metrics: RoundMetrics,
                 seconds_per_round: float) -> None:
    del round_number, metrics, seconds_per_round

  def close(self) -> None:
    pass


def in_notebook() -> bool:
  """Whether this runs in a Jupyter (or Colab) kernel."""
  shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
  return (shell is not None and "ZMQ" in type(shell).__name__) or "google.colab" in sys.modules


def default_progress(log_every: int, label: str | None = None) -> "Progress":
  """A bar in a terminal or a notebook, else a line every `log_every` rounds (to the
  "fedora_jax" logger where it logs INFO, else stderr); nothing at log_every 0."""
  if not log_every:
    return Silent()
  if in_notebook():
    return ProgressBar(label, notebook=True)
  if sys.stderr.isatty():
    return ProgressBar(label)
  return LogProgress(log_every, label,
                     logger if logger.isEnabledFor(logging.INFO) else _StderrLog())


class LogProgress:
  """A log line every `log_every` rounds and after the last one (0: none), named by
  `label` (default: the run's algorithm)."""

  def __init__(self, log_every: int, label: str | None = None,
               log: logging.Logger | _StderrLog = logger):
    self.log_every, self.label, self._log = log_every, label, log
    self._run, self._rounds, self._task = "", 0, "classification"
    self.note: Note | None = None  # set by `noting`

  def start(self, run: str, rounds: int, task: str) -> None:
    self._run, self._rounds, self._task = self.label or run, rounds, task

  def compiled(self, seconds: float, first_round: int) -> None:
    del seconds, first_round  # the plain log stays as short as it was

  def round_done(self, round_number: int, metrics: RoundMetrics,
                 seconds_per_round: float) -> None:
    if not self.log_every or (round_number % self.log_every and round_number != self._rounds):
      return
    score = score_name(self._task)
    self._log.info("%s round %d/%d: %.3f s/round, val %s %s, test %s %s, ETA %.0f s%s",
                   self._run, round_number, self._rounds, seconds_per_round, score,
                   format_mean(metrics.val_score), score, format_mean(metrics.test_score),
                   seconds_per_round * (self._rounds - round_number),
                   _noted(self.note, round_number))

  def close(self) -> None:
    pass


# "fedora: 40%|####      | 12/30 rounds [00:09, 0.21 s/round, ETA 4 s, val acc ...]"
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rounds [{elapsed}{postfix}]"


class ProgressBar:
  """A tqdm bar per run on `file` (default stderr), described by `label` (default: the
  run's algorithm), left on screen when the run ends."""

  def __init__(self, label: str | None = None, file: TextIO | None = None,
               notebook: bool = False):
    self.label = label
    self._file = file
    self._notebook = notebook
    self._bar: Any = None  # a tqdm bar (untyped) from start to close
    self._rounds, self._task = 0, "classification"
    self.note: Note | None = None  # set by `noting`

  def start(self, run: str, rounds: int, task: str) -> None:
    import tqdm  # pylint: disable=g-import-not-at-top
    self.close()
    self._rounds, self._task = rounds, task
    if self._notebook:
      self._bar = _notebook_bar(rounds, self.label or run)
      return
    file = self._file or sys.stderr
    # Follow the window's width. A pty that reports no size (`script`, some CI runners)
    # gets 120 columns and 40 lines: tqdm would draw nothing in a 0 x 0 window.
    sized = _has_size(file)
    self._bar = tqdm.tqdm(total=rounds, desc=self.label or run, bar_format=_BAR_FORMAT,
                          file=file, dynamic_ncols=sized, ncols=None if sized else 120,
                          nrows=None if sized else 40, leave=True, postfix="compiling")

  def compiled(self, seconds: float, first_round: int) -> None:
    note = f"compiled in {seconds:.1f} s"
    if first_round:  # restored rounds count as done, not as fast ones
      self._bar.n = self._bar.last_print_n = first_round
      note += f", resumed after round {first_round}"
    self._bar.set_postfix_str(note)

  def round_done(self, round_number: int, metrics: RoundMetrics,
                 seconds_per_round: float) -> None:
    score = score_name(self._task)
    eta = format_seconds(seconds_per_round * (self._rounds - round_number))
    self._bar.set_postfix_str(
        f"{seconds_per_round:.3f} s/round, ETA {eta}, val {score}"
        f" {format_mean(metrics.val_score)}, test {score} {format_mean(metrics.test_score)}"
        f"{_noted(self.note, round_number)}", refresh=False)
    self._bar.update(round_number - self._bar.n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _notebook_bar(rounds: int, description: str):
  """tqdm's notebook widget where ipywidgets is installed (Colab has it), else its text
  bar on the cell's output."""
  import tqdm  # pylint: disable=g-import-not-at-top
  try:
    # Imported only to learn whether it is installed: tqdm.notebook's widget needs it.
    import ipywidgets  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
    import tqdm.notebook  # pylint: disable=g-import-not-at-top
    bar_class = tqdm.notebook.tqdm
  except ImportError:
    bar_class = tqdm.tqdm
  return bar_class(total=rounds, desc=description, bar_format=_BAR_FORMAT, leave=True,
                   postfix="compiling", file=sys.stdout)


def _has_size(file: TextIO) -> bool:
  try:
    return min(os.get_terminal_size(file.fileno())) > 0
  except (AttributeError, OSError, ValueError):  # not a file, or not a terminal
    return False


class LineHandler(logging.Handler):
  """Log records as plain lines on stderr: an INFO record is its message, others say
  their level and logger ("warning (jax._src.xla_bridge): ..."). Written through
  tqdm.write, which moves an open bar below the line."""

  def emit(self, record: logging.LogRecord) -> None:
    import tqdm  # pylint: disable=g-import-not-at-top
    try:
      message = record.getMessage()
      if record.levelno != logging.INFO:
        message = f"{record.levelname.lower()} ({record.name}): {message}"
      if record.exc_info:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
      tqdm.tqdm.write(message, file=sys.stderr)
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)
