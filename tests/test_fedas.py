"""FedAS: the prototype alignment loss, a client's round (prototypes from its own model,
the received extractor aligned to them, training under its own head, the Fisher trace)
and the Fisher-weighted server mean, against hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedas
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _features(params, x):
  layer = params["params"]["Dense_0"]
  return jax.nn.relu(x @ layer["kernel"] + layer["bias"])


def test_alignment_loss_sums_each_class_mean_squared_error():
  model = tiny_model(hidden=(2,))
  params = init_params(model)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
  y = jnp.array([0, 2, 0, 1])
  prototypes = jnp.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
  loss = fedas.alignment_loss(model.apply, "Dense_1", prototypes)
  z = np.asarray(_features(params, x))
  expected = (np.mean(np.square(z[[0, 2]] - prototypes[0]))     # class 0: 2 samples x 2
              + np.mean(np.square(z[3] - prototypes[1]))
              + np.mean(np.square(z[1] - prototypes[2])))
  np.testing.assert_allclose(loss(params, x, y, jnp.ones(4)), expected, rtol=1e-6)
  # A padded sample counts for nothing.
  np.testing.assert_allclose(loss(params, x, y, jnp.array([1.0, 1.0, 0.0, 1.0])),
                             expected - np.mean(np.square(z[[0, 2]] - prototypes[0]))
                             + np.mean(np.square(z[0] - prototypes[0])), rtol=1e-6)


def test_a_client_aligns_the_global_extractor_trains_and_reports_its_fisher_trace():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)       # full batches throughout
  algorithm = fedas.fedas(fedas.FedAsConfig(align_batch_size=8), trainer)
  own, received = init_params(model, seed=0), init_params(model, seed=1)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(own, received, splits, jax.random.key(0))

  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  z = _features(own, x)
  prototypes = jnp.stack([z[y == c].mean(0) if (y == c).any() else jnp.zeros(5)
                          for c in range(3)])

  def align(params):
    f = _features(params, x)
    return sum(jnp.mean(jnp.square(f[y == c] - prototypes[c]))
               for c in range(3) if (y == c).any())
  grads = jax.grad(align)(received)
  start = {"params": {"Dense_0": jax.tree.map(lambda p, g: p - 0.01 * g,
                                              received["params"]["Dense_0"],
                                              grads["params"]["Dense_0"]),
                      "Dense_1": own["params"]["Dense_1"]}}
  ce = lambda p: mean_ce(model, p, x, y)
  trained = jax.tree.map(lambda p, g: p - LR * g, start, jax.grad(ce)(start))
  chex.assert_trees_all_close(out.state, trained, atol=1e-6)
  fisher = sum(jnp.sum(g ** 2) for g in jax.tree.leaves(jax.grad(ce)(trained)))
  np.testing.assert_allclose(out.upload.fisher, fisher, rtol=1e-5)


def test_server_mean_is_weighted_by_the_fisher_traces_of_the_sampled_clients():
  algorithm = fedas.fedas(fedas.FedAsConfig(), tiny_trainer(tiny_model()))
  models = {"w": jnp.array([[1.0, 2.0], [5.0, 5.0], [3.0, 0.0]])}
  uploads = fedas.AsUpload(model=models, fisher=jnp.array([1.0, 7.0, 3.0]))
  state = algorithm.aggregate({"w": jnp.zeros(2)}, models, uploads,
                              jnp.array([10.0, 0.0, 2.0]))   # client 1 sat out
  np.testing.assert_allclose(state.server["w"], (np.array([1.0, 2.0]) + 3 * np.array(
      [3.0, 0.0])) / 4, rtol=1e-6)
  chex.assert_trees_all_close(algorithm.personalized_params(state.server, state.clients),
                              models)


@pytest.mark.parametrize("field,value", [("align_lr", 0.0), ("align_epochs", -1),
                                         ("align_batch_size", 0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedas: {field}"):
    fedas.fedas(fedas.FedAsConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
