"""Run progress (fedora_jax.progress): plain lines, the terminal bar, what run_algorithm
tells them, and which one a command picks (experiments/cli.py)."""

import dataclasses
import io
import logging

import numpy as np
import pytest

from experiments import cli
from experiments import flags as run_flags
from fedora_jax import algorithms, progress, simulation
from fedora_jax.errors import TrainingDivergedError
from fedora_jax.rounds import RoundMetrics
from fedora_jax.simulation import TrainConfig, run_algorithm
import tiny


def metrics(val, test, k=2):
  return RoundMetrics(train_loss=np.ones(k), local_steps=np.ones(k), val_loss=np.ones(k),
                      val_score=np.full(k, val), test_loss=np.ones(k),
                      test_score=np.full(k, test), extra={})


class Lines(logging.Handler):
  def __init__(self):
    super().__init__()
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture
def lines():
  log = logging.getLogger("test_progress")
  handler = Lines()
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  yield log, handler.lines
  log.removeHandler(handler)


def test_plain_lines_every_log_every_rounds_and_after_the_last(lines):
  log, seen = lines
  reporter = progress.LogProgress(log_every=2, log=log)
  reporter.start("fedora", 5, "classification")
  reporter.compiled(3.0, 0)
  for r in range(1, 6):
    reporter.round_done(r, metrics(0.5, 0.25), 0.5)
  reporter.close()
  assert seen == [
      "fedora round 2/5: 0.500 s/round, val acc 0.5000, test acc 0.2500, ETA 2 s",
      "fedora round 4/5: 0.500 s/round, val acc 0.5000, test acc 0.2500, ETA 0 s",
      "fedora round 5/5: 0.500 s/round, val acc 0.5000, test acc 0.2500, ETA 0 s"]
  # A label names the runs (reproduce's rows); a regression reports MAE; 0: silent.
  seen.clear()
  labelled = progress.LogProgress(log_every=1, label="row 2/3 fedavg seed 0", log=log)
  labelled.start("fedavg", 1, "regression")
  labelled.round_done(1, metrics(1.5, 2.0), 0.25)
  assert seen == ["row 2/3 fedavg seed 0 round 1/1: 0.250 s/round, val mae 1.5000,"
                  " test mae 2.0000, ETA 0 s"]
  silent = progress.LogProgress(log_every=0, log=log)
  silent.start("fedavg", 1, "classification")
  silent.round_done(1, metrics(0.5, 0.5), 0.1)
  assert len(seen) == 1


def test_bar_shows_rounds_speed_eta_and_scores():
  out = io.StringIO()
  bar = progress.ProgressBar(label="row 3/8 fedavg seed 0", file=out)
  bar.start("fedavg", 4, "classification")
  bar.compiled(1.5, 0)
  assert "0/4 rounds [00:00, compiled in 1.5 s]" in out.getvalue()
  bar.round_done(1, metrics(0.5, 0.25), 2.0)
  bar.round_done(2, metrics(0.75, 0.5), 2.0)
  bar.close()
  screen = out.getvalue().split("\r")[-1]  # what the line shows last
  assert screen.startswith("row 3/8 fedavg seed 0:  50%|")
  assert "2/4 rounds" in screen
  assert "2.000 s/round, ETA 4 s, val acc 0.7500, test acc 0.5000" in screen
  # A resumed run starts its bar at the restored round; one bar per run, in turn.
  out = io.StringIO()
  bar = progress.ProgressBar(file=out)
  bar.start("local", 3, "classification")
  bar.compiled(0.5, 2)
  bar.round_done(3, metrics(0.5, 0.5), 0.1)
  bar.close()
  screen = out.getvalue().split("\r")[-1]
  assert screen.startswith("local: 100%|") and "3/3 rounds" in screen


def test_eta_reads_like_a_clock():
  assert [progress.format_seconds(s) for s in (4.4, 59.6, 187, 3723)] == [
      "4 s", "1:00", "3:07", "1:02:03"]


class Recorder:
  def __init__(self):
    self.calls = []

  def start(self, run, rounds, task):
    self.calls.append(("start", run, rounds, task))

  def compiled(self, seconds, first_round):
    self.calls.append(("compiled", first_round))

  def round_done(self, round_number, metrics, seconds_per_round):
    assert seconds_per_round > 0 and metrics.test_score.shape == (3,)
    self.calls.append(("round", round_number))

  def close(self):
    self.calls.append(("close",))


