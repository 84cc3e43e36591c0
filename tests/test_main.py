"""End to end: `python -m experiments.main` for two rounds, and its one-line errors."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--num_clients=4", "--rounds=2", "--local_epochs=1", "--hidden=16",
        "--log_every=1"]


def run_main(*args):
  return subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.quick  # the quick tier's end-to-end run
def test_fedora_end_to_end_writes_results(tmp_path):
  workdir = tmp_path / "run"
  proc = run_main("--dataset=rmnist", f"--workdir={workdir}", *FAST)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  for key in ("dataset", "algorithm", "seed", "rounds", "acc", "r_acc", "ptr", "devices",
              "best_val", "clients"):
    assert key in results
  assert results["algorithm"] == "fedora" and results["rounds"] == 2
  # With no other flag, FEDORA is the authors' variant, whose numbers the paper reports.
  assert {k: results["fedora"][k] for k in ("weights", "top_k", "alpha", "pull")} == {
      "weights": "exp", "top_k": 2, "alpha": 4.0, "pull": "decoupled"}
  assert len(results["clients"]) == 4
  accs = np.array([c["acc"] for c in results["clients"]])
  local = np.array([c["local_acc"] for c in results["clients"]])
  assert np.isclose(results["acc"], accs.mean(), atol=1e-5)
  assert np.isclose(results["ptr"], np.mean(accs >= local), atol=1e-6)
  for c in results["clients"]:
    assert {"id", "acc", "local_acc", "r_acc", "n_train"} <= set(c)
    assert c["n_train"] == 128
  assert np.load(workdir / "similarity.npy").shape == (4, 4)
  assert (workdir / "clients.csv").exists() and (workdir / "rounds.csv").exists()
  assert "best-validation round" in proc.stdout and "final round 2" in proc.stdout
  # Not a terminal: plain progress lines (--log_every=1), no bar, no absl/XLA log lines.
  lines = proc.stderr.splitlines()
  assert ("rmnist: 4 clients in 1 size bucket(s); train samples per client: min 128,"
          " median 128, max 128") in lines
  for name in ("fedora", "local"):
    for r in (1, 2):
      assert any(line.startswith(f"{name} round {r}/2: ") and "s/round, val acc" in line
                 for line in lines), proc.stderr
  assert "training the LOCAL reference on the same split and seed" in lines
  assert "\r" not in proc.stderr and "libtpu" not in proc.stderr
  assert not [line for line in lines if re.match(r"[IWEF]\d{4} ", line)], proc.stderr

  # The LOCAL reference the run trained is saved as a LOCAL run; FedAvg reuses it.
  reference = workdir / "local" / "results.json"
  local_clients = json.loads(reference.read_text())["clients"]
  assert [c["acc"] for c in local_clients] == [c["local_acc"] for c in results["clients"]]
  proc = run_main("--algorithm=fedavg", f"--reference={reference}",
                  f"--workdir={tmp_path / 'fedavg'}", *FAST)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "training the LOCAL reference" not in proc.stderr
  fedavg = json.loads((tmp_path / "fedavg" / "results.json").read_text())
  assert [c["local_acc"] for c in fedavg["clients"]] == [c["acc"] for c in local_clients]
  # A reference from another split or schedule is refused before any training.
  proc = run_main("--algorithm=fedavg", f"--reference={reference}", "--lr=0.1",
                  f"--workdir={tmp_path / 'other'}", *FAST)
  assert proc.returncode != 0 and "lr=0.005 (run: 0.1)" in proc.stderr
  # A longer LOCAL run serves, read at this run's last round from its history; a shorter
  # one is refused.
  proc = run_main("--algorithm=fedavg", f"--reference={reference}",
                  f"--workdir={tmp_path / 'shorter'}", *FAST, "--rounds=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  shorter = json.loads((tmp_path / "shorter" / "results.json").read_text())
  local_round_1 = np.load(workdir / "local" / "history.npz")["test_acc"][0]
  np.testing.assert_allclose([c["local_acc"] for c in shorter["clients"]], local_round_1,
                             atol=1e-6)
  proc = run_main("--algorithm=fedavg", f"--reference={reference}",
                  f"--workdir={tmp_path / 'longer'}", *FAST, "--rounds=3")
  assert proc.returncode == 1 and "ran 2 rounds, fewer than this run's 3" in proc.stderr


def test_reference_none_trains_no_local_and_leaves_r_acc_null(tmp_path):
  """--reference=none (a model per client that does not fit): no LOCAL trained or
  written; accuracies as usual, R-Acc and PTR null."""
  workdir = tmp_path / "run"
  proc = run_main("--dataset=rmnist", "--algorithm=fedavg", "--reference=none",
                  f"--workdir={workdir}", *FAST)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "LOCAL reference" not in proc.stderr
  assert not (workdir / "local").exists()
  results = json.loads((workdir / "results.json").read_text())
  assert 0 < results["acc"] <= 1
  assert results["r_acc"] is None and results["ptr"] is None
  assert all(c["local_acc"] is None and c["acc"] is not None for c in results["clients"])


def test_new_clients_are_held_out_and_served(tmp_path):
  proc = run_main("--new_clients=2", "--num_clients=6", f"--workdir={tmp_path}",
                  *[f for f in FAST if not f.startswith("--num_clients")])
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  block = results["new_clients"]
  held_out = [c["id"] for c in block["clients"]]
  assert len(held_out) == 2 and block["count"] == 2
  assert sorted(held_out + [c["id"] for c in results["clients"]]) == list(range(6))
  for name in ("fedora_without_labels", "fedora_with_labels", "fedavg_without_labels",
               "fedavg_with_labels"):
    assert 0.0 <= block[name] <= 1.0
  assert "new clients (2, held out of training" in proc.stdout


@pytest.mark.parametrize("preset,variant", [
    ("rmnist", "authors"), ("rmnist_paper", "paper"), ("rmnist_imbalanced", "authors"),
    ("rfmnist", "authors"), ("rfmnist_paper", "paper"), ("cifar10_authors", "authors")])
def test_presets_pick_their_fedora_variant(preset, variant):
  # The flags a preset expands to, nested --flagfile included, as the command reads them.
  flag_values = flags.FlagValues()
  cwd = os.getcwd()
  os.chdir(ROOT)  # nested --flagfile paths are relative to the repository root
  try:
    expanded = flag_values.read_flags_from_files(
        [f"--flagfile=experiments/configs/{preset}.flags"])
  finally:
    os.chdir(cwd)
  variants = [a.split("=", 1)[1] for a in expanded if a.startswith("--fedora_variant=")]
  assert variants[-1] == variant  # the last one given wins
  assert "--algorithm=fedora" in expanded


BAD_INPUT = [
    (["--algorithm=nope"], "--algorithm"),
    (["--dataset=nope"], "--dataset"),
    (["--num_clients=400"], "need"),
    (["--rounds=0"], "--rounds"),
    (["--data_dir=/nonexistent"], "not found"),
    (["--hidden=12,x"], "--hidden"),
    (["--fedora_alpha=-1"], "fedora_alpha"),
    (["--setting=lopsided"], "--setting"),
    (["--reference=/nonexistent/results.json"], "--reference"),
    (["--num_clients=4", "--new_clients=4"], "leaves no client to train"),
    (["--algorithm=local", "--new_clients=1"],
     "--new_clients serves clients held out of training, which local does not; use it with"
     " fedora"),
    (["--batch_size=0"], "--batch_size"),
    (["--momentum=1.5"], "--momentum"),
    (["--fedora_p=0"], "fedora_p must be >= 1"),
    (["--fedora_lambda_value=0.1"], "--fedora_lambda_value only acts with"
     " --fedora_lambda_rule=constant; this run's is authors"),
    (["--algorithm=fedprox", "--fedprox_ala_anchor=theta_hat"],
     "--fedprox_ala_anchor only acts under --ala, which this run does not use"),
    (["--num_clients=4", "--new_clients=1", "--fedora_similarity=gradients"],
     "it has no gradients similarity to them"),
    (["--max_pad_ratio=0.5"], "--max_pad_ratio"),
    (["--lr=1e30", "--num_clients=4", "--hidden=16", "--local_epochs=1"],
     "NaN or Inf loss in round 1 at client(s) 0, 1, 2, 3"),
    (["stray_argument"], "unexpected arguments"),
    (["--algorithm=fedavg", "--attack=alie", "--attackers=1.0"],
     "--attackers must be in [0, 1), got 1.0"),
    (["--attackers=0.2"], "--attackers needs --attack"),
    (["--algorithm=fedora", "--attack=sign_flip"],
     "--attack needs an algorithm whose server averages a shared part"),
    (["--algorithm=fedavg", "--num_clients=10", "--aggregation=krum", "--attack=alie",
      "--attackers=0.4"], "--aggregation=krum needs n > 2f + 2 uploads a round"),
    (["--algorithm=fedavg", "--num_clients=4", "--aggregation=norm_bound",
      "--attack=gaussian", "--attackers=0.5"],
     "--aggregation=norm_bound cannot tolerate half or more of the uploads Byzantine"),
    ("corrupt", "truncated or corrupt"),
]


def test_bad_input_gets_a_one_line_error(tmp_path):
  """Every BAD_INPUT case: a non-zero exit and one `error:` line naming the problem, no
  traceback. The cases run forked from one process that imported experiments.main once
  (tests/main_cases.py), so each costs its own work, not a fresh interpreter's imports."""
  # A data_dir whose training images are cut short.
  shutil.copytree(os.path.join(ROOT, "fedora_jax", "data", "mnist"), tmp_path / "mnist")
  images = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
  images.write_bytes(images.read_bytes()[:100000])
  cases = [[f"--workdir={tmp_path / f'run{i}'}", "--rounds=1",
            *([f"--data_dir={tmp_path / 'mnist'}"] if args == "corrupt" else args)]
           for i, (args, _) in enumerate(BAD_INPUT)]
  (tmp_path / "cases.json").write_text(json.dumps(cases))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "main_cases.py"),
                         str(tmp_path / "cases.json")], cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  runs = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(runs) == len(BAD_INPUT)
  for (args, message), (code, output) in zip(BAD_INPUT, runs):
    errors = [line for line in output.splitlines() if line.startswith(("error:", "FATAL"))]
    assert code != 0, (args, output[-2000:])
    assert "Traceback" not in output, (args, output[-2000:])
    assert len(errors) == 1 and message in errors[0], (args, output[-2000:])


