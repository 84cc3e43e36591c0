"""FEDORA's graph, selective lambda and client update (paper and authors' variants)."""

import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import propagation, similarity
from fedora_jax.algorithms import fedora
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, run_rounds, tiny_data, tiny_model, tiny_trainer


def test_lambda_rules():
  paper = fedora.config_for_variant("paper")
  authors = fedora.config_for_variant("authors")
  local_loss = jnp.array([1.0, 0.5, 0.7])
  propagated_loss = jnp.array([0.4, 0.9, 0.7])
  np.testing.assert_allclose(fedora.selective_lambda(local_loss, propagated_loss, paper),
                             [0.6, 1e-8, 1e-8], rtol=1e-6)
  np.testing.assert_allclose(fedora.selective_lambda(local_loss, propagated_loss, authors),
                             [np.exp(0.3), 0.0, 1.0], rtol=1e-6)
  # Table 5: one lambda for every client, whatever the validation losses say.
  constant = fedora.config_for_variant("authors", lambda_rule="constant", lambda_value=0.1)
  np.testing.assert_allclose(fedora.selective_lambda(local_loss, propagated_loss, constant),
                             [0.1, 0.1, 0.1], rtol=1e-6)


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
  with pytest.raises(ConfigError, match="fedora: similarity must be one of principal_angles,"):
    fedora.config_for_variant(similarity="kl")
  with pytest.raises(ConfigError, match="fedora: lambda_rule must be one of paper, authors,"
                     " constant"):
    fedora.config_for_variant(lambda_rule="fixed")
  with pytest.raises(ConfigError, match="fedora: lambda_value must be >= 0, got -1"):
    fedora.config_for_variant(lambda_rule="constant", lambda_value=-1.0)


def _one_client_case():
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  params = init_params(model, seed=0)
  propagated = init_params(model, seed=1)  # stands in for theta_hat
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  return model, params, propagated, splits, clients[0]


@pytest.mark.parametrize("variant", ["paper", "authors"])
@pytest.mark.parametrize("constant_lambda", [None, 0.3])
def test_client_update_takes_the_regularised_step(variant, constant_lambda):
  model, params, propagated, splits, client = _one_client_case()
  lr = 0.05
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch SGD step, no momentum
  overrides = ({} if constant_lambda is None else
               dict(lambda_rule="constant", lambda_value=constant_lambda))
  config = fedora.config_for_variant(variant, lr=lr, **overrides)
  algorithm = fedora.fedora(config, trainer)
  out = algorithm.client_update(params, propagated, splits, jax.random.key(0))

  diff = (mean_ce(model, params, client.x_val, client.y_val)
          - mean_ce(model, propagated, client.x_val, client.y_val))
  lam = max(1e-8, diff) if variant == "paper" else (np.exp(diff / 2) if diff >= 0 else 0.0)
  if constant_lambda is not None:  # Table 5: the same weight / pull, lambda fixed
    lam = constant_lambda
  np.testing.assert_allclose(out.metrics["lambda"], lam, rtol=1e-5)
  grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(params)
  if variant == "paper":   # gradient of CE + lambda ||theta - theta_hat||^2
    expected = jax.tree.map(lambda p, g, h: p - lr * (g + 2 * lam * (p - h)),
                            params, grads, propagated)
  else:                    # SGD step, then theta -= lr * lambda * (theta_before - theta_hat)
    expected = jax.tree.map(lambda p, g, h: p - lr * g - lr * lam * (p - h),
                            params, grads, propagated)
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)


