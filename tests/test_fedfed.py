"""FedFed: its losses (reconstruction, KL, mixup, the mixed batch) and its noise by hand
and numpy; the shared pool's draws (engine/shared_pool.py) by hand; the generator's
shapes; the pool a run builds equal to each client's x - G(x) in client order; the
rounds' messages drawn from it; one client's round against numpy; bad values refused."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import fedfed
from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import shared_pool
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.models.feature_vae import FeatureVAE, architecture_for, init_vae
from tiny import tiny_data, tiny_model, tiny_trainer


def _ce(logits, y):
  z = logits - logits.max(-1, keepdims=True)
  log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -log_p[np.arange(len(y)), y]


def test_reconstruction_and_kl_by_hand():
  x = jnp.array([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]])
  x_r = jnp.array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
  w = jnp.array([1.0, 1.0, 0.0])   # the third is padding
  # per sample: (1 + 4) / 2, (1 + 1) / 2
  np.testing.assert_allclose(fedfed.reconstruction_loss(x_r, x, w), (2.5 + 1.0) / 2)
  mu = jnp.array([[1.0, 0.0], [0.0, 2.0], [9.0, 9.0]])
  logvar = jnp.array([[0.0, np.log(2.0)], [0.0, 0.0], [9.0, 9.0]])
  # 1 + logvar - mu^2 - e^logvar: sample 0: (1 + 0 - 1 - 1) + (1 + ln 2 - 0 - 2);
  # sample 1: (0) + (1 - 4 - 1); scaled by -1/2 / (2 samples x 3 x 2 latent)
  total = (-1 + np.log(2.0) - 1) + (-4)
  np.testing.assert_allclose(fedfed.kl_loss(mu, logvar, w), -0.5 * total / 12, rtol=1e-6)


def test_noise_per_sample_and_per_batch():
  key = jax.random.key(3)
  shape = (4, 2, 3)
  gaussian = fedfed.noise_of(key, shape, 0.5, "gaussian", "sample")
  np.testing.assert_allclose(gaussian, 0.5 * jax.random.normal(key, shape))
  laplace = fedfed.noise_of(key, shape, 0.25, "laplace", "batch")
  # the authors' draw: one noise of a sample's shape on every sample of the batch
  np.testing.assert_allclose(laplace, np.broadcast_to(
      0.25 * jax.random.laplace(key, (1, 2, 3)), shape))
  assert not np.allclose(gaussian[0], gaussian[1])


def test_mixup_partners_permute_the_real_rows():
  w = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
  partners = np.asarray(fedfed.mixup_partners(jax.random.key(0), w))
  assert sorted(partners[:4]) == [0, 1, 2, 3]
  np.testing.assert_array_equal(partners[4:], [4, 5])


def test_mixup_loss_against_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 3)).astype(np.float32)
  y = np.array([0, 1, 1, 0], np.int32)
  w = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
  model = nn.Dense(2)
  params = model.init(jax.random.key(1), x)
  key, step = jax.random.key(7), 5
  value, next_step = fedfed.mixup_loss(model.apply, 2.0, key)(params, step, x, y, w)
  lam_key, perm_key = jax.random.split(jax.random.fold_in(key, step))
  lam = float(jax.random.beta(lam_key, 2.0, 2.0))
  partners = np.asarray(fedfed.mixup_partners(perm_key, jnp.asarray(w)))
  kernel, bias = (np.asarray(params["params"][k]) for k in ("kernel", "bias"))
  logits = (lam * x + (1 - lam) * x[partners]) @ kernel + bias
  per_sample = lam * _ce(logits, y) + (1 - lam) * _ce(logits, y[partners])
  np.testing.assert_allclose(value, (per_sample * w).sum() / w.sum(), rtol=1e-5)
  assert int(next_step) == step + 1


def test_mixed_batch_is_the_mean_ce_over_its_three_parts():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 3, 4)).astype(np.float32)   # [B, own + two shared, features]
  y = np.array([[0, 1, 2], [2, 2, 0]], np.int32)
  w = np.array([1.0, 0.0], np.float32)
  model = nn.Dense(3)
  params = model.init(jax.random.key(2), x[:, 0])
  kernel, bias = (np.asarray(params["params"][k]) for k in ("kernel", "bias"))
  # one real row: its three samples' CE, averaged
  expected = np.mean([_ce(x[:1, i] @ kernel + bias, y[:1, i])[0] for i in range(3)])
  np.testing.assert_allclose(fedfed.mixed_batch_loss(model.apply)(params, x, y, w),
                             expected, rtol=1e-5)


def test_mixed_data_batch_and_union():
  own = ClientData(x=np.full((3, 2), 255, np.uint8), y=np.array([0, 1, 0], np.int32),
                   mask=np.array([True, True, False]), n=np.array(2, np.int32))
  shared_x = jnp.arange(12.0).reshape(3, 2, 2)
  shared_y = jnp.array([[1, 2], [0, 0], [2, 1]], jnp.int32)
  w = jnp.array([1.0, 1.0, 0.0])
  batch = fedfed.mixed_data(own, shared_x, shared_y, w, "batch")
  assert batch.x.shape == (3, 3, 2)
  np.testing.assert_allclose(batch.x[:, 0], 1.0)   # uint8 pixels as [0, 1]
  np.testing.assert_allclose(batch.x[:, 1:], shared_x)
  np.testing.assert_array_equal(batch.y, [[0, 1, 2], [1, 0, 0], [0, 2, 1]])
  assert int(batch.n) == 2
  union = fedfed.mixed_data(own, shared_x[:, :1], shared_y[:, :1], w, "union")
  np.testing.assert_allclose(union.x[3:], shared_x[:, 0])
  np.testing.assert_array_equal(union.y, [0, 1, 0, 1, 0, 2])
  np.testing.assert_array_equal(union.mask, [True, True, False, True, True, False])
  assert int(union.n) == 4


def test_balanced_draw_by_hand():
  """Pool of 6 real rows (classes 0, 0, 0, 1, 1, 2) and 2 padding; n = 7, C = 3: two
  distinct rows of each class (class 2 repeats its only one), then one uniform row."""
  y = jnp.array([0, 1, 0, 2, 1, 0, 0, 0])
  mask = jnp.array([True, True, True, True, True, True, False, False])
  for seed in range(5):
    indices, weights = shared_pool.draw_balanced(jax.random.key(seed), y, mask,
                                                 jnp.array(7), 9, 3)
    indices = np.asarray(indices)
    assert set(indices[:2]) <= {0, 2, 5} and indices[0] != indices[1]
    assert set(indices[2:4]) == {1, 4}
    np.testing.assert_array_equal(indices[4:6], [3, 3])
    assert np.all(np.asarray(mask)[indices])   # every slot a real row
    np.testing.assert_array_equal(weights, [1] * 7 + [0] * 2)


def test_uniform_draw_distinct_real_rows():
  mask = jnp.array([True, False, True, True, False, True])
  indices, weights = shared_pool.draw_uniform(jax.random.key(0), mask, jnp.array(3), 6)
  indices = np.asarray(indices)
  assert len(set(indices[:3])) == 3 and set(indices) <= {0, 2, 3, 5}
  np.testing.assert_array_equal(weights, [1, 1, 1, 0, 0, 0])


def test_pool_of_flattens_clients_in_order():
  x = jnp.arange(12.0).reshape(2, 3, 2)
  pool = shared_pool.concatenate([
      shared_pool.pool_of(x, jnp.array([[0, 1, 2], [2, 1, 0]]),
                          jnp.array([[True, True, False], [True, False, False]])),
      shared_pool.pool_of(x[:1, :1], jnp.array([[1]]), jnp.array([[True]]))])
  np.testing.assert_allclose(pool.x, np.concatenate([np.arange(12.0).reshape(6, 2),
                                                     [[0.0, 1.0]]]))
  np.testing.assert_array_equal(pool.y, [0, 1, 2, 2, 1, 0, 1])
  np.testing.assert_array_equal(pool.mask, [1, 1, 0, 1, 0, 0, 1])


@pytest.mark.parametrize("architecture,shape,latent", [("conv", (8, 12, 2), 4 * 2 * 3),
                                                       ("mlp", (5,), 4)])
def test_generator_shapes(architecture, shape, latent):
  vae = FeatureVAE(architecture=architecture, depth=4)
  variables = init_vae(vae, jax.random.key(0), shape)
  x = jax.random.uniform(jax.random.key(1), (3,) + shape)
  x_r, mu, logvar = vae.apply(variables, x, jax.random.key(2))
  assert x_r.shape == x.shape and mu.shape == logvar.shape == (3, latent)
  assert np.all((np.asarray(x_r) > 0) & (np.asarray(x_r) < 1))
  # eval mode reconstructs from mu: no randomness
  np.testing.assert_allclose(vae.apply(variables, x, jax.random.key(9))[0], x_r)


def test_architecture_for():
  assert architecture_for((28, 28, 1), "auto") == "conv"
  assert architecture_for((784,), "auto") == "mlp"
  assert architecture_for((30, 30, 3), "auto") == "mlp"
  assert architecture_for((784,), "conv") is None


@functools.cache
def _init(config, sizes=(9, 9, 9), seed=0):
  """(algorithm, its initial state, the data, the initial models, init's key); cached:
  the tests sharing a config share its compiled init."""
  data, _ = tiny_data(sizes, num_features=4, num_classes=3, seed=seed)
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4)
  algorithm = fedfed.fedfed(config, trainer)
  params = tree.broadcast_to_clients(model.init(jax.random.key(0), jnp.zeros((1, 4))),
                                     data.num_clients)
  data = data._replace(buckets=tuple(jax.tree.map(jnp.asarray, b) for b in data.buckets))
  key = jax.random.key(4)
  state = jax.jit(lambda p, k: algorithm.init(InitContext(params=p, data=data,
                                                          trainer=trainer, key=k)))(
      params, key)
  return algorithm, state, data, params, key


def test_pool_is_each_clients_sensitive_features():
  """No distillation round, no noise: the pool is x - G(x) of every client's training
  rows, G at its initialisation, clients in order; the global model the initial one."""
  config = fedfed.FedFedConfig(distill_rounds=0, noise_std1=0.0, noise_std2=0.0)
  algorithm, state, data, params, key = _init(config)
  vae = FeatureVAE(architecture="mlp", depth=config.vae_depth)
  variables = init_vae(vae, jax.random.split(key, 4)[0], (4,))
  assert len(data.buckets) == 1
  train = data.buckets[0].train
  x = np.asarray(train.x).reshape(-1, 4)
  expected = x - np.asarray(vae.apply(variables, jnp.asarray(x), jax.random.key(0))[0])
  for pool in state.server.pools:
    np.testing.assert_allclose(pool.x, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pool.y, np.asarray(train.y).reshape(-1))
    np.testing.assert_array_equal(pool.mask, np.asarray(train.mask).reshape(-1))
  np.testing.assert_array_equal(state.clients, data.split_sizes("train"))
  jax.tree.map(np.testing.assert_allclose, state.server.params, tree.first(params))


def test_distillation_moves_the_generator_and_the_model_as_classifier():
  """Two stage rounds move G (the pool) and, with classifier=model, the global model (the
  default separate classifier leaves it initial: test_pool_is_each_clients_...)."""
  config = fedfed.FedFedConfig(distill_rounds=0, noise_std1=0.0, noise_std2=0.0)
  _, untrained, _, params, _ = _init(config)
  _, trained, _, _, _ = _init(config._replace(distill_rounds=2, classifier="model"))
  assert not np.allclose(trained.server.pools[0].x, untrained.server.pools[0].x)
  assert not np.allclose(trained.server.params["params"]["Dense_0"]["kernel"],
                         tree.first(params)["params"]["Dense_0"]["kernel"])


def test_messages_draw_class_balanced_pool_rows():
  config = fedfed.FedFedConfig(distill_rounds=0, noise_std1=0.0, noise_std2=0.0)
  algorithm, state, data, _, _ = _init(config)
  message = algorithm.broadcast(state.server, state.clients)
  assert message.x.shape == (3, 9, 2, 4) and message.y.shape == (3, 9, 2)
  pools = state.server.pools
  for k in range(3):
    for level in range(2):
      rows = [np.flatnonzero(np.all(np.asarray(pools[level].x) == row, axis=1))[0]
              for row in np.asarray(message.x[k, :, level])]
      np.testing.assert_array_equal(np.asarray(pools[level].y)[rows], message.y[k, :, level])
      # 9 samples, 3 classes: three of each
      np.testing.assert_array_equal(np.bincount(np.asarray(message.y[k, :, level]),
                                                minlength=3), [3, 3, 3])


def test_client_round_against_numpy():
  """Full batch of 3 own rows and their 3 + 3 drawn rows, plain SGD on a linear model:
  W -= lr grad of the mean CE over the 9 samples."""
  rng = np.random.default_rng(0)
  own = ClientData(x=rng.normal(size=(3, 2)).astype(np.float32),
                   y=np.array([0, 1, 1], np.int32), mask=np.ones(3, bool),
                   n=np.array(3, np.int32))
  shared_x = rng.normal(size=(3, 2, 2)).astype(np.float32)
  shared_y = np.array([[1, 0], [0, 0], [1, 1]], np.int32)
  lr = 0.5
  model = nn.Dense(2)
  params = model.init(jax.random.key(0), own.x)
  trainer = tiny_trainer(model, lr=lr, batch_size=8)
  algorithm = fedfed.fedfed(fedfed.FedFedConfig(), trainer)
  message = fedfed.FedFedMessage(params=params, x=jnp.asarray(shared_x),
                                 y=jnp.asarray(shared_y), weights=jnp.ones(3))
  splits = type("Splits", (), {"train": own})()
  out = algorithm.client_update(jnp.array(3), message, splits, jax.random.key(1))
  x = np.concatenate([own.x, shared_x[:, 0], shared_x[:, 1]])
  y = np.concatenate([own.y, shared_y[:, 0], shared_y[:, 1]])
  kernel, bias = (np.asarray(params["params"][k]) for k in ("kernel", "bias"))
  logits = x @ kernel + bias
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  grad = (p - np.eye(2)[y]) / len(y)
  np.testing.assert_allclose(out.upload["params"]["kernel"], kernel - lr * x.T @ grad,
                             rtol=1e-5)
  np.testing.assert_allclose(out.upload["params"]["bias"], bias - lr * grad.sum(0),
                             rtol=1e-5)


@pytest.mark.parametrize("field,value", [("distill_rounds", -1), ("vae_epochs", 0),
                                         ("vae_depth", 3), ("vae_lr", 0.0), ("kl", -1.0),
                                         ("noise_std1", -0.1), ("mix", "both"),
                                         ("noise", "uniform"), ("classifier", "vae"),
                                         ("architecture", "resnet")])
def test_bad_values_refused_in_one_line(field, value):
  config = fedfed.FedFedConfig()._replace(**{field: value})
  with pytest.raises(FieldError, match=field) as error:
    fedfed.fedfed(config, tiny_trainer(tiny_model()))
  assert "\n" not in str(error.value)


def test_conv_on_vectors_refused():
  with pytest.raises(ConfigError, match="divisible by 4"):
    _init(fedfed.FedFedConfig(architecture="conv", distill_rounds=0))
