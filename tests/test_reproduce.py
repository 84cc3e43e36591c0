"""`python -m experiments.reproduce`: a tiny table end to end, extended, and its errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import reproduce
from fedora_jax.errors import ConfigError
from test_main import FAST, ROOT


def run_reproduce(*args):
  return subprocess.run([sys.executable, "-m", "experiments.reproduce", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_table_rows_run_and_a_rerun_adds_rows_keeping_finished_ones(tmp_path):
  common = ["--table=fedora1", "--dataset=rmnist", f"--workdir={tmp_path}", *FAST]
  proc = run_reproduce("--rows=local,fedavg", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  fedavg_timing = (tmp_path / "seed0" / "fedavg" / "timing.json").read_text()

  # The same sweep with one more row: the finished rows are restored, not retrained.
  proc = run_reproduce("--rows=fedora,fedavg", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fedavg: resuming after round 2 of 2" in proc.stderr
  assert (tmp_path / "seed0" / "fedavg" / "timing.json").read_text() == fedavg_timing

  table = json.loads((tmp_path / "table.json").read_text())
  rows = {row["algorithm"]: row for row in table["rows"]}
  assert list(rows) == ["local", "fedavg", "fedora"]  # LOCAL always, in the table's order
  for row in rows.values():
    assert 0.0 <= row["acc"] <= 1.0 and row["round_seconds"] > 0 and row["wall_seconds"] > 0
  fedavg = json.loads((tmp_path / "seed0" / "fedavg" / "results.json").read_text())
  assert rows["fedavg"]["acc"] == pytest.approx(fedavg["acc"], abs=1e-4)
  assert rows["local"]["r_acc"] == pytest.approx(0.0, abs=1e-6)
  # The paper's numbers come from the data file, with where they were printed.
  paper = reproduce.load_paper_rows("fedora1", "rmnist")
  assert rows["fedora"]["paper_acc"] == paper["fedora"]["acc"]
  assert rows["fedavg"]["paper_acc"] is None and "Table 1" in rows["fedora"]["paper_source"]
  markdown = (tmp_path / "table.md").read_text()
  assert "| fedora |" in markdown and f"{paper['fedora']['acc']:.4f}" in markdown
  assert (tmp_path / "table.png").stat().st_size > 0
  np.testing.assert_equal(table["rounds"], 2)


def test_unknown_rows_are_refused():
  with pytest.raises(ConfigError, match="unknown --rows nope"):
    reproduce.check_rows(["fedavg", "nope"])
  assert reproduce.check_rows(["fedora", "fedavg"]) == ["local", "fedavg", "fedora"]


def test_bad_row_hyperparameters_fail_before_the_sweep(tmp_path):
  proc = run_reproduce("--table=fedora1", "--rows=fedamp", "--fedamp_sigma=0",
                       f"--workdir={tmp_path}", *FAST)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].endswith("fedamp_sigma must be > 0, got 0.0")
  assert not os.path.exists(tmp_path / "seed0")


def test_seeds_give_mean_and_population_std_beside_the_paper():
  runs = [{"acc": 0.70, "r_acc": 0.01, "ptr": 0.5, "round_seconds": 0.2,
           "wall_seconds": 10.0, "results": "a"},
          {"acc": 0.80, "r_acc": 0.03, "ptr": None, "round_seconds": 0.4,
           "wall_seconds": 30.0, "results": "b"}]
  paper = {"fedora": {"acc": 0.8251, "r_acc": 0.0806, "ptr": 1.0, "source": "Table 1"}}
  row = reproduce.summarize("fedora", runs, paper)
  assert row["acc"] == pytest.approx(0.75) and row["acc_std"] == pytest.approx(0.05)
  assert row["r_acc"] == pytest.approx(0.02) and row["r_acc_std"] == pytest.approx(0.01)
  assert row["ptr"] == pytest.approx(0.5)  # a missing value is left out, not taken as 0
  assert row["paper_acc"] == 0.8251 and row["paper_source"] == "Table 1"
  assert row["round_seconds"] == pytest.approx(0.3) and row["wall_seconds"] == 40.0
  markdown = reproduce.format_markdown("T", "settings", [row])
  assert "| fedora | 0.7500 ± 0.0500 | +0.0200 ± 0.0100 |" in markdown


def test_cells_round_to_four_places_without_negative_zero():
  assert reproduce._cell(-0.00001, signed=True) == "+0.0000"
  assert reproduce._cell(0.08056, 0.01, signed=True) == "+0.0806 ± 0.0100"
  assert reproduce._cell(None) == "—"