def test_authors_validation_loss_sums_the_batch_means():
  # ClientUpdate.get_loss: batches of B in order, each batch's mean, summed; a batch as
  # large as the set gives the mean (so rotated MNIST's 64 images and B = 64 agree).
  model, params, _, splits, client = _one_client_case()
  trainer = tiny_trainer(model, batch_size=8)
  n = len(client.y_val)
  assert n == 4  # batches of 3: [0, 1, 2] and a short last one, [3]
  by_hand = sum(mean_ce(model, params, client.x_val[i:i + 3], client.y_val[i:i + 3])
                for i in range(0, n, 3))
  np.testing.assert_allclose(fedora.authors_val_loss(trainer, params, splits.val, 3),
                             by_hand, rtol=1e-5)
  np.testing.assert_allclose(fedora.authors_val_loss(trainer, params, splits.val, n),
                             mean_ce(model, params, client.x_val, client.y_val), rtol=1e-6)
  # Both presets keep the mean (docs/algorithms/fedora.md: the sum overflows lambda on the
  # imbalanced setting's large client); the code's sum is one flag away.
  assert fedora.config_for_variant("authors").val_loss == "mean"
  assert fedora.config_for_variant("authors", val_loss="batch_sum").val_loss == "batch_sum"


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


@pytest.mark.parametrize("steps", [0, 80])
def test_one_model_held_by_every_client_propagates_exactly_as_it_is(steps):
  # The first round: P's rows sum to 1 only to rounding, which set lambda to 0 for some
  # clients under the authors' rule (diff -1e-7 < 0); their code propagates nothing then.
  data, _ = tiny_data([6, 6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model)
  algorithm = fedora.fedora(fedora.config_for_variant("authors", propagation_steps=steps),
                            trainer)
  one = model.init(jax.random.key(3), jnp.zeros((1, 4)))
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (4,) + a.shape), one)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  propagated = algorithm.broadcast(state.server, stacked)
  chex.assert_trees_all_equal(propagated, stacked)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  first = jax.tree.map(lambda a: a[0], stacked)
  out = algorithm.client_update(first, first, splits, jax.random.key(1))
  assert float(out.metrics["lambda"]) == 1.0  # exp(0 / 2)
  # Models that differ still propagate (the test above).
  other = jax.tree.map(lambda a: a.at[1].add(0.1), stacked)
  assert not jnp.array_equal(jax.tree.leaves(algorithm.broadcast(state.server, other))[0],
                             jax.tree.leaves(other)[0])


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


# Three hand-made client models: flattened, c0 = (1, 0, 0), c1 = (1, 1, 0), c2 = (0, -2, 1).
_HAND_MODELS = {"w": jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, -2.0]]),
                "b": jnp.array([[0.0], [0.0], [1.0]])}
_R = 1.0 / np.sqrt(2.0)
_HAND_COSINES = np.array([[1.0, _R, 0.0],
                          [_R, 1.0, -2.0 / np.sqrt(10.0)],
                          [0.0, -2.0 / np.sqrt(10.0), 1.0]])


def _context(params, num_clients=3, key=0):
  data, _ = tiny_data([6] * num_clients)
  return InitContext(params=params, data=data, trainer=None, key=jax.random.key(key))


def test_parameter_similarity_is_the_cosine_of_the_client_models():
  np.testing.assert_allclose(fedora.parameter_similarity(_HAND_MODELS), _HAND_COSINES,
                             atol=1e-6)
  config = fedora.config_for_variant("paper", similarity="parameters")
  algorithm = fedora.fedora(config, tiny_trainer(tiny_model()))
  state = algorithm.init(_context(_HAND_MODELS))
  np.testing.assert_allclose(state.server.similarity, _HAND_COSINES, atol=1e-6)
  # The paper's cosine weights take no negative weight: c1 and c2 are not linked.
  graph = np.maximum(_HAND_COSINES, 0.0).astype(np.float32)
  np.testing.assert_allclose(state.server.graph, graph, atol=1e-6)
  np.testing.assert_allclose(state.server.propagation,
                             propagation.propagation_matrix(graph, alpha=1.0), atol=1e-5)
  # Recomputed after every round from the models the next round propagates.
  trained = {"w": jnp.array([[0.0, 1.0], [1.0, 0.0], [3.0, 4.0]]), "b": jnp.zeros((3, 1))}
  state = algorithm.aggregate(state.server, trained, (), jnp.ones(3))
  np.testing.assert_allclose(state.server.similarity,
                             [[1.0, 0.0, 0.8], [0.0, 1.0, 0.6], [0.8, 0.6, 1.0]], atol=1e-6)
  chex.assert_trees_all_equal(state.clients, trained)


