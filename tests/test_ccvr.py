"""CCVR: the clients' class statistics and the server's global Gaussians against numpy,
the virtual counts by hand, the samples' moments, one calibration SGD step by hand, and
which rounds calibrate."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import ccvr
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer

Z = np.array([[1.0, 2.0], [3.0, 0.0], [2.0, 5.0], [-1.0, 1.0], [4.0, 4.0], [9.0, 9.0]])
Y = np.array([0, 0, 0, 1, 2, 2])
MASK = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])   # the last sample is padding


@pytest.mark.parametrize("covariance,ddof", [("unbiased", 1), ("biased", 0)])
def test_class_feature_stats_match_numpy(covariance, ddof):
  stats = ccvr.class_feature_stats(jnp.asarray(Z), jnp.asarray(Y), jnp.asarray(MASK), 4,
                                   covariance)
  np.testing.assert_allclose(stats.counts, [3, 1, 1, 0])
  np.testing.assert_allclose(stats.means[0], Z[:3].mean(axis=0), rtol=1e-6)
  np.testing.assert_allclose(stats.means[2], Z[4], rtol=1e-6)   # the padding left out
  np.testing.assert_allclose(stats.covs[0], np.cov(Z[:3].T, ddof=ddof), rtol=1e-5)
  np.testing.assert_allclose(stats.covs[1:], 0.0)                # one sample, or none


def test_global_gaussians_are_the_pooled_sample_statistics():
  rng = np.random.default_rng(0)
  parts = [rng.normal(size=(n, 3)) + i for i, n in enumerate((4, 7, 5))]
  stats = [ccvr.class_feature_stats(jnp.asarray(z), jnp.zeros(len(z), jnp.int32),
                                    jnp.ones(len(z)), 1) for z in parts]
  stacked = jax.tree.map(lambda *s: jnp.stack(s), *stats)
  sampled = jnp.array([True, False, True])   # client 1 sat the round out
  gaussians = ccvr.global_gaussians(stacked, sampled)
  pooled = np.concatenate([parts[0], parts[2]])
  np.testing.assert_allclose(gaussians.counts, [9])
  np.testing.assert_allclose(gaussians.means[0], pooled.mean(axis=0), rtol=1e-5)
  np.testing.assert_allclose(gaussians.covs[0], np.cov(pooled.T), rtol=1e-4, atol=1e-6)


def test_virtual_counts_by_hand():
  counts = jnp.array([6.0, 0.0, 2.0, 1.0])   # class 3's single sample has no covariance
  labels, real = ccvr.virtual_labels(counts, 2, "proportional")
  # 8 slots dealt by 6 : 2 over the classes with N_c >= 2.
  np.testing.assert_array_equal(labels, [0, 0, 0, 0, 0, 0, 2, 2])
  assert bool(real.all())
  labels, real = ccvr.virtual_labels(counts, 2, "equal")
  np.testing.assert_array_equal(labels, [0, 0, 1, 1, 2, 2, 3, 3])
  np.testing.assert_array_equal(real, [1, 1, 0, 0, 1, 1, 0, 0])


def test_virtual_samples_have_the_gaussians_moments():
  # A rank-one covariance (the samples on a line through the mean) and a full one.
  covs = jnp.array([[[4.0, 2.0], [2.0, 1.0]], [[1.0, 0.3], [0.3, 0.5]]])
  gaussians = ccvr.FeatureStats(means=jnp.array([[1.0, -1.0], [0.0, 3.0]]), covs=covs,
                                counts=jnp.array([10.0, 10.0]))
  virtual = ccvr.sample_virtual(gaussians, jax.random.key(0), 4000, "equal")
  x, y = np.asarray(virtual.x), np.asarray(virtual.y)
  first = x[y == 0] - np.array([1.0, -1.0])
  np.testing.assert_allclose(first[:, 0], 2.0 * first[:, 1], atol=1e-4)   # on the line
  for c in range(2):
    np.testing.assert_allclose(x[y == c].mean(axis=0), gaussians.means[c], atol=0.06)
    # 4,000 draws: a variance's standard error is sigma^2 sqrt(2 / 4000), 2.2 %.
    np.testing.assert_allclose(np.cov(x[y == c].T), covs[c], rtol=0.1, atol=0.05)


def test_calibration_is_one_sgd_step_of_the_head_by_hand():
  head = {"params": {"Dense_1": {"kernel": jnp.array([[1.0, 0.0], [0.0, 1.0]]),
                                 "bias": jnp.zeros(2)}}}
  model = {"params": {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)},
                      **head["params"]}}
  virtual = ClientData(x=jnp.array([[1.0, 0.0], [0.0, 2.0]]), y=jnp.array([1, 1]),
                       mask=jnp.ones(2, bool), n=jnp.array(2))
  trainer = make_client_trainer(lambda p, x: x, make_optimizer(0.5, 0.0), 1, 8)
  new = ccvr.calibrate_head(model, "Dense_1", virtual, jax.random.key(0), trainer)
  # Mean cross-entropy of logits x W: the gradient is mean_n x_n^T (softmax_n - e_y).
  x, w = np.array([[1.0, 0.0], [0.0, 2.0]]), np.eye(2)
  p = np.exp(x @ w) / np.exp(x @ w).sum(axis=1, keepdims=True)
  err = p - np.eye(2)[[1, 1]]
  np.testing.assert_allclose(new["params"]["Dense_1"]["kernel"], w - 0.5 * x.T @ err / 2,
                             rtol=1e-5)
  np.testing.assert_allclose(new["params"]["Dense_1"]["bias"], -0.5 * err.mean(axis=0),
                             rtol=1e-5)
  chex.assert_trees_all_close(new["params"]["Dense_0"], model["params"]["Dense_0"])


def _round(config, round_index):
  model = tiny_model()
  algorithm = ccvr.ccvr(config, tiny_trainer(model))
  params = init_params(model)
  z = jnp.asarray(np.random.default_rng(1).normal(size=(10, 5)))
  stats = ccvr.class_feature_stats(z, jnp.arange(10) % 3, jnp.ones(10), 3)
  uploads = ccvr.CcvrUpload(params=jax.tree.map(lambda p: jnp.stack([p + 1, p + 3]),
                                                params),
                            stats=jax.tree.map(lambda s: jnp.stack([s, s]), stats))
  server = ccvr.CcvrServer(model=params, scored=params, key=jax.random.key_data(
      jax.random.key(0)), round=jnp.array(round_index))
  return params, algorithm.aggregate(server, jnp.zeros(2), uploads, jnp.array([1.0, 1.0]))


def test_last_calibrates_only_the_last_round():
  config = ccvr.CcvrConfig(rounds=3)
  params, before = _round(config, 1)
  averaged = jax.tree.map(lambda p: p + 2, params)
  chex.assert_trees_all_close(before.server.model, averaged, rtol=1e-6)
  chex.assert_trees_all_close(before.server.scored, averaged, rtol=1e-6)  # FedAvg's
  _, last = _round(config, 2)
  chex.assert_trees_all_close(last.server.model, averaged, rtol=1e-6)
  # The round's starting model, its body kept and its classifier trained.
  scored = last.server.scored["params"]
  chex.assert_trees_all_close(scored["Dense_0"], params["params"]["Dense_0"])
  assert not np.allclose(scored["Dense_1"]["kernel"], params["params"]["Dense_1"]["kernel"])
  _, every = _round(config._replace(calibrate="every"), 0)
  chex.assert_trees_all_close(every.server.scored["params"]["Dense_0"],
                              params["params"]["Dense_0"])


@pytest.mark.parametrize("field,value", [("calibrate", "first"), ("covariance", "x"),
                                         ("samples_per_class", 0), ("rounds", 0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"ccvr: {field}"):
    ccvr.ccvr(ccvr.CcvrConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
