"""FedBN: its server step by hand, FedAvg averaging BatchNorm statistics where FedBN keeps
them, FedAvg exactly on a model without BatchNorm, two rounds of a tiny ResNet and of the
CNN with BatchNorm (coaching_cnn_bn's shape)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms, tree
from fedora_jax.algorithms import fedavg, fedbn, local
from fedora_jax.engine import batch_stats
from fedora_jax.errors import FieldError
from fedora_jax.models.cnn import CNN, DenseBN
from fedora_jax.simulation import TrainConfig, run_algorithm
from tiny import (RESNET_X_SHAPE, TinyBN, run_rounds, tiny_data, tiny_model, tiny_resnet,
                  tiny_trainer)


def _model(dense, scale, mean):
  """A one-layer-and-a-BatchNorm variables dict (folded), leaves as given."""
  return {"params": {"Dense_0": {"kernel": dense},
                     "BatchNorm_0": {"scale": scale, "batch_stats": {"mean": mean}}}}


def test_server_averages_all_but_batch_norm_by_hand():
  algorithm = fedbn.fedbn(fedbn.FedBnConfig(), trainer=None)
  # Two clients' uploads: their non-BatchNorm leaves only.
  uploads = {"params": {"Dense_0": {"kernel": jnp.array([[1.0, 2.0], [3.0, 6.0]])}}}
  clients = fedbn.FedBnClient(index=jnp.arange(2), batch_norm={"params": {"BatchNorm_0": {
      "scale": jnp.array([[0.5], [2.0]]),
      "batch_stats": {"mean": jnp.array([[1.0], [-1.0]])}}}})
  state = algorithm.aggregate(None, clients, uploads, jnp.array([1.0, 3.0]))
  # (1 * [1, 2] + 3 * [3, 6]) / 4
  chex.assert_trees_all_close(state.server, {"params": {"Dense_0": {"kernel": jnp.array(
      [2.5, 5.0])}}})
  chex.assert_trees_all_equal(state.clients, clients)
  evaluated = algorithm.personalized_params(state.server, state.clients)
  chex.assert_trees_all_close(evaluated, _model(jnp.array([[2.5, 5.0], [2.5, 5.0]]),
                                                jnp.array([[0.5], [2.0]]),
                                                jnp.array([[1.0], [-1.0]])))
  # The paper's Algorithm 1: 1/K over the round's clients (the third sat it out).
  uniform = fedbn.fedbn(fedbn.FedBnConfig(weighting="uniform"), trainer=None)
  three = {"params": {"Dense_0": {"kernel": jnp.array([[1.0, 2.0], [3.0, 6.0], [9.0, 9.0]])}}}
  state = uniform.aggregate(None, clients, three, jnp.array([1.0, 3.0, 0.0]))
  chex.assert_trees_all_close(state.server["params"]["Dense_0"]["kernel"],
                              jnp.array([2.0, 4.0]))


def test_split_keeps_scale_bias_and_statistics_local():
  params = {"params": {"ConvBN_0": {
      "Conv_0": {"kernel": 1.0},
      "BatchNorm_0": {"scale": 2.0, "bias": 3.0, "batch_stats": {"mean": 4.0, "var": 5.0}}},
      "Dense_0": {"kernel": 6.0, "bias": 7.0}}}
  shared, local_part = fedbn.split_batch_norm(params)
  assert shared == {"params": {"ConvBN_0": {"Conv_0": {"kernel": 1.0}},
                               "Dense_0": {"kernel": 6.0, "bias": 7.0}}}
  assert local_part == {"params": {"ConvBN_0": {"BatchNorm_0": {
      "scale": 2.0, "bias": 3.0, "batch_stats": {"mean": 4.0, "var": 5.0}}}}}
  assert fedbn.with_batch_norm(shared, local_part) == params


def test_fedavg_averages_the_statistics_and_fedbn_keeps_them():
  sizes = [2, 3, 5]
  data, _ = tiny_data(sizes)
  model = TinyBN()
  trainer = tiny_trainer(model, batch_size=8)
  weights = jnp.asarray(sizes, jnp.float32)

  def one_round(algorithm):
    state, _, _, _ = run_rounds(algorithm, trainer, data, model, rounds=1)
    return state.algorithm, algorithm.personalized_params(*state.algorithm)
  # Round 1 trains every client from the shared initial model with the same keys, so
  # LOCAL's clients are the models FedAvg and FedBN receive.
  _, trained = one_round(local.local(local.LocalConfig(), trainer))
  _, fedavg_models = one_round(fedavg.fedavg(fedavg.FedAvgConfig(), trainer))
  _, fedbn_models = one_round(fedbn.fedbn(fedbn.FedBnConfig(), trainer))
  average = tree.weighted_mean(trained, weights)
  chex.assert_trees_all_close(tree.first(fedavg_models), average, atol=1e-6)
  batch_norm = trained["params"]["BatchNorm_0"]
  chex.assert_trees_all_close(fedbn_models["params"]["BatchNorm_0"], batch_norm, atol=1e-6)
  assert not np.allclose(batch_norm["batch_stats"]["mean"][0],
                         batch_norm["batch_stats"]["mean"][1])
  for name in ("Dense_0", "Dense_1"):
    chex.assert_trees_all_close(
        fedbn_models["params"][name],
        tree.broadcast_to_clients(average["params"][name], len(sizes)), atol=1e-6)


def test_without_batch_norm_fedbn_is_fedavg_exactly():
  data, _ = tiny_data([2, 3, 5])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, momentum=0.9)
  runs = [run_rounds(algorithm, trainer, data, model, rounds=2) for algorithm in
          (fedavg.fedavg(fedavg.FedAvgConfig(), trainer),
           fedbn.fedbn(fedbn.FedBnConfig(), trainer))]
  (fedavg_state, fedavg_metrics, _, _), (fedbn_state, fedbn_metrics, _, _) = runs
  chex.assert_trees_all_equal(fedbn_metrics, fedavg_metrics)
  chex.assert_trees_all_equal(fedbn_state.algorithm.server, fedavg_state.algorithm.server)
  assert jax.tree.leaves(fedbn_state.algorithm.clients.batch_norm) == []


def test_two_rounds_of_a_tiny_resnet_keep_each_clients_batch_norm():
  data, _ = tiny_data([4, 6, 5], x_shape=RESNET_X_SHAPE)
  train = TrainConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.1, log_every=0)
  result = run_algorithm(algorithms.make("fedbn"), tiny_resnet(), data, train)
  assert np.isfinite(result.history.val_loss).all()
  clients = result.final_state.algorithm.clients.batch_norm
  leaves = jax.tree_util.tree_leaves_with_path(clients)
  # Stem and block BatchNorms: scale, bias, mean and variance each, trained apart.
  assert len(leaves) == 4 * 3 and all(batch_stats.is_batch_norm(p) for p, _ in leaves)
  for _, leaf in leaves:
    assert not np.allclose(leaf[0], leaf[1])
  server = result.final_state.algorithm.server
  assert not any(batch_stats.is_batch_norm(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(server))


def test_unknown_weighting_is_a_field_error():
  with pytest.raises(FieldError, match="weighting"):
    fedbn.fedbn(fedbn.FedBnConfig(weighting="median"), trainer=None)


def test_dense_batch_norm_normalises_in_train_mode_and_keeps_a_tenth_of_the_batch():
  # The CNN's BatchNorm: statistics over the batch's real samples (mask); the running
  # averages move 0.1 of the way to the batch's mean and (biased) variance.
  x = jnp.array([[1.0], [3.0], [100.0]])
  layer = DenseBN(1)
  variables = layer.init(jax.random.key(0), x, None)
  variables = {**variables, "params": {**variables["params"], "Dense_0": {
      "kernel": jnp.ones((1, 1)), "bias": jnp.zeros(1)}}}
  mask = jnp.array([True, True, False])
  y, updated = layer.apply(variables, x, mask, mutable=["batch_stats"])
  # Real samples 1 and 3: mean 2, variance 1, so they normalise to -1 and +1.
  np.testing.assert_allclose(y[:2, 0], [-1.0, 1.0], atol=1e-4)
  statistics = updated["batch_stats"]["BatchNorm_0"]
  np.testing.assert_allclose(statistics["mean"], [0.2], atol=1e-6)
  np.testing.assert_allclose(statistics["var"], [0.9 + 0.1 * 1.0], atol=1e-6)
  # Inference mode: the running averages, not the batch.
  y = layer.apply({**variables, **updated}, x, None)
  np.testing.assert_allclose(y[:, 0], (x[:, 0] - 0.2) / np.sqrt(1.0 + 1e-5), rtol=1e-5)


def test_two_rounds_of_the_batch_norm_cnn_keep_its_four_batch_norms_local():
  data, _ = tiny_data([4, 6, 5], x_shape=(16, 16, 1))
  model = CNN(num_outputs=3, kernels=2, dense=(4, 3), batch_norm=True)
  train = TrainConfig(rounds=2, local_epochs=1, batch_size=4, lr=0.1, log_every=0)
  result = run_algorithm(algorithms.make("fedbn"), model, data, train)
  assert np.isfinite(result.history.val_loss).all()
  leaves = jax.tree_util.tree_leaves_with_path(result.final_state.algorithm.clients.batch_norm)
  # ConvBN_0, ConvBN_1, DenseBN_0, DenseBN_1: scale, bias, mean and variance each.
  assert len(leaves) == 4 * 4 and all(batch_stats.is_batch_norm(p) for p, _ in leaves)
  for _, leaf in leaves:
    assert not np.allclose(leaf[0], leaf[1])
  server = result.final_state.algorithm.server
  assert sorted(server["params"]) == ["ConvBN_0", "ConvBN_1", "DenseBN_0", "DenseBN_1",
                                      "Dense_0"]
  assert not any(batch_stats.is_batch_norm(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(server))
