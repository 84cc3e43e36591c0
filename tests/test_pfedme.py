"""pFedMe: the inner solver against the proximal point in closed form, one client's local
iterations by hand, and the server's beta mixing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import pfedme
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_model, tiny_trainer


def least_squares(params, x, y, weights):
  """f(theta; D) = 1/2 mean_D (x.theta - y)^2: gradient A theta - b."""
  residual = x @ params["w"] - y
  return 0.5 * jnp.sum(weights * residual ** 2) / jnp.sum(weights)


def _quadratic_case():
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(6, 3)), rng.normal(size=6)
  return x, y, x.T @ x / 6, x.T @ y / 6, rng.normal(size=3), rng.normal(size=3)


def _solve(config, theta, w, x, y):
  new, _ = pfedme.solve_personal(least_squares, config, {"w": jnp.asarray(theta, jnp.float32)},
                                 {"w": jnp.asarray(w, jnp.float32)}, jnp.asarray(x, jnp.float32),
                                 jnp.asarray(y, jnp.float32), jnp.ones(len(y)))
  return np.asarray(new["w"])


def test_k_steps_on_h_by_hand():
  x, y, a, b, theta, w = _quadratic_case()
  config = pfedme.PfedmeConfig(lam=2.0, k=3, personal_lr=0.1, theta_l2=0.01)
  expected = theta
  for _ in range(3):  # theta -= lr (grad f + lambda (theta - w) + mu theta)
    expected = expected - 0.1 * (a @ expected - b + 2.0 * (expected - w) + 0.01 * expected)
  np.testing.assert_allclose(_solve(config, theta, w, x, y), expected, rtol=1e-5, atol=1e-6)


def test_inner_solver_converges_to_the_proximal_point():
  # theta_hat(w) = argmin f(theta) + lambda/2 ||theta - w||^2 = (A + lambda I)^-1 (b + lambda w)
  x, y, a, b, theta, w = _quadratic_case()
  lam = 15.0
  config = pfedme.PfedmeConfig(lam=lam, k=300, personal_lr=0.05)
  prox = np.linalg.solve(a + lam * np.eye(3), b + lam * w)
  np.testing.assert_allclose(_solve(config, theta, w, x, y), prox, atol=1e-5)
  # ... so the local update is a step along grad F(w) = lambda (w - theta_hat(w)).
  updated = pfedme.local_update({"w": jnp.asarray(w)}, {"w": jnp.asarray(prox)},
                                config._replace(eta=0.01))
  np.testing.assert_allclose(updated["w"], w - 0.01 * lam * (w - prox), rtol=1e-6)


@pytest.mark.parametrize("personal_model", ["theta", "local"])
def test_client_update_by_hand(personal_model):
  # Identical samples: every batch's mean loss is that sample's, whatever the shuffle.
  rng = np.random.default_rng(1)
  x = np.repeat(rng.normal(size=(1, 4)).astype(np.float32), 3, axis=0)
  y = np.full(3, 1, np.int32)
  extra = (rng.normal(size=(2, 4)).astype(np.float32), np.zeros(2, np.int32))
  data = stack_clients([Client(x, y, *extra, *extra)], num_classes=3)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4, epochs=2)  # R = 2 iterations of 1 batch
  config = pfedme.PfedmeConfig(lam=3.0, k=2, personal_lr=0.2, eta=0.05,
                               personal_model=personal_model)
  algorithm = pfedme.pfedme(config, trainer)
  w0 = init_params(model)
  out = jax.jit(algorithm.client_update)(pfedme.PfedmeClient(personal=w0), w0, splits,
                                         jax.random.key(0))

  grad = jax.jit(jax.grad(lambda p: mean_ce(model, p, x, y)))
  theta, local = w0, w0
  for _ in range(2):
    for _ in range(2):  # K steps on h, warm-started from the previous theta
      theta = jax.tree.map(lambda t, g, w: t - 0.2 * (g + 3.0 * (t - w)), theta, grad(theta),
                           local)
    local = jax.tree.map(lambda w, t: w - 0.05 * 3.0 * (w - t), local, theta)
  chex.assert_trees_all_close(out.upload, local, atol=1e-6)
  chex.assert_trees_all_close(out.state.personal, theta if personal_model == "theta" else local,
                              atol=1e-6)
  assert int(out.train.steps) == 2


def test_server_mixes_the_sampled_mean_with_beta():
  algorithm = pfedme.pfedme(pfedme.PfedmeConfig(beta=2.0), tiny_trainer(tiny_model()))
  uploads = {"w": jnp.array([[1.0], [4.0], [100.0]])}
  clients = pfedme.PfedmeClient(personal={"w": jnp.zeros((3, 1))})
  state = algorithm.aggregate({"w": jnp.array([0.5])}, clients, uploads,
                              jnp.array([2.0, 1.0, 0.0]))  # client 2 sat the round out
  # (1 - beta) w + beta (2 * 1 + 1 * 4) / 3
  np.testing.assert_allclose(state.server["w"], [-0.5 + 2.0 * 2.0])


def test_bad_settings_are_refused():
  with pytest.raises(ConfigError, match="pfedme: k"):
    pfedme.pfedme(pfedme.PfedmeConfig(k=0), tiny_trainer(tiny_model()))
  with pytest.raises(ConfigError, match="pfedme: personal_model"):
    pfedme.pfedme(pfedme.PfedmeConfig(personal_model="w"), tiny_trainer(tiny_model()))


def _by_hand(model, w0, x, y, lam, k, personal_lr, eta, iterations):
  """theta_i and w_{i,R} of one client whose samples are all the same."""
  grad = jax.jit(jax.grad(lambda p: mean_ce(model, p, x, y)))
  theta, local = w0, w0
  for _ in range(iterations):
    for _ in range(k):
      theta = jax.tree.map(lambda t, g, w: t - personal_lr * (g + lam * (t - w)), theta,
                           grad(theta), local)
    local = jax.tree.map(lambda w, t: w - eta * lam * (w - t), local, theta)
  return theta, local


@pytest.mark.parametrize("train_clients", ["all", "sampled"])
def test_partial_participation_trains_every_client_or_the_sampled(train_clients):
  from tiny import run_rounds  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(4)
  clients, sizes = [], (3, 3, 3, 3)
  for k, n in enumerate(sizes):  # each client's samples identical: any batch is the same
    x = np.repeat(rng.normal(size=(1, 4)).astype(np.float32), n, axis=0)
    extra = (rng.normal(size=(2, 4)).astype(np.float32), np.zeros(2, np.int32))
    clients.append(Client(x, np.full(n, k % 3, np.int32), *extra, *extra))
  data = stack_clients(clients, num_classes=3)
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4, epochs=2)  # R = 2 iterations of 1 batch
  config = pfedme.PfedmeConfig(lam=3.0, k=2, personal_lr=0.2, eta=0.05, beta=1.5,
                               train_clients=train_clients)
  state, metrics, stacked, _ = run_rounds(pfedme.pfedme(config, trainer), trainer, data,
                                          model, rounds=1, participation=0.5)
  w0 = jax.tree.map(lambda a: a[0], stacked)
  sampled = np.asarray(metrics.bytes_up) > 0
  assert sampled.sum() == 2
  trained = [_by_hand(model, w0, c.x_train, c.y_train, 3.0, 2, 0.2, 0.05, 2)
             for c in clients]
  for k in range(4):
    personal = jax.tree.map(lambda a, k=k: a[k], state.algorithm.clients.personal)
    # Every client's theta_i (all), or the sampled ones' (sampled: the others keep w0).
    expected = trained[k][0] if train_clients == "all" or sampled[k] else w0
    chex.assert_trees_all_close(personal, expected, atol=2e-6)
    assert np.isfinite(metrics.train_loss[k]) == (train_clients == "all" or sampled[k])
  # The server: (1 - beta) w0 + beta times the sampled clients' mean w_{i,R} (equal sizes).
  mean = jax.tree.map(lambda *w: sum(w) / 2, *[trained[k][1] for k in np.flatnonzero(sampled)])
  chex.assert_trees_all_close(state.algorithm.server,
                              jax.tree.map(lambda w, m: -0.5 * w + 1.5 * m, w0, mean),
                              atol=2e-6)
  # Every client receives the model when all train; only the sampled send theirs.
  assert (np.asarray(metrics.bytes_down) > 0).sum() == (4 if train_clients == "all" else 2)


def test_bad_train_clients_is_refused():
  with pytest.raises(ConfigError, match="pfedme: train_clients"):
    pfedme.pfedme(pfedme.PfedmeConfig(train_clients="some"), tiny_trainer(tiny_model()))