def test_help_lists_a_first_runs_flags_by_group_with_defaults():
  proc = run_main("--help")
  lines = proc.stdout.splitlines()
  for group in ("data:", "model and training:", "algorithm:", "output:", "devices:"):
    assert group in lines, proc.stdout
  assert "  --rounds (default: 500)" in lines and "  --dataset (default: rmnist)" in lines
  assert len(lines) < 120  # --helpfull has the other ~200 flags
  proc = run_main("--help_algorithm=FedProx")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("--algorithm=fedprox: FedProx")
  assert "  --fedprox_mu" in proc.stdout.splitlines()
  proc = run_main("--help_algorithm=fednope")
  assert proc.returncode == 1 and proc.stderr.startswith("error: unknown algorithm 'fednope'")


def test_default_workdirs_differ_by_setting_and_the_same_command_resumes(tmp_path):
  def run_here(*args):
    return subprocess.run([sys.executable, "-m", "experiments.main", "--algorithm=local",
                           *FAST, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
  assert run_here().returncode == 0
  assert run_here("--lr=0.01").returncode == 0
  workdirs = sorted(os.listdir(tmp_path / "runs"))
  assert len(workdirs) == 2, workdirs
  assert all(re.fullmatch(r"rmnist_balanced_local_seed0_[0-9a-f]{8}", w) for w in workdirs)
  proc = run_here()
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "local: resuming after round 2 of 2" in proc.stderr
  assert sorted(os.listdir(tmp_path / "runs")) == workdirs
  # The data moved to another folder: the same run, resumed.
  moved = tmp_path / "moved_data"
  moved.mkdir()
  embedded = os.path.join(ROOT, "fedora_jax", "data", "mnist")
  for name in os.listdir(embedded):
    os.symlink(os.path.join(embedded, name), moved / name)
  proc = run_here(f"--data_dir={moved}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "local: resuming after round 2 of 2" in proc.stderr
  assert sorted(os.listdir(tmp_path / "runs")) == workdirs


def test_helpfull_puts_the_projects_groups_first_and_each_algorithm_under_its_name():
  lines = run_main("--helpfull").stdout.splitlines()
  headings = [line for line in lines if line.endswith(":") and not line.startswith(" ")]
  ours = headings[headings.index("1. the run: algorithm, data, seeds:"):]
  assert ours[:6] == ["1. the run: algorithm, data, seeds:", "2. client partition:",
                      "3. model and client training:",
                      "4. output: workdir, progress, checkpoints, watchdog:",
                      "5. devices and processes:",
                      "6. plug-ins: ALA (--ala) and ConFREE (--aggregation=confree):"]
  assert "7. algorithm fedprox:" in ours and ours.index("7. algorithm fedprox:") < ours.index(
      next(h for h in ours if h.startswith("absl")))
  fedprox = lines.index("7. algorithm fedprox:")
  assert lines[fedprox + 1].startswith("  --fedprox_")
