"""--eval_every: test scored only in the rounds it is due, the reported results exact."""

import numpy as np
import pytest

from fedora_jax import algorithms, metric_writer, plots
from fedora_jax import train as train_lib
from fedora_jax import results as results_lib
from fedora_jax.checkpoint import Checkpointer
from fedora_jax.progress import format_mean
from fedora_jax.simulation import TrainConfig, due_for_test, run_algorithm
from tiny import tiny_data, tiny_model

ROUNDS = 7


def _run(eval_every: int, rounds: int = ROUNDS, checkpointer=None):
  data, _ = tiny_data([12, 10, 12], seed=3)
  train = TrainConfig(rounds=rounds, local_epochs=1, batch_size=4, lr=0.3, log_every=0,
                      eval_every=eval_every)
  return run_algorithm(algorithms.make("fedavg", algorithms.default_config("fedavg", train)),
                       tiny_model(),
                       data, train, checkpointer=checkpointer)


def _scored_rounds(history) -> list[int]:
  return [r + 1 for r in range(len(history.test_score))
          if not np.isnan(history.test_score[r]).any()]


@pytest.fixture(scope="module")
def every_round():
  return _run(eval_every=1)


@pytest.fixture(scope="module")
def every_third():
  return _run(eval_every=3)


def test_test_is_scored_every_nth_round_at_the_last_and_at_each_new_best(every_round,
                                                                       every_third):
  np.testing.assert_allclose(every_third.history.val_score, every_round.history.val_score,
                             rtol=1e-6)
  means = every_round.history.val_score.mean(axis=1)
  new_best = [r + 1 for r in range(ROUNDS) if r == 0 or means[r] > means[:r].max()]
  want = sorted({3, 6, ROUNDS, *new_best})
  assert _scored_rounds(every_third.history) == want
  assert len(want) < ROUNDS  # rounds were skipped: the case is not vacuous
  scored = np.array(want) - 1
  np.testing.assert_allclose(every_third.history.test_score[scored],
                             every_round.history.test_score[scored], rtol=1e-6)
  np.testing.assert_allclose(every_third.history.test_loss[scored],
                             every_round.history.test_loss[scored], rtol=1e-6)


def test_final_and_best_validation_results_are_those_of_every_round(every_round, every_third):
  ours, theirs = (results_lib.client_scores(every_third),
                  results_lib.client_scores(every_round))
  assert ours.best_round == theirs.best_round
  np.testing.assert_allclose(ours.final, theirs.final, rtol=1e-6)
  np.testing.assert_allclose(ours.best_val, theirs.best_val, rtol=1e-6)


def test_a_resumed_run_scores_the_rounds_an_unbroken_one_does(tmp_path, every_third):
  checkpointer = Checkpointer(str(tmp_path), every=2)
  _run(eval_every=3, rounds=4, checkpointer=checkpointer)
  resumed = _run(eval_every=3, checkpointer=checkpointer)
  assert resumed.resumed_from_round == 4
  # The 4-round run scored its last round; after it, the restored rounds' best validation
  # decides, as in the unbroken run (which skips round 5).
  after = [r for r in _scored_rounds(resumed.history) if r > 4]
  assert after == [r for r in _scored_rounds(every_third.history) if r > 4]
  assert 5 not in after


@pytest.mark.parametrize("round_number,mean_val,best,lower,due", [
    (4, 0.1, 0.5, False, True),       # every 2nd round
    (3, 0.4, 0.5, False, False),      # not better, not due
    (3, 0.5, 0.5, False, False),      # a tie is not a new best (the first round counts)
    (3, 0.6, 0.5, False, True),       # a new best validation accuracy
    (3, 0.4, 0.5, True, True),        # a regression's new best: a lower MAE
    (1, 0.1, np.nan, False, True),    # no round before it
    (9, 0.1, 0.5, False, True),       # the last round
])
def test_due_for_test(round_number, mean_val, best, lower, due):
  train = TrainConfig(rounds=9, eval_every=2)
  val_score = np.array([mean_val - 0.1, mean_val + 0.1])
  assert due_for_test(round_number, train, val_score, best, lower) is due


def test_a_round_without_test_is_left_out_of_logs_and_curves(every_third):
  history = every_third.history
  skipped = next(r for r in range(ROUNDS) if np.isnan(history.test_score[r]).all())
  metrics = history._replace(**{f: getattr(history, f)[skipped] for f in history._fields
                                if f != "extra" and getattr(history, f) is not None},
                             extra={})
  scalars = metric_writer.round_scalars(metrics, "fedavg")
  assert "val/accuracy" in scalars and "test/accuracy" not in scalars
  assert format_mean(metrics.test_score) == "n/a"
  assert format_mean(np.array([0.25, 0.5])) == "0.3750"
  rounds, curve = plots.mean_per_round(history.test_score)
  assert list(rounds) == _scored_rounds(history) and np.isfinite(curve).all()


def test_results_record_eval_every_only_when_it_is_not_one():
  assert "eval_every" not in train_lib._train_info(TrainConfig())  # golden files unchanged
  assert train_lib._train_info(TrainConfig(eval_every=5))["eval_every"] == 5
