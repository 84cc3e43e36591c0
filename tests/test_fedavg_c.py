"""FedAvg-C: FedAvg's upload untouched, the personalised model is the received global model
with only its classifier fine-tuned (two hand-computed gradient steps on the head)."""

import chex
import jax
import jax.numpy as jnp
import pytest

from fedora_jax.algorithms import fedavg_c
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def head_steps(model, params, client, steps, head="Dense_1"):
  """Full-batch gradient steps on the head layer alone, by hand."""
  for _ in range(steps):
    grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(params)
    params = {"params": {**params["params"], head: jax.tree.map(
        lambda p, g: p - LR * g, params["params"][head], grads["params"][head])}}
  return params


def _client_round(config):
  """One client's FedAvg-C update from the initial model, two full-batch steps."""
  data, clients = tiny_data([6, 6])
  model = tiny_model()  # Dense_0 (body), Dense_1 (head)
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  global_params = init_params(model)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = fedavg_c.fedavg_c(config, trainer)
  state = algorithm.init(InitContext(
      params=jax.tree.map(lambda a: a[None].repeat(2, 0), global_params), data=data,
      trainer=trainer, key=jax.random.key(0)))
  out = algorithm.client_update(jax.tree.map(lambda a: a[0], state.clients), global_params,
                                splits, jax.random.key(3))
  return out, model, trainer, global_params, splits, clients[0]


def test_client_fine_tunes_the_classifier_of_the_global_model_only():
  out, model, trainer, global_params, splits, client = _client_round(
      fedavg_c.FedAvgCConfig())

  # The upload is FedAvg's: the whole model trained.
  whole, _ = trainer.train(global_params, splits.train, jax.random.key(3))
  chex.assert_trees_all_close(out.upload, whole, atol=1e-6)
  # The personalised model: w - lr grad_head CE twice on the head, the body as received.
  tuned = out.state.fine_tuned
  chex.assert_trees_all_close(tuned, head_steps(model, global_params, client, 2),
                              atol=1e-6)
  chex.assert_trees_all_equal(tuned["params"]["Dense_0"], global_params["params"]["Dense_0"])
  assert not jnp.allclose(tuned["params"]["Dense_1"]["kernel"],
                          global_params["params"]["Dense_1"]["kernel"])


def test_model_reading_keeps_the_whole_locally_trained_model():
  # fine_tune="model" (PFLlib's "evaluate personalized models, ie FedAvg-C"): the
  # personalised model is the round's local model, two full-batch SGD steps on the whole
  # model from the global one, which is also the upload.
  out, model, _, global_params, _, client = _client_round(
      fedavg_c.FedAvgCConfig(fine_tune="model"))
  expected = global_params
  for _ in range(2):
    grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(expected)
    expected = jax.tree.map(lambda p, g: p - LR * g, expected, grads)
  chex.assert_trees_all_close(out.state.fine_tuned, expected, atol=1e-6)
  chex.assert_trees_all_equal(out.state.fine_tuned, out.upload)
  with pytest.raises(ConfigError, match="fedavg_c: fine_tune must be one of head, model"):
    fedavg_c.fedavg_c(fedavg_c.FedAvgCConfig(fine_tune="all"), tiny_trainer(model))


def test_head_layers_must_leave_a_body():
  trainer = tiny_trainer(tiny_model())
  with pytest.raises(ConfigError, match="fedavg_c: head_layers"):
    fedavg_c.fedavg_c(fedavg_c.FedAvgCConfig(head_layers=0), trainer)
  data, _ = tiny_data([6, 6])
  algorithm = fedavg_c.fedavg_c(fedavg_c.FedAvgCConfig(head_layers=2), trainer)
  params = jax.tree.map(lambda a: a[None].repeat(2, 0), init_params(tiny_model()))
  with pytest.raises(ConfigError, match="fedavg_c_head_layers must be between 1 and 1"):
    algorithm.init(InitContext(params=params, data=data, trainer=trainer,
                               key=jax.random.key(0)))
