"""Every registered algorithm runs two rounds: finite, right shapes, one compilation."""

import chex
import pytest

from fedora_jax import algorithms
from tiny import default_config, run_rounds, tiny_data, tiny_model, tiny_trainer


@pytest.mark.parametrize("name", sorted(algorithms.REGISTRY))
def test_two_rounds(name):
  data, _ = tiny_data([5, 5, 9, 30])  # two size buckets
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4, epochs=2, momentum=0.9)
  registered = algorithms.get(name)
  algorithm = registered.factory(default_config(name), trainer)
  state, metrics, stacked, traces = run_rounds(algorithm, trainer, data, model)
  assert traces == 1
  chex.assert_tree_all_finite(metrics)
  chex.assert_tree_shape_prefix(metrics, (4,))
  personalized = algorithm.personalized_params(state.algorithm.server, state.algorithm.clients)
  chex.assert_trees_all_equal_shapes(personalized, stacked)
  chex.assert_tree_all_finite(personalized)
