"""FedPHP: the MMD and distillation terms against their formulas, the features the MMD
sees, and the HPM's moving average over two participations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedphp
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def fedrepo_mmd(source, target):
  """FedRepo's mmd_rbf_noaccelerate (kernel_mul 2, kernel_num 5), written out in numpy."""
  total = np.concatenate([source, target])
  n = len(total)
  distances = ((total[:, None] - total[None]) ** 2).sum(-1)
  bandwidth = distances.sum() / (n * n - n) + 1e-8
  bandwidth /= 2.0 ** (5 // 2)
  kernels = sum(np.exp(-distances / (bandwidth * 2.0 ** i)) for i in range(5))
  m = len(source)
  return np.mean(kernels[:m, :m] + kernels[m:, m:] - kernels[:m, m:] - kernels[m:, :m])


def test_mmd_is_fedrepos_and_ignores_padding():
  rng = np.random.default_rng(0)
  source, target = rng.normal(size=(4, 3)), rng.normal(size=(4, 3)) + 1.0
  value = fedphp.mmd(jnp.asarray(source, jnp.float32), jnp.asarray(target, jnp.float32),
                     jnp.ones(4))
  np.testing.assert_allclose(value, fedrepo_mmd(source, target), rtol=1e-5)
  padded = fedphp.mmd(jnp.asarray(np.concatenate([source, 9 * np.ones((2, 3))]), jnp.float32),
                      jnp.asarray(np.concatenate([target, -9 * np.ones((2, 3))]), jnp.float32),
                      jnp.array([1.0, 1, 1, 1, 0, 0]))
  np.testing.assert_allclose(padded, value, rtol=1e-5)
  assert abs(float(fedphp.mmd(jnp.asarray(source), jnp.asarray(source), jnp.ones(4)))) < 1e-6


def test_pfllib_kernel_mmd_has_fixed_bandwidths():
  """PFLlib's MMD(x, y, 'rbf'): mean(XX + YY - 2 XY), each the sum over a in 10, 15,
  20, 50 of exp(-d / (2 a)), d the squared distances; here in numpy, features scaled so
  that the fixed bandwidths and FedRepo's data-driven ones disagree."""
  rng = np.random.default_rng(1)
  source, target = 4 * rng.normal(size=(5, 3)), 4 * rng.normal(size=(5, 3)) + 2.0
  def kernels(a, b):
    distances = ((a[:, None] - b[None]) ** 2).sum(-1)
    return sum(np.exp(-0.5 * distances / s) for s in (10, 15, 20, 50))
  expected = np.mean(kernels(source, source) + kernels(target, target)
                     - 2 * kernels(source, target))
  value = fedphp.mmd(jnp.asarray(source, jnp.float32), jnp.asarray(target, jnp.float32),
                     jnp.ones(5), kernel="pfllib")
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  assert abs(float(value) - fedrepo_mmd(source, target)) > 1e-3
  with pytest.raises(ConfigError, match="fedphp: mmd_kernel"):
    fedphp.fedphp(fedphp.FedPhpConfig(mmd_kernel="rbf"), tiny_trainer(tiny_model()))


def test_distillation_is_cross_entropy_to_the_softened_teacher():
  student = np.array([[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]])
  teacher = np.array([[4.0, 0.0, 0.0], [0.0, 8.0, 0.0]])
  soft = np.exp(teacher / 4.0) / np.exp(teacher / 4.0).sum(-1, keepdims=True)
  log_p = student - np.log(np.exp(student).sum(-1, keepdims=True))
  expected = -(soft * log_p).sum(-1)[0]  # the second sample is padding
  value = fedphp.distillation(jnp.asarray(student), jnp.asarray(teacher), jnp.array([1.0, 0.0]),
                              4.0)
  np.testing.assert_allclose(value, expected, rtol=1e-6)


def test_features_are_the_input_of_the_head():
  model = tiny_model()
  params = init_params(model)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), jnp.float32)
  features, logits = fedphp.head_inputs(model.apply, "Dense_1")(params, x)
  layer = params["params"]["Dense_0"]
  np.testing.assert_allclose(features, jax.nn.relu(x @ layer["kernel"] + layer["bias"]),
                             rtol=1e-6)
  np.testing.assert_allclose(logits, model.apply(params, x), rtol=1e-6)


@pytest.mark.parametrize("reg", ["mmd", "kd"])
def test_hpm_inherits_the_trained_models_by_moving_average(reg):
  data, _ = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4, epochs=1)
  # mu = 0.9 * participations / 2: 0 the first time, 0.45 the second.
  config = fedphp.FedPhpConfig(reg=reg, lam=0.3, mu_participations=2)
  algorithm = fedphp.fedphp(config, trainer)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  update = jax.jit(algorithm.client_update)
  w0, w1 = init_params(model, seed=0), init_params(model, seed=1)
  client = fedphp.FedPhpClient(hpm=w1, local=(), participations=jnp.zeros((), jnp.int32))

  first = update(client, w0, splits, jax.random.key(0))
  chex.assert_trees_all_close(first.state.hpm, first.upload, atol=1e-7)  # mu = 0
  second = update(first.state, w1, splits, jax.random.key(1))
  chex.assert_trees_all_close(
      second.state.hpm,
      jax.tree.map(lambda v, w: 0.45 * v + 0.55 * w, first.upload, second.upload), atol=1e-6)
  np.testing.assert_allclose([first.metrics["hpm_mu"], second.metrics["hpm_mu"]], [0.0, 0.45])
  assert int(second.state.participations) == 2
  # The transfer term pulls the training: without it the same steps land elsewhere.
  plain, _ = trainer.train(w1, splits.train, jax.random.key(1))
  assert not np.allclose(plain["params"]["Dense_0"]["kernel"],
                         second.upload["params"]["Dense_0"]["kernel"], atol=1e-6)


