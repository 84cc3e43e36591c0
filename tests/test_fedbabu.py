"""FedBABU: the body trained under the frozen initial head, bodies averaged under that
head, and the personalised model fine-tuned from the received global model."""

import chex
import jax
import jax.numpy as jnp
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import fedbabu
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _step(model, params, x, y, layers):
  """One SGD step on the cross-entropy, of the layers `layers` only."""
  grad = jax.grad(lambda p: mean_ce(model, p, x, y))(params)
  return {"params": {n: jax.tree.map(lambda p, g: p - LR * g, l, grad["params"][n])
                     if n in layers else l for n, l in params["params"].items()}}


@pytest.mark.parametrize("part,tuned", [("full", ["Dense_0", "Dense_1"]), ("head", ["Dense_1"])])
def test_client_trains_the_body_under_the_frozen_head_and_fine_tunes(part, tuned):
  data, clients = tiny_data([6, 6])
  model = tiny_model(hidden=(5,))  # Dense_0 (body), Dense_1 (head)
  # One full-batch step a call; weight decay would move a head left in the optimizer.
  trainer = tiny_trainer(model, lr=LR, weight_decay=0.5, batch_size=8)
  algorithm = fedbabu.fedbabu(fedbabu.FedBabuConfig(finetune_epochs=2, finetune_part=part),
                              trainer)
  global_params = init_params(model, seed=0)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  out = algorithm.client_update(global_params, global_params, splits, jax.random.key(0))
  body = global_params["params"]["Dense_0"]
  grad = jax.grad(lambda b: mean_ce(model, {"params": {**global_params["params"],
                                                       "Dense_0": b}}, x, y))(body)
  # SGD with weight decay 0.5 on the body alone: b - lr (g + 0.5 b).
  expected = jax.tree.map(lambda b, g: b - LR * (g + 0.5 * b), body, grad)
  assert sorted(out.upload["params"]) == ["Dense_0"]
  chex.assert_trees_all_close(out.upload["params"]["Dense_0"], expected, atol=1e-6)
  # Fine-tuning: two epochs (two full-batch steps) of the received model, `tuned` layers only.
  tuned_params = global_params
  for _ in range(2):
    grad = jax.grad(lambda p: mean_ce(model, p, x, y))(tuned_params)
    tuned_params = {"params": {
        n: jax.tree.map(lambda p, g: p - LR * (g + 0.5 * p), l, grad["params"][n])
        if n in tuned else l for n, l in tuned_params["params"].items()}}
  chex.assert_trees_all_close(out.state, tuned_params, atol=1e-6)


def test_server_averages_bodies_under_the_initial_head():
  data, _ = tiny_data([4, 8, 6])
  model = tiny_model()
  algorithm = fedbabu.fedbabu(fedbabu.FedBabuConfig(), tiny_trainer(model))
  stacked = tree.broadcast_to_clients(init_params(model), 3)
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=None,
                                     key=jax.random.key(0)))
  bodies = {"params": {"Dense_0": jax.tree.map(
      lambda a: a + jnp.arange(3.0).reshape((3,) + (1,) * (a.ndim - 1)),
      stacked["params"]["Dense_0"])}}
  weights = jnp.array([4.0, 0.0, 6.0])  # client 1 sat the round out
  new = algorithm.aggregate(state.server, stacked, bodies, weights)
  initial = init_params(model)["params"]
  chex.assert_trees_all_close(new.server["params"]["Dense_0"],
                              jax.tree.map(lambda a: a + 1.2, initial["Dense_0"]))
  chex.assert_trees_all_close(new.server["params"]["Dense_1"], initial["Dense_1"])
  assert new.clients is stacked  # the fine-tuned models are the personalised ones
  chex.assert_trees_all_close(algorithm.personalized_params(new.server, new.clients), stacked)
  global_view = fedbabu.fedbabu(fedbabu.FedBabuConfig(finetune_epochs=0), tiny_trainer(model))
  chex.assert_trees_all_close(global_view.personalized_params(new.server, new.clients),
                              tree.broadcast_to_clients(new.server, 3))


def test_bad_hyperparameters_are_one_line_errors():
  trainer = tiny_trainer(tiny_model())
  with pytest.raises(ConfigError, match="fedbabu: finetune_epochs"):
    fedbabu.fedbabu(fedbabu.FedBabuConfig(finetune_epochs=-1), trainer)
  with pytest.raises(ConfigError, match="fedbabu: finetune_part"):
    fedbabu.fedbabu(fedbabu.FedBabuConfig(finetune_part="body"), trainer)
