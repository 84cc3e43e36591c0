"""FedProx-C: FedProx's proximal upload, and the received global model's classifier
fine-tuned without the proximal term (hand-computed gradient steps); with
fine_tune="model", the proximal local model itself."""

import chex
import jax
import jax.numpy as jnp

from fedora_jax.algorithms import fedprox_c
from fedora_jax.algorithms.base import InitContext
from test_fedavg_c import LR, head_steps
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

MU = 0.5


def _client_round(fine_tune):
  """One client's update from w0 (two full-batch steps), with the proximal steps by hand:
  w1 = w0 - lr g(w0); w2 = w1 - lr (g(w1) + mu (w1 - w0)). -> (output, model, w0, client,
  w2)."""
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)
  w0 = init_params(model)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = fedprox_c.fedprox_c(fedprox_c.FedProxCConfig(mu=MU, fine_tune=fine_tune),
                                  trainer)
  state = algorithm.init(InitContext(
      params=jax.tree.map(lambda a: a[None].repeat(2, 0), w0), data=data, trainer=trainer,
      key=jax.random.key(0)))
  out = algorithm.client_update(jax.tree.map(lambda a: a[0], state.clients), w0, splits,
                                jax.random.key(3))
  grad = lambda p: jax.grad(lambda q: mean_ce(model, q, clients[0].x_train,
                                              clients[0].y_train))(p)
  w1 = jax.tree.map(lambda p, g: p - LR * g, w0, grad(w0))
  w2 = jax.tree.map(lambda p, g, a: p - LR * (g + MU * (p - a)), w1, grad(w1), w0)
  return out, model, w0, clients[0], w2


def test_upload_is_proximal_and_the_classifier_is_fine_tuned_without_it():
  out, model, w0, client, w2 = _client_round("head")
  chex.assert_trees_all_close(out.upload, w2, atol=1e-6)
  # Personalised: two plain steps on the head of w0, no pull towards w0.
  chex.assert_trees_all_close(out.state.fine_tuned, head_steps(model, w0, client, 2),
                              atol=1e-6)


def test_model_reading_keeps_the_proximal_local_model():
  # fine_tune="model": the personalised model is the round's proximal local model, the
  # upload itself.
  out, _, _, _, w2 = _client_round("model")
  chex.assert_trees_all_close(out.state.fine_tuned, w2, atol=1e-6)
  chex.assert_trees_all_equal(out.state.fine_tuned, out.upload)
