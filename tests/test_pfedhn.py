"""pFedHN: per-client models from the hypernetwork, and the server's vjp update."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import pfedhn
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

NUM_CLIENTS = 4


def _setup(**overrides):
  data, _ = tiny_data([6] * NUM_CLIENTS)
  model = tiny_model()
  trainer = tiny_trainer(model, lr=0.1, batch_size=8)
  config = pfedhn.PfedhnConfig(**{"hidden_dim": 7, "n_hidden": 2, **overrides})
  algorithm = pfedhn.pfedhn(config, trainer)
  params = init_params(model)
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (NUM_CLIENTS,) + a.shape), params)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  return algorithm, state, stacked, data


def test_hypernetwork_gives_each_client_its_own_model_of_the_right_shapes():
  algorithm, state, stacked, _ = _setup()
  # The paper's embedding size 1 + K / 4 = 2, the hidden layers as configured.
  chex.assert_shape(state.server.params.embeddings, (NUM_CLIENTS, 2))
  assert len(state.server.params.hypernetwork.layers) == 1 + 2
  models = algorithm.personalized_params(state.server, state.clients)
  chex.assert_trees_all_equal_shapes(models, stacked)
  chex.assert_trees_all_close(algorithm.broadcast(state.server, state.clients), models)
  kernel = jax.tree.leaves(models)[-1]
  assert not np.allclose(kernel[0], kernel[1])
  # Client k's model is h(v_k): the same map applied to its own embedding.
  one = pfedhn.hypernetwork_apply(state.server.params.hypernetwork,
                                  state.server.params.embeddings[2])
  chex.assert_trees_all_close(one, jax.tree.map(lambda a: a[2], models), atol=1e-6)


def test_hypergradient_is_the_vjp_of_the_deltas():
  algorithm, state, _, _ = _setup()
  params = state.server.params
  models = pfedhn.client_models(params)
  deltas = jax.tree.map(lambda a: 0.01 * jnp.ones_like(a), models)
  deltas = jax.tree.map(lambda d: d.at[1].set(0.0), deltas)  # client 1 sends nothing
  grads = pfedhn.hypergradient(params, deltas)

  def inner_product(p):
    return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(pfedhn.client_models(p)),
                                                jax.tree.leaves(deltas)))
  chex.assert_trees_all_close(grads, jax.grad(inner_product)(params), atol=1e-5)
  np.testing.assert_array_equal(grads.embeddings[1], 0.0)  # only its own client's term
  assert np.abs(np.asarray(grads.embeddings[0])).sum() > 0


def test_server_step_moves_the_generated_models_towards_the_trained_ones():
  lr = 1e-3
  algorithm, state, _, data = _setup(server_lr=lr, server_weight_decay=0.0, grad_clip=0.0)
  sent = algorithm.broadcast(state.server, state.clients)
  client_keys = jax.random.split(jax.random.key(1), NUM_CLIENTS)
  out = jax.vmap(algorithm.client_update)(state.clients, sent, data.buckets[0], client_keys)
  trained = jax.tree.map(lambda before, delta: before - delta, sent, out.upload)

  new_state = algorithm.aggregate(state.server, state.clients, out.upload, jnp.ones(4))
  # First step of SGD with momentum: phi - lr * grad.
  grads = pfedhn.hypergradient(state.server.params, out.upload)
  chex.assert_trees_all_close(
      new_state.server.params,
      jax.tree.map(lambda p, g: p - lr * g, state.server.params, grads), atol=1e-6)

  def gap(models):
    return sum(float(jnp.sum((a - b) ** 2)) for a, b in
               zip(jax.tree.leaves(models), jax.tree.leaves(trained)))
  assert gap(algorithm.personalized_params(new_state.server, new_state.clients)) < gap(sent)


def test_per_client_steps_decay_once_per_sampled_client():
  # Zero deltas leave only weight decay lam and momentum m: the official trainer's two
  # steps (lr e) give p (1 - e lam) - e (m lam p + lam (1 - e lam) p) = 0.8575 p at
  # e = 0.1, lam = 0.5, m = 0.9; one summed step 1 - e lam = 0.95. Clients 2, 3 sat out.
  lr, decay = 0.1, 0.5
  algorithm, state, _, _ = _setup(server_lr=lr, server_weight_decay=decay, grad_clip=0.0,
                                  server_steps="per_client")
  zeros = jax.tree.map(jnp.zeros_like, algorithm.broadcast(state.server, state.clients))
  sampled = jnp.array([3.0, 5.0, 0.0, 0.0])
  stepped = algorithm.aggregate(state.server, state.clients, zeros, sampled)
  chex.assert_trees_all_close(stepped.server.params,
                              jax.tree.map(lambda p: 0.8575 * p, state.server.params),
                              atol=1e-6)
  summed, _, _, _ = _setup(server_lr=lr, server_weight_decay=decay, grad_clip=0.0)
  once = summed.aggregate(state.server, state.clients, zeros, sampled)
  chex.assert_trees_all_close(once.server.params,
                              jax.tree.map(lambda p: 0.95 * p, state.server.params), atol=1e-6)


def test_per_client_steps_without_decay_or_momentum_add_up_to_the_summed_step():
  # Each client's hypergradient is taken at the round's start, so plain SGD steps sum.
  algorithm, state, _, _ = _setup(server_lr=1e-2, server_weight_decay=0.0, grad_clip=0.0,
                                  server_momentum=0.0, server_steps="per_client")
  sent = algorithm.broadcast(state.server, state.clients)
  deltas = jax.tree.map(lambda a: 0.01 * jnp.cos(jnp.arange(a.size).reshape(a.shape)), sent)
  stepped = algorithm.aggregate(state.server, state.clients, deltas, jnp.ones(NUM_CLIENTS))
  grads = pfedhn.hypergradient(state.server.params, deltas)
  chex.assert_trees_all_close(
      stepped.server.params,
      jax.tree.map(lambda p, g: p - 1e-2 * g, state.server.params, grads), atol=1e-6)


def test_unknown_server_steps_is_a_config_error():
  with pytest.raises(ConfigError, match="server_steps"):
    _setup(server_steps="sequential")
