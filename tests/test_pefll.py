"""PeFLL: the descriptor and its normalisations against hand values, the server's m, s,
the hypernetwork's and the embedding network's gradients against jax.grad of the
chain rule's inner product, scoring with absent classes masked, and bad values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import pefll, pfedhn
from fedora_jax.algorithms.base import InitContext
from fedora_jax.algorithms.pefll import PefllConfig, Scale
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer


def test_descriptor_and_normalisations_by_hand():
  layers = ((jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]]), jnp.array([0.0, 0.0, 1.0])),)
  inputs = jnp.array([[1.0, 2.0], [3.0, 0.0], [9.0, 9.0]])
  raw = pefll.raw_descriptor(layers, inputs, jnp.array([1.0, 1.0, 0.0]))   # third left out
  # Rows (1, 2, 3) and (3, 0, 7): their mean (2, 1, 5).
  np.testing.assert_allclose(raw, [2.0, 1.0, 5.0], rtol=1e-6)
  mean, std = 8.0 / 3.0, np.sqrt(((2 - 8 / 3) ** 2 + (1 - 8 / 3) ** 2 + (5 - 8 / 3) ** 2) / 2)
  mine = pefll.own_scale(raw)
  np.testing.assert_allclose([mine.mean, mine.std], [mean, std], rtol=1e-6)
  want = (np.array([2.0, 1.0, 5.0]) - mean) / std
  np.testing.assert_allclose(pefll.normalized(raw, mine._replace(ready=False), "each"), want,
                             rtol=1e-5)
  unset = Scale(jnp.zeros(()), jnp.ones(()), jnp.bool_(False))
  np.testing.assert_allclose(pefll.normalized(raw, unset, "first"), want, rtol=1e-5)
  fixed = Scale(jnp.array(1.0), jnp.array(2.0), jnp.bool_(True))
  np.testing.assert_allclose(pefll.normalized(raw, fixed, "first"), [0.5, 0.0, 2.0], rtol=1e-6)


def test_server_keeps_the_first_sampled_clients_scale():
  uploads = Scale(jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 5.0, 6.0]), jnp.ones(3, bool))
  unset = Scale(jnp.zeros(()), jnp.ones(()), jnp.bool_(False))
  got = pefll.first_scale(unset, uploads, jnp.array([False, True, True]))
  np.testing.assert_allclose([got.mean, got.std, got.ready], [2.0, 5.0, 1.0])
  kept = pefll.first_scale(got, uploads, jnp.array([True, False, False]))
  np.testing.assert_allclose([kept.mean, kept.std], [2.0, 5.0])
  none = pefll.first_scale(unset, uploads, jnp.zeros(3, bool))
  assert not bool(none.ready)


def test_descriptor_weights_draw_count_real_samples():
  mask = jnp.array([True, True, True, True, False])
  weights = pefll.descriptor_weights(mask, 2, jax.random.key(0))
  assert float(weights.sum()) == 2.0 and float(weights[4]) == 0.0
  np.testing.assert_array_equal(pefll.descriptor_weights(mask, 0, jax.random.key(0)),
                                [1, 1, 1, 1, 0])


def test_hyper_gradient_is_the_chain_rule():
  target = init_params(tiny_model(), 4)
  hyper = pfedhn.init_hypernetwork(jax.random.key(1), 2, 3, 1, target)
  descriptors = jax.random.normal(jax.random.key(2), (3, 2))
  deltas = jax.tree.map(lambda a: jax.random.normal(jax.random.key(3), (3,) + a.shape), target)

  def inner(net):
    models = jax.vmap(lambda v: pfedhn.hypernetwork_apply(net, v))(descriptors)
    return sum(jnp.vdot(m, d) for m, d in zip(jax.tree.leaves(models), jax.tree.leaves(deltas)))
  got = pefll.hyper_gradient(hyper, descriptors, deltas)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.grad(inner)(hyper))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _built(**overrides):
  model = tiny_model()
  trainer = tiny_trainer(model)
  data, _ = tiny_data((5, 6, 7))
  algorithm = pefll.pefll(PefllConfig(embed_batches=0, **overrides), trainer)
  stacked = tree.broadcast_to_clients(init_params(model, 4), 3)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  return algorithm, state, data


def test_client_embedding_gradient_is_the_chain_rule():
  algorithm, state, data = _built()
  splits = jax.tree.map(lambda a: a[1], data.buckets[0])      # the second client
  received = jax.tree.map(lambda a: a[1], algorithm.broadcast(state.server, state.clients))
  out = algorithm.client_update(state.clients[1], received, splits, jax.random.key(4))
  networks, scale = received
  inputs = pefll.embed_inputs(splits.train.x, splits.train.y, 3, "xy")
  weights = splits.train.mask.astype(jnp.float32)

  def inner(embed):
    v = pefll.normalized(pefll.raw_descriptor(embed, inputs, weights), scale, "first")
    theta = pfedhn.hypernetwork_apply(networks.hyper, v)
    return sum(jnp.vdot(t, d) for t, d in zip(jax.tree.leaves(theta),
                                               jax.tree.leaves(out.upload.delta)))
  for a, b in zip(jax.tree.leaves(out.upload.embed_grad),
                  jax.tree.leaves(jax.grad(inner)(networks.embed))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The descriptor it uploads is its own standardised one (no m, s yet).
  raw = pefll.raw_descriptor(networks.embed, inputs, weights)
  np.testing.assert_allclose(out.upload.descriptor, (raw - raw.mean()) / jnp.std(raw, ddof=1),
                             rtol=1e-4, atol=1e-6)


def test_scoring_masks_absent_classes():
  algorithm, state, data = _built()
  splits = jax.tree.map(lambda a: a[0], data.buckets[0])
  # Client 0's training split without class 2: its logits for class 2 are 0.
  train = splits.train._replace(mask=splits.train.mask & (splits.train.y != 2))
  splits = splits._replace(train=train)
  networks, scale = algorithm.shared_model(state.server)
  inputs = pefll.embed_inputs(train.x, train.y, 3, "xy")
  raw = pefll.raw_descriptor(networks.embed, inputs, train.mask.astype(jnp.float32))
  theta = pfedhn.hypernetwork_apply(networks.hyper, pefll.normalized(raw, scale, "first"))
  logits = tiny_model().apply(theta, splits.test.x) * jnp.array([1.0, 1.0, 0.0])
  real = splits.test.mask
  want = np.mean(np.asarray(jnp.argmax(logits, -1) == splits.test.y)[np.asarray(real)])
  (stats,) = algorithm.evaluate_splits((networks, scale), splits, ("test",))
  np.testing.assert_allclose(stats.score, want, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("embed_model", "cnn"), ("normalize", "both"),
                                         ("embed_layers", 0), ("embed_batches", -1),
                                         ("server_lr", 0.0), ("grad_clip", -1.0)])
def test_bad_values_refused(field, value):
  with pytest.raises(ConfigError, match=field):
    pefll.pefll(PefllConfig(**{field: value}), tiny_trainer(tiny_model()))
