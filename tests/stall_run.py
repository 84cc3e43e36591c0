"""Runs `experiments.main` or `experiments.reproduce` with one round of one algorithm
stalled, as a hung runtime stalls it (tests/test_watchdog.py).

  STALL_ALGORITHM=fedavg STALL_ROUND=3 python tests/stall_run.py main FLAGS...

That algorithm's run blocks forever in that round, after its training and before its
metrics are checked (where a deadlocked device leaves the main thread: waiting, not
running Python); everything else runs as the command does. With STALL_WITH=sigint the
process gets a SIGINT there instead, as from Ctrl-C.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from absl import app

from experiments import main as main_lib
from experiments import reproduce
from fedora_jax import simulation

_running = {}
_build_algorithm, _check_finite = simulation.build_algorithm, simulation.check_finite


def build_algorithm(*args, **kwargs):
  algorithm = _build_algorithm(*args, **kwargs)
  _running["algorithm"] = algorithm.name
  return algorithm


def check_finite(metrics, round_number, **kwargs):
  if (_running.get("algorithm") == os.environ["STALL_ALGORITHM"]
      and round_number == int(os.environ["STALL_ROUND"])):
    if os.environ.get("STALL_WITH") == "sigint":
      signal.raise_signal(signal.SIGINT)
    while True:  # forever, in short sleeps: a pending signal's handler runs between them
      time.sleep(0.05)
  _check_finite(metrics, round_number, **kwargs)


if __name__ == "__main__":
  # Ctrl-C reaches a run in the foreground. A command started in the background (bash
  # without job control: `make test-slow &`, nohup) ignores SIGINT, its children too,
  # and Python then installs no KeyboardInterrupt handler: the raised SIGINT would do
  # nothing and the stall would last until the test's timeout.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  simulation.build_algorithm, simulation.check_finite = build_algorithm, check_finite
  command = sys.argv.pop(1)
  app.run({"main": main_lib.main, "reproduce": reproduce.main}[command])
