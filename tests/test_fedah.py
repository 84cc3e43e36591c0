"""FedAH: one step of the head weights W against a hand-computed gradient, the scored model
(global extractor, aggregated head) by hand, the first round's W, the phases' frozen
layers, the server's FedAvg, and bad values refused."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedah
from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer


def _two_by_two(kernel, bias):
  """MLP 2-2-2 params: the extractor the identity (ReLU on top), the head given."""
  return {"params": {"Dense_0": {"kernel": jnp.eye(2), "bias": jnp.zeros(2)},
                     "Dense_1": {"kernel": jnp.asarray(kernel, jnp.float32),
                                 "bias": jnp.asarray(bias, jnp.float32)}}}


def _one_sample(x, y, pad=3):
  xs = jnp.zeros((1 + pad, 2)).at[0].set(jnp.asarray(x, jnp.float32))
  return ClientData(x=xs, y=jnp.zeros(1 + pad, jnp.int32).at[0].set(y),
                    mask=jnp.arange(1 + pad) < 1, n=jnp.asarray(1, jnp.int32))


def test_head_weight_step_by_hand():
  model = tiny_model(num_classes=2, hidden=(2,))
  trainer = tiny_trainer(model, batch_size=4)
  local = _two_by_two(np.zeros((2, 2)), np.zeros(2))
  global_params = _two_by_two([[1.0, 0.0], [0.0, 0.0]], [0.5, -0.5])
  ones = {"params": {"Dense_1": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}}
  # x = (1, 0): features (1, 0); with W = 1 the head is the global one, logits (1.5, -0.5).
  w = fedah.learn_head_weights(trainer.loss, local, global_params, ones,
                               _one_sample([1.0, 0.0], 1), jax.random.key(0), epochs=1,
                               eta=1.0, batch_size=4)
  p0 = np.exp(1.5) / (np.exp(1.5) + np.exp(-0.5))
  dlogits = np.array([p0, (1.0 - p0) - 1.0])           # softmax - onehot(1)
  # grad_W = grad_h_hat * (Theta_h - h): kernel row 0 = features[0] * dlogits.
  kernel = np.clip(1.0 - np.outer([1.0, 0.0], dlogits) * np.array([[1.0, 0.0], [0.0, 0.0]]),
                   0, 1)
  bias = np.clip(1.0 - dlogits * np.array([0.5, -0.5]), 0, 1)
  np.testing.assert_allclose(w["params"]["Dense_1"]["kernel"], kernel, rtol=1e-6)
  np.testing.assert_allclose(w["params"]["Dense_1"]["bias"], bias, rtol=1e-6)
  assert kernel[0, 0] < 1 and bias[0] < 1   # the step moved W, not only the clip


def test_scored_model_is_the_global_extractor_and_the_aggregated_head():
  algorithm = fedah.fedah(fedah.FedAhConfig(), tiny_trainer(tiny_model()))
  params = init_params(tiny_model())
  clients = jax.tree.map(lambda p: jnp.stack([p + 1.0, p + 2.0]), params)
  weights = {"params": {"Dense_1": jax.tree.map(
      lambda p: jnp.stack([jnp.full(p.shape, 0.25), jnp.zeros(p.shape)]),
      params["params"]["Dense_1"])}}
  scored = algorithm.personalized_params(params, fedah.AhClient(clients, weights))
  for i, (shift, w) in enumerate([(1.0, 0.25), (2.0, 0.0)]):
    chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], scored["params"]["Dense_0"]),
                                params["params"]["Dense_0"])
    # h + (Theta - h) w with h = Theta + shift: Theta + shift (1 - w).
    chex.assert_trees_all_close(
        jax.tree.map(lambda a, i=i: a[i], scored["params"]["Dense_1"]),
        jax.tree.map(lambda p, s=shift * (1 - w): p + s, params["params"]["Dense_1"]),
        rtol=1e-6)


def _splits(n=6, seed=0):
  rng = np.random.default_rng(seed)
  data = ClientData(x=jnp.asarray(rng.normal(size=(n, 4)), jnp.float32),
                    y=jnp.asarray(rng.integers(0, 3, n), jnp.int32),
                    mask=jnp.ones(n, bool), n=jnp.asarray(n, jnp.int32))
  return ClientSplits(train=data, val=data, test=data)


def test_first_round_keeps_w_at_ones_and_trains_both_parts():
  trainer = tiny_trainer(tiny_model())
  algorithm = fedah.fedah(fedah.FedAhConfig(), trainer)
  params = init_params(tiny_model())
  stacked = jax.tree.map(lambda p: p[None], params)
  state = algorithm.init(InitContext(params=stacked, data=None, trainer=trainer,
                                           key=jax.random.key(0)))
  client = jax.tree.map(lambda a: a[0], state.clients)
  out = algorithm.client_update(client, params, _splits(), jax.random.key(1))
  chex.assert_trees_all_close(out.state.weights, client.weights)   # Theta_h - h_i = 0
  for layer in ("Dense_0", "Dense_1"):
    assert not np.allclose(out.upload["params"][layer]["kernel"],
                           params["params"][layer]["kernel"])
  assert int(out.train.steps) == 2   # one head step, then one extractor step (6 < 8)
  chex.assert_trees_all_close(out.state.model, out.upload)


def test_phases_freeze_the_other_part():
  trainer = tiny_trainer(tiny_model())
  params = init_params(tiny_model())
  data = _splits().train
  trained, _ = fedah.train_head_then_body(trainer, params, "Dense_1", data,
                                          jax.random.key(2), head_epochs=1)
  head_key, _ = jax.random.split(jax.random.key(2))
  # The head's phase alone, the extractor fixed at the start: the same head.
  head_only, _ = trainer.train(
      {"params": {"Dense_1": params["params"]["Dense_1"]}}, data, head_key,
      loss_fn=lambda h, x, y, w: trainer.loss(
          {"params": {**params["params"], **h["params"]}}, x, y, w), epochs=1)
  chex.assert_trees_all_close(trained["params"]["Dense_1"], head_only["params"]["Dense_1"])


def test_server_averages_whole_models():
  algorithm = fedah.fedah(fedah.FedAhConfig(), tiny_trainer(tiny_model()))
  params = init_params(tiny_model())
  uploads = jax.tree.map(lambda p: jnp.stack([p, p + 4.0]), params)
  new = algorithm.aggregate(params, None, uploads, jnp.array([3.0, 1.0]))
  chex.assert_trees_all_close(new.server, jax.tree.map(lambda p: p + 1.0, params),
                              rtol=1e-6)


@pytest.mark.parametrize("field,value", [("eta", 0.0), ("plocal_epochs", 0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedah: {field}"):
    fedah.fedah(fedah.FedAhConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
