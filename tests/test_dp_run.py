"""User-level DP from the command line: a run's epsilon in rounds.csv, results.json and on
the progress line, its record holding the noise it trained with, and its one-line
errors."""

import csv
import json
import os
import subprocess
import sys

import numpy as np

from fedora_jax import accounting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--algorithm=fedavg", "--num_clients=4", "--local_epochs=1", "--hidden=16",
        "--log_every=1", "--checkpoint_every=1"]
DP = ["--dp_clip_norm=0.5", "--dp_target_epsilon=6", "--dp_delta=1e-3"]


def run_main(*args):
  return subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_a_dp_run_reports_its_epsilon_each_round(tmp_path):
  workdir = tmp_path / "run"
  proc = run_main(*FAST, *DP, "--rounds=2", f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  dp = results["dp"]
  assert dp["expected_clients"] == 4 and dp["sampling"] == "fixed" and dp["accountant"] == "rdp"
  everyone = accounting.RoundSampling("fixed", 4, 4)
  expected = [accounting.epsilon(dp["noise_multiplier"], r, 1e-3, everyone) for r in (1, 2)]
  assert 5.99 < results["dp_epsilon"] <= 6.0 and results["dp_epsilon"] == dp["epsilon"]
  np.testing.assert_allclose(results["dp_epsilon"], expected[1], rtol=1e-9)
  with open(workdir / "rounds.csv") as f:
    rows = list(csv.DictReader(f))
  np.testing.assert_allclose([float(row["dp_epsilon"]) for row in rows], expected, rtol=1e-5)
  assert all(0 <= float(row["mean_dp_clipped"]) <= 1 for row in rows)
  lines = proc.stderr.splitlines()
  for r in (1, 2):
    assert any(line.startswith(f"fedavg+dp round {r}/2: ")
               and line.endswith(f"epsilon {expected[r - 1]:.3g}") for line in lines), lines
  assert any(line.startswith("local round 1/2: ") and "epsilon" not in line for line in lines)
  assert "user-level DP: epsilon 6 at delta 0.001 after 2 rounds" in proc.stdout
  assert np.load(workdir / "history.npz")["dp_epsilon"].shape == (2,)
  # The same target over more rounds needs more noise: another run, refused in one line.
  proc = run_main(*FAST, *DP, "--rounds=3", f"--workdir={workdir}")
  assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
  assert "noise_multiplier" in proc.stderr


def test_a_dp_run_resumes_with_its_noise_and_clip_norm(tmp_path):
  """The plug-in's server state (its key, round and adaptive C) is checkpointed: a run
  extended from round 1 to 2 equals the 2-round run trained at once."""
  args = [*FAST, "--dp_clip_norm=0.5", "--dp_noise_multiplier=2", "--dp_delta=1e-3",
          "--dp_adaptive_clip_quantile=0.5", "--dp_clipped_count_stddev=2"]
  once, twice = tmp_path / "once", tmp_path / "twice"
  for workdir, rounds in ((once, 2), (twice, 1), (twice, 2)):
    # The first run's LOCAL reference serves the others.
    reference = [f"--reference={once / 'local' / 'results.json'}"] if workdir == twice else []
    proc = run_main(*args, *reference, f"--rounds={rounds}", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resuming after round 1" in proc.stderr
  for name in ("test_acc", "dp_epsilon", "dp_update_norm"):
    np.testing.assert_allclose(np.load(twice / "history.npz")[name],
                               np.load(once / "history.npz")[name], rtol=1e-6)
  np.testing.assert_allclose(np.load(twice / "dp_clip_norm.npy"),
                             np.load(once / "dp_clip_norm.npy"), rtol=1e-6)


BAD_INPUT = [
    (["--dp_clip_norm=1", "--dp_noise_multiplier=-1", "--dp_delta=1e-5"],
     "--dp_noise_multiplier must be >= 0, got -1"),
    (["--dp_clip_norm=1", "--dp_target_epsilon=2"],
     "--dp_delta must be given with --dp_target_epsilon"),
    (["--algorithm=local", "--dp_clip_norm=1", "--dp_noise_multiplier=1", "--dp_delta=1e-5"],
     "DP (--dp_clip_norm) needs an algorithm whose server averages what its clients upload;"
     " local does not"),
    (["--algorithm=fedora", "--dp_clip_norm=1", "--dp_noise_multiplier=1", "--dp_delta=1e-5"],
     "fedora does not"),
    (["--dp_noise_multiplier=1", "--dp_delta=1e-5"], "--dp_clip_norm must be > 0"),
    (["--dp_clip_norm=1", "--dp_noise_multiplier=1", "--dp_target_epsilon=2",
      "--dp_delta=1e-5"], "got both"),
    (["--dp_clip_norm=1", "--dp_noise_multiplier=1", "--dp_delta=1e-5", "--dp_accountant=pld",
      "--participation=0.5"], "accounts for Poisson sampling only"),
    (["--dp_clip_norm=1", "--dp_noise_multiplier=5", "--dp_delta=1e-5",
      "--dp_adaptive_clip_quantile=0.5"], "adaptive clipping needs 2 sigma_b > z"),
    (["--aggregation=median", "--dp_clip_norm=1", "--dp_noise_multiplier=1",
      "--dp_delta=1e-5"], "does not combine with --aggregation"),
]


def test_bad_dp_input_gets_a_one_line_error(tmp_path):
  """Each case: a non-zero exit and one `error:` line, no traceback (forked from one
  process that imported experiments.main once: tests/main_cases.py)."""
  cases = [[f"--workdir={tmp_path / f'run{i}'}", "--rounds=1", "--algorithm=fedavg", *args]
           for i, (args, _) in enumerate(BAD_INPUT)]
  (tmp_path / "cases.json").write_text(json.dumps(cases))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "main_cases.py"),
                         str(tmp_path / "cases.json")], cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  runs = json.loads(proc.stdout.strip().splitlines()[-1])
  for (args, message), (code, output) in zip(BAD_INPUT, runs):
    errors = [line for line in output.splitlines() if line.startswith(("error:", "FATAL"))]
    assert code != 0 and "Traceback" not in output, (args, output[-2000:])
    assert len(errors) == 1 and message in errors[0], (args, output[-2000:])
