"""FedRep's alternating head / body steps and FedRoD's balanced-softmax + residual heads."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedrep, fedrod
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _case(n=6):
  data, clients = tiny_data([n, n])
  model = tiny_model(hidden=(5,))  # Dense_0 (body), Dense_1 (head)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  return data, model, splits, clients[0]


def _grad(model, params, client):
  return jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(params)


def _step(params, grad, layers):
  return {"params": {n: jax.tree.map(lambda p, g: p - LR * g, l, grad["params"][n])
                     if n in layers else l for n, l in params["params"].items()}}


def test_batch_size_is_read_off_the_trainer():
  for batch_size in (1, 8, 64, 100):
    assert fedrep.batch_size_of(tiny_trainer(tiny_model(), batch_size=batch_size)) == batch_size


def test_fedrep_trains_the_head_then_the_body_and_uploads_the_body():
  _, model, splits, client = _case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=3)  # full-batch steps
  algorithm = fedrep.fedrep(fedrep.FedRepConfig(head_epochs=1), trainer)
  params, body = init_params(model, seed=0), {"params": {"Dense_0": init_params(
      model, seed=1)["params"]["Dense_0"]}}
  out = algorithm.client_update(params, body, splits, jax.random.key(0))
  start = {"params": {**params["params"], **body["params"]}}
  expected = _step(start, _grad(model, start, client), ["Dense_1"])     # epoch 1: head
  for _ in range(2):                                                    # epochs 2-3: body
    expected = _step(expected, _grad(model, expected, client), ["Dense_0"])
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)
  assert sorted(out.upload["params"]) == ["Dense_0"]
  chex.assert_trees_all_close(out.upload["params"]["Dense_0"], expected["params"]["Dense_0"])
  with pytest.raises(ConfigError, match="fedrep: head_epochs"):
    fedrep.fedrep(fedrep.FedRepConfig(head_epochs=0), trainer)
  with pytest.raises(ConfigError, match="smaller than the local epochs"):  # body never trains
    fedrep.fedrep(fedrep.FedRepConfig(head_epochs=3), trainer)


def test_balanced_softmax_is_cross_entropy_with_the_log_prior_in_the_bias():
  _, model, _, client = _case()
  params = init_params(model)
  x, y = jnp.asarray(client.x_train), jnp.asarray(client.y_train)
  log_prior = fedrod.class_log_prior(y, jnp.ones_like(y, bool), 3)
  counts = np.bincount(np.asarray(y), minlength=3)
  np.testing.assert_allclose(log_prior, np.log(np.maximum(counts, 1e-8)), rtol=1e-6)
  trainer = tiny_trainer(model)
  loss = fedrod.fedrod_loss(trainer, "Dense_1", log_prior)
  zero_head = jax.tree.map(jnp.zeros_like, {"params": {"Dense_1": params["params"]["Dense_1"]}})
  logits = model.apply(params, x)
  balanced = optax.softmax_cross_entropy_with_integer_labels(logits + log_prior, y).mean()
  # A zero personal head: the residual term is the generic model's own cross-entropy.
  total = loss(fedrod.FedRodTrained(model=params, personal=zero_head), x, y, jnp.ones(len(y)))
  np.testing.assert_allclose(total, balanced + mean_ce(model, params, x, y), rtol=1e-5)


def test_fedrod_step_and_personalised_model():
  data, model, splits, client = _case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)  # one full-batch step
  algorithm = fedrod.fedrod(fedrod.FedRodConfig(), trainer)
  params = init_params(model, seed=0)
  personal = {"params": {"Dense_1": init_params(model, seed=1)["params"]["Dense_1"]}}
  out = algorithm.client_update(personal, params, splits, jax.random.key(0))

  x, y = jnp.asarray(client.x_train), jnp.asarray(client.y_train)
  log_prior = fedrod.class_log_prior(y, jnp.ones_like(y, bool), 3)
  grad_g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, x) + log_prior, y).mean())(params)
  expected_model = jax.tree.map(lambda p, g: p - LR * g, params, grad_g)

  def residual(p_head):
    features = jax.nn.relu(x @ params["params"]["Dense_0"]["kernel"]
                           + params["params"]["Dense_0"]["bias"])
    logits = (model.apply(params, x)
              + features @ p_head["kernel"] + p_head["bias"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  head = personal["params"]["Dense_1"]
  expected_head = jax.tree.map(lambda p, g: p - LR * g, head, jax.grad(residual)(head))
  chex.assert_trees_all_close(out.upload, expected_model, atol=1e-6)
  chex.assert_trees_all_close(out.state["params"]["Dense_1"], expected_head, atol=1e-6)

  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (2,) + a.shape), params)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  chex.assert_trees_all_close(state.clients["params"]["Dense_1"],
                              stacked["params"]["Dense_1"])  # PFLlib: a copy of the head
  evaluated = algorithm.personalized_params(params, state.clients)
  np.testing.assert_allclose(evaluated["params"]["Dense_1"]["bias"][0],
                             2 * params["params"]["Dense_1"]["bias"], atol=1e-7)


def test_frozen_part_gathers_momentum_of_its_weight_decay_unless_the_phase_restarts():
  # Two head steps, then one body step, on the loss body + head (both gradients 1):
  # lr 0.1, momentum 0.5, weight decay 0.1, both parts starting at 1. The head steps are
  # 1 - 0.1 * 1.1 = 0.89, then its trace 0.5 * 1.1 + (1 + 0.1 * 0.89) = 1.639: 0.7261.
  # The frozen body's gradient is 0 plus its decay 0.1: trace 0.1, then 0.15. Its step:
  # shared, 0.5 * 0.15 + 1.1 = 1.175 -> 0.8825; separate, a fresh trace: 1.1 -> 0.89.
  data, _ = tiny_data([6])
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  trainer = tiny_trainer(tiny_model(), lr=0.1, momentum=0.5, weight_decay=0.1, epochs=3,
                         batch_size=8)  # one step an epoch
  params = {"params": {"body": {"w": jnp.ones(())}, "head": {"w": jnp.ones(())}}}

  def loss(p, x, y, weights):
    del x, y, weights
    return p["params"]["body"]["w"] + p["params"]["head"]["w"]

  for phase_optimizer, body in (("shared", 0.8825), ("separate", 0.89)):
    trained, stats = fedrep.alternating_train(
        trainer, params, ["head"], jnp.asarray(2.0), splits.train, jax.random.key(0),
        loss_fn=loss, phase_optimizer=phase_optimizer)
    assert int(stats.steps) == 3
    np.testing.assert_allclose(trained["params"]["head"]["w"], 0.7261, rtol=1e-6)
    np.testing.assert_allclose(trained["params"]["body"]["w"], body, rtol=1e-6,
                               err_msg=phase_optimizer)
  with pytest.raises(ConfigError, match="fedrep: phase_optimizer"):
    fedrep.fedrep(fedrep.FedRepConfig(head_epochs=1, phase_optimizer="each"), trainer)
