"""FedSR: the KL bound and the norm by hand, the client's loss and the sampled prediction
against numpy, the server's average in both reference forms, and bad values refused."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedsr
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer

SOFTPLUS_INV_1 = float(np.log(np.e - 1.0))   # softplus of it is 1


def test_cmi_bound_by_hand():
  reference = fedsr.Reference(mu=jnp.array([[9.0, 9.0], [0.0, 1.0]]),
                              sigma=jnp.full((2, 2), SOFTPLUS_INV_1), scale=jnp.array(2.0))
  kl = fedsr.cmi_bound(jnp.array([[0.5, 0.0]]), jnp.array([[0.5, 1.0]]), jnp.array([1]),
                       reference)
  # Feature 0: N(1, 1) against N(0, 1): (1 + 1) / 2 - 1/2 = 0.5. Feature 1: N(0, 2^2)
  # against N(1, 1): log(1 / 2) + (4 + 1) / 2 - 1/2.
  np.testing.assert_allclose(kl, [0.5 + np.log(0.5) + 2.0], rtol=1e-6)


def test_norm_by_hand_and_its_gradient_at_zero():
  np.testing.assert_allclose(fedsr.safe_norm(jnp.array([[3.0, 4.0], [0.0, 0.0]])), [5, 0])
  grad = jax.grad(lambda z: jnp.sum(fedsr.safe_norm(z)))(jnp.zeros((1, 2)))
  np.testing.assert_array_equal(grad, np.zeros((1, 2)))


def numpy_distribution(p, m, x, relu):
  h = np.maximum(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0.0)   # the MLP's body
  out = h @ m["kernel"] + m["bias"]
  out = np.maximum(out, 0.0) if relu else out
  d = h.shape[1]
  return out[:, :d], np.log1p(np.exp(out[:, d:]))


def numpy_log_softmax(logits):
  return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def setup(seed=0):
  model = tiny_model()
  params = init_params(model)
  rng = np.random.default_rng(seed)
  m = {"kernel": rng.normal(size=(5, 10)).astype(np.float32),
       "bias": rng.normal(size=10).astype(np.float32)}
  x = rng.normal(size=(3, 4)).astype(np.float32)
  return model, params, m, x, rng


@pytest.mark.parametrize("relu", [False, True])
def test_client_loss_against_numpy(relu):
  model, params, m, x, rng = setup()
  y, w = np.array([0, 2, 1]), np.array([1.0, 1.0, 0.0])   # the third sample is padding
  eps = rng.normal(size=(3, 5)).astype(np.float32)
  reference = fedsr.Reference(mu=rng.normal(size=(3, 5)).astype(np.float32),
                              sigma=rng.normal(size=(3, 5)).astype(np.float32),
                              scale=np.float32(1.5))
  p = jax.tree.map(np.asarray, params["params"])
  mu, sigma = numpy_distribution(p, m, x, relu)
  z = mu + sigma * eps
  logits = z @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
  ce = -numpy_log_softmax(logits)[np.arange(3), y]
  r = np.log1p(np.exp(reference.sigma[y]))
  kl = (np.log(r) - np.log(1.5 * sigma)
        + ((1.5 * sigma) ** 2 + (1.5 * mu - reference.mu[y]) ** 2) / (2 * r ** 2) - 0.5)
  expected = np.sum(w * (ce + 0.1 * np.linalg.norm(z, axis=1) + 0.01 * kl.sum(axis=1))) / 2
  config = fedsr.FedSrConfig(l2r=0.1, cmi=0.01, map_relu=relu)
  trained = fedsr.SrTrained(fedsr.SrModel(params, jax.tree.map(jnp.asarray, m)),
                            jax.tree.map(jnp.asarray, reference))
  loss = fedsr.sr_objective(model.apply, config, trained, jnp.asarray(x), jnp.asarray(y),
                            jnp.asarray(w), jnp.asarray(eps))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


@pytest.mark.parametrize("samples", [0, 3])
def test_prediction_against_numpy(samples):
  model, params, m, x, _ = setup(1)
  p = jax.tree.map(np.asarray, params["params"])
  mu, sigma = numpy_distribution(p, m, x, False)
  seed = jnp.uint32(7)
  head = p["Dense_1"]
  if samples == 0:
    expected = mu @ head["kernel"] + head["bias"]
  else:
    eps = np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (samples, 3, 5)))
    probs = np.exp(numpy_log_softmax(((mu + sigma * eps) @ head["kernel"]
                                      + head["bias"]).reshape(-1, 3))).reshape(samples, 3, 3)
    expected = np.log(probs.mean(axis=0))
  out = fedsr.predict(model.apply, fedsr.FedSrConfig(eval_samples=samples),
                      fedsr.SrEval(fedsr.SrModel(params, jax.tree.map(jnp.asarray, m)), seed),
                      jnp.asarray(x))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reference", ["local", "shared"])
def test_the_server_averages_the_model_and_keeps_or_averages_the_reference(reference):
  model, params, m, _, _ = setup()
  algorithm = fedsr.fedsr(fedsr.FedSrConfig(reference=reference), tiny_trainer(model))
  ref = fedsr.Reference(jnp.zeros((3, 5)), jnp.ones((3, 5)), jnp.ones(()))
  server = fedsr.SrServer(fedsr.SrModel(params, jax.tree.map(jnp.asarray, m)), ref,
                          jnp.uint32(4))
  two = lambda t: jax.tree.map(lambda a: jnp.stack([a + 1, a + 3]), t)   # noqa: E731
  uploads = server.model if reference == "local" else fedsr.SrTrained(server.model, ref)
  new = algorithm.aggregate(server, jnp.zeros(2), two(uploads), jnp.array([1.0, 1.0]))
  chex.assert_trees_all_close(new.server.model,
                              jax.tree.map(lambda a: a + 2, server.model), rtol=1e-6)
  expected = ref if reference == "local" else jax.tree.map(lambda a: a + 2, ref)
  chex.assert_trees_all_close(new.server.reference, expected, rtol=1e-6)
  assert int(new.server.seed) == 5   # the evaluation's draws renewed


@pytest.mark.parametrize("field,value", [("l2r", -1.0), ("cmi", -0.1), ("eval_samples", -1),
                                         ("reference", "global")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedsr: {field}"):
    fedsr.fedsr(fedsr.FedSrConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
