"""fedora_jax.sweep from Python: named overrides -> configs -> rows run, read again when
the sweep reruns, only read with train=False, a row scored against its seed's LOCAL."""

import pytest

from fedora_jax import sweep
from fedora_jax.errors import TrainingDivergedError

BASE = {"num_clients": 3, "rounds": 2, "local_epochs": 1, "hidden": [16], "log_every": 0,
        "checkpoint_every": 0}
OVERRIDES = {"local": {"algorithm": "local"}, "fedavg": {"algorithm": "fedavg"}}


def test_a_python_sweep_runs_reads_and_reports_its_rows(tmp_path):
  rows = sweep.grid(BASE, OVERRIDES, str(tmp_path))
  assert [r.workdir for r in rows] == [str(tmp_path / "seed0" / "local"),
                                       str(tmp_path / "seed0" / "fedavg")]
  assert rows[1].references == (str(tmp_path / "seed0" / "local" / "results.json"),)
  assert rows[1].config.algorithm.name == "fedavg" and rows[1].config.train.rounds == 2
  options = sweep.Options(progress=lambda label: None)
  local, fedavg = sweep.run_configs(rows, options)
  assert not local.read and not fedavg.read
  # Scored against the LOCAL row, not a LOCAL of its own.
  assert not (tmp_path / "seed0" / "fedavg" / "local").exists()
  assert ([c["local_acc"] for c in fedavg.results["clients"]]
          == [c["acc"] for c in local.results["clients"]])
  # Run again: every row read, nothing trained.
  again = sweep.run_configs(rows, options)
  assert [o.read for o in again] == [True, True] and again[1].results == fedavg.results
  # Only read, at more rounds than they ran: not finished, and why.
  longer = sweep.grid({**BASE, "rounds": 3}, OVERRIDES, str(tmp_path))
  read = sweep.run_configs(longer, options._replace(train=False))
  assert [o.results for o in read] == [None, None]
  assert read[0].unfinished == "not finished, no checkpoint saved"
  # A finished row's numbers, as a table reads them.
  row_run = sweep.read_row_run(rows[1].workdir)
  assert row_run.acc == pytest.approx(fedavg.results["acc"])
  assert row_run.machine.startswith("cpu x") and row_run.wall_seconds > 0


def test_a_diverged_row_is_left_out_as_failed_and_the_sweep_goes_on(tmp_path):
  overrides = {"local": {"algorithm": "local"},
               "diverges": {"algorithm": "fedavgm", "fedavgm_server_lr": 1e30},
               "fedavg": {"algorithm": "fedavg"}}
  rows = sweep.grid(BASE, overrides, str(tmp_path))
  told = []
  options = sweep.Options(progress=lambda label: None,
                          on_diverged=lambda row, message: told.append(row.name))
  local, diverged, fedavg = sweep.run_configs(rows, options)
  assert told == ["diverges seed 0"]
  assert diverged.results is None and diverged.unfinished.startswith("failed: NaN or Inf")
  assert local.results is not None and fedavg.results is not None
  # Recorded for this sweep: read again, it is left out without training.
  again = sweep.run_configs(rows, options)
  assert told == ["diverges seed 0"] and again[1].unfinished == diverged.unfinished
  # Without on_diverged, the library raises, naming the row.
  (tmp_path / "seed0" / "diverges" / sweep.STALLED_ROW).unlink()
  with pytest.raises(TrainingDivergedError, match="^diverges seed 0: NaN or Inf"):
    sweep.run_configs(rows, sweep.Options(progress=lambda label: None))
