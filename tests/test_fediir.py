"""FedIIR: the classifier gradient and the penalised loss against numpy, the server's
running mean of the sampled clients' gradients by hand, and the bad values refused."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fediir
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer

Z = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
Y = np.array([0, 1, 1])
W = np.array([1.0, 1.0, 0.0])   # the third sample is padding


def numpy_head_gradient(kernel, bias, z, y, w):
  logits = z @ kernel + bias
  p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  err = (p - np.eye(kernel.shape[1])[y]) * w[:, None] / w.sum()
  return z.T @ err, err.sum(axis=0)


def test_head_gradient_by_hand():
  kernel, bias = np.array([[0.5, -1.0], [2.0, 0.0]]), np.array([0.1, -0.2])
  grad = fediir.head_gradient({"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)},
                              jnp.asarray(Z), jnp.asarray(Y), jnp.asarray(W))
  dk, db = numpy_head_gradient(kernel, bias, Z, Y, W)
  np.testing.assert_allclose(grad["kernel"], dk, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad["bias"], db, rtol=1e-5, atol=1e-7)


def test_penalised_loss_by_hand():
  model = tiny_model()
  params = init_params(model)
  p = jax.tree.map(np.asarray, params["params"])
  x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
  z = np.maximum(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0.0)   # the MLP's body
  y, w = np.array([0, 2, 1]), np.array([1.0, 1.0, 1.0])
  head = p["Dense_1"]
  logits = z @ head["kernel"] + head["bias"]
  ce = np.mean(np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(3), y])
  g = {"kernel": np.full_like(head["kernel"], 0.1), "bias": np.full_like(head["bias"], -0.2)}
  dk, db = numpy_head_gradient(head["kernel"], head["bias"], z, y, w)
  expected = ce + 0.5 * (np.sum((dk - g["kernel"]) ** 2) + np.sum((db - g["bias"]) ** 2))
  loss = fediir.iir_loss(model.apply, "Dense_1", jax.tree.map(jnp.asarray, g), 0.5)
  np.testing.assert_allclose(loss(params, jnp.asarray(x), jnp.asarray(y), jnp.asarray(w)),
                             expected, rtol=1e-5)
  # The penalty's gradient reaches the body through the features (create_graph=True).
  grads = jax.grad(loss)(params, jnp.asarray(x), jnp.asarray(y), jnp.asarray(w))
  plain = jax.grad(fediir.iir_loss(model.apply, "Dense_1", jax.tree.map(jnp.asarray, g),
                                   0.0))(params, jnp.asarray(x), jnp.asarray(y),
                                         jnp.asarray(w))
  assert not np.allclose(grads["params"]["Dense_0"]["kernel"],
                         plain["params"]["Dense_0"]["kernel"])


def test_server_running_mean_by_hand():
  old = {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}
  grads = {"kernel": jnp.stack([jnp.full((2, 2), 2.0), jnp.full((2, 2), 50.0),
                                jnp.full((2, 2), 5.0)]),
           "bias": jnp.array([[1.0, 1.0], [9.0, 9.0], [4.0, 4.0]])}
  batches = jnp.array([1.0, 7.0, 2.0])
  sampled = jnp.array([True, False, True])   # client 1 sat the round out
  new = fediir.updated_mean(old, grads, batches, sampled, 0.9)
  # Mean over the sampled clients' batches: (1 x 2 + 2 x 5) / 3 = 4, (1 + 8) / 3 = 3.
  np.testing.assert_allclose(new["kernel"], 0.9 * 1.0 + 0.1 * 4.0, rtol=1e-6)
  np.testing.assert_allclose(new["bias"], 0.1 * 3.0, rtol=1e-6)
  kept = fediir.updated_mean(old, grads, batches, jnp.zeros(3, bool), 0.9)
  chex.assert_trees_all_close(kept, old)


def test_a_round_averages_the_models_and_updates_the_mean():
  model = tiny_model()
  algorithm = fediir.fediir(fediir.FedIirConfig(), tiny_trainer(model))
  params = init_params(model)
  server = fediir.IirServer(model=params, grad_mean=jax.tree.map(
      jnp.zeros_like, params["params"]["Dense_1"]))
  grads = jax.tree.map(lambda g: jnp.stack([g + 1, g + 3]), server.grad_mean)
  uploads = fediir.IirUpload(params=jax.tree.map(lambda p: jnp.stack([p + 1, p + 3]),
                                                 params),
                             grad=grads, batches=jnp.array([1.0, 1.0]))
  new = algorithm.aggregate(server, jnp.zeros(2), uploads, jnp.array([1.0, 1.0]))
  chex.assert_trees_all_close(new.server.model, jax.tree.map(lambda p: p + 2, params),
                              rtol=1e-6)
  chex.assert_trees_all_close(new.server.grad_mean,
                              jax.tree.map(lambda g: g + 0.05 * 2, server.grad_mean))


@pytest.mark.parametrize("field,value", [("penalty", -1.0), ("ema", 1.0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fediir: {field}"):
    fediir.fediir(fediir.FedIirConfig()._replace(**{field: value}),
                  tiny_trainer(tiny_model()))
