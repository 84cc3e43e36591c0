"""FedDBE: the initialisation period's global mean, a round's two steps (the running mean
carried from the first into the second, the personal bias trained with the model) and
the scored model h(f(x) + m), each against a computation by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import feddbe
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _features(params, x):
  """f(x) of the tiny MLP: its hidden layer (Dense_0, ReLU), the head Dense_1's input."""
  layer = params["params"]["Dense_0"]
  return jax.nn.relu(x @ layer["kernel"] + layer["bias"])


def _head(params, z):
  layer = params["params"]["Dense_1"]
  return z @ layer["kernel"] + layer["bias"]


def test_initialisation_period_sets_the_size_weighted_mean_of_the_running_means():
  data, clients = tiny_data([6, 4], max_pad_ratio=1.0)   # one bucket, one client padded
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)     # one full-batch step each
  algorithm = feddbe.feddbe(feddbe.FedDbeConfig(mean_momentum=0.5), trainer)
  params = init_params(model)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  # One step from r = 0: r_i = 0.5 * the mean of f(x) over client i's samples, at the
  # initial model (the step's own forward); g = (6 r_0 + 4 r_1) / 10.
  means = [0.5 * _features(params, c.x_train).mean(0) for c in clients]
  np.testing.assert_allclose(state.server.global_mean, (6 * means[0] + 4 * means[1]) / 10,
                             rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(state.server.model, params)   # the trained copies dropped
  np.testing.assert_array_equal(state.clients, np.zeros((2, 5), np.float32))


def test_a_round_carries_the_running_mean_and_trains_the_bias_with_the_model():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)   # two full-batch steps
  config = feddbe.FedDbeConfig(kl_weight=3.0, mean_momentum=0.5)
  algorithm = feddbe.feddbe(config, trainer)
  params = init_params(model)
  global_mean = jnp.linspace(0.0, 1.0, 5)
  bias = jnp.array([0.2, -0.1, 0.0, 0.3, 0.1])
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(bias, feddbe.DbeServer(params, global_mean), splits,
                                jax.random.key(0))

  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)

  def loss(theta, m, previous):
    z = _features(theta, x)
    mean = 0.5 * previous + 0.5 * z.mean(0)
    ce = optax.softmax_cross_entropy_with_integer_labels(_head(theta, z + m), y).mean()
    return ce + 3.0 * jnp.mean(0.5 * (mean - global_mean) ** 2), mean

  theta, m, previous = params, bias, jnp.zeros(5)
  for _ in range(2):   # the second step's r starts from the first's, a constant
    (_, mean), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        theta, m, previous)
    theta = jax.tree.map(lambda p, g: p - LR * g, theta, grads[0])
    m, previous = m - LR * grads[1], mean
  chex.assert_trees_all_close(out.upload, theta, atol=1e-6)
  np.testing.assert_allclose(out.state, m, atol=1e-6)


def test_the_scored_model_is_the_head_on_the_shifted_representation():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  algorithm = feddbe.feddbe(feddbe.FedDbeConfig(), tiny_trainer(model))
  params = init_params(model)
  biases = jnp.array([[0.5, -0.2, 0.1, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0, 0.0]])
  scored = algorithm.personalized_params(feddbe.DbeServer(params, jnp.zeros(5)), biases)
  x = jnp.asarray(clients[0].x_test)
  for k in range(2):
    ours = model.apply(jax.tree.map(lambda a, k=k: a[k], scored), x)
    np.testing.assert_allclose(ours, _head(params, _features(params, x) + biases[k]),
                               rtol=1e-5, atol=1e-6)
  del data


@pytest.mark.parametrize("field,value", [("kl_weight", -1.0), ("mean_momentum", 0.0),
                                         ("mean_momentum", 1.5)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"feddbe: {field}"):
    feddbe.feddbe(feddbe.FedDbeConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
