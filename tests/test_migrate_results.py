"""scripts/migrate_results.py: records of earlier formats brought to the current one."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _client(k, acc, local_acc, r_acc, best_val_acc=0.5, local_best_val_acc=0.5):
  return {"id": k, "acc": acc, "local_acc": local_acc, "r_acc": r_acc,
          "best_val_acc": best_val_acc, "local_best_val_acc": local_best_val_acc,
          "best_val_r_acc": 0.0}


def _write(directory, results, timing):
  os.makedirs(directory)
  for name, document in (("results.json", results), ("timing.json", timing)):
    with open(os.path.join(directory, name), "w") as f:
      json.dump(document, f, indent=2)


def _read(directory, name):
  with open(os.path.join(directory, name)) as f:
    return json.load(f)


def _migrate(root, *flags):
  return subprocess.run([sys.executable, "scripts/migrate_results.py", str(root), *flags],
                        cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_a_record_from_before_the_tie_rule_is_summarized_again(tmp_path):
  # Client 0 tied with LOCAL (218 / 277 both, one bit apart before rounding) but was not
  # counted; client 1 is 0.1 below its LOCAL 0.6: PTR 1/2, R-Acc (0 - 1/6) / 2.
  stale = {"task": "classification", "platform": "cpu", "acc": 0.643502,
           "r_acc": -0.083333, "ptr": 0.0,
           "best_val": {"round": 3, "acc": 0.55, "r_acc": 0.1, "ptr": 1.0},
           "clients": [_client(0, 0.787004, 0.787004, -1e-7, 0.6),
                       _client(1, 0.5, 0.6, -0.166667)]}
  # A current record: client 0 was a tie in the run (its unrounded values one count);
  # rounded to 6 decimals its accuracies are 1e-6 apart, still the same count.
  current = {**stale, "r_acc": 0.0, "ptr": 1.0,
             "clients": [_client(0, 0.932489, 0.93249, 0.0, 0.6)],
             "best_val": {"round": 3, "acc": 0.6, "r_acc": 0.2, "ptr": 1.0}}
  old_timing = {"resumed_from_round": 3, "round_seconds_all": 1.0, "seconds_all": 5.0,
                "segments": [{"first_round": 0, "last_round": 3},
                             {"first_round": 3, "last_round": 5,
                              "machine": "cpu x1, 1 cores"}]}
  _write(tmp_path / "stale", stale, old_timing)
  _write(tmp_path / "current", current, {**old_timing, "segments": []})

  assert "2 file(s) to change" in _migrate(tmp_path, "--dry_run")
  assert _read(tmp_path / "stale", "results.json") == stale
  assert "2 file(s) changed" in _migrate(tmp_path)
  fresh = _read(tmp_path / "stale", "results.json")
  assert fresh["ptr"] == 0.5 and fresh["acc"] == stale["acc"]
  assert fresh["r_acc"] == pytest.approx(-1 / 12, abs=1e-6)
  assert [c["r_acc"] for c in fresh["clients"]] == [0.0, pytest.approx(-1 / 6, abs=1e-6)]
  assert fresh["best_val"] == {**stale["best_val"], "r_acc": 0.1, "ptr": 1.0}
  assert [s["machine"] for s in _read(tmp_path / "stale", "timing.json")["segments"]] == [
      "cpu", "cpu x1, 1 core"]
  assert _read(tmp_path / "current", "results.json") == current
  # A second run has nothing left to do.
  assert "0 file(s) changed" in _migrate(tmp_path)
