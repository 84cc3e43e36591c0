"""FEDORA's graph, selective lambda and client update (paper and authors' variants)."""

import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import propagation
from fedora_jax.algorithms import fedora
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def test_lambda_rules():
  paper = fedora.config_for_variant("paper")
  authors = fedora.config_for_variant("authors")
  local_loss = jnp.array([1.0, 0.5, 0.7])
  propagated_loss = jnp.array([0.4, 0.9, 0.7])
  np.testing.assert_allclose(fedora.selective_lambda(local_loss, propagated_loss, paper),
                             [0.6, 1e-8, 1e-8], rtol=1e-6)
  np.testing.assert_allclose(fedora.selective_lambda(local_loss, propagated_loss, authors),
                             [np.exp(0.3), 0.0, 1.0], rtol=1e-6)


def test_authors_graph_keeps_top2_exp_weights_without_self_loops():
  cosines = jnp.array([[1.0, 0.9, 0.2, 0.5],
                       [0.9, 1.0, 0.3, 0.1],
                       [0.2, 0.3, 1.0, 0.8],
                       [0.5, 0.1, 0.8, 1.0]])
  graph = fedora.propagation_graph(cosines, fedora.config_for_variant("authors"))
  expected = np.zeros((4, 4))
  for row, cols in enumerate([(1, 3), (0, 2), (3, 1), (2, 0)]):
    for col in cols:
      expected[row, col] = np.exp(10 * cosines[row, col])
  np.testing.assert_allclose(graph, expected, rtol=1e-5)
  # The paper's graph is the cosine similarity itself, diagonal included.
  np.testing.assert_allclose(
      fedora.propagation_graph(cosines, fedora.config_for_variant("paper")), cosines)


def test_the_default_variant_is_the_authors_and_the_config_defaults_the_equations():
  # The run's default reproduces the paper's numbers; FedoraConfig() keeps the paper's
  # printed values, each field's own default (the registry's convention).
  assert fedora.DEFAULT_VARIANT == "authors"
  default = fedora.config_for_variant(lr=0.01)
  assert default == fedora.config_for_variant("authors", lr=0.01)
  assert (default.weights, default.top_k, default.zero_diagonal, default.alpha,
          default.lambda_rule, default.pull) == ("exp", 2, True, 4.0, "authors", "decoupled")
  assert fedora.config_for_variant("paper") == fedora.FedoraConfig()
  # An explicit field overrides the preset.
  assert fedora.config_for_variant(pull="prox").pull == "prox"


def test_bad_config_is_refused():
  with pytest.raises(ConfigError, match="variant"):
    fedora.config_for_variant("mine")
  with pytest.raises(ConfigError, match="alpha"):
    fedora.config_for_variant("paper", alpha=0.0)
  with pytest.raises(ConfigError, match="pull"):
    fedora.config_for_variant("paper", pull="push")


def _one_client_case():
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  params = init_params(model, seed=0)
  propagated = init_params(model, seed=1)  # stands in for theta_hat
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  return model, params, propagated, splits, clients[0]


@pytest.mark.parametrize("variant", ["paper", "authors"])
def test_client_update_takes_the_regularised_step(variant):
  model, params, propagated, splits, client = _one_client_case()
  lr = 0.05
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch SGD step, no momentum
  config = fedora.config_for_variant(variant, lr=lr)
  algorithm = fedora.fedora(config, trainer)
  out = algorithm.client_update(params, propagated, splits, jax.random.key(0))

  diff = (mean_ce(model, params, client.x_val, client.y_val)
          - mean_ce(model, propagated, client.x_val, client.y_val))
  lam = max(1e-8, diff) if variant == "paper" else (np.exp(diff / 2) if diff >= 0 else 0.0)
  np.testing.assert_allclose(out.metrics["lambda"], lam, rtol=1e-5)
  grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(params)
  if variant == "paper":   # gradient of CE + lambda ||theta - theta_hat||^2
    expected = jax.tree.map(lambda p, g, h: p - lr * (g + 2 * lam * (p - h)),
                            params, grads, propagated)
  else:                    # SGD step, then theta -= lr * lambda * (theta_before - theta_hat)
    expected = jax.tree.map(lambda p, g, h: p - lr * g - lr * lam * (p - h),
                            params, grads, propagated)
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)


@pytest.mark.parametrize("steps", [0, 80])
def test_broadcast_propagates_every_parameter(steps):
  data, _ = tiny_data([6, 6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model)
  config = fedora.config_for_variant("paper", propagation_steps=steps)
  algorithm = fedora.fedora(config, trainer)
  stacked = jax.vmap(lambda s: model.init(jax.random.key(s), jnp.zeros((1, 4))))(
      jnp.arange(4))
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  similarity = state.server.similarity
  chex.assert_shape(similarity, (4, 4))
  np.testing.assert_allclose(np.diag(similarity), 1.0, atol=1e-5)  # p = 1
  propagated = algorithm.broadcast(state.server, stacked)
  flat = jax.vmap(lambda p: jax.flatten_util.ravel_pytree(p)[0])
  np.testing.assert_allclose(flat(propagated),
                             propagation.propagate(flat(stacked), similarity, alpha=1.0),
                             atol=1e-5)


def test_new_client_gets_the_weighted_mean_of_its_neighbours():
  # theta_hat_new = D_new^-1 W_new Theta_hat: (1 * 2 + 3 * 6) / 4 = 5.
  params = {"w": jnp.array([[2.0], [6.0]])}
  out = fedora.propagate_to_new_clients(jnp.array([[1.0, 3.0]]), params)
  np.testing.assert_allclose(out["w"], [[5.0]])


def test_new_client_edges_follow_the_variant():
  cross = jnp.array([[0.9, 0.1, 0.5]])
  authors = fedora.new_client_graph(cross, fedora.config_for_variant("authors"))
  np.testing.assert_allclose(authors, [[np.exp(9.0), 0.0, np.exp(5.0)]], rtol=1e-5)
  np.testing.assert_allclose(fedora.new_client_graph(cross, fedora.config_for_variant("paper")),
                             cross)
