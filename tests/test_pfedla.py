"""pFedLA: the layer-wise aggregation and the chain-rule step of each client's
hypernetwork, in closed form on a two-client, two-layer model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import pfedla
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer


def test_layer_wise_aggregation_with_normalised_weights():
  models = {"params": {"Dense_0": {"kernel": jnp.array([[1.0], [3.0]])},
                       "Dense_1": {"kernel": jnp.array([[10.0], [20.0]])}}}
  alpha = jnp.array([[[1.0, 3.0], [0.0, 0.0]],     # client 0: layer 0 1:3; layer 1 all 0
                     [[2.0, 2.0], [0.0, 5.0]]])    # client 1
  weights = jax.vmap(pfedla.normalized_weights)(alpha, jnp.arange(2))
  np.testing.assert_allclose(weights, [[[0.25, 0.75], [1.0, 0.0]],   # all-0: its own layer
                                       [[0.5, 0.5], [0.0, 1.0]]])
  mixed = pfedla.aggregate_layers(weights, models)
  np.testing.assert_allclose(mixed["params"]["Dense_0"]["kernel"], [[2.5], [2.0]])
  np.testing.assert_allclose(mixed["params"]["Dense_1"]["kernel"], [[10.0], [20.0]])


def _setup(config=pfedla.PfedlaConfig(embed_dim=3, hidden_dim=4, server_lr=0.5)):
  data, _ = tiny_data([5, 6])
  model = tiny_model(hidden=(5,))  # Dense_0, Dense_1: L = 2 layers
  algorithm = pfedla.pfedla(config, tiny_trainer(model))
  models = jax.vmap(lambda k: init_params(model, seed=k))(jnp.arange(2))  # two distinct models
  state = algorithm.init(InitContext(params=models, data=data, trainer=None,
                                     key=jax.random.key(0)))
  return algorithm, state, models


def test_hypernetwork_step_follows_the_chain_rule_through_the_normalised_weights():
  """d theta_bar_i^l / d b_i[l, j] = (theta_j^l - theta_bar_i^l) / S_i^l where the ReLU is
  active (S_i^l = sum_j alpha_ij^l); so with c_i = theta_bar_i - theta_i' the head bias
  moves by -lr <c_i^l, theta_j^l - theta_bar_i^l> / S_i^l, and only for sampled clients."""
  algorithm, state, models = _setup()
  server = state.server
  alpha = jax.vmap(pfedla.raw_layer_weights)(server.hypernetworks)      # [2, L, 2]
  assert (alpha[0] > 0).all()  # U(0, 1) heads on ReLU features: client 0 all active
  received = algorithm.broadcast(server, state.clients)
  uploads = jax.tree.map(lambda a: a * 0.9 - 0.01, received)             # "trained" models
  weights = jnp.array([3.0, 0.0])                                        # client 1 sat out
  new = algorithm.aggregate(server, state.clients, uploads, weights).server
  names = ["Dense_0", "Dense_1"]
  expected_b = np.zeros((2, 2))
  for l, name in enumerate(names):
    flat = lambda t, k, name=name: np.concatenate(
        [np.ravel(a[k]) for a in jax.tree.leaves(t["params"][name])])
    c = flat(received, 0) - flat(uploads, 0)
    for j in range(2):
      expected_b[l, j] = -0.5 * c @ (flat(models, j) - flat(received, 0)) / float(
          jnp.sum(alpha[0, l]))
  np.testing.assert_allclose(new.hypernetworks.heads_b[0], expected_b, rtol=1e-4, atol=1e-7)
  # Client 1 (weight 0): hypernetwork and stored model unchanged.
  chex.assert_trees_all_close(tree.take(new.hypernetworks, 1),
                              tree.take(server.hypernetworks, 1))
  chex.assert_trees_all_close(tree.take(new.models, 1), tree.take(models, 1))
  chex.assert_trees_all_close(tree.take(new.models, 0), tree.take(uploads, 0))
  # The public code's sign: the same step, reversed.
  flipped = pfedla.pfedla(pfedla.PfedlaConfig(embed_dim=3, hidden_dim=4, server_lr=0.5,
                                              delta_sign="after_minus_before"),
                          tiny_trainer(tiny_model(hidden=(5,))))
  reverse = flipped.aggregate(server, state.clients, uploads, weights).server
  np.testing.assert_allclose(reverse.hypernetworks.heads_b[0], -expected_b, rtol=1e-4,
                             atol=1e-7)


def test_personalised_model_is_each_clients_layer_wise_aggregate():
  algorithm, state, models = _setup()
  alpha = np.asarray(jax.vmap(pfedla.raw_layer_weights)(state.server.hypernetworks))
  personalised = algorithm.personalized_params(state.server, state.clients)
  for i in range(2):
    for l, name in enumerate(["Dense_0", "Dense_1"]):
      total = alpha[i, l].sum()
      weights = alpha[i, l] / total if total > 0 else np.eye(2)[i]
      for field in ("kernel", "bias"):
        stacked = np.asarray(models["params"][name][field])
        np.testing.assert_allclose(personalised["params"][name][field][i],
                                   np.tensordot(weights, stacked, axes=1), rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(personalised, algorithm.broadcast(state.server, state.clients))


def test_local_view_scores_each_clients_last_trained_model():
  algorithm, state, models = _setup(pfedla.PfedlaConfig(embed_dim=3, hidden_dim=4,
                                                        server_lr=0.5, evaluate="local"))
  # Before any training: the models the run started from.
  chex.assert_trees_all_close(algorithm.personalized_params(state.server, state.clients),
                              models)
  received = algorithm.broadcast(state.server, state.clients)
  uploads = jax.tree.map(lambda a: a * 0.9 - 0.01, received)
  new = algorithm.aggregate(state.server, state.clients, uploads, jnp.array([3.0, 0.0]))
  scored = algorithm.personalized_params(new.server, new.clients)
  # Client 0 trained: its upload; client 1 sat out: still its starting model.
  chex.assert_trees_all_close(tree.first(scored), tree.first(uploads))
  chex.assert_trees_all_close(jax.tree.map(lambda a: a[1], scored),
                              jax.tree.map(lambda a: a[1], models))


def test_bad_hyperparameters_are_one_line_errors():
  trainer = tiny_trainer(tiny_model())
  for config, match in ((pfedla.PfedlaConfig(server_lr=0.0), "pfedla: server_lr"),
                        (pfedla.PfedlaConfig(embed_dim=0), "pfedla: embed_dim"),
                        (pfedla.PfedlaConfig(delta_sign="up"), "pfedla: delta_sign"),
                        (pfedla.PfedlaConfig(evaluate="global"), "pfedla: evaluate"),
                        (pfedla.PfedlaConfig(buffers="some"), "pfedla: buffers")):
    with pytest.raises(ConfigError, match=match):
      pfedla.pfedla(config, trainer)


def _fixed_hypernetworks(alpha: np.ndarray, embed_dim: int = 2, hidden_dim: int = 3):
  """Hypernetworks whose weights are alpha [N, L, N] (> 0): features all 1 (zero hidden
  kernels, last hidden bias 1), zero head kernels, head biases alpha."""
  num_clients, num_layers, _ = alpha.shape
  zeros = lambda *shape: jnp.zeros((num_clients,) + shape, jnp.float32)
  hidden = ((zeros(embed_dim, hidden_dim), zeros(hidden_dim)),
            (zeros(hidden_dim, hidden_dim), zeros(hidden_dim)),
            (zeros(hidden_dim, hidden_dim), jnp.ones((num_clients, hidden_dim))))
  return pfedla.LayerHypernetworks(embeddings=zeros(embed_dim), hidden=hidden,
                                   heads_w=zeros(num_layers, hidden_dim, num_clients),
                                   heads_b=jnp.asarray(alpha, jnp.float32))


def _bn_models():
  """Two clients' models: a layer with a BatchNorm (its running averages folded in) and a
  dense head."""
  norm = {"scale": jnp.array([[1.0], [3.0]]), "bias": jnp.array([[0.0], [4.0]]),
          "batch_stats": {"mean": jnp.array([[10.0], [30.0]]),
                          "var": jnp.array([[1.0], [5.0]])}}
  return {"params": {"ConvBN_0": {"Conv_0": {"kernel": jnp.array([[2.0], [6.0]])},
                                  "BatchNorm_0": norm},
                     "Dense_0": {"kernel": jnp.array([[1.0], [2.0]])}}}


def test_buffers_own_keeps_each_clients_running_averages_by_hand():
  # Client 0 weighs the BatchNorm layer 1:3, client 1 1:1.
  nets = _fixed_hypernetworks(np.array([[[1.0, 3.0], [1.0, 1.0]],
                                        [[2.0, 2.0], [0.0, 5.0]]]))
  models = _bn_models()
  mixed = pfedla.personalized_models(nets, models)
  own = pfedla.personalized_models(nets, models, own_buffers=True)
  for result in (mixed, own):  # the trainable tensors: 0.25 * 2 + 0.75 * 6, 0.5 * (2 + 6)
    np.testing.assert_allclose(result["params"]["ConvBN_0"]["Conv_0"]["kernel"][:, 0], [5, 4])
    np.testing.assert_allclose(result["params"]["ConvBN_0"]["BatchNorm_0"]["scale"][:, 0],
                               [2.5, 2.0])
  stats = lambda m: m["params"]["ConvBN_0"]["BatchNorm_0"]["batch_stats"]
  np.testing.assert_allclose(stats(mixed)["mean"][:, 0], [25.0, 20.0])
  np.testing.assert_allclose(stats(mixed)["var"][:, 0], [4.0, 3.0])
  np.testing.assert_allclose(stats(own)["mean"][:, 0], [10.0, 30.0])   # each its own
  np.testing.assert_allclose(stats(own)["var"][:, 0], [1.0, 5.0])


def test_buffers_own_leaves_the_running_averages_out_of_the_chain_rule():
  """Head bias b_0[l, j] moves by -lr <c^l, theta_j^l - theta_bar_0^l> / S^l over the
  trainable tensors only (the averages are client 0's own, whatever phi_0)."""
  alpha = np.array([[[1.0, 3.0], [1.0, 1.0]], [[2.0, 2.0], [0.0, 5.0]]])
  models = _bn_models()
  trainer = tiny_trainer(tiny_model())
  server = pfedla.PfedlaServer(hypernetworks=_fixed_hypernetworks(alpha), models=models)
  received = pfedla.personalized_models(server.hypernetworks, models, own_buffers=True)
  uploads = jax.tree.map(lambda a: a * 0.5 + 1.0, received)  # buffers moved as well
  expected = {}
  for buffers in ("own", "mix"):
    config = pfedla.PfedlaConfig(server_lr=0.1, buffers=buffers)
    algorithm = pfedla.pfedla(config, trainer)
    new = algorithm.aggregate(server, jnp.zeros(2), uploads, jnp.array([1.0, 0.0])).server
    expected[buffers] = np.asarray(new.hypernetworks.heads_b[0])
  # Layer 0 (ConvBN_0), own: trainable entries kernel, scale, bias of client 0's theta_bar
  # (5, 2.5, 3) uploaded as (3.5, 2.25, 2.5): c = theta_bar - theta' = (1.5, 0.25, 0.5);
  # theta_j - theta_bar: j = 0 (2 - 5, 1 - 2.5, 0 - 3), j = 1 (6 - 5, 3 - 2.5, 4 - 3); S 4.
  c = np.array([1.5, 0.25, 0.5])
  step = [-0.1 * c @ np.array([-3.0, -1.5, -3.0]) / 4, -0.1 * c @ np.array([1.0, 0.5, 1.0]) / 4]
  np.testing.assert_allclose(expected["own"][0], np.array([1.0, 3.0]) + step, rtol=1e-6)
  # mix: client 0's mixed averages (25, 4) beside the uploaded (0.5 * 10 + 1, 0.5 * 1 + 1)
  # add c = (19, 2.5) against theta_j - theta_bar = (10 - 25, 1 - 4) and (30 - 25, 5 - 4).
  step_mix = [step[0] - 0.1 * (19 * -15 + 2.5 * -3) / 4, step[1] - 0.1 * (19 * 5 + 2.5) / 4]
  np.testing.assert_allclose(expected["mix"][0], np.array([1.0, 3.0]) + step_mix, rtol=1e-6)


def test_delta_signs_move_the_aggregate_towards_or_away_from_the_trained_model():
  """To first order the default step moves theta_bar_0 towards client 0's trained model
  (descent on its loss); the public codes' sign moves it away (docs/algorithms/pfedla.md)."""
  algorithm, state, _ = _setup()
  server = state.server
  received = algorithm.broadcast(server, state.clients)
  uploads = jax.tree.map(lambda a: a * 0.9 - 0.01, received)

  def distance(nets):  # theta_bar_0 from `nets` and the models before the round
    mixed = pfedla.personalized_models(nets, server.models)
    return float(sum(jnp.sum((a[0] - b[0]) ** 2)
                     for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(uploads))))
  before = distance(server.hypernetworks)
  for sign, closer in (("before_minus_after", True), ("after_minus_before", False)):
    config = pfedla.PfedlaConfig(embed_dim=3, hidden_dim=4, server_lr=1e-3, delta_sign=sign)
    stepped = pfedla.pfedla(config, tiny_trainer(tiny_model(hidden=(5,)))).aggregate(
        server, state.clients, uploads, jnp.array([1.0, 0.0])).server
    assert (distance(stepped.hypernetworks) < before) == closer, (sign, before)
