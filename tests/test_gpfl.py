"""GPFL: one local step (personalised task, the GCE's cosine loss, the distance to the
received embeddings, the weight decay of GCE and CoV) against the gradient of the loss
written out by hand; the server's conditional inputs at partial participation; the
scored model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import gpfl
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1
DIM, CLASSES = 5, 3


def _features(params, x):
  layer = params["params"]["Dense_0"]
  return jax.nn.relu(x @ layer["kernel"] + layer["bias"])


def _layer_norm(v, branch):
  return (v - v.mean()) / jnp.sqrt(v.var() + 1e-5) * branch["scale"] + branch["offset"]


def _cov(valve, z, c):
  gamma = _layer_norm(jax.nn.relu(c @ valve["gamma"]["kernel"] + valve["gamma"]["bias"]),
                      valve["gamma"])
  beta = _layer_norm(jax.nn.relu(c @ valve["beta"]["kernel"] + valve["beta"]["bias"]),
                     valve["beta"])
  return jax.nn.relu(z * (1 + gamma) + beta)


def _setup(lam=0.3, mu=0.2):
  data, clients = tiny_data([6, 6])
  model = tiny_model(hidden=(DIM,))
  trainer = tiny_trainer(model, lr=LR, batch_size=8)     # one full-batch step
  algorithm = gpfl.gpfl(gpfl.GpflConfig(lam=lam, mu=mu), trainer)
  params = init_params(model)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  return data, clients, model, algorithm, params, state


def test_one_local_step_descends_the_written_out_loss():
  data, clients, _, algorithm, params, state = _setup()
  server = state.server
  client = jax.tree.map(lambda a: a[0], state.clients)
  client = client._replace(generic_input=jnp.linspace(-1, 1, DIM),
                           personal_input=jnp.linspace(0.5, -0.5, DIM))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(client, server, splits, jax.random.key(0))

  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)

  def loss(theta, embeddings, valve):
    z = _features(theta, x)
    head = theta["params"]["Dense_1"]
    logits = _cov(valve, z, client.personal_input) @ head["kernel"] + head["bias"]
    generic = _cov(valve, z, client.generic_input)
    unit = lambda v: v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    cosines = unit(generic) @ unit(embeddings).T
    ce = optax.softmax_cross_entropy_with_integer_labels
    return (ce(logits, y).mean() + ce(cosines, y).mean()
            + 0.3 * jnp.linalg.norm(generic - server.embeddings[y])
            + 0.1 * (jnp.sum(embeddings ** 2)
                     + sum(jnp.sum(v ** 2) for v in jax.tree.leaves(valve))))

  grads = jax.grad(loss, argnums=(0, 1, 2))(params, server.embeddings, server.valve)
  step = lambda p, g: jax.tree.map(lambda a, b: a - LR * b, p, g)
  theta = step(params, grads[0])
  chex.assert_trees_all_close(out.upload.body["params"]["Dense_0"],
                              theta["params"]["Dense_0"], atol=1e-6)
  chex.assert_trees_all_close(out.state.head["params"]["Dense_1"],
                              theta["params"]["Dense_1"], atol=1e-6)
  chex.assert_trees_all_close(out.upload.embeddings, step(server.embeddings, grads[1]),
                              atol=1e-6)
  chex.assert_trees_all_close(out.upload.valve, step(server.valve, grads[2]), atol=1e-6)


def test_conditional_inputs_from_the_embeddings_each_client_held():
  _, clients, _, algorithm, _, state = _setup()
  shares = np.stack([np.bincount(c.y_train, minlength=CLASSES) / len(c.y_train)
                     for c in clients])
  np.testing.assert_allclose(state.clients.class_shares, shares, rtol=1e-6)
  server = state.server
  trained = server.embeddings + 1.0                  # client 0's upload
  uploads = gpfl.GpflServer(
      body=jax.tree.map(lambda a: jnp.stack([a, 0 * a]), server.body),
      embeddings=jnp.stack([trained, jnp.zeros_like(trained)]),
      valve=jax.tree.map(lambda a: jnp.stack([a, 0 * a]), server.valve))
  new = algorithm.aggregate(server, state.clients, uploads, jnp.array([6.0, 0.0]))
  chex.assert_trees_all_close(new.server.embeddings, trained)
  # Client 0 sampled: from the GCE it trained; client 1 not: from the previous global one.
  np.testing.assert_allclose(new.clients.generic_input[0], trained.mean(0), rtol=1e-6)
  np.testing.assert_allclose(new.clients.personal_input[0], shares[0] @ trained,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.clients.generic_input[1], server.embeddings.mean(0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.clients.personal_input[1], shares[1] @ server.embeddings,
                             rtol=1e-5, atol=1e-6)


def test_the_scored_model_is_the_head_on_the_personal_route():
  _, clients, _, algorithm, params, state = _setup()
  clients_state = state.clients._replace(personal_input=jnp.ones((2, DIM)))
  scored = algorithm.personalized_params(state.server, clients_state)
  x = jnp.asarray(clients[1].x_test)
  ours = algorithm.evaluate(jax.tree.map(lambda a: a[1], scored),
                            jax.tree.map(lambda a: jnp.asarray(a[1]),
                                         _setup()[0].buckets[0].test))
  head = params["params"]["Dense_1"]
  logits = _cov(state.server.valve, _features(params, x), jnp.ones(DIM)) @ head["kernel"] \
      + head["bias"]
  y = jnp.asarray(clients[1].y_test)
  np.testing.assert_allclose(ours.score, np.mean(np.argmax(logits, -1) == y), rtol=1e-6)
  np.testing.assert_allclose(
      ours.loss, optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), rtol=1e-5)


@pytest.mark.parametrize("field,value", [("lam", -1.0), ("mu", -0.1)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"gpfl: {field}"):
    gpfl.gpfl(gpfl.GpflConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
