"""PartialFed: the layer-wise partial initialisation, PartialFed-Fix being FedPer step for
step, and the adaptive strategy's straight-through step against a hand computation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedper, partialfed
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from fedora_jax.rounds import RoundState, build_train_round
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _start(algorithm, trainer, data, params):
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape), params)
  context = InitContext(params=stacked, data=data, trainer=trainer, key=jax.random.key(0))
  return RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(context))


def test_fix_runs_fedper_step_for_step():
  data, _ = tiny_data([5, 7, 6])
  model = tiny_model(hidden=(5, 4))             # Dense_0, Dense_1 loaded; Dense_2 kept
  trainer = tiny_trainer(model, lr=LR, momentum=0.5, batch_size=4, epochs=2)
  params = init_params(model)
  ours = partialfed.partialfed(partialfed.PartialFedConfig(), trainer)
  theirs = fedper.fedper(fedper.FedPerConfig(personal_layers=1), trainer)
  states = [_start(a, trainer, data, params) for a in (ours, theirs)]
  rounds = [jax.jit(build_train_round(a, trainer, data)) for a in (ours, theirs)]
  for _ in range(2):
    outs = [r(s, data.buckets, jax.random.key(1)) for r, s in zip(rounds, states)]
    states = [o[0] for o in outs]
    np.testing.assert_allclose(outs[0][1].test_score, outs[1][1].test_score)
  ours_state, theirs_state = (s.algorithm for s in states)
  for layer in ("Dense_0", "Dense_1"):  # the loaded layers average exactly like FedPer's
    chex.assert_trees_all_close(ours_state.server["params"][layer],
                                theirs_state.server["params"][layer], atol=1e-6)
  chex.assert_trees_all_close(
      ours.personalized_params(ours_state.server, ours_state.clients),
      theirs.personalized_params(theirs_state.server, theirs_state.clients), atol=1e-6)


def test_adaptive_step_loads_the_drawn_layers_and_learns_the_strategy():
  data, clients = tiny_data([6])
  model = tiny_model()                           # Dense_0, Dense_1
  trainer = tiny_trainer(model, lr=LR, batch_size=8)  # one full-batch step, plain SGD
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  logits = jnp.array([0.7, -0.4])
  temperature = 0.5
  algorithm = partialfed.partialfed(
      partialfed.PartialFedConfig(strategy="adaptive", temperature=temperature), trainer)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  key = jax.random.key(5)
  client = partialfed.PartialFedClient(local=local, logits=logits)
  out = jax.jit(algorithm.client_update)(client, global_params, splits, key)

  # The draw: A_l = 1[pi_l + g_l > 0] with g from the client's noise key.
  noise = partialfed.loading_noise(jax.random.split(key)[0], 2)
  load = np.asarray(logits + noise > 0)
  names = ("Dense_0", "Dense_1")
  start = {"params": {n: (global_params if load[i] else local)["params"][n]
                      for i, n in enumerate(names)}}
  x, y = clients[0].x_train, clients[0].y_train
  grads = jax.grad(lambda p: mean_ce(model, p, x, y))(start)
  chex.assert_trees_all_close(out.upload, jax.tree.map(lambda p, g: p - LR * g, start, grads),
                              atol=1e-6)
  # pi_l <- pi_l - lr * sigmoid'(z_l) / T * <grad_l L, theta^t_l - theta^c_l>, z = (pi + g)/T.
  z = (logits + noise) / temperature
  slope = jax.nn.sigmoid(z) * (1 - jax.nn.sigmoid(z)) / temperature
  inner = jnp.array([sum(jnp.vdot(g, a - b) for g, a, b in zip(
      jax.tree.leaves(grads["params"][n]), jax.tree.leaves(global_params["params"][n]),
      jax.tree.leaves(local["params"][n]))) for n in names])
  np.testing.assert_allclose(out.state.logits, logits - LR * slope * inner, rtol=1e-5,
                             atol=1e-7)
  assert np.all(np.abs(inner) > 1e-4)   # the strategy did move
  np.testing.assert_allclose(out.metrics["loaded_layers"], load.mean())


def test_evaluation_loads_the_most_likely_layers_of_the_latest_global_model():
  model = tiny_model()
  trainer = tiny_trainer(model)
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  algorithm = partialfed.partialfed(partialfed.PartialFedConfig(strategy="adaptive"), trainer)
  stack = lambda *trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
  clients = partialfed.PartialFedClient(local=stack(local, local),
                                        logits=jnp.array([[1.0, -1.0], [-1.0, 0.0]]))
  evaluated = algorithm.personalized_params(global_params, clients)
  for k, sources in enumerate([(global_params, local), (local, global_params)]):
    for name, source in zip(("Dense_0", "Dense_1"), sources):
      chex.assert_trees_all_equal(jax.tree.map(lambda a, k=k: a[k], evaluated["params"][name]),
                                  source["params"][name])


@pytest.mark.parametrize("config, message", [
    (partialfed.PartialFedConfig(strategy="greedy"), "partialfed: strategy"),
    (partialfed.PartialFedConfig(local_layers=0), "partialfed: local_layers"),
    (partialfed.PartialFedConfig(temperature=0.0), "partialfed: temperature"),
])
def test_bad_config_is_one_line_error(config, message):
  with pytest.raises(ConfigError, match=message):
    partialfed.partialfed(config, tiny_trainer(tiny_model()))
