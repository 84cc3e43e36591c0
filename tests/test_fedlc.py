"""FedLC: the calibrated loss against the paper's formula written out in numpy (and
PFLlib's cross-entropy form), the class counts, and one local step on the calibrated
cross-entropy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedlc
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_calibrated_loss_is_the_papers():
  logits = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
  y = np.array([0, 2])
  counts = np.array([16.0, 1.0, 0.0])  # class 2 absent: n = 1e-8
  tau = 0.5
  margin = tau * np.maximum(counts, 1e-8) ** -0.25  # [0.25, 0.5, 50]
  calibrated = logits - margin
  others = [-(calibrated[i, y[i]] - np.log(sum(np.exp(calibrated[i, c]) for c in range(3)
                                              if c != y[i]))) for i in range(2)]
  everything = [-(calibrated[i, y[i]] - np.log(np.exp(calibrated[i]).sum())) for i in range(2)]
  offsets = fedlc.calibration(jnp.asarray(counts), tau)
  for denominator, by_hand in (("others", others), ("all", everything)):
    np.testing.assert_allclose(
        fedlc.calibrated_loss(jnp.asarray(logits), jnp.asarray(y), jnp.ones(2), offsets,
                              denominator), np.mean(by_hand), rtol=1e-5)
  # A padded sample (weight 0) counts for nothing.
  np.testing.assert_allclose(
      fedlc.calibrated_loss(jnp.asarray(logits), jnp.asarray(y), jnp.array([1.0, 0.0]),
                            offsets, "all"), everything[0], rtol=1e-5)


def test_class_counts_of_real_samples():
  y = jnp.array([[0, 2, 2, 1], [1, 1, 0, 0]])
  mask = jnp.array([[True, True, True, False], [True, True, False, False]])
  np.testing.assert_array_equal(fedlc.class_counts(y, mask, 4), [1, 2, 2, 0])


def test_local_steps_descend_the_calibrated_cross_entropy():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  params = init_params(model)
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (2,) + a.shape), params)
  algorithm = fedlc.fedlc(fedlc.FedLcConfig(tau=0.8, denominator="all"), trainer)
  server = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                      key=jax.random.key(0))).server
  all_labels = np.concatenate([c.y_train for c in clients])
  np.testing.assert_array_equal(server.class_counts, np.bincount(all_labels, minlength=3))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(jnp.zeros(()), server, splits, jax.random.key(0))
  client = clients[0]
  margin = 0.8 * np.maximum(np.bincount(client.y_train, minlength=3), 1e-8) ** -0.25
  expected = params
  for _ in range(2):
    g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(p, client.x_train) - margin, client.y_train).mean())(expected)
    expected = jax.tree.map(lambda p, g: p - LR * g, expected, g)
  chex.assert_trees_all_close(out.upload, expected, atol=1e-6)


@pytest.mark.parametrize("field,value", [("tau", -1.0), ("denominator", "none"),
                                         ("counts", "server")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedlc: {field}"):
    fedlc.fedlc(fedlc.FedLcConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
