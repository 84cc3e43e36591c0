"""FedPCL: the prototypes (local, global, each client's set), a client's step on the two
contrastive losses with its uploaded prototypes, the server's update, and the scoring,
against hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedpcl
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1
TAU = 0.5


def _unit(v):
  return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def _features(params, x):
  layer = params["params"]["Dense_0"]
  return jax.nn.relu(x @ layer["kernel"] + layer["bias"])


def _hand_prototypes(params, x, y, num_classes=3):
  r = _unit(np.asarray(_features(params, x)))
  own = np.array([np.any(y == c) for c in range(num_classes)])
  means = np.stack([r[y == c].mean(0) if own[c] else np.zeros(r.shape[1])
                    for c in range(num_classes)])
  return means, own


def test_global_prototypes_and_the_clients_sets():
  rng = np.random.default_rng(0)
  means = rng.normal(size=(3, 2, 4)).astype(np.float32)        # K 3, C 2, d 4
  own = np.array([[True, False], [True, True], [False, False]])
  previous = fedpcl.PclServer(prototypes=jnp.full((2, 4), 7.0),
                              present=jnp.array([False, True]))
  uploads = fedpcl.PclUpload(prototypes=jnp.asarray(means), own=jnp.asarray(own))
  # Client 1 not counted: class 0 from client 0 alone, class 1 from nobody (kept).
  new = fedpcl.global_prototypes(uploads, jnp.array([True, False, True]), previous)
  np.testing.assert_allclose(new.prototypes[0], means[0, 0], atol=1e-6)
  np.testing.assert_allclose(new.prototypes[1], np.full(4, 7.0))
  np.testing.assert_array_equal(new.present, [True, True])
  every = fedpcl.global_prototypes(uploads, jnp.ones(3, bool), previous)
  np.testing.assert_allclose(every.prototypes[0], (means[0, 0] + means[1, 0]) / 2, atol=1e-6)
  np.testing.assert_allclose(every.prototypes[1], means[1, 1], atol=1e-6)
  sets = fedpcl.padded_sets(uploads, every)
  np.testing.assert_allclose(sets[0], np.stack([means[0, 0], every.prototypes[1]]), atol=1e-6)
  np.testing.assert_allclose(sets[1], means[1], atol=1e-6)
  np.testing.assert_allclose(sets[2], every.prototypes, atol=1e-6)


def _setup(config):
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)             # one full-batch step
  algorithm = fedpcl.fedpcl(config, trainer)
  params = init_params(model, seed=0)
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (3,) + a.shape), params)
  state = algorithm.init(fedpcl.InitContext(params=stacked, data=data, trainer=trainer,
                                            key=jax.random.key(0)))
  return data, clients, model, algorithm, params, state


def test_the_first_prototypes_come_from_the_initial_model():
  _, clients, _, _, params, state = _setup(fedpcl.FedPclConfig())
  hand = [_hand_prototypes(params, c.x_train, c.y_train) for c in clients]
  own = np.stack([o for _, o in hand])
  mean = np.stack([np.mean([m[c] for m, o in hand if o[c]], axis=0) for c in range(3)])
  np.testing.assert_allclose(state.server.prototypes, mean, atol=1e-5)
  for k, (means, held) in enumerate(hand):
    np.testing.assert_array_equal(state.clients.own[k], held)
    np.testing.assert_allclose(state.clients.prototypes[k],
                               np.where(held[:, None], means, mean), atol=1e-5)
  assert own.any(axis=0).all()


def test_a_client_step_descends_both_contrastive_losses():
  data, clients, model, algorithm, params, state = _setup(fedpcl.FedPclConfig(tau=TAU))
  messages = algorithm.broadcast(state.server, state.clients)
  k = 1
  splits = jax.tree.map(lambda a: jnp.asarray(a[k]), data.buckets[0])
  client = jax.tree.map(lambda a: a[k], state.clients)
  out = algorithm.client_update(client, jax.tree.map(lambda a: a[k], messages), splits,
                                jax.random.key(0))
  x, y = jnp.asarray(clients[k].x_train), jnp.asarray(clients[k].y_train)
  global_prototypes, sets = state.server.prototypes, state.clients.prototypes

  def nll(r, prototypes):          # -log softmax(<r, P_c> / tau)[y], a mean over the batch
    logits = r @ prototypes.T / TAU
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

  def loss(p):
    h = _features(p, x)
    r = h / jnp.sqrt(jnp.maximum(jnp.sum(h * h, axis=-1, keepdims=True), 1e-24))
    return nll(r, global_prototypes) + sum(nll(r, sets[j]) for j in range(3)) / 3
  grads = jax.grad(loss)(params)
  trained = jax.tree.map(lambda a, g: a - LR * g, params, grads)
  chex.assert_trees_all_close(out.state.params, trained, atol=1e-6)
  means, own = _hand_prototypes(trained, clients[k].x_train, clients[k].y_train)
  np.testing.assert_allclose(out.upload.prototypes, means, atol=1e-5)
  np.testing.assert_array_equal(out.upload.own, own)


def test_the_server_rebuilds_the_sampled_clients_sets_only():
  data, _, _, algorithm, _, state = _setup(fedpcl.FedPclConfig())
  rng = np.random.default_rng(1)
  uploads = fedpcl.PclUpload(prototypes=jnp.asarray(rng.normal(size=(3, 3, 5)), jnp.float32),
                             own=jnp.array([[True, True, False], [False] * 3,
                                            [True, False, False]]))
  new = algorithm.aggregate(state.server, state.clients, uploads, jnp.array([6.0, 0.0, 2.0]))
  expected = np.stack([(uploads.prototypes[0, 0] + uploads.prototypes[2, 0]) / 2,
                       uploads.prototypes[0, 1], state.server.prototypes[2]])
  np.testing.assert_allclose(new.server.prototypes, expected, atol=1e-6)
  np.testing.assert_allclose(new.clients.prototypes[1], state.clients.prototypes[1])
  np.testing.assert_allclose(new.clients.prototypes[0],
                             np.stack([uploads.prototypes[0, 0], uploads.prototypes[0, 1],
                                       expected[2]]), atol=1e-6)
  np.testing.assert_array_equal(new.clients.own[2], [True, False, False])
  np.testing.assert_array_equal(new.clients.own[1], state.clients.own[1])


@pytest.mark.parametrize("predict,label", [("similarity", 1), ("distance", 0)])
def test_a_client_is_scored_by_its_prototypes(predict, label):
  # r = (1, 0) (the body's output, normalised). Similarity picks the largest <r, P_c>:
  # class 1 (2.0 > 0.9); distance the nearest of the classes the client holds (0 and 2):
  # ||r - P_0||^2 = 0.01 + 0.36 against 0 + 4.
  model = tiny_model(hidden=(2,))
  params = init_params(model, num_features=2)
  params["params"]["Dense_0"] = {"kernel": jnp.eye(2), "bias": jnp.zeros(2)}
  prototypes = jnp.array([[0.9, 0.6], [2.0, 0.0], [1.0, 2.0]])
  config = fedpcl.FedPclConfig(predict=predict)
  scored = {"similarity": jnp.array([True, True, True]),
            "distance": jnp.array([True, False, True])}[predict]
  forward = fedpcl.prototype_forward(model.apply, "Dense_1", config)
  scores = forward(fedpcl.PclPersonal(params, prototypes, scored), jnp.array([[3.0, 0.0]]))
  assert int(jnp.argmax(scores[0])) == label


@pytest.mark.parametrize("field,value", [("tau", 0.0), ("clip_norm", -1.0),
                                         ("predict", "head")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedpcl: {field}"):
    fedpcl.fedpcl(fedpcl.FedPclConfig()._replace(**{field: value}),
                  tiny_trainer(tiny_model()))
