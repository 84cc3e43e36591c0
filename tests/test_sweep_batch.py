"""The run axis from the sweep module (fedora_jax/train_batch.py, sweep.run_configs) and
the CLI's --seeds and --sweep: rows that differ only in values train as one program,
each into its own workdir with the files and results it has alone.

Equal within tests/test_batch.py's tolerance (the batched program may add in another
order): every client's accuracy the same, losses to rtol 1e-5. On this CPU the files
have come out byte-identical."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import flags as run_flags
from fedora_jax import algorithms, sweep, train, train_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"num_clients": 3, "rounds": 2, "local_epochs": 1, "hidden": [16], "log_every": 0,
        "checkpoint_every": 0}
OVERRIDES = {"local": {"algorithm": "local"}, "fedavg": {"algorithm": "fedavg"}}
QUIET = sweep.Options(progress=lambda label: None)
FAST = ["--num_clients=3", "--rounds=2", "--local_epochs=1", "--hidden=16", "--log_every=0",
        "--checkpoint_every=0"]


def _files(directory) -> set[str]:
  """The run's files, TensorBoard's (named by the time they were written) by folder."""
  return {os.path.relpath(os.path.join(d, f) if "tfevents" not in f else d, directory)
          for d, _, names in os.walk(directory) for f in names}


def assert_same_document(got, want, path="results"):
  if isinstance(want, dict):
    assert set(got) == set(want), path
    for key in want:
      assert_same_document(got[key], want[key], f"{path}.{key}")
  elif isinstance(want, list):
    assert len(got) == len(want), path
    for i, (g, w) in enumerate(zip(got, want)):
      assert_same_document(g, w, f"{path}[{i}]")
  elif isinstance(want, float):
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6), path
  else:
    assert got == want, path


def assert_same_run(batched: str, alone: str):
  assert _files(batched) == _files(alone)
  for run in (".", "local") if os.path.isdir(os.path.join(alone, "local")) else (".",):
    with open(os.path.join(batched, run, "results.json")) as f:
      got = json.load(f)
    with open(os.path.join(alone, run, "results.json")) as f:
      want = json.load(f)
    assert_same_document(got, want)
    with np.load(os.path.join(batched, run, "history.npz")) as g, \
        np.load(os.path.join(alone, run, "history.npz")) as w:
      assert set(g.files) == set(w.files)
      for name in w.files:
        if name.endswith(("acc", "score")):
          np.testing.assert_array_equal(g[name], w[name])
        else:
          np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6)


def spy(monkeypatch) -> list[int]:
  """The number of runs of each program train_batch trains."""
  sizes: list[int] = []
  real = train_batch.train_batch

  def counted(configs, *args, **kwargs):
    sizes.append(len(configs))
    return real(configs, *args, **kwargs)
  monkeypatch.setattr(train_batch, "train_batch", counted)
  return sizes


def test_three_seeds_of_a_sweep_as_one_program_equal_the_runs_alone(tmp_path, monkeypatch):
  sizes = spy(monkeypatch)
  seeds = (0, 1, 2)
  batched = sweep.grid(BASE, OVERRIDES, str(tmp_path / "batched"), seeds=seeds)
  outcomes = sweep.run_configs(batched, QUIET)
  # The LOCAL rows first (the others are scored against them), then FedAvg's.
  assert sizes == [3, 3]
  assert [o.read for o in outcomes] == [False] * 6
  alone = sweep.grid(BASE, OVERRIDES, str(tmp_path / "alone"), seeds=seeds)
  singles = sweep.run_configs(alone, QUIET._replace(batch_runs=False))
  assert sizes == [3, 3]
  for single, outcome in zip(singles, outcomes):
    assert_same_document(outcome.results, single.results)
  for row in batched:  # seed<s>/local, seed<s>/fedavg: fedavg scored by the LOCAL row
    assert not os.path.exists(os.path.join(row.workdir, "local"))
    assert_same_run(row.workdir, row.workdir.replace(str(tmp_path / "batched"),
                                                     str(tmp_path / "alone")))
  # Rerun: every row read, nothing trained.
  again = sweep.run_configs(batched, QUIET)
  assert sizes == [3, 3] and all(o.read for o in again)


def test_runs_the_program_refuses_train_alone(tmp_path, monkeypatch):
  sizes = spy(monkeypatch)
  # FedAMP reads sigma as a Python number: refused as one program, each runs alone.
  rows = sweep.seeds_grid({**BASE, "algorithm": "fedamp", "rounds": 1},
                          {"fedamp_sigma": [1.0, 2.0]}, workdir=str(tmp_path))
  outcomes = sweep.run_configs(rows, QUIET)
  assert sizes == [2]
  assert [o.results["algorithm"] for o in outcomes] == ["fedamp", "fedamp"]
  for row in rows:
    assert os.path.isfile(os.path.join(row.workdir, "local", "results.json"))


def test_seeds_grid_names_and_workdirs(tmp_path):
  rows = sweep.seeds_grid({**BASE, "algorithm": "fedprox"}, {"fedprox_mu": [0.01, 0.1]},
                          seed=3, seeds=2, workdir=str(tmp_path))
  assert [r.name for r in rows] == ["fedprox_mu=0.01 seed 3", "fedprox_mu=0.01 seed 4",
                                    "fedprox_mu=0.1 seed 3", "fedprox_mu=0.1 seed 4"]
  assert rows[1].workdir == str(tmp_path / "fedprox_mu=0.01" / "seed4")
  assert [r.config.algorithm.config.mu for r in rows] == [0.01, 0.01, 0.1, 0.1]
  assert len({train_batch.batch_key(r.config) for r in rows}) == 1
  # Without a workdir, each run's own default one.
  defaults = sweep.seeds_grid(BASE, {}, seeds=2)
  assert [r.workdir for r in defaults] == [train.default_workdir(r.config) for r in defaults]
  assert len({r.workdir for r in defaults}) == 2


def test_an_algorithm_sweep_trains_one_local_per_seed_and_other_values(tmp_path):
  rows = sweep.seeds_grid(BASE, {"algorithm": ["local", "fedavg", "fedprox"],
                                 "hidden": [[16], [32]]}, seeds=2, workdir=str(tmp_path))
  by_name = {r.name: r for r in rows}
  local = by_name["algorithm=local,hidden=[16] seed 1"]
  assert local.references == ()
  assert by_name["algorithm=fedprox,hidden=[16] seed 1"].references == (
      os.path.join(local.workdir, "results.json"),)
  assert by_name["algorithm=fedavg,hidden=[32] seed 0"].references == (os.path.join(
      by_name["algorithm=local,hidden=[32] seed 0"].workdir, "results.json"),)
  # A shape or an algorithm changes the program: one per value (a key each), LOCAL first.
  assert len({train_batch.batch_key(r.config) for r in rows}) == 6
  assert sweep._batches(rows, range(len(rows)))[0] == [0, 1]  # pylint: disable=protected-access
  # Without LOCAL among the values, each run trains its own reference.
  assert all(r.references == () for r in sweep.seeds_grid(
      BASE, {"algorithm": ["fedavg", "fedprox"]}, workdir=str(tmp_path)))


def test_the_spread_table_holds_each_combinations_seeds(tmp_path):
  rows = sweep.seeds_grid(BASE, {"algorithm": ["local", "fedavg"]}, seeds=2,
                          workdir=str(tmp_path))
  outcomes = [sweep.RowOutcome({"acc": acc, "r_acc": acc - 0.5, "ptr": None}, read=True)
              for acc in (0.5, 0.5, 0.6, 0.8)]
  outcomes[3] = sweep.RowOutcome(None, read=False, unfinished="not started")
  sweep.write_spread(rows, outcomes, str(tmp_path / "sweep"), "python -m x")
  table = json.loads((tmp_path / "sweep.json").read_text())
  assert table["command"] == "python -m x"
  fedavg = table["runs"][1]
  assert fedavg["run"] == "algorithm=fedavg" and fedavg["seeds_finished"] == 1
  assert fedavg["acc"] == {"mean": 0.6, "std": 0.0, "values": [0.6]} and "ptr" not in fedavg
  markdown = (tmp_path / "sweep.md").read_text().splitlines()
  assert markdown[2:] == ["| run | seeds | Acc | R-Acc |", "|---|---:|---:|---:|",
                          "| algorithm=local | 2 | 0.5000 ± 0.0000 | 0.0000 ± 0.0000 |",
                          "| algorithm=fedavg | 1 | 0.6000 | 0.1000 |"]


def run_main(*args):
  return subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)


def test_cli_seeds_and_sweep_write_each_run(tmp_path):
  proc = run_main("--algorithm=fedprox", *FAST, "--seeds=2",
                  "--sweep=fedprox_mu=0.01,0.1", f"--workdir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for mu in ("0.01", "0.1"):
    for seed in (0, 1):
      workdir = tmp_path / f"fedprox_mu={mu}" / f"seed{seed}"
      results = json.loads((workdir / "results.json").read_text())
      assert results["seed"] == seed and results["rounds"] == 2
      assert (workdir / "local" / "results.json").exists()
      recorded = json.loads((workdir / "run_config.json").read_text())
      assert recorded["config"]["algorithm"]["config"]["mu"] == float(mu)
      assert f"results in {workdir} " in proc.stdout
  assert "4 runs (fedprox_mu=0.01 seed 0 .. fedprox_mu=0.1 seed 1) as one program" in (
      proc.stderr)
  spread = [line for line in proc.stdout.splitlines() if "seeds finished" in line]
  assert [line.split(":")[0] for line in spread] == ["fedprox_mu=0.01", "fedprox_mu=0.1"]
  assert all("Acc " in line and " +- " in line for line in spread)
  table = json.loads((tmp_path / "sweep.json").read_text())
  assert [run["run"] for run in table["runs"]] == ["fedprox_mu=0.01", "fedprox_mu=0.1"]
  assert table["command"].startswith("python -m experiments.main --algorithm=fedprox")
  assert f"table in {tmp_path / 'sweep'}.md" in proc.stdout


@pytest.mark.parametrize("given,message", [
    ("--sweep=nosuch=1,2", "error: --sweep=nosuch=1,2: 'nosuch' is not a run flag"),
    ("--sweep=fedprox_mu=a", "error: --sweep=fedprox_mu=a: could not convert")])
def test_cli_bad_sweeps_stop_with_one_line(tmp_path, given, message):
  proc = run_main("--algorithm=fedprox", *FAST, given, f"--workdir={tmp_path}")
  assert proc.returncode == 1
  assert proc.stderr.strip().startswith(message) and len(proc.stderr.splitlines()) == 1
  assert not os.listdir(tmp_path)


def test_a_row_scored_against_a_local_its_batch_would_train_runs_after_it(tmp_path):
  rows = sweep.seeds_grid({**BASE, "algorithm": "fedprox"}, {"fedprox_mu": [0.01, 0.1]},
                          seeds=2, workdir=str(tmp_path))
  # mu=0.1 seed 0 scored against mu=0.01 seed 0's own LOCAL: after that row's program.
  rows[2] = rows[2]._replace(references=(os.path.join(rows[0].workdir, "local",
                                                      "results.json"),))
  assert sweep._batches(rows, range(4)) == [[0, 1], [2, 3]]  # pylint: disable=protected-access
  plain = sweep.seeds_grid({**BASE, "algorithm": "fedprox"}, {"fedprox_mu": [0.01, 0.1]},
                           seeds=2, workdir=str(tmp_path))
  assert sweep._batches(plain, range(4)) == [[0, 1, 2, 3]]  # pylint: disable=protected-access


def run_reproduce(*args):
  return subprocess.run([sys.executable, "-m", "experiments.reproduce", "--table=fedora1",
                         "--dataset=rmnist", "--rows=local,fedavg", *FAST, *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)


def test_reproduce_runs_a_rows_three_seeds_as_one_program(tmp_path):
  proc = run_reproduce("--seeds=3", f"--workdir={tmp_path / 'batched'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for row in ("1/6 local", "2/6 fedavg"):
    last = int(row[0]) + 4
    assert (f"3 runs (row {row} seed 0 .. row {last}/6 {row.split()[1]} seed 2) as one"
            " program") in proc.stderr, proc.stderr[-3000:]
  table = json.loads((tmp_path / "batched" / "table.json").read_text())
  assert [(r["algorithm"], r["seeds"]) for r in table["rows"]] == [("local", 3), ("fedavg", 3)]
  # Seed 1's rows alone give the same runs.
  proc = run_reproduce("--seed=1", "--batch_runs=false", f"--workdir={tmp_path / 'alone'}")
  assert proc.returncode == 0 and "as one program" not in proc.stderr, proc.stderr[-3000:]
  for row in ("local", "fedavg"):
    assert_same_run(str(tmp_path / "batched" / "seed1" / row),
                    str(tmp_path / "alone" / "seed1" / row))


def test_sweep_algorithm_all_is_every_registered_algorithm_local_first():
  run_flags.FLAGS(["main", "--sweep=algorithm=all", "--sweep=lr=0.1,0.01"])
  try:
    values = run_flags.sweep_values()
  finally:
    run_flags.FLAGS.unparse_flags()
  assert values["algorithm"][0] == "local" and values["lr"] == [0.1, 0.01]
  assert sorted(values["algorithm"]) == sorted(algorithms.REGISTRY)
