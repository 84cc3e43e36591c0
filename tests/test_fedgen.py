"""FedGen: the generator's batch normalisation and label draws, a client's step (its data
loss plus its head's loss on a generated batch), and the server's generator step against
the ensemble of the uploaded heads, each against a hand computation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import fedgen
from fedora_jax.errors import ConfigError
from fedora_jax.models.generator import (FeatureGenerator, batch_normalized, draw_inputs,
                                         init_generator)
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_batch_normalization_uses_the_batch_statistics():
  h = jnp.array([[1.0, 2.0], [3.0, 6.0]])  # means 2, 4; biased variances 1, 4
  out = batch_normalized(h, jnp.array([2.0, 2.0]), jnp.array([1.0, 1.0]))
  np.testing.assert_allclose(out, [[-1.0, -1.0], [3.0, 3.0]], atol=1e-5)


def test_draws_follow_the_class_weights_and_uniform_noise():
  labels, noise = draw_inputs(jax.random.key(0), jnp.array([0.0, 3.0, 1.0]), 4000, 3)
  assert not (labels == 0).any()
  assert abs(float(jnp.mean(labels == 1)) - 0.75) < 0.03
  assert noise.shape == (4000, 3) and float(noise.min()) >= 0 and float(noise.max()) < 1


def constant_generator(features: int, num_classes: int, output) -> tuple:
  """A generator whose every output is `output` (its last layer's kernel 0)."""
  generator = FeatureGenerator(features=features, num_classes=num_classes, hidden=4)
  params = init_generator(generator, jax.random.key(0), 2)
  last = {"kernel": jnp.zeros((4, features)), "bias": jnp.asarray(output, jnp.float32)}
  return generator, {"params": {**params["params"], "Dense_1": last}}


def test_the_generated_loss_is_the_heads_cross_entropy_on_the_generated_features():
  generator, params = constant_generator(2, 2, [2.0, 0.0])
  head = {"kernel": jnp.eye(2), "bias": jnp.zeros(2)}
  loss = fedgen.generated_loss(head, generator, params, jax.random.key(1),
                               jnp.array([0.0, 5.0]), 6, 2)
  # logits (2, 0) for label 1: log(e^2 + 1).
  np.testing.assert_allclose(loss, np.log(np.exp(2.0) + 1.0), rtol=1e-6)


def test_ensemble_weights():
  weights = jnp.array([3.0, 0.0, 1.0])
  np.testing.assert_allclose(fedgen.ensemble_weights(weights, "uniform"), [0.5, 0, 0.5])
  np.testing.assert_allclose(fedgen.ensemble_weights(weights, "samples"), [0.75, 0, 0.25])


def test_a_client_step_adds_its_heads_loss_on_a_generated_batch():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  algorithm = fedgen.fedgen(fedgen.FedGenConfig(noise_dim=2, hidden_dim=4),
                            tiny_trainer(model, lr=LR, batch_size=8))
  params = init_params(model)
  _, generator_params = constant_generator(5, 3, [1.0, -2.0, 0.5, 0.0, 3.0])
  message = fedgen.GenMessage(params=params, generator=generator_params,
                              class_weights=jnp.array([0.0, 0.0, 4.0]))  # every y' is 2
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(jnp.zeros(()), message, splits, jax.random.key(0))

  x, y = clients[0].x_train, clients[0].y_train
  z = jnp.array([1.0, -2.0, 0.5, 0.0, 3.0])

  def loss(p):
    head = p["params"]["Dense_1"]
    generated = optax.softmax_cross_entropy_with_integer_labels(
        z @ head["kernel"] + head["bias"], 2)
    return mean_ce(model, p, x, y) + generated
  grads = jax.grad(loss)(params)  # one batch of 6 <= 8: one step
  chex.assert_trees_all_close(out.upload, jax.tree.map(lambda p, g: p - LR * g, params, grads),
                              atol=1e-6)
  assert int(out.train.steps) == 1


@pytest.mark.parametrize("ensemble", ["uniform", "samples"])
def test_the_server_steps_the_generator_against_the_uploaded_heads(ensemble):
  model = tiny_model()
  config = fedgen.FedGenConfig(noise_dim=2, hidden_dim=4, generator_lr=0.01,
                               server_epochs=1, ensemble=ensemble)
  algorithm = fedgen.fedgen(config, tiny_trainer(model, batch_size=8))
  generator = FeatureGenerator(features=5, num_classes=3, hidden=4)
  generator_params = init_generator(generator, jax.random.key(3), 2)
  models = [init_params(model, seed=s) for s in range(3)]
  uploads = jax.tree.map(lambda *a: jnp.stack(a), *models)
  weights = jnp.array([1.0, 0.0, 3.0])  # client 1 sat out
  server = fedgen.GenServer(params=models[0], generator=generator_params,
                            opt_state=optax.adam(0.01).init(generator_params),
                            class_weights=jnp.array([1.0, 2.0, 1.0]),
                            key=jax.random.key_data(jax.random.key(5)), round=jnp.array(2))
  new = algorithm.aggregate(server, jnp.zeros(3), uploads, weights).server

  a = {"uniform": [0.5, 0.0, 0.5], "samples": [0.25, 0.0, 0.75]}[ensemble]
  teacher = jax.tree.map(lambda *h: sum(w * l for w, l in zip(a, h)),
                         *[m["params"]["Dense_1"] for m in models])
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 2), 0)
  labels, noise = draw_inputs(key, server.class_weights, 8, 2)

  def loss(g):
    z = generator.apply(g, noise, labels)
    return optax.softmax_cross_entropy_with_integer_labels(
        z @ teacher["kernel"] + teacher["bias"], labels).mean()
  grads = jax.grad(loss)(generator_params)
  # Adam's first step: lr g / (|g| + eps), lr sign(g) where g is not ~0 (the bias under
  # the BatchNorm has a gradient of rounding errors only: there, a step of at most lr).
  for p, g, moved in zip(jax.tree.leaves(generator_params), jax.tree.leaves(grads),
                         jax.tree.leaves(new.generator)):
    clear = np.abs(np.asarray(g)) > 1e-5
    np.testing.assert_allclose(np.asarray(moved)[clear],
                               np.asarray(p - 0.01 * jnp.sign(g))[clear], atol=1e-6)
    assert np.all(np.abs(np.asarray(moved - p)) <= 0.01 + 1e-7)
  assert np.mean(np.abs(np.asarray(grads["params"]["Dense_1"]["kernel"])) > 1e-5) > 0.9
  global_model = jax.tree.map(lambda a0, a2: 0.25 * a0 + 0.75 * a2, models[0], models[2])
  chex.assert_trees_all_close(new.params, global_model, atol=1e-6)
  assert int(new.round) == 3


def test_bad_configs_fail_in_one_line():
  trainer = algorithms.stand_in_trainer()
  for field, value in (("ensemble", "median"), ("noise_dim", 0), ("generator_lr", 0.0),
                       ("server_epochs", -1)):
    with pytest.raises(ConfigError, match=field):
      fedgen.fedgen(fedgen.FedGenConfig()._replace(**{field: value}), trainer)
