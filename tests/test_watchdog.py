"""The watchdog (fedora_jax/watchdog.py, --stall_timeout): a stalled run ends with one
line and exit status 75, keeps its checkpoint and resumes on rerun; a sweep records the
stalled row as failed and goes on."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fedora_jax import watchdog as watchdog_lib
from fedora_jax.errors import FieldError
from test_main import FAST, ROOT

STALL_RUN = os.path.join(ROOT, "tests", "stall_run.py")


def test_round_limit_follows_the_median_round():
  auto = watchdog_lib.StallLimits(compile_seconds=100.0)
  assert auto.round_limit(None) == 100.0     # the first round: compile's limit
  assert auto.round_limit(2.0) == 600.0      # 20 x 2 s, at least 600 s
  assert auto.round_limit(60.0) == 1200.0    # 20 x 60 s
  fixed = watchdog_lib.StallLimits(round_seconds=5.0, compile_seconds=100.0)
  assert fixed.round_limit(None) == 100.0 and fixed.round_limit(60.0) == 5.0
  with pytest.raises(FieldError, match="round_seconds must be > 0"):
    watchdog_lib.StallLimits(round_seconds=0.0)


def test_a_stage_past_its_limit_is_reported_once_and_others_are_not():
  stalls = []
  fired = threading.Event()

  def on_stall(message):
    stalls.append(message)
    fired.set()

  with watchdog_lib.Watchdog(watchdog_lib.StallLimits(), on_stall,
                             poll_seconds=0.02) as watchdog:
    for i in range(5):  # stages that finish in time
      watchdog.stage(f"fedavg: round {i + 1} of 9", 0.5)
      time.sleep(0.1)
    watchdog.idle()     # nothing watched: no limit
    time.sleep(0.7)
    assert not stalls
    watchdog.stage("fedavg: round 6 of 9", 0.2, "its checkpoint of round 5 is kept")
    assert fired.wait(5.0)
    time.sleep(0.3)     # reported once, not again every poll
  assert stalls == ["fedavg: round 6 of 9: no progress for 0.2 s, stopped;"
                    " its checkpoint of round 5 is kept"]


def _stalled(command, *args, algorithm="fedavg", round_number=3, stall_with="hang"):
  env = dict(os.environ, STALL_ALGORITHM=algorithm, STALL_ROUND=str(round_number),
             STALL_WITH=stall_with)
  return subprocess.run([sys.executable, STALL_RUN, command, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def _command(module, *args):
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


_PAUSED_CHILD = """
import time
from fedora_jax import watchdog
with watchdog.Watchdog(poll_seconds=0.1, pause_seconds=1.0) as dog:
  dog.stage("a paused stage", 2.0)
  print("staged", flush=True)
  time.sleep(4.5)  # 3 s of it stopped by the test: about 1.5 s run, under the limit
  dog.stage("a stalled stage", 2.0)
  print("went on", flush=True)
  time.sleep(3.0)  # running: past the limit
print("not reached", flush=True)
"""


def test_time_the_process_is_stopped_does_not_count_as_a_stall():
  # A run paused with SIGSTOP (Ctrl-Z) and resumed goes on; a stall after it still ends it.
  child = subprocess.Popen([sys.executable, "-c", _PAUSED_CHILD], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  assert child.stdout.readline() == "staged\n"
  time.sleep(0.5)
  child.send_signal(signal.SIGSTOP)
  time.sleep(3.0)
  child.send_signal(signal.SIGCONT)
  out, err = child.communicate(timeout=60)
  assert out == "went on\n", err
  assert child.returncode == watchdog_lib.STALL_EXIT_STATUS
  assert err.strip() == "error: a stalled stage: no progress for 2 s, stopped"


def test_a_stalled_round_ends_the_run_with_one_line_and_a_rerun_resumes(tmp_path):
  args = ["--dataset=rmnist", "--algorithm=fedavg", f"--workdir={tmp_path}",
          *[f for f in FAST if not f.startswith("--rounds")], "--rounds=4",
          "--checkpoint_every=1", "--stall_timeout=5"]
  proc = _stalled("main", *args)
  assert proc.returncode == watchdog_lib.STALL_EXIT_STATUS, proc.stderr[-3000:]
  assert proc.stderr.splitlines()[-1] == (
      "error: fedavg: round 3 of 4: no progress for 5 s, stopped; its checkpoint of round"
      " 2 is kept; rerun the same command to resume")
  assert "Traceback" not in proc.stderr

  proc = _command("main", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fedavg: resuming after round 2 of 4" in proc.stderr
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["rounds"] == 4 and len(results["clients"]) == 4


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path):
  args = ["--dataset=rmnist", "--algorithm=FedAvg", f"--workdir={tmp_path}", *FAST,
          "--checkpoint_every=1"]
  proc = _stalled("main", *args, round_number=2, stall_with="sigint")
  assert proc.returncode == 130, proc.stderr[-3000:]
  assert proc.stderr.splitlines()[-1] == (
      "error: fedavg: round 2 of 2 interrupted; its checkpoint of round 1 is kept; rerun"
      " the same command to resume")


def test_a_sweep_leaves_a_stalled_row_out_as_failed_and_goes_on(tmp_path):
  args = ["--table=fedora1", "--dataset=rmnist", "--rows=fedavg,fedprox",
          f"--workdir={tmp_path}", *FAST, "--checkpoint_every=1", "--stall_timeout=5"]
  proc = _stalled("reproduce", *args, round_number=2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("error: row 2/3 fedavg seed 0: fedavg: round 2 of 2: no progress for 5 s,"
          " stopped; its checkpoint of round 1 is kept; the row is left out as failed and"
          " the sweep goes on") in proc.stderr
  assert "row 1/3 local seed 0: finished in" in proc.stderr  # the sweep, started again
  assert "row 3/3 fedprox seed 0 ->" in proc.stderr
  table = json.loads((tmp_path / "table.json").read_text())
  assert [row["algorithm"] for row in table["rows"]] == ["local", "fedprox"]
  assert table["unfinished"]["fedavg"] == [
      "seed 0: failed: fedavg: round 2 of 2: no progress for 5 s, stopped; its checkpoint"
      " of round 1 is kept"]
  assert "failed: fedavg: round 2 of 2" in (tmp_path / "table.md").read_text()

  # A later sweep retries the row: it resumes from its checkpoint and finishes.
  proc = _command("reproduce", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fedavg: resuming after round 1 of 2" in proc.stderr
  table = json.loads((tmp_path / "table.json").read_text())
  assert [row["algorithm"] for row in table["rows"]] == ["local", "fedavg", "fedprox"]
  assert not (tmp_path / "seed0" / "fedavg" / "stalled.json").exists()


def test_a_sweep_s_id_reaches_its_reexecution_and_no_other_program():
  # In os.environ, an id taken in this process (a sweep run here) would reach every
  # later command started from it, and each would leave out, as stalled "in this sweep",
  # the rows it should retry (it failed this file's test above in CI, under pytest-xdist).
  from fedora_jax import sweep
  before = os.environ.get(sweep.SWEEP_ENV)
  assert sweep.sweep_id() == sweep.sweep_id()
  assert os.environ.get(sweep.SWEEP_ENV) == before
  assert sweep.reexecution_env()[sweep.SWEEP_ENV] == sweep.sweep_id()
