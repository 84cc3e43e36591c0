"""APPLE: one local step on the own core model and the DR vector by hand, the lambda(r)
schedules, the choice of M downloads, and rounds with stale copies (M < N - 1); PFLlib's
form (p's start, gradient, the mixture uploaded, lambda's lag) by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import apple
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, run_rounds, tiny_data, tiny_model, tiny_trainer

LR = 0.1


@pytest.mark.parametrize("core_lr_scale", [1.0, 3.0])
def test_one_step_moves_the_own_core_and_p_along_their_gradients(core_lr_scale):
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=1)  # one full-batch step
  config = apple.AppleConfig(mu=0.5, reg_rounds=4, p_lr_scale=0.2, core_lr_scale=core_lr_scale)
  algorithm = apple.apple(config, trainer)
  cores = jax.tree.map(lambda *m: jnp.stack(m), *[init_params(model, seed=s) for s in range(3)])
  p = jnp.array([0.5, 0.3, 0.2])
  p0 = jnp.array([0.2, 0.5, 0.3])
  client = apple.AppleClient(index=jnp.array(1), p=p, personal=tree.first(cores), copies=())
  message = apple.AppleMessage(cores=cores, fresh=jnp.ones(3, bool), p0=p0,
                               round=jnp.array(1))
  splits = jax.tree.map(lambda a: jnp.asarray(a[1]), data.buckets[0])
  out = jax.jit(algorithm.client_update)(client, message, splits, jax.random.key(0))

  coef = 0.5 * (np.cos(np.pi / 4) + 1) / 2                  # mu lambda(1), cosine, L = 4
  mixed = tree.mix(p, cores)
  grad = jax.jit(jax.grad(lambda w: mean_ce(model, w, clients[1].x_train,
                                            clients[1].y_train)))(mixed)
  # d/dw_c^i = p_ii grad (at core_lr_scale x LR);
  # d/dp_j = <grad, w_c^j> + 2 coef (p_j - p0_j), at 0.2 x LR.
  expected_core = jax.tree.map(lambda c, g: c - core_lr_scale * LR * p[1] * g,
                               tree.take(cores, 1), grad)
  dots = jnp.stack([sum(jnp.vdot(g, c) for g, c in zip(jax.tree.leaves(grad),
                                                        jax.tree.leaves(tree.take(cores, j))))
                    for j in range(3)])
  expected_p = p - 0.2 * LR * (dots + 2 * coef * (p - p0))
  chex.assert_trees_all_close(out.upload[0], expected_core, atol=1e-6)
  np.testing.assert_allclose(out.state.p, expected_p, atol=1e-6)
  expected_cores = jax.tree.map(lambda c, own: c.at[1].set(own), cores, expected_core)
  chex.assert_trees_all_close(out.state.personal, tree.mix(expected_p, expected_cores),
                              atol=1e-6)
  np.testing.assert_allclose(out.metrics["lambda_mu"], coef, rtol=1e-6)


def test_personalized_model_is_the_weighted_sum_of_core_models():
  cores = {"a": jnp.arange(24.0).reshape(3, 2, 4), "b": jnp.array([[1.0], [2.0], [3.0]])}
  p = jnp.array([0.5, -0.25, 2.0])
  mixed = apple.personalized_model(p, cores)
  np.testing.assert_allclose(mixed["a"], 0.5 * cores["a"][0] - 0.25 * cores["a"][1]
                             + 2.0 * cores["a"][2])
  np.testing.assert_allclose(mixed["b"], [0.5 - 0.5 + 6.0])


def test_lambda_schedules():
  rounds = jnp.arange(6)
  cosine = apple.reg_schedule(rounds, apple.AppleConfig(reg_rounds=4, schedule="cosine"))
  np.testing.assert_allclose(cosine, [1.0, (np.cos(np.pi / 4) + 1) / 2, 0.5,
                                      (np.cos(3 * np.pi / 4) + 1) / 2, 0.0, 0.0], atol=1e-6)
  exponential = apple.reg_schedule(rounds, apple.AppleConfig(reg_rounds=4,
                                                             schedule="exponential"))
  np.testing.assert_allclose(exponential, [0.001 ** (r / 4) for r in range(4)] + [0.0, 0.0],
                             rtol=1e-5)


def test_download_choice_takes_never_downloaded_models_first():
  relations = jnp.full((4, 4), 0.25)
  downloaded = jnp.ones((4, 4), bool).at[0, 3].set(False).at[2, 1].set(False)
  for seed in range(5):
    chosen = apple.download_choice(relations, downloaded, jax.random.key(seed),
                                   jnp.array(3), 1, "weighted")
    assert chosen.sum(axis=1).tolist() == [1, 1, 1, 1]
    assert not jnp.diagonal(chosen).any()
    assert bool(chosen[0, 3]) and bool(chosen[2, 1])


def test_limited_downloads_keep_stale_copies():
  data, _ = tiny_data([5, 6, 7, 8])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4, epochs=1)
  algorithm = apple.apple(apple.AppleConfig(num_models=1), trainer)
  state, metrics, _, _ = run_rounds(algorithm, trainer, data, model, rounds=3)
  assert np.isfinite(np.asarray(metrics.test_loss)).all()
  server, clients = state.algorithm
  # Each client's copy of its own core model is the one it uploaded last.
  for i in range(4):
    chex.assert_trees_all_close(tree.take(tree.take(clients.copies, i), i),
                                tree.take(server.cores, i))
  # Round 1 downloads everything, then one other model a round.
  assert server.downloaded.all()
  np.testing.assert_allclose(server.relations, clients.p)


def test_unsampled_clients_keep_their_core_model():
  algorithm = apple.apple(apple.AppleConfig(), tiny_trainer(tiny_model()))
  server = apple.AppleServer(cores={"w": jnp.array([[1.0], [2.0], [3.0]])},
                             relations=jnp.zeros((3, 3)), p0=jnp.full(3, 1 / 3),
                             downloaded=jnp.eye(3, dtype=bool), round=jnp.array(0),
                             key=jnp.zeros(2, jnp.uint32))
  clients = apple.AppleClient(index=jnp.arange(3), p=jnp.full((3, 3), 1 / 3),
                              personal={"w": jnp.zeros((3, 1))}, copies=())
  uploads = ({"w": jnp.array([[10.0], [0.0], [30.0]])}, jnp.ones((3, 3), bool))
  state = algorithm.aggregate(server, clients, uploads, jnp.array([5.0, 0.0, 5.0]))
  np.testing.assert_allclose(state.server.cores["w"], [[10.0], [2.0], [30.0]])
  assert state.server.downloaded[jnp.array([0, 2])].all() and not state.server.downloaded[1, 0]


def test_bad_settings_are_refused():
  with pytest.raises(ConfigError, match="apple: schedule"):
    apple.apple(apple.AppleConfig(schedule="linear"), tiny_trainer(tiny_model()))
  with pytest.raises(ConfigError, match="apple: num_models"):
    apple.apple(apple.AppleConfig(num_models=-1), tiny_trainer(tiny_model()))


# PFLlib's form: each option against a step computed by hand.

def _one_client(config: apple.AppleConfig, epochs: int = 1, round_index: int = 1):
  """Client 1 of three, full-batch steps (6 samples, batch 8: order-free), from fixed
  cores, p and p_0: (its update, the cores, p, p_0, the gradient at a mixture)."""
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=epochs)
  cores = jax.tree.map(lambda *m: jnp.stack(m), *[init_params(model, seed=s) for s in range(3)])
  p = jnp.array([0.5, 0.3, 0.2])
  p0 = jnp.array([0.2, 0.5, 0.3])
  client = apple.AppleClient(index=jnp.array(1), p=p, personal=tree.first(cores), copies=())
  message = apple.AppleMessage(cores=cores, fresh=jnp.ones(3, bool), p0=p0,
                               round=jnp.array(round_index))
  splits = jax.tree.map(lambda a: jnp.asarray(a[1]), data.buckets[0])
  out = jax.jit(apple.apple(config, trainer).client_update)(client, message, splits,
                                                             jax.random.key(0))
  grad = jax.jit(jax.grad(lambda w: mean_ce(model, w, clients[1].x_train,
                                            clients[1].y_train)))
  return out, cores, p, p0, grad


def _mean_of_means(a, b) -> jax.Array:
  """PFLlib's <a, b>: the mean over the tensors of mean(a_t * b_t)."""
  leaves = [jnp.mean(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  return sum(leaves) / len(leaves)


def _pfllib_step(cores, p, p0, grad, coef, p_lr_scale, core_scale):
  """clientapple.py's step by hand: the own core (client 1) by core_scale LR p_11 g, then
  each p_j by the mean of means of g and core j, the own core stepped, plus the
  proximal gradient (ours at twice its coefficient: 2 coef)."""
  g = grad(tree.mix(p, cores))
  core = jax.tree.map(lambda c, gl: c - core_scale * LR * p[1] * gl, tree.take(cores, 1), g)
  stepped = jax.tree.map(lambda c, own: c.at[1].set(own), cores, core)
  dots = jnp.stack([_mean_of_means(g, tree.take(stepped, j)) for j in range(3)])
  return stepped, p - p_lr_scale * LR * (dots + 2 * coef * (p - p0))


def test_pfllib_p_gradient_is_a_mean_of_means_after_the_core_step():
  config = apple.AppleConfig(mu=0.5, reg_rounds=4, p_lr_scale=0.2, core_lr_scale=3.0,
                             p_gradient="pfllib")
  out, cores, p, p0, grad = _one_client(config)
  coef = 0.5 * (np.cos(np.pi / 4) + 1) / 2                  # mu lambda(1), cosine, L = 4
  stepped, expected_p = _pfllib_step(cores, p, p0, grad, coef, 0.2, 3.0)
  chex.assert_trees_all_close(out.upload[0], tree.take(stepped, 1), atol=1e-6)
  np.testing.assert_allclose(out.state.p, expected_p, atol=1e-7, rtol=1e-6)
  # The own core's step shows in p_11: read before the step, p_11 would differ.
  g = grad(tree.mix(p, cores))
  before = p[1] - 0.2 * LR * (_mean_of_means(g, tree.take(cores, 1)) + 2 * coef * (p[1] - p0[1]))
  assert abs(float(before - expected_p[1])) > 1e-5
  assert abs(float(out.state.p[1] - expected_p[1])) < abs(float(before - expected_p[1])) / 100


def test_mixture_upload_is_w_p_from_before_the_last_step():
  # Two full-batch steps; PFLlib uploads and scores the mixture the second started from.
  config = apple.AppleConfig(mu=0.5, reg_rounds=4, p_lr_scale=0.2, core_lr_scale=3.0,
                             p_gradient="pfllib", upload="mixture")
  out, cores, p, p0, grad = _one_client(config, epochs=2)
  coef = 0.5 * (np.cos(np.pi / 4) + 1) / 2
  stepped, p1 = _pfllib_step(cores, p, p0, grad, coef, 0.2, 3.0)
  before_last = tree.mix(p1, stepped)
  chex.assert_trees_all_close(out.upload[0], before_last, atol=1e-6)
  chex.assert_trees_all_close(out.state.personal, before_last, atol=1e-6)
  last, p2 = _pfllib_step(stepped, p1, p0, grad, coef, 0.2, 3.0)
  np.testing.assert_allclose(out.state.p, p2, atol=1e-7, rtol=1e-6)
  # Not the trained core, nor the mixture after the last step.
  assert float(jnp.max(jnp.abs(tree.take(last, 1)["params"]["Dense_0"]["kernel"]
                               - out.upload[0]["params"]["Dense_0"]["kernel"]))) > 1e-3


@pytest.mark.parametrize("round_index,expected", [(0, 1.0), (1, 1.0), (2, 0.5), (3, 0.0)])
def test_previous_lambda_lags_a_round(round_index, expected):
  # PFLlib: lambda 1 in rounds 0 and 1, then (cos((r - 1) pi / L) + 1) / 2; L = 2.
  config = apple.AppleConfig(mu=0.5, reg_rounds=2, lambda_round="previous")
  out, *_ = _one_client(config, round_index=round_index)
  np.testing.assert_allclose(out.metrics["lambda_mu"], 0.5 * expected, atol=1e-7)


def test_uniform_p_start_keeps_p0_at_the_size_shares():
  data, _ = tiny_data([5, 6, 9])
  model = tiny_model()
  trainer = tiny_trainer(model)
  params = tree.broadcast_to_clients(init_params(model), 3)
  state = apple.apple(apple.AppleConfig(p_start="uniform"), trainer).init(
      InitContext(params=params, data=data, trainer=trainer, key=jax.random.key(0)))
  np.testing.assert_allclose(state.clients.p, np.full((3, 3), 1 / 3), rtol=1e-6)
  np.testing.assert_allclose(state.server.p0, np.array([5, 6, 9]) / 20, rtol=1e-6)
  with pytest.raises(ConfigError, match="apple: upload"):
    apple.apple(apple.AppleConfig(upload="model"), trainer)
