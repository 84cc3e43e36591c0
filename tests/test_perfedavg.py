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


def _identical_test_client(num_test):
  """One client whose test samples are all the same (every test batch's mean loss is
  that sample's), its training samples random."""
  rng = np.random.default_rng(2)
  x_test = np.repeat(rng.normal(size=(1, 4)).astype(np.float32), num_test, axis=0)
  client = Client(rng.normal(size=(6, 4)).astype(np.float32), np.arange(6) % 3,
                  rng.normal(size=(3, 4)).astype(np.float32), np.zeros(3, np.int32),
                  x_test, np.full(num_test, 1, np.int32))
  data = stack_clients([client], num_classes=3)
  return jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0]), client


def test_latest_scores_one_step_from_the_global_model_on_a_training_batch():
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  splits, client = _identical_sample_client(4)
  alpha = 0.4
  algorithm = perfedavg.perfedavg(
      perfedavg.PerFedAvgConfig(alpha=alpha, evaluation="latest"), trainer)
  w0 = init_params(model)
  scored = perfedavg.Adaptable(model=w0, key=jax.random.key(3))
  val, test = jax.jit(algorithm.evaluate_splits, static_argnums=2)(
      scored, splits, ("val", "test"))
  grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(w0)
  adapted = jax.tree.map(lambda p, g: p - alpha * g, w0, grads)
  by_hand = lambda x, y: mean_ce(model, adapted, x, y)
  np.testing.assert_allclose(test.loss, by_hand(client.x_test, client.y_test), rtol=1e-5)
  np.testing.assert_allclose(val.loss, by_hand(client.x_val, client.y_val), rtol=1e-5)


def test_a41f7ba_form_takes_alpha_then_beta_on_two_test_batches():
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  splits, client = _identical_test_client(5)
  alpha, beta = 0.4, 0.25
  algorithm = perfedavg.perfedavg(
      perfedavg.PerFedAvgConfig(alpha=alpha, beta=beta, evaluation="test"), trainer)
  w0 = init_params(model)
  (test,) = jax.jit(algorithm.evaluate_splits, static_argnums=2)(
      perfedavg.Adaptable(model=w0, key=jax.random.key(3)), splits, ("test",))
  loss = lambda p: mean_ce(model, p, client.x_test, client.y_test)
  step = lambda p, lr: jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p))
  np.testing.assert_allclose(test.loss, loss(step(step(w0, alpha), beta)), rtol=1e-5)
  # One step alone (the head's form on test data) is another number.
  assert abs(float(test.loss) - float(loss(step(w0, alpha)))) > 1e-4


@pytest.mark.parametrize("evaluation", ["latest", "test"])
def test_every_client_is_scored_from_the_latest_global_model(evaluation):
  from tiny import run_rounds, tiny_data  # pylint: disable=import-outside-toplevel
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  data, clients = tiny_data((4, 4, 4, 4))
  config = perfedavg.PerFedAvgConfig(alpha=0.3, beta=0.2, evaluation=evaluation)
  algorithm = perfedavg.perfedavg(config, trainer)
  state, metrics, _, _ = run_rounds(algorithm, trainer, data, model, rounds=2,
                                    participation=0.5)
  server = state.algorithm.server
  sat_out = np.isnan(np.asarray(metrics.train_loss))
  assert sat_out.sum() == 2 and int(server.round) == 2
  keys = perfedavg.adaptation_keys(server, jnp.arange(4))
  bucket = jax.tree.map(jnp.asarray, data.buckets[0])
  for k in range(4):  # sampled or not, each client adapts the server's model
    splits = jax.tree.map(lambda a, k=k: a[k], bucket)
    if evaluation == "test":
      adapted = perfedavg.adapt_on_test(trainer.loss, config, server.model, splits.test,
                                        keys[k], 2)
    else:
      adapted = perfedavg.adapt(trainer.loss, 0.3, server.model, splits.train, keys[k], 2)
    expected = mean_ce(model, adapted, clients[k].x_test, clients[k].y_test)
    np.testing.assert_allclose(metrics.test_loss[k], expected, rtol=1e-5)


def test_latest_is_no_ala_host_and_bad_evaluation_is_refused():
  trainer = tiny_trainer(tiny_model())
  latest = perfedavg.perfedavg(perfedavg.PerFedAvgConfig(evaluation="latest"), trainer)
  assert latest.ala_hooks is None
  with pytest.raises(ConfigError, match="perfedavg: evaluation"):
    perfedavg.perfedavg(perfedavg.PerFedAvgConfig(evaluation="fresh"), trainer)
