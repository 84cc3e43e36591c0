"""FedGC: the softmax over a client's own classes, the class means, the server's
gradient-correction step on every head and a client's step under a bias-free head,
against hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import fedgc
from fedora_jax.errors import ConfigError
from tiny import init_params, run_rounds, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_logits_of_classes_a_client_lacks_fall_below_its_top_one():
  logits = fedgc.local_logits(jnp.array([1.0, 5.0, 3.0]), jnp.array([True, False, True]))
  np.testing.assert_allclose(logits, [1.0, 3.0 - fedgc.EXCLUDED_GAP, 3.0])


def test_class_means_over_the_clients_holding_each_class():
  kernels = jnp.array([[[1.0, 2.0, 7.0]], [[3.0, 4.0, 8.0]]])  # [K=2, d=1, C=3]
  held = jnp.array([[True, True, False], [True, False, False]])
  np.testing.assert_allclose(fedgc.class_means(kernels, held), [[2.0], [2.0], [0.0]])


def test_the_correction_moves_the_rows_of_the_clients_without_the_class():
  # d = 1. Client 0 holds class 0 (row a), client 1 class 1 (row b), client 2 both:
  # class 0's mean e_0 = (a + c0) / 2, class 1's e_1 = (b + c1) / 2; only client 1 lacks
  # class 0 and only client 0 lacks class 1, each class counted by its two holders.
  a, b, c0, c1 = 1.0, 0.5, 0.2, -0.4
  kernels = jnp.array([[[a, 9.0]], [[9.0, b]], [[c0, c1]]])
  held = jnp.array([[True, False], [False, True], [True, True]])
  e0, e1 = (a + c0) / 2, (b + c1) / 2
  new = fedgc.corrected_kernels(kernels, held, 0.3)
  # d/db of 2 log(e^{e0^2} + e^{b e0}); d/da of 2 log(e^{e1^2} + e^{a e1}).
  grad_b = 2 * e0 * np.exp(b * e0) / (np.exp(e0 * e0) + np.exp(b * e0))
  grad_a = 2 * e1 * np.exp(a * e1) / (np.exp(e1 * e1) + np.exp(a * e1))
  np.testing.assert_allclose(new, [[[a - 0.3 * grad_a, 9.0]], [[9.0, b - 0.3 * grad_b]],
                                   [[c0, c1]]], rtol=1e-6)


def test_a_class_every_client_holds_is_not_corrected():
  kernels = jnp.array([[[1.0, 2.0]], [[3.0, -1.0]]])
  held = jnp.ones((2, 2), bool)
  np.testing.assert_allclose(fedgc.corrected_kernels(kernels, held, 1.0), kernels)


def test_a_client_trains_its_body_and_bias_free_head_over_its_classes():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  algorithm = fedgc.fedgc(fedgc.FedGcConfig(), tiny_trainer(model, lr=LR, batch_size=8))
  params = init_params(model)
  head = {"params": {"Dense_1": {**params["params"]["Dense_1"], "bias": jnp.zeros(3)}}}
  body = {"params": {"Dense_0": params["params"]["Dense_0"]}}
  x, y = clients[0].x_train, clients[0].y_train
  held = jnp.zeros(3, bool).at[jnp.asarray(y)].set(True)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(jnp.zeros(()), fedgc.GcMessage(body, head, held), splits,
                                jax.random.key(0))

  start = {"params": {**body["params"], **head["params"]}}

  def loss(p):
    hidden = jax.nn.relu(x @ p["params"]["Dense_0"]["kernel"] + p["params"]["Dense_0"]["bias"])
    logits = (hidden @ p["params"]["Dense_1"]["kernel"])[:, held]  # bias-free, own classes
    local = jnp.cumsum(held) - 1
    return optax.softmax_cross_entropy_with_integer_labels(logits, local[y]).mean()
  grads = jax.grad(loss)(start)
  trained = jax.tree.map(lambda p, g: p - LR * g, start, grads)
  chex.assert_trees_all_close(out.upload.body["params"]["Dense_0"],
                              trained["params"]["Dense_0"], atol=1e-6)
  chex.assert_trees_all_close(out.upload.head["params"]["Dense_1"]["kernel"][:, held],
                              trained["params"]["Dense_1"]["kernel"][:, held], atol=1e-6)
  np.testing.assert_array_equal(out.upload.head["params"]["Dense_1"]["bias"], 0.0)


def test_the_server_averages_the_bodies_and_corrects_every_head():
  data, _ = tiny_data([5, 6, 9, 5, 8, 7])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4)
  config = algorithms.default_config("fedgc", lr=0.1)
  algorithm = fedgc.fedgc(config, trainer)
  state, metrics, _, _ = run_rounds(algorithm, trainer, data, model, rounds=2,
                                    participation=0.5)
  server = state.algorithm.server
  held = np.asarray(server.held)
  # The held classes are each client's training labels (one bucket here).
  ys = [np.asarray(data.buckets[0].train.y[k])[np.asarray(data.buckets[0].train.mask[k])]
        for k in range(6)]
  for k, y in enumerate(ys):
    np.testing.assert_array_equal(held[k], np.isin(np.arange(3), y))
  np.testing.assert_array_equal(server.heads["params"]["Dense_1"]["bias"], 0.0)
  assert int((np.asarray(metrics.local_steps) > 0).sum()) == 3
  assert np.isfinite(np.asarray(metrics.val_loss)).all()


def test_bad_configs_fail_in_one_line():
  trainer = algorithms.stand_in_trainer()
  with pytest.raises(ConfigError, match="lam"):
    fedgc.fedgc(fedgc.FedGcConfig(lam=-1.0), trainer)
