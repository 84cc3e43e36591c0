"""FedAP: the Wasserstein distances and the momentum weights against hand values, the
BatchNorm inputs' moments against numpy, the mixtures with each client's BatchNorm kept
(the authors' and FL-bench's), the warm-up's FedAvg, the moments stored from a client's
first round after it, and bad values."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedap
from fedora_jax.engine import batch_stats
from fedora_jax.errors import ConfigError
from fedora_jax.models.norm import batch_norm
from tiny import RESNET_X_SHAPE, init_folded, tiny_model, tiny_resnet, tiny_trainer


def test_wasserstein_distances_by_hand():
  # Two BatchNorm layers, K = 2: layer 0 has 2 channels, layer 1 one.
  moments = fedap.Moments(
      mean=(jnp.array([[0.0, 0.0], [3.0, 4.0]]), jnp.array([[1.0], [1.0]])),
      var=(jnp.array([[1.0, 1.0], [1.0, 1.0]]), jnp.array([[1.0], [9.0]])))
  d = fedap.wasserstein_distances(moments, 2)
  # Layer 0: sqrt(3^2 + 4^2 + 0) = 5; layer 1: sqrt(0 + (3 - 1)^2) = 2.
  np.testing.assert_allclose(d, [[0.0, 7.0], [7.0, 0.0]], rtol=1e-6)


def test_aggregation_weights_by_hand():
  d = jnp.array([[0.0, 1.0, 4.0, 9.0], [1.0, 0.0, 0.0, 9.0], [4.0, 0.0, 0.0, 9.0],
                 [9.0, 9.0, 9.0, 0.0]])
  measured = jnp.array([True, True, True, False])
  w = fedap.aggregation_weights(d, measured, 0.5)
  # Client 0: 1/1 and 1/4 normalised, times 1 - m: 0.5 * (0.8, 0.2).
  np.testing.assert_allclose(w[0], [0.5, 0.4, 0.1, 0.0], rtol=1e-6)
  # Client 1: distance 0 to client 2 weighs 1e14, so nearly all of 1 - m goes there.
  np.testing.assert_allclose(w[1], [0.5e-14, 0.5, 0.5, 0.0], rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(w[3], [0.0, 0.0, 0.0, 1.0])   # not measured: its own model
  alone = fedap.aggregation_weights(d, jnp.array([True, False, False, False]), 0.5)
  np.testing.assert_allclose(alone, np.eye(4))              # no other measured client


class _BnFirst(nn.Module):
  """x -> BatchNorm -> Dense: the first BatchNorm's input is x itself."""

  @nn.compact
  def __call__(self, x, mask=None):
    h = batch_norm(x, mask, self.is_mutable_collection("batch_stats"))
    return nn.Dense(2)(batch_norm(nn.Dense(3)(h), mask,
                                  self.is_mutable_collection("batch_stats")))


