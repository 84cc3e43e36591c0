"""A watchdog that ends a run which has stopped making progress.

A run that hangs (a deadlocked runtime, a stuck device, a dead collective) waits forever
at 0 % CPU, and an overnight sweep loses the night. The run loop tells the watchdog
which stage it is in and how long that stage may take (compiling; round r of R; saving a
checkpoint); a background thread checks the clock, and when a stage outlives its limit
it calls `on_stall` with one line naming the run, the stage and the limit.

Time the process does not run is not time without progress: a run stopped with Ctrl-Z
or SIGSTOP (paused while something else is timed), or a machine that sleeps, shows
as one long gap between the watchdog's polls, and a gap over `pause_seconds` counts as
one poll. A hung run's watchdog thread keeps polling (the hang holds the main thread,
not this one), so its stalled time counts in full.

A stalled runtime cannot be interrupted from Python (the main thread sits in C++, not in
bytecode), so the default `on_stall` prints that line and ends the process at once with
exit status STALL_EXIT_STATUS. Checkpoints are written under a temporary name and
renamed when complete (checkpoint.py), so the last finished one survives, and rerunning
the same command resumes from it.

  with Watchdog(StallLimits(round_seconds=600)) as watchdog:
    run_algorithm(..., watchdog=watchdog)
"""

import dataclasses
import os
import sys
import threading
import time
from typing import Callable

from fedora_jax.errors import FieldError

# EX_TEMPFAIL of sysexits.h: a temporary failure, the same command may succeed.
STALL_EXIT_STATUS = 75


@dataclasses.dataclass(frozen=True)
class StallLimits:
  """How long each stage of a run may go without finishing.

  round_seconds: a round (with its test evaluation and checkpoint); None: automatic,
    `round_multiple` times the median round so far, at least `min_round_seconds`.
  compile_seconds: the model and algorithm init, compilation, and the first round after
    it (its time is not yet known, and the first execution may do one-time work).
  """
  round_seconds: float | None = None
  compile_seconds: float = 3600.0
  round_multiple: float = 20.0
  min_round_seconds: float = 600.0

  def __post_init__(self):
    for name in ("round_seconds", "compile_seconds", "round_multiple", "min_round_seconds"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise FieldError("stall", name, f"must be > 0, got {value}")

  def round_limit(self, median_round_seconds: float | None) -> float:
    """The limit of a round, given the median of the rounds so far (None: none yet)."""
    if median_round_seconds is None:
      return self.compile_seconds
    if self.round_seconds is not None:
      return self.round_seconds
    return max(self.min_round_seconds, self.round_multiple * median_round_seconds)


def exit_process(message: str) -> None:
  """The default on_stall: `message` on stderr as one line, then the process ends."""
  sys.stdout.flush()
  # A live progress bar holds the terminal's last line without a newline.
  sys.stderr.write(("\n" if sys.stderr.isatty() else "") + f"error: {message}\n")
  sys.stderr.flush()
  os._exit(STALL_EXIT_STATUS)  # pylint: disable=protected-access


class Watchdog:
  """Watches the stages a run reports (`stage`) from a daemon thread; a context manager.

  on_stall(message) runs on the watchdog's thread when a stage outlives its limit; it is
  expected not to return (exit_process, or a sweep's re-exec). If it does return, the
  watchdog stops watching until the next `stage`.
  """

  def __init__(self, limits: StallLimits = StallLimits(),
               on_stall: Callable[[str], None] = exit_process,
               poll_seconds: float = 1.0, pause_seconds: float = 30.0):
    self.limits = limits
    self.on_stall = on_stall
    self._poll_seconds = poll_seconds
    self._pause_seconds = pause_seconds
    self._lock = threading.Lock()
    # what, limit, start, the seconds paused before it, note
    self._stage: tuple[str, float, float, float, str] | None = None
    self._paused = 0.0  # seconds the process did not run, since the watchdog started
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def __enter__(self) -> "Watchdog":
    self._stop.clear()
    self._thread = threading.Thread(target=self._watch, name="fedora_jax-watchdog",
                                    daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self._thread = None

  def stage(self, what: str, limit_seconds: float, note: str = "") -> None:
    """The run has entered stage `what` ("fedavg: round 3 of 50"), which may take up to
    `limit_seconds`; `note` ends the stall message (what is kept, how to resume)."""
    with self._lock:
      self._stage = (what, limit_seconds, time.monotonic(), self._paused, note)

  def idle(self) -> None:
    """Nothing to watch until the next `stage` (between runs, writing results)."""
    with self._lock:
      self._stage = None

  def _watch(self) -> None:
    last = time.monotonic()
    while not self._stop.wait(self._poll_seconds):
      now = time.monotonic()
      with self._lock:
        if now - last > self._pause_seconds:  # the process was stopped: one poll counts
          self._paused += now - last - self._poll_seconds
        last = now
        stage = self._stage
        if stage is None or now - stage[2] - (self._paused - stage[3]) <= stage[1]:
          continue
        self._stage = None
      what, limit, _, _, note = stage
      message = f"{what}: no progress for {limit:g} s, stopped"
      self.on_stall(message + (f"; {note}" if note else ""))
