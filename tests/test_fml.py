"""FML: one local step of the personal and meme models (mutual-learning KLs with the peer
held fixed; PFLlib's form with both losses into both models, the KL / C and each model's
gradient clipped) against hand-written gradients, and the server's mean of the memes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fml
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _kl(p_logits, q_logits):
  p, q = jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)
  return jnp.mean(jnp.sum(p * (jnp.log(p) - jnp.log(q)), axis=-1))


def _ce(logits, y):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _setup(config):
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  algorithm = fml.fml(config, tiny_trainer(model, lr=LR, batch_size=8))   # one full batch
  personal, meme = init_params(model, seed=0), init_params(model, seed=1)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(personal, meme, splits, jax.random.key(0))
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  return model, personal, meme, out, x, y


def _step(params, grads):
  return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def test_mutual_learning_step_with_the_peer_held_fixed():
  model, personal, meme, out, x, y = _setup(fml.FmlConfig(alpha=0.3, beta=0.6))
  fixed_meme, fixed_personal = model.apply(meme, x), model.apply(personal, x)
  grad_w = jax.grad(lambda w: 0.3 * _ce(model.apply(w, x), y)
                    + 0.7 * _kl(fixed_meme, model.apply(w, x)))(personal)
  grad_m = jax.grad(lambda m: 0.6 * _ce(model.apply(m, x), y)
                    + 0.4 * _kl(fixed_personal, model.apply(m, x)))(meme)
  chex.assert_trees_all_close(out.state, _step(personal, grad_w), atol=1e-6)
  chex.assert_trees_all_close(out.upload, _step(meme, grad_m), atol=1e-6)


def test_pfllib_form_both_losses_into_both_models_kl_over_classes_clipped():
  config = fml.FmlConfig(alpha=0.3, beta=0.6, detach_peer=False, kl_reduction="mean",
                         clip_norm=0.05)
  model, personal, meme, out, x, y = _setup(config)

  def total(w, m):
    pw, pm = model.apply(w, x), model.apply(m, x)
    return (0.3 * _ce(pw, y) + 0.7 * _kl(pm, pw) / 3
            + 0.6 * _ce(pm, y) + 0.4 * _kl(pw, pm) / 3)
  grads = jax.grad(total, argnums=(0, 1))(personal, meme)

  def clip(g):
    norm = np.sqrt(sum(float(jnp.sum(v ** 2)) for v in jax.tree.leaves(g)))
    assert norm > 0.05    # the clipping acts
    return jax.tree.map(lambda v: v * 0.05 / (norm + 1e-6), g)
  chex.assert_trees_all_close(out.state, _step(personal, clip(grads[0])), atol=1e-6)
  chex.assert_trees_all_close(out.upload, _step(meme, clip(grads[1])), atol=1e-6)


def test_server_mean_of_the_memes():
  uploads = {"w": jnp.array([1.0, 4.0, 7.0])}
  weights = jnp.array([1.0, 0.0, 3.0])
  for mean, expected in (("weighted", (1.0 + 21.0) / 4), ("uniform", (1.0 + 7.0) / 2)):
    algorithm = fml.fml(fml.FmlConfig(server_mean=mean), tiny_trainer(tiny_model()))
    state = algorithm.aggregate({"w": jnp.array(0.0)}, {"w": jnp.zeros(3)}, uploads, weights)
    np.testing.assert_allclose(state.server["w"], expected, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("alpha", 1.5), ("beta", -0.1), ("clip_norm", -1.0),
                                         ("kl_reduction", "sum"), ("server_mean", "median")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fml: {field}"):
    fml.fml(fml.FmlConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