def test_client_moments_are_those_of_the_batch_norm_inputs():
  model = _BnFirst()
  x = jax.random.normal(jax.random.key(0), (7, 4)) * 2.0 + 1.0
  mask = jnp.array([True, True, True, True, True, False, False])
  params = batch_stats.fold(model.init(jax.random.key(1), x))
  apply = batch_stats.model_apply(model.apply)
  moments = jax.jit(lambda p: fedap.client_moments(apply, p, x, mask))(params)
  assert len(moments.mean) == 2
  real = np.asarray(x[:5])
  np.testing.assert_allclose(moments.mean[0], real.mean(axis=0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(moments.var[0], real.var(axis=0), rtol=1e-4, atol=1e-6)
  # The second layer's input: the first Dense over the first BatchNorm (inference mode).
  hidden = np.asarray(fedap.batch_norm_inputs(apply, params, x)[1])[:5]
  np.testing.assert_allclose(moments.mean[1], hidden.mean(axis=0), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(moments.var[1], hidden.var(axis=0), rtol=1e-4, atol=1e-6)


def test_client_moments_of_a_convolution_pool_the_positions():
  model = tiny_resnet()
  params = init_folded(model, x_shape=RESNET_X_SHAPE)
  apply = batch_stats.model_apply(model.apply)
  x = jax.random.uniform(jax.random.key(2), (3,) + RESNET_X_SHAPE)
  moments = fedap.client_moments(apply, params, x, jnp.ones(3, bool))
  first = np.asarray(fedap.batch_norm_inputs(apply, params, x)[0])   # [3, H, W, C]
  np.testing.assert_allclose(moments.mean[0], first.mean(axis=(0, 1, 2)), rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(moments.var[0], first.var(axis=(0, 1, 2)), rtol=1e-4,
                             atol=1e-6)


def _stacked_resnet(num_clients=3):
  params = init_folded(tiny_resnet(), x_shape=RESNET_X_SHAPE)
  return jax.tree.map(lambda p: jnp.stack([p + i for i in range(num_clients)]), params)


@pytest.mark.parametrize("kept", ["all", "statistics"])
def test_broadcast_mixes_and_keeps_each_clients_batch_norm(kept):
  config = fedap.FedApConfig(warmup=0.0, batch_norm=kept)
  algorithm = fedap.fedap(config, tiny_trainer(tiny_resnet()))
  clients = _stacked_resnet()
  weights = jnp.array([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
  server = fedap.ApServer(model=jax.tree.map(lambda c: c[0], clients), round=jnp.array(3),
                          moments=fedap.Moments((), ()), measured=jnp.ones(3, bool),
                          weights=weights)
  sent = algorithm.broadcast(server, clients)
  shifts = np.array([0.75, 1.0, 1.0])   # sum_j w_ij j: client i's leaves are p + i

  def check(path, new, old):
    local = (batch_stats.is_batch_norm(path) if kept == "all"
             else batch_stats.is_statistic(path))
    for i in range(3):
      expected = old[i] if local else old[0] + shifts[i]
      np.testing.assert_allclose(new[i], expected, rtol=1e-5, atol=1e-5)

  jax.tree_util.tree_map_with_path(check, sent, clients)


def test_warmup_averages_then_first_rounds_store_the_moments():
  algorithm = fedap.fedap(fedap.FedApConfig(warmup=0.25, rounds=4),
                          tiny_trainer(tiny_model()))
  clients = jax.tree.map(lambda p: jnp.stack([p, p + 2.0, p + 4.0]),
                         init_folded(tiny_model()))
  moments = fedap.Moments(mean=(jnp.zeros((3, 2)),), var=(jnp.ones((3, 2)),))
  server = fedap.ApServer(model=jax.tree.map(lambda c: c[0], clients), round=jnp.array(0),
                          moments=moments, measured=jnp.zeros(3, bool), weights=jnp.eye(3))
  uploaded = fedap.Moments(mean=(jnp.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]]),),
                           var=(jnp.ones((3, 2)),))
  weights = jnp.array([1.0, 0.0, 3.0])    # client 1 sat the round out
  warm = algorithm.aggregate(server, clients, (clients, uploaded), weights)
  # FedAvg: (1 p + 3 (p + 4)) / 4 = p + 3 on every client; nothing measured yet.
  expected = jax.tree.map(lambda c: c[0] + 3.0, clients)
  chex.assert_trees_all_close(warm.server.model, expected, rtol=1e-6)
  chex.assert_trees_all_close(warm.clients, jax.tree.map(lambda c: jnp.stack([c] * 3),
                                                         expected), rtol=1e-6)
  assert not np.any(warm.server.measured)
  # Round T_w = 1: clients 0 and 2 measured (distance 10 apart), client 1 not yet.
  after = algorithm.aggregate(warm.server, clients, (clients, uploaded), weights)
  np.testing.assert_array_equal(after.server.measured, [True, False, True])
  np.testing.assert_allclose(after.server.moments.mean[0][1], [0.0, 0.0])   # kept
  np.testing.assert_allclose(after.server.weights,
                             [[0.5, 0.0, 0.5], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], rtol=1e-6)
  chex.assert_trees_all_close(after.server.model, warm.server.model)   # frozen
  chex.assert_trees_all_close(after.clients, clients)                  # trained, kept
  # Client 1's first round after the warm-up: its moments join; 0 and 2 keep theirs.
  later = algorithm.aggregate(after.server, clients, (clients, fedap.Moments(
      mean=(jnp.full((3, 2), 9.0),), var=(jnp.ones((3, 2)),))), jnp.ones(3))
  np.testing.assert_allclose(later.server.moments.mean[0],
                             [[0.0, 0.0], [9.0, 9.0], [6.0, 8.0]])
  d01, d12 = np.hypot(9.0, 9.0), np.hypot(3.0, 1.0)
  row1 = 0.5 * np.array([1 / d01, 0.0, 1 / d12]) / (1 / d01 + 1 / d12)
  np.testing.assert_allclose(later.server.weights[1], row1 + [0.0, 0.5, 0.0], rtol=1e-5)


def test_a_model_without_batch_norm_mixes_uniformly():
  algorithm = fedap.fedap(fedap.FedApConfig(warmup=0.0), tiny_trainer(tiny_model()))
  clients = jax.tree.map(lambda p: jnp.stack([p] * 3), init_folded(tiny_model()))
  shapes = fedap.client_moments(batch_stats.model_apply(tiny_model().apply),
                                jax.tree.map(lambda c: c[0], clients), jnp.zeros((2, 4)),
                                jnp.ones(2, bool))
  assert shapes.mean == ()
  server = fedap.ApServer(model=jax.tree.map(lambda c: c[0], clients), round=jnp.array(0),
                          moments=shapes, measured=jnp.zeros(3, bool), weights=jnp.eye(3))
  new = algorithm.aggregate(server, clients, (clients, shapes), jnp.ones(3))
  np.testing.assert_allclose(new.server.weights,
                             [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])


@pytest.mark.parametrize("field,value", [("warmup", -0.5), ("warmup", 100.0), ("rounds", 0),
                                         ("model_momentum", 1.5), ("batch_norm", "none"),
                                         ("score", "best")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedap: {field}") as raised:
    fedap.fedap(fedap.FedApConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
  assert "\n" not in str(raised.value)
