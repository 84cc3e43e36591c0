"""SCAFFOLD: the corrected local step and option II's control variate against a hand
computation, and the server's update at partial participation (c moves by 1/N of the
sampled clients' sum)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import scaffold
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _constant_like(params, value):
  return jax.tree.map(lambda p: jnp.full_like(p, value), params)


def test_client_step_is_corrected_by_the_control_variates():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  x = init_params(model)
  control, client_control = _constant_like(x, 0.3), _constant_like(x, -0.2)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = scaffold.scaffold(scaffold.ScaffoldConfig(lr=LR), trainer)
  out = algorithm.client_update(client_control, scaffold.ServerState(x, control), splits,
                                jax.random.key(0))

  # y <- y - lr (g(y) + c - c_i), twice; c_i+ = c_i - c + (x - y) / (2 lr).
  client = clients[0]
  y = x
  for _ in range(2):
    g = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(y)
    y = jax.tree.map(lambda p, g: p - LR * (g + 0.3 - (-0.2)), y, g)
  expected_control = jax.tree.map(lambda x, y: -0.2 - 0.3 + (x - y) / (2 * LR), x, y)
  chex.assert_trees_all_close(out.upload.model_delta,
                              jax.tree.map(jnp.subtract, y, x), atol=1e-6)
  chex.assert_trees_all_close(out.state, expected_control, atol=1e-5)
  chex.assert_trees_all_close(out.upload.control_delta,
                              jax.tree.map(lambda c: c + 0.2, expected_control), atol=1e-5)


def test_server_update_at_partial_participation():
  # N = 4 clients, clients 0 and 2 sampled (weights 2 and 6), one scalar parameter.
  algorithm = scaffold.scaffold(scaffold.ScaffoldConfig(server_lr=0.5),
                                tiny_trainer(tiny_model()))
  server = scaffold.ServerState(params={"w": jnp.array(1.0)}, control={"w": jnp.array(0.1)})
  clients = {"w": jnp.zeros(4)}
  uploads = scaffold.Upload(model_delta={"w": jnp.array([2.0, 0.0, 4.0, 0.0])},
                            control_delta={"w": jnp.array([1.0, 0.0, 3.0, 0.0])})
  weights = jnp.array([2.0, 0.0, 6.0, 0.0])
  new = algorithm.aggregate(server, clients, uploads, weights).server
  # x + eta_g (2 + 4) / 2 (the uniform 1/|S| mean); c + (1 + 3) / 4 (the 1/N sum).
  np.testing.assert_allclose(new.params["w"], 1.0 + 0.5 * 3.0)
  np.testing.assert_allclose(new.control["w"], 0.1 + 1.0)
  weighted = scaffold.scaffold(scaffold.ScaffoldConfig(server_lr=0.5, server_mean="weighted"),
                               tiny_trainer(tiny_model()))
  np.testing.assert_allclose(
      weighted.aggregate(server, clients, uploads, weights).server.params["w"],
      1.0 + 0.5 * (2 * 2.0 + 6 * 4.0) / 8)


def test_with_momentum_the_control_divides_by_the_steps_momentum_makes():
  # beta 0.5, K 3 steps from a zero buffer: 1 + 1.5 + 1.75 = 4.25 plain steps' way,
  # = (3 - 0.5 (1 - 0.125) / 0.5) / 0.5.
  np.testing.assert_allclose(scaffold.momentum_steps(jnp.array(3), 0.5), 4.25, rtol=1e-6)
  np.testing.assert_allclose(scaffold.momentum_steps(jnp.array(3), 0.0), 3.0)
  x, y = {"w": jnp.array(1.0)}, {"w": jnp.array(0.15)}
  new = scaffold.new_client_control({"w": jnp.array(0.2)}, {"w": jnp.array(0.1)}, x, y,
                                    jnp.array(3), lr=0.2, momentum=0.5)
  np.testing.assert_allclose(new["w"], 0.2 - 0.1 + 0.85 / (4.25 * 0.2), rtol=1e-6)
  # A constant gradient g through three momentum steps: c_i+ - c_i + c is g again.
  g, lr, beta, velocity, w = 0.4, 0.1, 0.5, 0.0, 1.0
  for _ in range(3):
    velocity = beta * velocity + g
    w -= lr * velocity
  new = scaffold.new_client_control({"w": jnp.array(0.0)}, {"w": jnp.array(0.0)},
                                    {"w": jnp.array(1.0)}, {"w": jnp.array(w)},
                                    jnp.array(3), lr=lr, momentum=beta)
  np.testing.assert_allclose(new["w"], g, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("server_lr", 0.0), ("lr", -1.0),
                                         ("momentum", 1.0), ("server_mean", "median")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"scaffold: {field}"):
    scaffold.scaffold(scaffold.ScaffoldConfig()._replace(**{field: value}),
                      tiny_trainer(tiny_model()))
