"""pFedSim: the classifier similarity and the -log(1 - s) weights against hand values, the
personalised broadcast (mixed body, own classifier), the warm-up's FedAvg, the
similarity measured on the round's pairs only, and the warm-up's rounds."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import pfedsim
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer


def test_classifier_similarity_by_hand():
  # Kernels [K=3, F=2, C=2]; column c is class c's weight vector.
  kernels = jnp.array([[[1.0, 0.0], [0.0, 1.0]],     # classes (1, 0), (0, 1)
                       [[1.0, 1.0], [0.0, 1.0]],     # classes (1, 0), (1, 1)
                       [[-1.0, 0.0], [0.0, -1.0]]])  # classes (-1, 0), (0, -1)
  s = pfedsim.classifier_similarity(kernels)
  half = 0.5 * (1.0 + 1.0 / np.sqrt(2.0))   # client 0 vs 1: cos 1 and 1/sqrt 2
  np.testing.assert_allclose(s[0, 1], half, rtol=1e-6)
  np.testing.assert_allclose(s[1, 0], half, rtol=1e-6)
  np.testing.assert_allclose(s[0, 2], 0.0)   # mean cosine -1, clipped at 0
  np.testing.assert_allclose(s[1, 2], 0.0)   # mean cosine -(1 + 1/sqrt 2)/2
  np.testing.assert_allclose(jnp.diag(s), 1.0, rtol=1e-6)


def test_aggregation_weights_by_hand():
  s = jnp.array([[1.0, 0.5, 0.0], [0.5, 1.0, 1.0], [0.0, 1.0, 1.0]])
  a = pfedsim.aggregation_weights(s)
  own = -np.log(1e-4)          # 9.2103...
  # rtol 1e-4: 1 - 0.9999 in float32 is 1e-4 to four digits.
  np.testing.assert_allclose(a[0], np.array([own, np.log(2.0), 0.0]) / (own + np.log(2.0)),
                             rtol=1e-4)
  # s = 1 off the diagonal is capped at 0.9999: client 2 weighs 1 and 2 alike.
  np.testing.assert_allclose(a[2], [0.0, 0.5, 0.5], rtol=1e-5)
  np.testing.assert_allclose(a.sum(axis=1), 1.0, rtol=1e-6)


def _stacked(num_clients=3):
  params = init_params(tiny_model())
  return jax.tree.map(
      lambda p: jnp.stack([p + i for i in range(num_clients)]), params)


def test_broadcast_mixes_the_body_and_keeps_each_classifier():
  algorithm = pfedsim.pfedsim(pfedsim.PfedSimConfig(warmup=0.0), tiny_trainer(tiny_model()))
  clients = _stacked()
  similarity = jnp.array([[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 1.0]])
  server = pfedsim.SimServer(model=jax.tree.map(lambda c: c[0] * 0, clients),
                             round=jnp.array(0), similarity=similarity)
  sent = algorithm.broadcast(server, clients)
  own, other = -np.log(1e-4), np.log(2.0)
  # Client i's leaves are p + i: client 0's body is p + other / (own + other).
  body, head = "Dense_0", "Dense_1"
  p = init_params(tiny_model())["params"]
  shift = other / (own + other)
  np.testing.assert_allclose(sent["params"][body]["kernel"][0],
                             p[body]["kernel"] + shift, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(sent["params"][body]["kernel"][1],
                             p[body]["kernel"] + 1 - shift, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(sent["params"][body]["bias"][2], p[body]["bias"] + 2,
                             rtol=1e-6)   # no similar client: its own body
  chex.assert_trees_all_close(sent["params"][head], clients["params"][head])


def test_warmup_sends_and_averages_the_global_model():
  algorithm = pfedsim.pfedsim(pfedsim.PfedSimConfig(warmup=2.0, rounds=10),
                              tiny_trainer(tiny_model()))
  clients = _stacked()
  server = pfedsim.SimServer(model=jax.tree.map(lambda c: c[1], clients),
                             round=jnp.array(1), similarity=jnp.eye(3))
  sent = algorithm.broadcast(server, clients)
  chex.assert_trees_all_close(sent, jax.tree.map(lambda c: jnp.stack([c[1]] * 3), clients))
  weights = jnp.array([1.0, 0.0, 3.0])   # client 1 sat the round out
  new = algorithm.aggregate(server, clients, clients, weights)
  # FedAvg: (1 (p + 0) + 3 (p + 2)) / 4 = p + 1.5, stored on every client; s untouched.
  expected = jax.tree.map(lambda c: c[0] + 1.5, clients)
  chex.assert_trees_all_close(new.server.model, expected, rtol=1e-6)
  chex.assert_trees_all_close(new.clients, jax.tree.map(lambda c: jnp.stack([c] * 3),
                                                        expected), rtol=1e-6)
  np.testing.assert_array_equal(new.server.similarity, jnp.eye(3))
  assert int(new.server.round) == 2


def test_personalisation_measures_only_the_rounds_pairs():
  algorithm = pfedsim.pfedsim(pfedsim.PfedSimConfig(warmup=0.0), tiny_trainer(tiny_model()))
  clients = _stacked()
  old = jnp.array([[1.0, 0.3, 0.2], [0.3, 1.0, 0.1], [0.2, 0.1, 1.0]])
  server = pfedsim.SimServer(model=jax.tree.map(lambda c: c[0], clients),
                             round=jnp.array(4), similarity=old)
  weights = jnp.array([2.0, 0.0, 1.0])   # clients 0 and 2 sampled
  new = algorithm.aggregate(server, clients, clients, weights)
  kernels = clients["params"]["Dense_1"]["kernel"]
  s02 = pfedsim.classifier_similarity(kernels)[0, 2]
  expected = old.at[0, 2].set(s02).at[2, 0].set(s02)
  np.testing.assert_allclose(new.server.similarity, expected, rtol=1e-6)
  chex.assert_trees_all_close(new.server.model, server.model)   # frozen after warm-up
  chex.assert_trees_all_close(new.clients, clients)             # the trained models kept


@pytest.mark.parametrize("warmup,rounds,expected", [(0.5, 100, 50), (0.25, 10, 2),
                                                    (1.0, 7, 7), (3.0, 10, 3)])
def test_warmup_rounds(warmup, rounds, expected):
  assert pfedsim.warmup_rounds(pfedsim.PfedSimConfig(warmup, rounds)) == expected


@pytest.mark.parametrize("field,value", [("warmup", -0.5), ("warmup", 100.0), ("rounds", 0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"pfedsim: {field}"):
    pfedsim.pfedsim(pfedsim.PfedSimConfig()._replace(**{field: value}),
                    tiny_trainer(tiny_model()))
