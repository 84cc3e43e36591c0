"""MOON: the model-contrastive loss in closed form, one local step against a hand-written
objective, and the server (FedAvg's mean, the previous models kept)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import moon
from fedora_jax.algorithms.base import InitContext
from fedora_jax.algorithms.layers import apply_with_representation
from fedora_jax.engine import batch_stats
from fedora_jax.errors import ConfigError
from tiny import TinyBN, init_folded, init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_contrastive_loss_in_closed_form():
  z = jnp.array([[1.0, 0.0], [3.0, 4.0]])
  z_glob = jnp.array([[2.0, 0.0], [4.0, 3.0]])   # cosines 1 and 24/25
  z_prev = jnp.array([[0.0, 5.0], [-3.0, -4.0]])  # cosines 0 and -1
  tau = 0.5
  expected = [np.log(1 + np.exp((0.0 - 1.0) / tau)), np.log(1 + np.exp((-1.0 - 0.96) / tau))]
  loss = moon.contrastive_loss(z, z_glob, z_prev, tau, jnp.array(True))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # The paper's form: cross-entropy of [sim_glob, sim_prev] / tau with the positive first.
  logits = jnp.stack([moon.cosine_similarity(z, z_glob), moon.cosine_similarity(z, z_prev)],
                     axis=1) / tau
  np.testing.assert_allclose(
      loss, optax.softmax_cross_entropy_with_integer_labels(logits, jnp.zeros(2, int)),
      rtol=1e-5)
  # No previous model (round 1): one positive logit, -log(1) = 0.
  np.testing.assert_allclose(moon.contrastive_loss(z, z_glob, z_prev, tau, jnp.array(False)),
                             [0.0, 0.0])


def _hand_objective(params, global_params, previous, x, y, mu, tau):
  """CE + mu * l_con on the tiny MLP written out: z = relu(x W0 + b0), logits = z W1 + b1."""
  def body(p):
    layer = p["params"]["Dense_0"]
    return jax.nn.relu(x @ layer["kernel"] + layer["bias"])
  z, z_glob, z_prev = body(params), body(global_params), body(previous)
  head = params["params"]["Dense_1"]
  ce = optax.softmax_cross_entropy_with_integer_labels(z @ head["kernel"] + head["bias"], y)

  def cos(a, b):
    return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1))
  positive, negative = jnp.exp(cos(z, z_glob) / tau), jnp.exp(cos(z, z_prev) / tau)
  return jnp.mean(ce - mu * jnp.log(positive / (positive + negative)))


def test_one_local_step_descends_cross_entropy_plus_mu_times_the_contrastive_loss():
  data, clients = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))  # Dense_0 (body), Dense_1 (head)
  trainer = tiny_trainer(model, lr=LR, batch_size=8)  # one full-batch SGD step
  config = moon.MoonConfig(mu=2.0, tau=0.5)
  algorithm = moon.moon(config, trainer)
  global_params, previous = init_params(model, seed=0), init_params(model, seed=1)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  client = moon.MoonClients(previous=previous, has_previous=jnp.array(True))
  out = algorithm.client_update(client, global_params, splits, jax.random.key(0))
  grad = jax.grad(_hand_objective)(global_params, global_params, previous, x, y,
                                   config.mu, config.tau)
  expected = jax.tree.map(lambda p, g: p - LR * g, global_params, grad)
  chex.assert_trees_all_close(out.upload, expected, atol=1e-6)
  chex.assert_trees_all_close(out.state.previous, expected, atol=1e-6)
  # Without a previous model (round 1) the step is FedAvg's: cross-entropy alone.
  first = algorithm.client_update(client._replace(has_previous=jnp.array(False)),
                                  global_params, splits, jax.random.key(0))
  ce_grad = jax.grad(_hand_objective)(global_params, global_params, previous, x, y, 0.0, 1.0)
  chex.assert_trees_all_close(first.upload, jax.tree.map(lambda p, g: p - LR * g,
                                                         global_params, ce_grad), atol=1e-6)


def test_server_averages_the_sampled_clients_and_keeps_their_models_as_previous():
  data, _ = tiny_data([4, 8, 6])
  model = tiny_model()
  algorithm = moon.moon(moon.MoonConfig(evaluate="local"), tiny_trainer(model))
  stacked = tree.broadcast_to_clients(init_params(model), 3)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=None,
                                     key=jax.random.key(0)))
  assert not state.clients.has_previous.any()
  uploads = jax.tree.map(lambda a: a + jnp.arange(3.0).reshape((3,) + (1,) * (a.ndim - 1)),
                         stacked)
  weights = jnp.array([4.0, 0.0, 6.0])  # client 1 sat the round out (weight 0)
  new = algorithm.aggregate(state.server, state.clients._replace(previous=uploads), uploads,
                            weights)
  chex.assert_trees_all_close(new.server, jax.tree.map(lambda a: a[0] + 1.2, stacked))
  assert new.clients.has_previous.all()
  chex.assert_trees_all_close(algorithm.personalized_params(new.server, new.clients), uploads)
  global_view = moon.moon(moon.MoonConfig(), tiny_trainer(model)).personalized_params(
      new.server, new.clients)
  chex.assert_trees_all_close(global_view, tree.broadcast_to_clients(new.server, 3))


def test_bad_hyperparameters_are_one_line_errors():
  trainer = tiny_trainer(tiny_model())
  for config, match in ((moon.MoonConfig(tau=0.0), "moon: tau"),
                        (moon.MoonConfig(mu=-1.0), "moon: mu"),
                        (moon.MoonConfig(evaluate="best"), "moon: evaluate")):
    with pytest.raises(ConfigError, match=match):
      moon.moon(config, trainer)


def test_fixed_models_run_on_their_running_averages_on_batch_norm_models():
  # The global and previous models in inference mode (the authors' eval()), the trained
  # one in train mode: the loss equals the one built from each pass computed by hand.
  model = TinyBN()
  trainer = tiny_trainer(model)
  params, global_params, previous = (init_folded(model, seed=s) for s in (0, 1, 2))
  moved = lambda p: jax.tree_util.tree_map_with_path(  # averages far from a batch's
      lambda path, a: a + 0.7 if batch_stats.is_statistic(path) else a, p)
  global_params, previous = moved(global_params), moved(previous)
  x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
  y, weights = np.array([0, 1, 2, 0, 1, 2]), np.ones(6, np.float32)
  config = moon.MoonConfig(mu=1.0, tau=0.5)
  loss = moon.moon_loss(trainer.apply, "Dense_1", global_params, previous, jnp.array(True),
                        config)
  with batch_stats.training(jnp.ones(6, bool)):
    got = loss(params, x, y, weights)
    logits, z = apply_with_representation(trainer.apply, params, x, "Dense_1")
    z_train_mode = apply_with_representation(trainer.apply, global_params, x, "Dense_1")[1]
  z_glob = apply_with_representation(trainer.apply, global_params, x, "Dense_1")[1]
  z_prev = apply_with_representation(trainer.apply, previous, x, "Dense_1")[1]
  want = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)
                  + moon.contrastive_loss(z, z_glob, z_prev, 0.5, jnp.array(True)))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert not np.allclose(z_glob, z_train_mode, atol=1e-3)  # the modes differ here
