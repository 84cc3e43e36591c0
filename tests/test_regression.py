"""Regression: MSE training, MAE evaluation, R-MAE / PTR, and a 2-round federated run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms, metrics, results
from fedora_jax.data.client_data import Client, ClientData, stack_clients
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.simulation import TrainConfig, run_algorithm
from fedora_jax.models import build_model
from fedora_jax.models.mlp import MLP
from fedora_jax import similarity
from tiny import init_params, mean_ce, tiny_model, tiny_trainer


def _linear(w, b):
  """A one-output linear model (MLP without hidden layers) with the given weights."""
  model = MLP(hidden=(), num_outputs=1)
  params = init_params(model, num_features=len(w))
  params = jax.tree.map(lambda a: a, params)
  params["params"]["Dense_0"]["kernel"] = jnp.asarray(w, jnp.float32)[:, None]
  params["params"]["Dense_0"]["bias"] = jnp.asarray([b], jnp.float32)
  return model, params


def _trainer(model, task, **kwargs):
  return make_client_trainer(model.apply, make_optimizer(0.1, 0.0), 1, 8,
                             task=task, **kwargs)


def test_mse_loss_and_mae_score_match_hand_computed_values():
  model, params = _linear([1.0, -2.0], 0.5)
  x = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [9.0, 9.0]], np.float32)
  y = np.array([1.0, 0.0, 3.0, 100.0], np.float32)
  # Predictions 1.5, -1.5, 0.5 (and -8.5 for the padded row); errors 0.5, -1.5, -2.5.
  weights = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
  trainer = _trainer(model, "regression")
  assert trainer.task == "regression"
  np.testing.assert_allclose(trainer.loss(params, x, y, weights),
                             (0.25 + 2.25 + 6.25) / 3, rtol=1e-6)
  data = ClientData(x=x, y=y, mask=weights.astype(bool), n=np.int32(3))
  stats = trainer.evaluate(params, data)
  np.testing.assert_allclose(stats.loss, (0.25 + 2.25 + 6.25) / 3, rtol=1e-6)
  np.testing.assert_allclose(stats.score, (0.5 + 1.5 + 2.5) / 3, rtol=1e-6)  # MAE
  # Chunked evaluation (chunks of 2, last one padded) gives the same numbers.
  chunked = _trainer(model, "regression", eval_batch_size=2).evaluate(params, data)
  np.testing.assert_allclose(chunked.score, stats.score, rtol=1e-6)


def test_regression_sgd_step_follows_the_mse_gradient():
  model, params = _linear([0.0, 0.0], 0.0)
  x = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
  y = np.array([2.0, -1.0], np.float32)
  data = ClientData(x=x, y=y, mask=np.ones(2, bool), n=np.int32(2))
  new_params, stats = _trainer(model, "regression").train(params, data, jax.random.key(0))
  # One full-batch step from zero weights: grad_w = -2/n sum_i y_i x_i, grad_b = -2 mean(y).
  grad_w = -(2.0 / 2) * (y[:, None] * x).sum(0)
  np.testing.assert_allclose(new_params["params"]["Dense_0"]["kernel"][:, 0],
                             -0.1 * grad_w, rtol=1e-6)
  np.testing.assert_allclose(new_params["params"]["Dense_0"]["bias"], [-0.1 * -y.mean() * 2],
                             rtol=1e-6)
  np.testing.assert_allclose(stats.loss, np.mean(y ** 2), rtol=1e-6)


def test_classification_stays_cross_entropy_and_accuracy():
  model = tiny_model()
  params = init_params(model)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 4)).astype(np.float32)
  y = rng.integers(0, 3, 5).astype(np.int32)
  trainer = tiny_trainer(model)
  assert trainer.task == "classification"
  np.testing.assert_allclose(trainer.loss(params, x, y, np.ones(5, np.float32)),
                             mean_ce(model, params, x, y), rtol=1e-6)
  stats = trainer.evaluate(params, ClientData(x=x, y=y, mask=np.ones(5, bool),
                                              n=np.int32(5)))
  expected_acc = np.mean(np.argmax(model.apply(params, x), -1) == y)
  np.testing.assert_allclose(stats.score, expected_acc, rtol=1e-6)
  with pytest.raises(ValueError, match="unknown task"):
    make_client_trainer(model.apply, make_optimizer(0.1), 1, 8, task="ranking")


def test_r_mae_and_ptr_on_a_hand_computed_case():
  mae = np.array([1.0, 2.0, 3.0, 0.5])
  local = np.array([2.0, 2.0, 2.0, 0.0])
  # (local - mae) / local: +0.5, 0, -0.5, undefined (LOCAL's MAE is 0).
  np.testing.assert_allclose(metrics.relative_mae(mae, local), [0.5, 0.0, -0.5, np.nan])
  summary = metrics.summarize_regression(mae, local)
  assert summary.mae == pytest.approx(1.625)
  assert summary.r_mae == pytest.approx(0.0)
  assert summary.ptr == pytest.approx(0.5)  # 1 <= 2 and 2 <= 2; 3 > 2 and 0.5 > 0
  assert metrics.summarize_regression(mae, None).r_mae is None
  history = np.array([[0.3, 0.5], [0.2, 0.2], [0.5, 0.5]])
  assert metrics.best_validation_round(history) == 2
  assert metrics.best_validation_round(history, lower_is_better=True) == 1


def _regression_clients(sizes, num_features=3, seed=0):
  rng = np.random.default_rng(seed)
  clients = []
  for k, n in enumerate(sizes):
    w = rng.normal(size=num_features) + k  # related but different client tasks

    def split(m, w=w):
      x = rng.normal(size=(m, num_features)).astype(np.float32)
      return x, (x @ w + 0.1 * rng.normal(size=m)).astype(np.float32)
    clients.append(Client(*split(n), *split(4), *split(5)))
  return clients


def test_stacking_keeps_real_targets_and_the_task_follows_them():
  data = stack_clients(_regression_clients([3, 6]), num_classes=1)
  assert data.task == "regression"
  assert data.buckets[0].train.y.dtype == np.float32
  z = similarity.client_features(data.buckets[0].train.x[0], data.buckets[0].train.y[0], 1)
  assert z.shape == (6, 3 + 1)  # [X, y]: the target is one column, not a one-hot


def test_two_round_regression_run_end_to_end():
  algorithm = "fedora"  # its client subspaces take [X, y] with a real-valued y
  data = stack_clients(_regression_clients([6, 8, 7, 20]), num_classes=1)
  model = build_model("mlp", data.num_classes, hidden=(8,))
  train = TrainConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.01, log_every=0)
  ours = run_algorithm(algorithms.make(algorithm), model, data, train)
  local = run_algorithm(algorithms.make("local"), model, data, train)
  for run in (ours, local):
    assert run.history.test_score.shape == (2, 4) and run.history.val_loss.shape == (2, 4)
    assert np.all(np.isfinite(run.history.test_score)) and np.all(run.history.test_score >= 0)
  # The reported MAE is the mean absolute error of the personalized models' predictions.
  info = {"dataset": "synthetic", "algorithm": algorithm, "setting": "natural",
          "num_clients": 4, "seed": 0, "rounds": 2, "task": "regression"}
  client_info = {"n_train": data.split_sizes("train")}
  report = results.build_results(info, ours, results.client_scores(ours, "regression"),
                                 results.client_scores(local, "regression"), client_info)
  assert "acc" not in report and "r_acc" not in report
  maes = np.array([c["mae"] for c in report["clients"]])
  local_maes = np.array([c["local_mae"] for c in report["clients"]])
  assert report["mae"] == pytest.approx(maes.mean(), abs=1e-5)
  assert report["ptr"] == pytest.approx(np.mean(maes <= local_maes), abs=1e-6)
  assert report["r_mae"] == pytest.approx(
      np.mean((local_maes - maes) / local_maes), abs=1e-4)
  assert "MAE" in results.format_table(report)
