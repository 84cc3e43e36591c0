"""The layer-wise methods (layers.py) on the CNN's conv + dense layers: two rounds,
finite, right shapes. Every algorithm on the MLP: test_algorithm_matrix.py."""

import chex
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms.ala import AlaConfig
from tiny import CNN_X_SHAPE, default_config, run_rounds, tiny_cnn, tiny_data, tiny_trainer


# The methods that work on layers (layers.py), on the CNN's conv + dense layers. FedRep,
# FedRoD, FedPer and LG-FedAvg take their body / head split from the same layer_names
# (tested on every registered model in test_split_layers.py) and are left out for time:
# a CNN round compiles in ~10 s here.
LAYERWISE = ["coaching", "fedala", "fedavg+ala"]


@pytest.mark.parametrize("name", LAYERWISE)
def test_layerwise_methods_run_on_the_cnn(name):
  data, _ = tiny_data([5, 9, 9], x_shape=CNN_X_SHAPE)
  model = tiny_cnn()
  trainer = tiny_trainer(model, batch_size=4, epochs=2)
  host = name.removesuffix("+ala")
  config = default_config(host)
  if name.endswith("+ala"):
    config = algorithms.Plugged(config, ala=AlaConfig())
  algorithm = algorithms.build(host, config, trainer)
  state, metrics, stacked, _ = run_rounds(algorithm, trainer, data, model, x_shape=CNN_X_SHAPE)
  chex.assert_tree_all_finite(metrics)
  personalized = algorithm.personalized_params(state.algorithm.server, state.algorithm.clients)
  chex.assert_trees_all_equal_shapes(personalized, stacked)
  chex.assert_tree_all_finite(personalized)
  assert sorted(stacked["params"]) == ["Conv_0", "Conv_1", "Dense_0", "Dense_1", "Dense_2"]