def test_gradient_similarity_is_the_cosine_of_the_client_updates():
  config = fedora.config_for_variant("paper", similarity="gradients")
  algorithm = fedora.fedora(config, tiny_trainer(tiny_model()))
  start = jax.tree.map(lambda a: jnp.broadcast_to(a, (3,) + a.shape),
                       init_params(tiny_model()))
  state = algorithm.init(_context(start))
  np.testing.assert_allclose(state.server.similarity, np.ones((3, 3)))  # no update yet
  # The updates dtheta = (3, 4, 0), (4, 3, 0), and client 2 did not train (weight 0): the
  # pairs with client 2 keep their last cosine.
  state = algorithm.aggregate(state.server, _HAND_MODELS,
                              {"w": jnp.array([[3.0, 4.0], [4.0, 3.0], [0.0, 0.0]]),
                               "b": jnp.zeros((3, 1))}, jnp.array([5.0, 5.0, 0.0]))
  np.testing.assert_allclose(state.server.similarity,
                             [[1.0, 0.96, 1.0], [0.96, 1.0, 1.0], [1.0, 1.0, 1.0]], atol=1e-6)
  # A client uploads its update, theta after local training minus theta before.
  model, params, propagated, splits, _ = _one_client_case()
  out = algorithm.client_update(params, propagated, splits, jax.random.key(0))
  chex.assert_trees_all_close(out.upload, jax.tree.map(jnp.subtract, out.state, params))
  # The principal angles upload nothing and keep W.
  default = fedora.fedora(fedora.config_for_variant(), tiny_trainer(model))
  assert default.client_update(params, propagated, splits, jax.random.key(0)).upload == ()


def test_random_similarity_is_drawn_once_from_the_algorithm_key():
  config = fedora.config_for_variant("authors", similarity="random")
  algorithm = fedora.fedora(config, tiny_trainer(tiny_model()))
  state = algorithm.init(_context(_HAND_MODELS, key=5))
  np.testing.assert_array_equal(state.server.similarity,
                                similarity.random_similarity(jax.random.key(5), 3))
  np.testing.assert_allclose(state.server.graph,
                             fedora.propagation_graph(state.server.similarity, config))
  again = algorithm.init(_context(_HAND_MODELS, key=5))
  np.testing.assert_array_equal(again.server.similarity, state.server.similarity)
  assert algorithm.aggregate is fedora.keep_states  # fixed for the whole run


@pytest.mark.parametrize("measure", ["parameters", "gradients"])
def test_per_round_similarities_run_jitted_rounds(measure):
  data, _ = tiny_data([6, 8, 6, 10])
  model = tiny_model()
  trainer = tiny_trainer(model)
  config = fedora.config_for_variant("authors", similarity=measure)
  algorithm = fedora.fedora(config, trainer)
  state, metrics, _, traces = run_rounds(algorithm, trainer, data, model, rounds=2)
  assert traces == 1
  clients = state.algorithm.clients
  w = np.asarray(state.algorithm.server.similarity)
  assert np.all(np.isfinite(w)) and np.all(np.isfinite(metrics.test_score))
  np.testing.assert_allclose(w, w.T, atol=1e-5)
  if measure == "parameters":  # the cosines of the models the next round propagates
    np.testing.assert_allclose(w, fedora.parameter_similarity(clients), atol=1e-5)
  else:
    assert not np.allclose(w, 1.0)  # the updates differ across clients
  np.testing.assert_allclose(state.algorithm.server.graph,
                             fedora.propagation_graph(w, config), rtol=1e-5)
