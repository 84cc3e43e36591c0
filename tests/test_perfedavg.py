"""Per-FedAvg's meta step (FO and HF) in closed form on a quadratic, and one client's round
by hand on the MLP."""

import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import perfedavg
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_model, tiny_trainer


def least_squares(params, x, y, weights):
  """f(w; D) = 1/2 mean_D (x.w - y)^2: gradient A w - b, Hessian A (A, b of the batch)."""
  residual = x @ params["w"] - y
  return 0.5 * jnp.sum(weights * residual ** 2) / jnp.sum(weights)


def normal_equations(x, y):
  return x.T @ x / len(y), x.T @ y / len(y)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_meta_step_matches_the_closed_form_on_a_quadratic(variant):
  rng = np.random.default_rng(0)
  batches = [(rng.normal(size=(5, 3)), rng.normal(size=5)) for _ in range(3)]
  w = rng.normal(size=3)
  config = perfedavg.PerFedAvgConfig(alpha=0.3, beta=0.2, variant=variant)
  per_step = 3 if variant == "hf" else 2
  jax_batches = tuple((jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
                       jnp.ones(5)) for x, y in batches[:per_step])
  new, outer_loss = perfedavg.meta_step(least_squares, {"w": jnp.asarray(w, jnp.float32)},
                                        jax_batches, config)

  (a, b), (a1, b1), (a2, _) = (normal_equations(x, y) for x, y in batches)
  adapted = w - 0.3 * (a @ w - b)                       # w - alpha grad f(w; D)
  outer = a1 @ adapted - b1                             # grad f(w_tilde; D')
  if variant == "hf":
    outer = (np.eye(3) - 0.3 * a2) @ outer              # (I - alpha hess f(w; D'')) v
  np.testing.assert_allclose(new["w"], w - 0.2 * outer, rtol=1e-5, atol=1e-6)
  x1, y1 = batches[1]
  np.testing.assert_allclose(outer_loss, 0.5 * np.mean((x1 @ adapted - y1) ** 2), rtol=1e-5)


def _identical_sample_client(num_samples):
  """One client whose training samples are all the same, so every batch's mean loss is
  that sample's loss whatever the shuffle."""
  rng = np.random.default_rng(1)
  x = np.repeat(rng.normal(size=(1, 4)).astype(np.float32), num_samples, axis=0)
  y = np.full(num_samples, 2, np.int32)
  extra = (rng.normal(size=(3, 4)).astype(np.float32), np.zeros(3, np.int32))
  client = Client(x, y, *extra, *extra)
  data = stack_clients([client], num_classes=3)
  return jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0]), client


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_client_update_takes_meta_steps_and_keeps_the_adapted_model(variant):
  model = tiny_model()
  # batch 2: FO deals chunks of 4, HF chunks of 6; 4 samples are one chunk per epoch.
  trainer = tiny_trainer(model, batch_size=2, epochs=2)
  splits, client = _identical_sample_client(4)
  alpha, beta = 0.4, 0.3
  algorithm = perfedavg.perfedavg(
      perfedavg.PerFedAvgConfig(alpha=alpha, beta=beta, variant=variant), trainer)
  w0 = init_params(model)
  out = jax.jit(algorithm.client_update)(w0, w0, splits, jax.random.key(0))

  loss = lambda p: mean_ce(model, p, client.x_train, client.y_train)
  step = lambda p, g, lr: jax.tree.map(lambda a, b: a - lr * b, p, g)
  unravel = jax.flatten_util.ravel_pytree(w0)[1]

  @jax.jit
  def by_hand(w):
    """The meta step written out; HF with the Hessian matrix itself."""
    outer = jax.grad(loss)(step(w, jax.grad(loss)(w), alpha))
    if variant == "hf":
      flat_w, flat_outer = (jax.flatten_util.ravel_pytree(t)[0] for t in (w, outer))
      hessian = jax.hessian(lambda v: loss(unravel(v)))(flat_w)
      outer = unravel(flat_outer - alpha * hessian @ flat_outer)
    return step(w, outer, beta)

  expected = by_hand(by_hand(w0))  # one meta step per epoch
  chex.assert_trees_all_close(out.upload, expected, atol=2e-6)
  assert int(out.train.steps) == 2
  # Evaluated: the received global model after one adaptation step.
  chex.assert_trees_all_close(out.state, jax.jit(lambda w: step(w, jax.grad(loss)(w), alpha))(w0),
                              atol=1e-6)


def test_a_step_without_outer_samples_changes_nothing():
  # 5 samples, chunks of 4: the second chunk's single sample goes to D, none to D'.
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, epochs=3)
  splits, _ = _identical_sample_client(5)
  algorithm = perfedavg.perfedavg(perfedavg.PerFedAvgConfig(), trainer)
  w0 = init_params(model)
  out = jax.jit(algorithm.client_update)(w0, w0, splits, jax.random.key(0))
  assert int(out.train.steps) == 3
  assert np.isfinite(float(out.train.loss))


def test_server_averages_only_the_sampled_uploads():
  algorithm = perfedavg.perfedavg(perfedavg.PerFedAvgConfig(), tiny_trainer(tiny_model()))
  uploads = {"w": jnp.array([[1.0], [4.0], [100.0]])}
  personal = {"w": jnp.zeros((3, 1))}
  state = algorithm.aggregate({"w": jnp.zeros(1)}, personal, uploads,
                              jnp.array([2.0, 1.0, 0.0]))
  np.testing.assert_allclose(state.server["w"], [2.0])  # (2 * 1 + 1 * 4) / 3


def test_bad_variant_is_refused():
  with pytest.raises(ConfigError, match="perfedavg: variant"):
    perfedavg.perfedavg(perfedavg.PerFedAvgConfig(variant="so"), tiny_trainer(tiny_model()))
