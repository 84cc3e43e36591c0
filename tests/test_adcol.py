"""ADCOL: the KL to the uniform client distribution by hand; the discriminator's forward
(eval and train mode, BatchNorm's running averages) and the client's loss against
numpy; one discriminator step against the gradient of its loss written out; the server
round (only the round's clients' real representations; FL-bench's averaged model); bad
values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import adcol
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer

EPS = adcol.BN_EPS


def test_uniform_kl_by_hand():
  logits = jnp.array([[0.0, 0.0], [np.log(3.0), 0.0], [9.0, -9.0]])
  weights = jnp.array([1.0, 1.0, 0.0])   # the third is padding
  # (1/2, 1/2): 0; (3/4, 1/4): (log(.5/.75) + log(.5/.25)) / 2 = log(4/3) / 2
  np.testing.assert_allclose(adcol.uniform_kl(logits, weights), np.log(4 / 3) / 4,
                             rtol=1e-6)


def _small_discriminator(features=3, clients=4, seed=0):
  d = adcol.init_discriminator(jax.random.key(seed), features, clients)
  rng = np.random.default_rng(seed)
  stats = {k: jnp.asarray(rng.uniform(0.5, 1.5, adcol.HIDDEN), jnp.float32)
           for k in d.stats}
  return d._replace(stats=stats)


def _numpy_forward(d, z, train_weights=None):
  p = {k: np.asarray(v, np.float64) for k, v in d.params.items()}
  h = np.asarray(z, np.float64)
  for i in range(2):
    h = h @ p[f"w{i}"]
    if train_weights is None:
      mean, var = np.asarray(d.stats[f"m{i}"]), np.asarray(d.stats[f"v{i}"])
    else:
      real = h[np.asarray(train_weights) > 0]
      mean, var = real.mean(0), real.var(0)
    h = np.maximum((h - mean) / np.sqrt(var + EPS) * p[f"g{i}"] + p[f"b{i}"], 0.0)
  return h @ p["w2"]


def test_discriminator_forward_against_numpy():
  d = _small_discriminator()
  z = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
  logits, _ = adcol.discriminate(d, jnp.asarray(z))
  np.testing.assert_allclose(logits, _numpy_forward(d, z), rtol=2e-4, atol=2e-5)
  w = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0])
  logits, stats = adcol.discriminate(d, jnp.asarray(z), w)
  np.testing.assert_allclose(np.asarray(logits)[np.asarray(w) > 0],
                             _numpy_forward(d, z, w)[np.asarray(w) > 0], rtol=2e-4, atol=2e-5)
  h = z[np.asarray(w) > 0] @ np.asarray(d.params["w0"])   # 4 real: unbiased var * 4 / 3
  np.testing.assert_allclose(stats["m0"], 0.9 * np.asarray(d.stats["m0"]) + 0.1 * h.mean(0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["v0"], 0.9 * np.asarray(d.stats["v0"])
                             + 0.1 * h.var(0, ddof=1), rtol=1e-4, atol=1e-6)


def test_client_loss_against_numpy():
  """CE of the MLP's logits + mu KL(U || softmax(D(z))), z the head's input (eval D)."""
  model = tiny_model(num_classes=3, hidden=(3,))
  rng = np.random.default_rng(2)
  x = rng.normal(size=(4, 4)).astype(np.float32)
  y = np.array([0, 2, 1, 1], np.int32)
  w = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
  params = model.init(jax.random.key(0), jnp.asarray(x))
  d = _small_discriminator()
  loss = adcol.client_loss(model.apply, "Dense_1", d, 0.7)(params, x, y, jnp.asarray(w))
  p = jax.tree.map(np.asarray, params)["params"]
  z = np.maximum(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0.0)
  logits = z @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
  log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  ce = -log_p[np.arange(4), y]
  dl = _numpy_forward(d, z)
  log_q = dl - np.log(np.exp(dl).sum(1, keepdims=True))
  kl = (np.log(1 / 4) - log_q).mean(1)
  np.testing.assert_allclose(loss, (ce * w).sum() / 3 + 0.7 * (kl * w).sum() / 3,
                             rtol=1e-4)


def test_discriminator_step_is_sgd_on_its_loss():
  """One epoch in one batch: params - lr grad of the mean CE of the real features'
  owners under train-mode BatchNorm; padding (real False) takes no part."""
  d = _small_discriminator(features=2, clients=3)
  rng = np.random.default_rng(3)
  features = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
  owners = jnp.array([0, 0, 1, 1, 2, 2])
  real = jnp.array([True, True, True, False, True, True])
  new = adcol.train_discriminator(d, features, owners, real, jax.random.key(0), 0.1, 1, 8)

  def train_loss(params):  # train mode, over the five real ones
    logits, _ = adcol.discriminate(adcol.Discriminator(params, d.stats), features[real],
                                   jnp.ones(5))
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(5), owners[real]])
  grads = jax.grad(train_loss)(d.params)
  for name in d.params:
    np.testing.assert_allclose(new.params[name], d.params[name] - 0.1 * grads[name],
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model", ["personal", "fedavg"])
def test_server_round_reads_the_round_s_clients_only(model):
  trainer = tiny_trainer(tiny_model(), batch_size=4)
  config = adcol.AdcolConfig(model=model, discriminator_epochs=1)
  algorithm = adcol.adcol(config, trainer)
  d = _small_discriminator(features=2, clients=3)
  rng = np.random.default_rng(4)
  features = jnp.asarray(rng.normal(size=(3, 2, 2)), jnp.float32)
  mask = jnp.array([[True, True], [True, False], [True, True]])
  weights = jnp.array([2.0, 0.0, 1.0])   # client 1 sat the round out
  models = {"w": jnp.array([[1.0], [50.0], [4.0]])}
  key = jax.random.key_data(jax.random.key(0))
  server = adcol.AdcolServer(discriminator=d, model={"w": jnp.zeros(1)} if model ==
                             "fedavg" else (), key=key, round=jnp.array(0))
  uploads = adcol.AdcolUpload(features=features, mask=mask,
                              model=models if model == "fedavg" else ())
  new = algorithm.aggregate(server, models, uploads, weights).server
  real = jnp.array([True, True, False, False, True, True])
  expected = adcol.train_discriminator(
      d, features.reshape(6, 2), jnp.array([0, 0, 1, 1, 2, 2]), real,
      jax.random.fold_in(jax.random.wrap_key_data(key), 0), 0.01, 1, 4)
  for name in d.params:
    np.testing.assert_allclose(new.discriminator.params[name], expected.params[name],
                               rtol=1e-6)
  assert int(new.round) == 1
  if model == "fedavg":
    np.testing.assert_allclose(new.model["w"], [(2 * 1.0 + 4.0) / 3], rtol=1e-6)


def test_upload_subset_takes_real_samples():
  mask = jnp.array([True, False, True, True, False])
  idx, real = adcol.upload_subset(jax.random.key(0), mask, 2)
  assert bool(real.all()) and bool(mask[idx].all())
  idx, real = adcol.upload_subset(jax.random.key(0), mask, 7)   # more than it holds
  assert int(real.sum()) == 3 and sorted(np.asarray(idx)[np.asarray(real)]) == [0, 2, 3]


@pytest.mark.parametrize("field,value", [("mu", -1.0), ("discriminator_lr", 0.0),
                                         ("discriminator_epochs", 0),
                                         ("representations", 0), ("model", "mean")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"adcol: {field}"):
    adcol.adcol(adcol.AdcolConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
