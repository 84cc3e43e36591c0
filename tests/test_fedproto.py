"""FedProto: prototypes, their aggregation and the regulariser by hand, one local step, and
nearest-prototype inference as a classifier head."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import fedproto
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_prototypes_are_the_class_means_of_the_real_samples():
  z = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0], [7.0, 7.0], [9.0, 9.0]])
  y = jnp.array([0, 0, 2, 2, 1])
  mask = jnp.array([True, True, True, False, False])  # the last two are padding
  protos = fedproto.class_prototypes(z, y, mask, 3)
  np.testing.assert_allclose(protos.means, [[2.0, 3.0], [0.0, 0.0], [5.0, 0.0]])
  np.testing.assert_allclose(protos.counts, [2.0, 0.0, 1.0])


def test_server_weights_prototypes_by_class_counts_and_ignores_absent_clients():
  means = jnp.array([[[1.0, 0.0], [0.0, 0.0], [2.0, 2.0]],
                     [[4.0, 3.0], [1.0, 1.0], [0.0, 0.0]],
                     [[9.0, 9.0], [9.0, 9.0], [9.0, 9.0]]])       # [K=3, C=3, d=2]
  counts = jnp.array([[1.0, 0.0, 2.0], [2.0, 5.0, 0.0], [7.0, 7.0, 7.0]])
  uploads = fedproto.Prototypes(means=means, counts=counts)
  weights = jnp.array([10.0, 20.0, 0.0])   # client 2 sat the round out
  previous = fedproto.Prototypes(means=jnp.full((3, 2), -1.0), counts=jnp.ones(3))
  weighted = fedproto.aggregate_prototypes(uploads, weights, previous, "weighted")
  # class 0: (1 * [1, 0] + 2 * [4, 3]) / 3; class 1: client 1 alone; class 2: client 0 alone.
  np.testing.assert_allclose(weighted.means, [[3.0, 2.0], [1.0, 1.0], [2.0, 2.0]], rtol=1e-6)
  np.testing.assert_allclose(weighted.counts, [3.0, 5.0, 2.0])
  mean = fedproto.aggregate_prototypes(uploads, weights, previous, "mean")
  np.testing.assert_allclose(mean.means, [[2.5, 1.5], [1.0, 1.0], [2.0, 2.0]], rtol=1e-6)
  # A class no sampled client holds keeps its previous prototype.
  only_client_1 = fedproto.aggregate_prototypes(uploads, jnp.array([0.0, 1.0, 0.0]), previous,
                                                "weighted")
  np.testing.assert_allclose(only_client_1.means, [[4.0, 3.0], [1.0, 1.0], [-1.0, -1.0]])
  np.testing.assert_allclose(only_client_1.counts, [2.0, 5.0, 1.0])


def test_regulariser_is_the_squared_distance_to_the_class_prototype():
  z = jnp.array([[1.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 2.0]])
  targets = jnp.array([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
  np.testing.assert_allclose(fedproto.prototype_distance(z, targets, "squared"), [5.0, 8.0])
  np.testing.assert_allclose(fedproto.prototype_distance(z, targets, "mse"), [1.25, 2.0])


def _hand_objective(params, x, y, prototypes, lam):
  """CE + lam * ||z - C_y||^2 / d on the tiny MLP written out (z = relu(x W0 + b0)); no
  regulariser where class y has no prototype."""
  body, head = params["params"]["Dense_0"], params["params"]["Dense_1"]
  z = jax.nn.relu(x @ body["kernel"] + body["bias"])
  ce = optax.softmax_cross_entropy_with_integer_labels(z @ head["kernel"] + head["bias"], y)
  has = prototypes.counts[y] > 0
  reg = jnp.where(has, jnp.mean(jnp.square(z - prototypes.means[y]), axis=-1), 0.0)
  return jnp.mean(ce + lam * reg)


def test_one_local_step_and_the_uploaded_prototypes():
  data, clients = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))  # Dense_0 (body: 5 features), Dense_1 (head)
  trainer = tiny_trainer(model, lr=LR, batch_size=8)  # one full-batch SGD step
  algorithm = fedproto.fedproto(fedproto.FedProtoConfig(lam=2.0), trainer)
  params = init_params(model, seed=0)
  global_protos = fedproto.Prototypes(
      means=jax.random.normal(jax.random.key(3), (3, 5)), counts=jnp.array([4.0, 0.0, 1.0]))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  client = fedproto.FedProtoClient(params=params, prototypes=global_protos)
  out = algorithm.client_update(client, global_protos, splits, jax.random.key(0))
  grad = jax.grad(_hand_objective)(params, x, y, global_protos, 2.0)
  expected = jax.tree.map(lambda p, g: p - LR * g, params, grad)
  chex.assert_trees_all_close(out.state.params, expected, atol=1e-6)
  body = expected["params"]["Dense_0"]
  z = jax.nn.relu(x @ body["kernel"] + body["bias"])
  counts = np.bincount(np.asarray(y), minlength=3)
  means = np.stack([np.asarray(z)[np.asarray(y) == c].mean(0) if counts[c] else np.zeros(5)
                    for c in range(3)])
  np.testing.assert_allclose(out.upload.means, means, atol=1e-5)
  np.testing.assert_allclose(out.upload.counts, counts)
  chex.assert_trees_all_close(out.state.prototypes, out.upload)


def test_training_prototypes_average_each_steps_representations_before_its_step():
  """prototypes="training" (the codes'): two full-batch epochs, so the class means of the
  representations under the initial model and under the model after one step."""
  data, clients = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)
  algorithm = fedproto.fedproto(fedproto.FedProtoConfig(lam=2.0, prototypes="training"),
                                trainer)
  params = init_params(model, seed=0)
  global_protos = fedproto.Prototypes(
      means=jax.random.normal(jax.random.key(3), (3, 5)), counts=jnp.array([4.0, 0.0, 1.0]))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  client = fedproto.FedProtoClient(params=params, prototypes=global_protos)
  out = algorithm.client_update(client, global_protos, splits, jax.random.key(0))
  grad = jax.grad(_hand_objective)(params, x, y, global_protos, 2.0)
  after_one = jax.tree.map(lambda p, g: p - LR * g, params, grad)
  def features(p):
    body = p["params"]["Dense_0"]
    return np.asarray(jax.nn.relu(x @ body["kernel"] + body["bias"]))
  z = np.concatenate([features(params), features(after_one)])
  labels = np.concatenate([np.asarray(y), np.asarray(y)])
  counts = np.bincount(np.asarray(y), minlength=3)
  means = np.stack([z[labels == c].mean(0) if counts[c] else np.zeros(5) for c in range(3)])
  np.testing.assert_allclose(out.upload.means, means, atol=1e-5)
  np.testing.assert_allclose(out.upload.counts, counts)


def test_nearest_prototype_inference_as_the_personalised_models_head():
  data, _ = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))
  stacked = tree.broadcast_to_clients(init_params(model), 2)
  context = InitContext(params=stacked, data=data, trainer=None, key=jax.random.key(0))
  means = jax.random.normal(jax.random.key(1), (3, 5))
  global_protos = fedproto.Prototypes(means=means, counts=jnp.array([2.0, 0.0, 3.0]))
  own = fedproto.Prototypes(means=jnp.zeros((2, 3, 5)),
                            counts=jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 4.0]]))
  x = jax.random.normal(jax.random.key(2), (7, 4))
  body = init_params(model)["params"]["Dense_0"]
  z = jax.nn.relu(x @ body["kernel"] + body["bias"])
  distances = jnp.sum(jnp.square(z[:, None] - means[None]), axis=-1)   # [7, C]
  for inference, allowed in (("global", [[1, 0, 1], [1, 0, 1]]),
                             ("global_own", [[1, 0, 1], [0, 0, 1]])):
    algorithm = fedproto.fedproto(fedproto.FedProtoConfig(inference=inference),
                                  tiny_trainer(model))
    clients = algorithm.init(context).clients._replace(prototypes=own)
    personalised = algorithm.personalized_params(global_protos, clients)
    for k in range(2):
      logits = model.apply(tree.take(personalised, k), x)
      present = np.asarray(allowed[k], bool)
      # Softmax over the present classes is that of -||z - C_c||^2; absent ones never win.
      np.testing.assert_allclose(jax.nn.log_softmax(logits[:, present]),
                                 jax.nn.log_softmax(-distances[:, present]), atol=1e-4)
      nearest = np.flatnonzero(present)[np.argmin(np.asarray(distances)[:, present], axis=1)]
      np.testing.assert_array_equal(np.argmax(logits, axis=1), nearest)
  head = fedproto.fedproto(fedproto.FedProtoConfig(inference="head"), tiny_trainer(model))
  chex.assert_trees_all_close(head.personalized_params(global_protos, clients), stacked)


def test_bad_hyperparameters_are_one_line_errors():
  trainer = tiny_trainer(tiny_model())
  for config, match in ((fedproto.FedProtoConfig(lam=-1.0), "fedproto: lam"),
                        (fedproto.FedProtoConfig(distance="l1"), "fedproto: distance"),
                        (fedproto.FedProtoConfig(aggregation="max"), "fedproto: aggregation"),
                        (fedproto.FedProtoConfig(inference="vote"), "fedproto: inference"),
                        (fedproto.FedProtoConfig(prototypes="last"), "fedproto: prototypes")):
    with pytest.raises(ConfigError, match=match):
      fedproto.fedproto(config, trainer)


def test_a_client_never_sampled_is_scored_by_every_global_prototype():
  # Client 1 has no prototypes of its own yet: under global_own and local it gets Eq. 4's
  # nearest of every global prototype (PFLlib's scoring), not the all-absent head's class 0.
  data, _ = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))
  stacked = tree.broadcast_to_clients(init_params(model), 2)
  context = InitContext(params=stacked, data=data, trainer=None, key=jax.random.key(0))
  global_protos = fedproto.Prototypes(means=jax.random.normal(jax.random.key(1), (3, 5)),
                                      counts=jnp.array([2.0, 0.0, 3.0]))
  own = fedproto.Prototypes(means=jnp.ones((2, 3, 5)),
                            counts=jnp.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
  x = jax.random.normal(jax.random.key(2), (7, 4))
  scored = {}
  for inference in ("global", "global_own", "local"):
    algorithm = fedproto.fedproto(fedproto.FedProtoConfig(inference=inference),
                                  tiny_trainer(model))
    clients = algorithm.init(context).clients._replace(prototypes=own)
    personalised = algorithm.personalized_params(global_protos, clients)
    scored[inference] = [model.apply(tree.take(personalised, k), x) for k in range(2)]
  for inference in ("global_own", "local"):
    np.testing.assert_allclose(scored[inference][1], scored["global"][1], atol=1e-6)
  # The sampled client keeps its own classes (global_own: class 0 alone).
  np.testing.assert_array_equal(np.argmax(scored["global_own"][0], axis=1), 0)
  # Before any prototype exists, each client's own classifier.
  algorithm = fedproto.fedproto(fedproto.FedProtoConfig(), tiny_trainer(model))
  clients = algorithm.init(context).clients
  empty = fedproto.Prototypes(means=jnp.zeros((3, 5)), counts=jnp.zeros(3))
  chex.assert_trees_all_close(algorithm.personalized_params(empty, clients), stacked)
