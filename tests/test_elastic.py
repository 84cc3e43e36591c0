"""Elastic aggregation: the clients' sensitivity (a moving average of |g| over the batches
of a share of their data, at the received model) against a hand computation, zeta and the
server's elastic step by hand, the per-tensor form, and bad values."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import elastic
from fedora_jax.engine.local_training import epoch_batches
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

MU = 0.9


def test_sensitivity_is_the_moving_average_over_the_shared_batches():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=0.1, batch_size=2, epochs=1)
  theta = init_params(model)
  start = jax.tree.map(lambda p: jnp.full_like(p, 0.2), theta)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = elastic.elastic(elastic.ElasticConfig(mu=MU, sample_ratio=0.5), trainer)
  out = algorithm.client_update(start, theta, splits, jax.random.key(3))
  # int(0.5 * 6) = 3 samples of the shuffled epoch: a batch of two, then one of one.
  sense_key, _ = jax.random.split(jax.random.key(3))
  indices, _ = epoch_batches(sense_key, splits.train.mask, splits.train.n, 2,
                             trainer.steps_per_epoch(splits.train.mask.shape[0]))
  order = np.asarray(indices).reshape(-1)
  x, y = np.asarray(splits.train.x), np.asarray(splits.train.y)
  omega = start
  for batch in (order[:2], order[2:3]):
    g = jax.grad(mean_ce, argnums=1)(model, theta, x[batch], y[batch])
    omega = jax.tree.map(lambda o, g: MU * o + (1 - MU) * jnp.abs(g), omega, g)
  chex.assert_trees_all_close(out.state, omega, atol=1e-6)
  chex.assert_trees_all_close(out.upload.sensitivity, omega, atol=1e-6)
  del clients


def test_layer_sensitivity_is_the_squared_gradient_norm():
  grads = {"a": jnp.array([3.0, -4.0]), "b": jnp.array([[1.0, 2.0]])}
  s = elastic.gradient_sensitivity(grads, "layer")
  np.testing.assert_allclose(s["a"], 25.0)
  np.testing.assert_allclose(s["b"], 5.0)


def test_coefficients_by_hand():
  # Three slots, the second sat the round out (its junk must not count in the max).
  omega = {"w": jnp.array([[1.0, 0.0], [9.0, 9.0], [3.0, 0.0]])}
  weights = jnp.array([1.0, 0.0, 3.0])
  zeta = elastic.elastic_coefficients(omega, weights, 0.5)
  # mean (1 + 9) / 4 = 2.5, max 3: 1.5 - 2.5 / 3; an all-zero column: 1.5 - 0 / 1e-7.
  np.testing.assert_allclose(zeta["w"], [1.5 - 2.5 / 3, 1.5], rtol=1e-6)


def test_server_step_scales_the_mean_update():
  algorithm = elastic.elastic(elastic.ElasticConfig(tau=0.5), tiny_trainer(tiny_model()))
  server = {"params": {"w": jnp.array([1.0, 1.0])}, "batch_stats": {"m": jnp.array(2.0)}}
  uploads = elastic.ElasticUpload(
      delta={"params": {"w": jnp.array([[0.4, 0.2], [7.0, 7.0], [0.0, 0.6]])},
             "batch_stats": {"m": jnp.array([1.0, 5.0, 3.0])}},
      sensitivity={"params": {"w": jnp.array([[2.0, 1.0], [9.0, 9.0], [2.0, 3.0]])},
                   "batch_stats": {"m": jnp.array([1.0, 1.0, 1.0])}})
  weights = jnp.array([1.0, 0.0, 1.0])
  new = algorithm.aggregate(server, (), uploads, weights).server
  # w: mean delta (0.2, 0.4); zeta (1.5 - 2/2, 1.5 - 2/3) = (0.5, 5/6)
  np.testing.assert_allclose(new["params"]["w"], [1.0 - 0.5 * 0.2, 1.0 - 5 / 6 * 0.4],
                             rtol=1e-6)
  # a folded BatchNorm average takes the plain mean: 2 - (1 + 3) / 2
  np.testing.assert_allclose(new["batch_stats"]["m"], 0.0, atol=1e-6)


@pytest.mark.parametrize("field,value", [("tau", -0.1), ("mu", 1.0), ("sample_ratio", 0.0),
                                         ("granularity", "block")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"elastic: {field}"):
    elastic.elastic(elastic.ElasticConfig()._replace(**{field: value}),
                    tiny_trainer(tiny_model()))