def test_run_algorithm_reports_compile_rounds_and_close_even_on_error():
  data, _ = tiny.tiny_data([8, 8, 8])
  train = TrainConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.1, log_every=0)
  recorder = Recorder()
  run_algorithm(algorithms.make("local"), tiny.tiny_model(), data, train,
                progress=recorder)
  assert recorder.calls == [("start", "local", 2, "classification"), ("compiled", 0),
                            ("round", 1), ("round", 2), ("close",)]
  recorder = Recorder()
  with pytest.raises(TrainingDivergedError):
    run_algorithm(algorithms.make("local"), tiny.tiny_model(), data,
                  dataclasses.replace(train, lr=1e30), progress=recorder)
  assert recorder.calls[-1] == ("close",) and ("round", 1) not in recorder.calls


class FakeTerminal(io.StringIO):
  def isatty(self):
    return True


def test_the_command_draws_a_bar_only_on_a_terminal(monkeypatch):
  flag_values = run_flags.FLAGS
  flag_values(["main"])
  try:
    monkeypatch.setattr("sys.stderr", FakeTerminal())
    assert isinstance(cli.progress_reporter("row 1/2"), progress.ProgressBar)
    flag_values.verbose = True  # C++ log lines would tear the bar
    assert isinstance(cli.progress_reporter(), progress.LogProgress)
    flag_values.verbose, flag_values.log_every = False, 0
    assert isinstance(cli.progress_reporter(), progress.LogProgress)
    flag_values.log_every = 10
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a pipe, a file, CI
    reporter = cli.progress_reporter("row 1/2")
    assert isinstance(reporter, progress.LogProgress)
    assert reporter.log_every == 10 and reporter.label == "row 1/2"
  finally:
    flag_values.unparse_flags()


def test_log_records_become_plain_lines(capsys):
  handler = progress.LineHandler()
  handler.emit(logging.LogRecord("fedora_jax", logging.INFO, __file__, 1, "rmnist: %d clients",
                                 (8,), None))
  handler.emit(logging.LogRecord("jax._src.xla_bridge", logging.WARNING, __file__, 1,
                                 "no GPU", (), None))
  assert capsys.readouterr().err == "rmnist: 8 clients\nwarning (jax._src.xla_bridge): no GPU\n"


def test_the_library_default_is_lines_off_a_terminal_and_none_is_silent(capsys):
  assert isinstance(progress.default_progress(0), progress.Silent)
  lines = progress.default_progress(1, label="fedavg")  # pytest's stderr: no terminal
  assert isinstance(lines, progress.LogProgress)
  lines.start("fedavg", 2, "classification")
  lines.round_done(2, metrics([0.5, 0.5], [0.25, 0.75]), 0.5)
  assert capsys.readouterr().err.startswith("fedavg round 2/2: 0.500 s/round")
  assert isinstance(simulation.resolve_progress(None, 1), progress.Silent)
  assert simulation.resolve_progress(lines, 1) is lines


def test_a_note_ends_each_round_report_while_noting(lines):
  """DP's epsilon so far on the progress line (train.py notes it during a DP run)."""
  log, seen = lines
  reporter = progress.LogProgress(log_every=1, log=log)
  bar = progress.ProgressBar(file=io.StringIO())
  postfixes = []
  for each in (reporter, bar):
    each.start("fedavg+dp", 2, "classification")
    with progress.noting(each, lambda r: f"epsilon {r * 1.5:.3g}"):
      each.round_done(1, metrics(0.5, 0.25), 0.5)
      postfixes.append(getattr(getattr(each, "_bar", None), "postfix", None))
    each.round_done(2, metrics(0.5, 0.25), 0.5)
  assert seen[0].endswith(", epsilon 1.5") and "epsilon" not in seen[1]
  assert postfixes[1].endswith(", epsilon 1.5") and "epsilon" not in bar._bar.postfix  # pylint: disable=protected-access
  bar.close()
  with progress.noting(progress.Silent(), lambda r: "unused"):  # no `note`: as it was
    pass
