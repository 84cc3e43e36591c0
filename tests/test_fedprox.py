"""FedProx's proximal step, and the fine-tuned variants leaving the server trajectory alone."""

import chex
import jax
import jax.numpy as jnp
import pytest

from fedora_jax.algorithms import fedavg, fedavg_ft, fedprox, fedprox_ft
from fedora_jax.algorithms.base import InitContext
from fedora_jax.rounds import RoundState, build_train_round
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _start(algorithm, trainer, data, params):
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape), params)
  context = InitContext(params=stacked, data=data, trainer=trainer, key=jax.random.key(0))
  return RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(context))


def _gd_steps(model, params, client, steps, mu=0.0, anchor=None):
  """Full-batch gradient steps on CE + mu/2 ||w - anchor||^2, by hand."""
  for _ in range(steps):
    grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(params)
    params = jax.tree.map(lambda p, g, a: p - LR * (g + mu * (p - a)), params, grads,
                          anchor if anchor is not None else params)
  return params


def test_client_takes_the_proximal_gradient_step():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  # Two epochs of one full batch each: the second step is the first to feel the pull.
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)
  global_params = init_params(model)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  mu = 0.5
  algorithm = fedprox.fedprox(fedprox.FedProxConfig(mu=mu), trainer)
  out = algorithm.client_update(jnp.zeros(()), global_params, splits, jax.random.key(0))

  # w1 = w0 - lr g(w0);  w2 = w1 - lr (g(w1) + mu (w1 - w0)).
  expected = _gd_steps(model, global_params, clients[0], 2, mu=mu, anchor=global_params)
  chex.assert_trees_all_close(out.upload, expected, atol=1e-6)
  plain = _gd_steps(model, global_params, clients[0], 2)
  assert not jnp.allclose(out.upload["params"]["Dense_0"]["kernel"],
                          plain["params"]["Dense_0"]["kernel"], atol=1e-5)


@pytest.mark.parametrize("ala_anchor", ["global", "theta_hat"])
def test_under_ala_training_starts_at_theta_hat_and_is_pulled_to_the_chosen_anchor(
    ala_anchor):
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)
  global_params = init_params(model)
  theta_hat = jax.tree.map(lambda a: a + 0.3, global_params)  # ALA's start, not w^t
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = fedprox.fedprox(fedprox.FedProxConfig(mu=0.5, ala_anchor=ala_anchor), trainer)
  _, message = algorithm.ala_hooks.replace(jnp.zeros(()), global_params, theta_hat)
  out = algorithm.client_update(jnp.zeros(()), message, splits, jax.random.key(0))

  # w1 = theta_hat - lr g;  w2 = w1 - lr (g(w1) + mu (w1 - anchor)), anchor w^t (the
  # paper's) or theta_hat.
  anchor = global_params if ala_anchor == "global" else theta_hat
  expected = _gd_steps(model, theta_hat, clients[0], 2, mu=0.5, anchor=anchor)
  chex.assert_trees_all_close(out.upload, expected, atol=1e-6)


def test_negative_mu_is_refused():
  with pytest.raises(ConfigError, match="fedprox: mu"):
    fedprox.fedprox(fedprox.FedProxConfig(mu=-1.0), tiny_trainer(tiny_model()))


@pytest.mark.parametrize("base_name", ["fedavg", "fedprox"])
def test_fine_tuning_leaves_the_server_trajectory_alone(base_name):
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)
  params = init_params(model)
  mu = 0.5
  if base_name == "fedavg":
    base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
    tuned = fedavg_ft.fedavg_ft(fedavg_ft.FedAvgFTConfig(), trainer)
  else:
    base = fedprox.fedprox(fedprox.FedProxConfig(mu=mu), trainer)
    tuned = fedprox_ft.fedprox_ft(fedprox_ft.FedProxFTConfig(mu=mu), trainer)
  base_round = jax.jit(build_train_round(base, trainer, data))
  tuned_round = jax.jit(build_train_round(tuned, trainer, data))
  base_state = _start(base, trainer, data, params)
  tuned_state = _start(tuned, trainer, data, params)

  for _ in range(2):
    global_before = base_state.algorithm.server
    base_state, _ = base_round(base_state, data.buckets, jax.random.key(1))
    tuned_state, _ = tuned_round(tuned_state, data.buckets, jax.random.key(1))
    # Same seed: the global model is the base method's, bit for bit.
    chex.assert_trees_all_equal(tuned_state.algorithm.server, base_state.algorithm.server)

  # Round 2's personalised model: the global model of round 1, fine-tuned with plain SGD
  # (two full-batch steps, no proximal term) on the client's own data.
  personalized = tuned.personalized_params(tuned_state.algorithm.server,
                                           tuned_state.algorithm.clients)
  for k, client in enumerate(clients):
    expected = _gd_steps(model, global_before, client, 2)
    chex.assert_trees_all_close(jax.tree.map(lambda a, k=k: a[k], personalized), expected,
                                atol=1e-5)
  global_model = base.personalized_params(base_state.algorithm.server,
                                          base_state.algorithm.clients)
  assert not jnp.allclose(personalized["params"]["Dense_0"]["kernel"],
                          global_model["params"]["Dense_0"]["kernel"], atol=1e-4)


def test_local_evaluation_scores_each_clients_own_proximal_model():
  # --fedprox_evaluate=local: the server is FedProx's (global) one, bit for bit; each
  # sampled client is scored on the model it trained, the others on the one they hold
  # (here the shared initial model: they have not trained yet).
  data, clients = tiny_data([6, 6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)
  params = init_params(model)
  mu = 0.5
  plain = fedprox.fedprox(fedprox.FedProxConfig(mu=mu), trainer)
  local = fedprox.fedprox(fedprox.FedProxConfig(mu=mu, evaluate="local"), trainer)
  assert local.shared_model is None
  key = jax.random.key(4)
  states = []
  for algorithm in (plain, local):
    round_fn = jax.jit(build_train_round(algorithm, trainer, data, participation=0.5))
    states.append(round_fn(_start(algorithm, trainer, data, params), data.buckets, key))
  (plain_state, _), (local_state, local_metrics) = states
  chex.assert_trees_all_close(local_state.algorithm.server, plain_state.algorithm.server,
                              atol=1e-6)
  personal = local.personalized_params(local_state.algorithm.server,
                                       local_state.algorithm.clients)
  trained = jax.device_get(local_metrics.local_steps) > 0
  assert trained.sum() == 2
  for k, client in enumerate(clients):
    expected = (_gd_steps(model, params, client, 2, mu=mu, anchor=params) if trained[k]
                else params)
    chex.assert_trees_all_close(jax.tree.map(lambda a, k=k: a[k], personal), expected,
                                atol=1e-5)


def test_unknown_evaluation_is_refused():
  with pytest.raises(ConfigError, match="fedprox: evaluate"):
    fedprox.fedprox(fedprox.FedProxConfig(evaluate="best"), tiny_trainer(tiny_model()))