def test_lambda_zero_trains_plain_cross_entropy():
  data, _ = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4, epochs=1)
  algorithm = fedphp.fedphp(fedphp.FedPhpConfig(lam=0.0), trainer)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  w0 = init_params(model)
  client = fedphp.FedPhpClient(hpm=init_params(model, seed=3), local=(),
                               participations=jnp.zeros((), jnp.int32))
  out = jax.jit(algorithm.client_update)(client, w0, splits, jax.random.key(0))
  plain, _ = jax.jit(trainer.train)(w0, splits.train, jax.random.key(0))
  chex.assert_trees_all_close(out.upload, plain, atol=1e-6)


def test_bad_settings_are_refused():
  with pytest.raises(ConfigError, match="fedphp: reg"):
    fedphp.fedphp(fedphp.FedPhpConfig(reg="l2"), tiny_trainer(tiny_model()))
  with pytest.raises(ConfigError, match="fedphp: mu_max"):
    fedphp.fedphp(fedphp.FedPhpConfig(mu_max=1.0), tiny_trainer(tiny_model()))


def test_a41f7ba_form_starts_from_the_mix_and_is_taught_by_the_global_model():
  data, _ = tiny_data([4, 4])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=0.3, batch_size=4, epochs=1)  # one step on all 4
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  x, y = splits.train.x, splits.train.y
  g, own = init_params(model), init_params(model, seed=3)
  ce = lambda p: mean_ce(model, p, x, y)
  step = lambda p, scale: jax.tree.map(lambda a, b: a - 0.3 * scale * b, p, jax.grad(ce)(p))
  # lambda 0: one CE step from (1 - mu) g + mu w_k.
  algorithm = fedphp.fedphp(fedphp.FedPhpConfig(lam=0.0, teacher="global"), trainer)
  client = fedphp.FedPhpClient(hpm=own, local=(), participations=jnp.zeros((), jnp.int32))
  message = fedphp.GlobalTeacherMessage(model=g, mu=jnp.asarray(0.25))
  out = jax.jit(algorithm.client_update)(client, message, splits, jax.random.key(0))
  start = jax.tree.map(lambda a, b: 0.75 * a + 0.25 * b, g, own)
  chex.assert_trees_all_close(out.upload, step(start, 1.0), atol=1e-6)
  chex.assert_trees_all_close(out.state.hpm, out.upload)
  # mu 0: the student starts as its teacher, where the MMD's gradient is 0, so the step is
  # (1 - lambda) times CE's; at lambda 1 nothing moves (a41f7ba's defaults).
  for lam in (0.4, 1.0):
    algorithm = fedphp.fedphp(fedphp.FedPhpConfig(lam=lam, teacher="global",
                                                  mmd_kernel="pfllib"), trainer)
    out = jax.jit(algorithm.client_update)(
        client, message._replace(mu=jnp.asarray(0.0)), splits, jax.random.key(0))
    chex.assert_trees_all_close(out.upload, step(g, 1.0 - lam), atol=1e-6)


def test_a41f7ba_form_ramps_mu_with_the_round_and_scores_the_next_start():
  model = tiny_model()
  algorithm = fedphp.fedphp(fedphp.FedPhpConfig(teacher="global", mu_max=0.6,
                                                mu_participations=4),
                            tiny_trainer(model))
  g, own = init_params(model), init_params(model, seed=3)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), own)
  clients = fedphp.FedPhpClient(hpm=stacked, local=(),
                                participations=jnp.ones((2,), jnp.int32))
  uploads = jax.tree.map(lambda a, b: jnp.stack([a, b]), g, own)
  state = algorithm.aggregate(fedphp.GlobalTeacherServer(model=g, round=jnp.asarray(1)),
                              clients, uploads, jnp.array([1.0, 3.0]))
  mean = jax.tree.map(lambda a, b: 0.25 * a + 0.75 * b, g, own)
  chex.assert_trees_all_close(state.server.model, mean)
  assert int(state.server.round) == 2
  message = algorithm.broadcast(state.server, state.clients)
  np.testing.assert_allclose(message.mu, [0.3, 0.3])   # 0.6 * 2 / 4
  scored = algorithm.personalized_params(state.server, state.clients)
  chex.assert_trees_all_close(jax.tree.map(lambda a: a[0], scored), jax.tree.map(
      lambda m, w: 0.7 * m + 0.3 * w, mean, own), atol=1e-6)
  with pytest.raises(ConfigError, match="fedphp: teacher"):
    fedphp.fedphp(fedphp.FedPhpConfig(teacher="local"), tiny_trainer(model))
