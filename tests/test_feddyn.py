"""FedDyn: the dynamically regularised local step and the g_k update against a hand
computation, PFLlib's unsquared penalty, and the server's h and model at partial
participation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import feddyn
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _client(penalty):
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  server_params = init_params(model)
  client_gradient = jax.tree.map(lambda p: jnp.full_like(p, 0.5), server_params)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = feddyn.feddyn(feddyn.FedDynConfig(alpha=0.3, penalty=penalty), trainer)
  out = algorithm.client_update(client_gradient, server_params, splits, jax.random.key(0))
  return model, clients[0], server_params, out


def test_client_step_and_gradient_state():
  model, client, s, out = _client("squared")
  # theta <- theta - lr (grad CE - g_k + alpha (theta - s)), twice, from s.
  theta = s
  for _ in range(2):
    g = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(theta)
    theta = jax.tree.map(lambda t, g, s: t - LR * (g - 0.5 + 0.3 * (t - s)), theta, g, s)
  chex.assert_trees_all_close(out.upload, theta, atol=1e-6)
  # g_k <- g_k - alpha (theta_k - s)
  chex.assert_trees_all_close(out.state, jax.tree.map(lambda t, s: 0.5 - 0.3 * (t - s),
                                                      theta, s), atol=1e-6)


def test_pfllib_penalty_is_the_unsquared_distance():
  model, client, s, out = _client("norm")
  # First step: theta = s, the norm's gradient 0 (PyTorch's); second: alpha/2 (t - s)/|t - s|.
  theta = s
  for step in range(2):
    g = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(theta)
    diff = jax.tree.map(jnp.subtract, theta, s)
    norm = float(np.sqrt(sum(np.sum(np.square(d)) for d in jax.tree.leaves(diff))))
    pull = 0.0 if step == 0 else 0.5 * 0.3 / norm
    theta = jax.tree.map(lambda t, g, d, pull=pull: t - LR * (g - 0.5 + pull * d), theta, g, diff)
  chex.assert_trees_all_close(out.upload, theta, atol=1e-6)


def test_server_at_partial_participation():
  # N = 4, clients 1 and 3 sampled; one scalar parameter; alpha 0.5.
  algorithm = feddyn.feddyn(feddyn.FedDynConfig(alpha=0.5), tiny_trainer(tiny_model()))
  server = feddyn.ServerState(params={"w": jnp.array(1.0)}, h={"w": jnp.array(0.2)})
  uploads = {"w": jnp.array([9.0, 2.0, 9.0, 4.0])}  # unsampled slots hold junk
  weights = jnp.array([0.0, 3.0, 0.0, 1.0])
  new = algorithm.aggregate(server, {"w": jnp.zeros(4)}, uploads, weights).server
  # h = 0.2 - 0.5 ((2 - 1) + (4 - 1)) / 4 = -0.3;  theta = (2 + 4) / 2 - h / 0.5 = 3.6
  np.testing.assert_allclose(new.h["w"], -0.3, rtol=1e-6)
  np.testing.assert_allclose(new.params["w"], 3.6, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("alpha", 0.0), ("penalty", "l1"),
                                         ("server_mean", "median")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"feddyn: {field}"):
    feddyn.feddyn(feddyn.FedDynConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
