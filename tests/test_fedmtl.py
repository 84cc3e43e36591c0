"""FedMTL: the server's summary of W, PFLlib's scale, and a client's step on its loss plus
the regulariser in each form, against hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedmtl
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _flat(params) -> np.ndarray:
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(params)])


def _models():
  model = tiny_model()
  return model, [init_params(model, seed=s) for s in range(3)]


def test_the_server_sends_the_mean_spread_and_squares_of_w():
  model, models = _models()
  algorithm = fedmtl.fedmtl(fedmtl.FedMtlConfig(), tiny_trainer(model))
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *models)
  message = jax.tree.map(lambda a: a[1], algorithm.broadcast((), stacked))
  w = np.stack([_flat(m) for m in models])                  # [3, d]
  np.testing.assert_allclose(_flat(message.mean), w.mean(0), atol=1e-6)
  np.testing.assert_allclose(message.spread, np.sum((w - w.mean(0)) ** 2), rtol=1e-5)
  np.testing.assert_allclose(message.squares, np.sum(w ** 2), rtol=1e-5)
  assert float(message.clients) == 3.0


def test_pfllibs_scale_is_ten_to_minus_the_digits_plus_one():
  _, models = _models()
  # The tiny MLP: 4*5 + 5 + 5*3 + 3 = 43 parameters, two digits: 10^-3.
  assert fedmtl.scale_of(models[0], "digits") == pytest.approx(1e-3)
  assert fedmtl.scale_of({"w": jnp.zeros(100_000)}, "digits") == pytest.approx(1e-7)
  assert fedmtl.scale_of(models[0], "one") == 1.0


@pytest.mark.parametrize("omega,gradient", [("mean", True), ("pfllib", True),
                                            ("pfllib", False)])
def test_a_client_step_descends_its_loss_and_the_regulariser(omega, gradient):
  data, clients = tiny_data([6, 6, 6])
  model, models = _models()
  config = fedmtl.FedMtlConfig(lam_mean=30.0, lam_norm=20.0, omega=omega,
                               regulariser_gradient=gradient)
  algorithm = fedmtl.fedmtl(config, tiny_trainer(model, lr=LR, batch_size=8))  # one batch
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *models)
  messages = algorithm.broadcast((), stacked)
  t = 1
  splits = jax.tree.map(lambda a: jnp.asarray(a[t]), data.buckets[0])
  out = algorithm.client_update(models[t], jax.tree.map(lambda a: a[t], messages), splits,
                                jax.random.key(0))
  x, y = jnp.asarray(clients[t].x_train), jnp.asarray(clients[t].y_train)
  scale = 1e-3                                               # 43 parameters

  def loss(params):
    w = [params if k == t else models[k] for k in range(3)]
    flat = [jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(p)]) for p in w]
    mean = sum(flat) / 3
    if omega == "mean":   # tr(W (I - 11^T/3) W^T)
      relation = sum(jnp.sum((f - mean) ** 2) for f in flat)
    else:                 # (1 - 1/3)^2 ||sum_k w_k||^2
      relation = (2 / 3) ** 2 * jnp.sum(sum(flat) ** 2)
    norm = sum(jnp.sum(f ** 2) for f in flat)
    ce = optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()
    return ce + scale * (30.0 * relation + 20.0 * norm), ce

  (value, ce), grads = jax.value_and_grad(loss, has_aux=True)(models[t])
  if not gradient:   # PFLlib's detached W: only the cross-entropy moves the model
    grads = jax.grad(lambda p: loss(p)[1])(models[t])
  chex.assert_trees_all_close(out.state, jax.tree.map(lambda a, g: a - LR * g, models[t],
                                                      grads), atol=1e-6)
  np.testing.assert_allclose(out.train.loss, value, rtol=1e-5)


@pytest.mark.parametrize("field,value", [("lam_mean", -1.0), ("lam_norm", -0.5),
                                         ("lam_scale", "ten"), ("omega", "learned")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedmtl: {field}"):
    fedmtl.fedmtl(fedmtl.FedMtlConfig()._replace(**{field: value}),
                  tiny_trainer(tiny_model()))
