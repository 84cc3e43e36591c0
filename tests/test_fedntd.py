"""FedNTD: the not-true logits, the distillation loss against the paper's formula written
out in numpy, and one local step against a hand-written objective."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedntd
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _ntd_by_hand(logits, global_logits, y, tau):
  """Mean over samples of sum_{c != y} q_g log(q_g / q_l), q the softmax of the
  not-true logits at temperature tau."""
  total = 0.0
  for z, zg, label in zip(logits, global_logits, y):
    keep = np.arange(len(z)) != label
    q, qg = _softmax(z[keep] / tau), _softmax(zg[keep] / tau)
    total += np.sum(qg * np.log(qg / q))
  return total / len(y)


def test_not_true_logits_drop_the_true_class():
  logits = jnp.array([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]])
  np.testing.assert_array_equal(fedntd.not_true_logits(logits, jnp.array([2, 0])),
                                [[0.0, 1.0, 3.0], [5.0, 6.0, 7.0]])


def test_distillation_is_the_papers_kl():
  rng = np.random.default_rng(0)
  logits, global_logits = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
  y = np.array([0, 3, 1, 1, 2])
  weights = np.array([1.0, 1.0, 1.0, 1.0, 0.0])  # the last a padded slot
  for tau in (1.0, 3.0):
    loss = fedntd.not_true_distillation(jnp.asarray(logits), jnp.asarray(global_logits),
                                        jnp.asarray(y), jnp.asarray(weights), tau)
    np.testing.assert_allclose(loss, _ntd_by_hand(logits[:4], global_logits[:4], y[:4], tau),
                               rtol=1e-5)


def _hand_loss(params, global_params, x, y, beta, tau):
  """The tiny MLP written out: logits = relu(x W0 + b0) W1 + b1."""
  def logits_of(p):
    h = jax.nn.relu(x @ p["params"]["Dense_0"]["kernel"] + p["params"]["Dense_0"]["bias"])
    return h @ p["params"]["Dense_1"]["kernel"] + p["params"]["Dense_1"]["bias"]
  z, zg = logits_of(params), jax.lax.stop_gradient(logits_of(global_params))
  ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], 1))
  keep = jnp.arange(z.shape[1])[None, :] != y[:, None]
  log_q = jax.nn.log_softmax(jnp.where(keep, z / tau, -jnp.inf))
  log_qg = jax.nn.log_softmax(jnp.where(keep, zg / tau, -jnp.inf))
  kl = jnp.sum(jnp.where(keep, jnp.exp(log_qg) * (log_qg - log_q), 0.0), axis=1)
  return ce + beta * jnp.mean(kl)


def test_local_steps_descend_ce_plus_beta_ntd():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  global_params = init_params(model)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = fedntd.fedntd(fedntd.FedNtdConfig(tau=2.0, beta=0.7), trainer)
  out = algorithm.client_update(jnp.zeros(()), global_params, splits, jax.random.key(0))
  client = clients[0]
  expected = global_params
  for _ in range(2):  # the first step's distillation gradient is 0 (equal models)
    g = jax.grad(_hand_loss)(expected, global_params, jnp.asarray(client.x_train),
                             jnp.asarray(client.y_train), 0.7, 2.0)
    expected = jax.tree.map(lambda p, g: p - LR * g, expected, g)
  chex.assert_trees_all_close(out.upload, expected, atol=1e-6)


def test_pfllib_form_scales_by_tau_squared_and_means_uniformly():
  trainer = tiny_trainer(tiny_model())
  uploads, weights = {"w": jnp.array([1.0, 5.0, 0.0])}, jnp.array([1.0, 3.0, 0.0])
  paper = fedntd.fedntd(fedntd.FedNtdConfig(), trainer)
  pfllib = fedntd.fedntd(fedntd.FedNtdConfig(server_mean="uniform"), trainer)
  np.testing.assert_allclose(paper.aggregate(None, None, uploads, weights).server["w"], 4.0)
  np.testing.assert_allclose(pfllib.aggregate(None, None, uploads, weights).server["w"], 3.0)
  x, y, w = jnp.ones((2, 4)), jnp.array([0, 2]), jnp.ones(2)
  params, other = init_params(tiny_model()), init_params(tiny_model(), seed=1)
  apply = tiny_model().apply
  plain = fedntd.ntd_loss(apply, other, fedntd.FedNtdConfig(tau=3.0, beta=1.0))(params, x, y, w)
  scaled = fedntd.ntd_loss(apply, other, fedntd.FedNtdConfig(tau=3.0, beta=1.0,
                                                             tau_squared=True))(params, x, y, w)
  ce = fedntd.masked_cross_entropy(apply(params, x), y, w)
  np.testing.assert_allclose(scaled - ce, 9.0 * (plain - ce), rtol=1e-4)


@pytest.mark.parametrize("field,value", [("tau", 0.0), ("beta", -1.0),
                                         ("server_mean", "median")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedntd: {field}"):
    fedntd.fedntd(fedntd.FedNtdConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
