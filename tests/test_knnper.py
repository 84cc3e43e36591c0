"""kNN-Per: the kNN probabilities and the interpolation against hand values, a client's
scores against a numpy brute force (lambda picked on validation), lambda 0 as the global
model's own scores, and bad values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import knnper
from fedora_jax.algorithms.layers import representations
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer


def test_knn_probabilities_by_hand():
  keys = jnp.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
  labels = jnp.array([0, 1, 1])
  query = jnp.zeros((1, 2))
  p = knnper.knn_probabilities(query, keys, labels, jnp.array([True] * 3), k=2, scale=1.0,
                               num_classes=3)
  # Nearest two: d^2 = 1 (class 0) and 4 (class 1); weights exp(-d^2 / (F=2 * 1)).
  near, far = np.exp(-0.5), np.exp(-2.0)
  np.testing.assert_allclose(p[0], [near / (near + far), far / (near + far), 0.0], rtol=1e-6)
  # Entry 0 left out: its two others are both class 1.
  p = knnper.knn_probabilities(query, keys, labels, jnp.array([False, True, True]), k=2,
                               scale=1.0, num_classes=3)
  np.testing.assert_allclose(p[0], [0.0, 1.0, 0.0], rtol=1e-6)
  # k larger than the valid entries: the missing neighbours weigh 0; none valid: zeros.
  p = knnper.knn_probabilities(query, keys, labels, jnp.array([True, False, False]), k=3,
                               scale=4.0, num_classes=3)
  np.testing.assert_allclose(p[0], [1.0, 0.0, 0.0], rtol=1e-6)
  p = knnper.knn_probabilities(query, keys, labels, jnp.zeros(3, bool), k=2, scale=1.0,
                               num_classes=3)
  np.testing.assert_array_equal(p, 0.0)


def test_mixture_and_its_loss_by_hand():
  p_knn = jnp.array([1.0, 0.0])
  logits = jnp.array([0.0, np.log(3.0)])       # softmax (0.25, 0.75)
  mixed = knnper.mixed_outputs(p_knn, logits, 0.25, "probabilities")
  np.testing.assert_allclose(mixed, [0.4375, 0.5625], rtol=1e-6)
  np.testing.assert_allclose(knnper.mixed_loss(mixed, jnp.array(0), "probabilities"),
                             -np.log(0.4375), rtol=1e-6)
  mixed = knnper.mixed_outputs(p_knn, logits, 0.25, "logits")
  np.testing.assert_allclose(mixed, [0.25, 0.75 * np.log(3.0)], rtol=1e-6)
  expected = -np.log(np.exp(0.25) / (np.exp(0.25) + 3.0 ** 0.75))
  np.testing.assert_allclose(knnper.mixed_loss(mixed, jnp.array(0), "logits"), expected,
                             rtol=1e-6)


def _client(seed=0, n_train=9, n_val=5, n_test=7, num_features=4, num_classes=3):
  rng = np.random.default_rng(seed)

  def split(n, pad=2):
    x = rng.normal(size=(n + pad, num_features)).astype(np.float32)
    y = rng.integers(0, num_classes, n + pad).astype(np.int32)
    mask = np.arange(n + pad) < n
    return ClientData(x=jnp.asarray(x), y=jnp.asarray(y), mask=jnp.asarray(mask),
                      n=jnp.asarray(n, jnp.int32))
  return ClientSplits(train=split(n_train), val=split(n_val), test=split(n_test))


def _brute_force(model, params, splits, k, grid):
  """numpy: accuracy at each lambda of `grid` on val and test (the paper's mixture)."""
  def feats(data):
    return np.asarray(representations(model.apply, params, data.x, "Dense_1"))
  head = params["params"]["Dense_1"]
  train = splits.train
  keys = feats(train)[np.asarray(train.mask)]
  labels = np.asarray(train.y)[np.asarray(train.mask)]

  def accuracies(data):
    real = np.asarray(data.mask)
    f = feats(data)[real]
    y = np.asarray(data.y)[real]
    logits = f @ np.asarray(head["kernel"]) + np.asarray(head["bias"])
    soft = np.exp(logits - logits.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    p_knn = np.zeros_like(soft)
    for q in range(len(f)):
      d = ((keys - f[q]) ** 2).sum(1)
      near = np.argsort(d)[:k]
      s = np.exp(-d[near] / f.shape[1])
      for i, j in enumerate(near):
        p_knn[q, labels[j]] += s[i] / s.sum()
    return np.array([((lam * p_knn + (1 - lam) * soft).argmax(1) == y).mean()
                     for lam in grid])
  return accuracies(splits.val), accuracies(splits.test)


def test_scores_match_a_brute_force_with_lambda_picked_on_validation():
  model = tiny_model()
  params = init_params(model, seed=3)
  config = knnper.KnnPerConfig(k=3, grid=5)
  algorithm = knnper.knnper(config, tiny_trainer(model))
  grid = np.linspace(0.0, 1.0, 5)
  for seed in range(3):
    splits = _client(seed)
    val, test = _brute_force(model, params, splits, 3, grid)
    chosen = int(np.argmax(val))
    scored = algorithm.evaluate_splits(params, splits, ("val", "test"))
    np.testing.assert_allclose(scored[0].score, val[chosen], rtol=1e-6)
    np.testing.assert_allclose(scored[1].score, test[chosen], rtol=1e-6)


def test_lambda_zero_is_the_global_model():
  model = tiny_model()
  params = init_params(model, seed=1)
  trainer = tiny_trainer(model)
  splits = _client(4)
  algorithm = knnper.knnper(knnper.KnnPerConfig(interpolation="fixed", weight=0.0), trainer)
  (ours,) = algorithm.evaluate_splits(params, splits, ("test",))
  plain = trainer.evaluate(params, splits.test)
  np.testing.assert_allclose(ours.score, plain.score, rtol=1e-6)
  np.testing.assert_allclose(ours.loss, plain.loss, rtol=1e-5)


def test_capacity_keeps_that_many_real_samples():
  mask = jnp.arange(12) < 9
  kept = knnper.datastore_entries(mask, 4)
  assert int(kept.sum()) == 4 and not bool(jnp.any(kept & ~mask))
  np.testing.assert_array_equal(knnper.datastore_entries(mask, 0), mask)
  np.testing.assert_array_equal(kept, knnper.datastore_entries(mask, 4))   # fixed subset


@pytest.mark.parametrize("field,value", [("k", 0), ("scale", 0.0), ("weight", 1.5),
                                         ("grid", 1), ("capacity", -1),
                                         ("interpolation", "test"), ("mix", "sum")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"knnper: {field}"):
    knnper.knnper(knnper.KnnPerConfig()._replace(**{field: value}),
                  tiny_trainer(tiny_model()))


def test_jits_under_vmap():
  model = tiny_model()
  params = init_params(model)
  algorithm = knnper.knnper(knnper.KnnPerConfig(k=2, grid=3), tiny_trainer(model))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), _client(0), _client(1))
  run = jax.jit(jax.vmap(lambda s: algorithm.evaluate_splits(params, s, ("val", "test"))))
  scores = run(stacked)
  alone = algorithm.evaluate_splits(params, _client(1), ("val", "test"))
  np.testing.assert_allclose(scores[1].score[1], alone[1].score, rtol=1e-6)
