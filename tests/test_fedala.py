"""FedALA / the ALA plug-in: the element-wise aggregation, W's clipped step, its schedule,
and ALA around every host it supports."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import ala
from fedora_jax.algorithms.base import InitContext
from fedora_jax.rounds import RoundState, build_train_round
from fedora_jax.errors import ConfigError
from test_confree import _two_rounds
from tiny import init_params, tiny_data, tiny_model, tiny_trainer


def _model_and_pair():
  model = tiny_model(hidden=(5, 4))  # Dense_0, Dense_1, Dense_2
  return model, init_params(model, seed=0), init_params(model, seed=1)


def test_aggregation_takes_global_lower_layers_and_mixes_the_top_ones():
  _, local, global_params = _model_and_pair()
  top = ala.top_layers(local, 2)
  assert top == ["Dense_1", "Dense_2"]
  weights = jax.tree.map(lambda a: jnp.full_like(a, 0.25),
                         {"params": {n: local["params"][n] for n in top}})
  weights["params"]["Dense_2"]["bias"] = jnp.array([0.0, 1.0, 0.5])
  mixed = ala.aggregate_locally(local, global_params, weights)
  chex.assert_trees_all_equal(mixed["params"]["Dense_0"], global_params["params"]["Dense_0"])
  for name in top:
    expected = jax.tree.map(lambda l, g, w: l + (g - l) * w, local["params"][name],
                            global_params["params"][name], weights["params"][name])
    chex.assert_trees_all_close(mixed["params"][name], expected, atol=1e-7)
  bias = mixed["params"]["Dense_2"]["bias"]
  np.testing.assert_allclose(bias[0], local["params"]["Dense_2"]["bias"][0])   # W = 0: local
  np.testing.assert_allclose(bias[1], global_params["params"]["Dense_2"]["bias"][1])  # W = 1
  with pytest.raises(ConfigError, match="ala: p"):
    ala.top_layers(local, 4)


def _one_client(n=6):
  data, clients = tiny_data([n, n])
  return jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0].train), clients[0]


def test_one_weight_step_is_the_papers_clipped_update():
  model, local, global_params = _model_and_pair()
  train, client = _one_client()
  trainer = tiny_trainer(model)
  weights = jax.tree.map(lambda a: jnp.full_like(a, 0.5),
                         {"params": {"Dense_2": local["params"]["Dense_2"]}})
  # s = 100% and a batch larger than the data: one full-batch step in a later round.
  config = ala.AlaConfig(s=100.0, eta=3.0, batch_size=8)
  learned, epochs, _ = ala.learn_weights(trainer.loss, config, local, global_params, weights,
                                         jnp.asarray(5), train, jax.random.key(0))
  assert int(epochs) == 1
  theta_hat = ala.aggregate_locally(local, global_params, weights)
  grad = jax.grad(lambda p: trainer.loss(p, jnp.asarray(client.x_train),
                                         jnp.asarray(client.y_train),
                                         jnp.ones(len(client.y_train))))(theta_hat)
  # W <- clip(W - eta * grad_theta L(theta_hat) * (Theta - theta), 0, 1)
  expected = jax.tree.map(lambda w, g, th_g, th_l: jnp.clip(w - 3.0 * g * (th_g - th_l), 0, 1),
                          weights["params"]["Dense_2"], grad["params"]["Dense_2"],
                          global_params["params"]["Dense_2"], local["params"]["Dense_2"])
  chex.assert_trees_all_close(learned["params"]["Dense_2"], expected, atol=1e-6)
  # A huge step lands on the box: every weight is clipped to 0 or 1.
  clipped, _, _ = ala.learn_weights(trainer.loss, config._replace(eta=1e6), local,
                                    global_params, weights, jnp.asarray(5), train,
                                    jax.random.key(0))
  values = np.concatenate([np.ravel(v) for v in jax.tree.leaves(clipped)])
  assert set(np.unique(values)) <= {0.0, 1.0}
  assert np.any(values == 0.0) and np.any(values == 1.0)


def test_weights_rest_in_round_one_converge_in_round_two_then_one_epoch():
  model, local, global_params = _model_and_pair()
  train, _ = _one_client()
  trainer = tiny_trainer(model)
  weights = jax.tree.map(jnp.ones_like, {"params": {"Dense_2": local["params"]["Dense_2"]}})
  config = ala.AlaConfig(s=50.0, batch_size=2, threshold=1e9, num_pre_loss=3, max_epochs=7)

  def epochs(rounds, cfg=config):
    return int(ala.learn_weights(trainer.loss, cfg, local, global_params, weights,
                                 jnp.asarray(rounds), train, jax.random.key(0))[1])
  assert epochs(0) == 0
  assert epochs(1) == 4          # the first epoch after num_pre_loss losses passes the test
  assert epochs(1, config._replace(threshold=0.0)) == 7   # never converges: max_epochs
  assert epochs(2) == 1


def test_the_authors_slice_is_consecutive_samples_in_stored_order_with_the_last_loss():
  # sample="slice": m = 3 of 6 samples from a random start, batches of 2 (the last
  # partial), the same every epoch; epoch_loss="last": the last batch's loss.
  model, local, global_params = _model_and_pair()
  train, client = _one_client()
  trainer = tiny_trainer(model)
  weights = jax.tree.map(lambda a: jnp.full_like(a, 0.5),
                         {"params": {"Dense_2": local["params"]["Dense_2"]}})
  config = ala.AlaConfig(s=50.0, eta=2.0, batch_size=2, sample="slice", epoch_loss="last")
  key = jax.random.key(4)
  learned, epochs, last = ala.learn_weights(trainer.loss, config, local, global_params,
                                            weights, jnp.asarray(5), train, key)
  start = int(ala.slice_start(jax.random.split(key)[0], 6, 3))
  assert int(epochs) == 1 and 0 <= start <= 3

  def step(w, rows):
    x, y = jnp.asarray(client.x_train[rows]), jnp.asarray(client.y_train[rows])
    loss_of = lambda w: trainer.loss(ala.aggregate_locally(local, global_params, w), x, y,
                                     jnp.ones(len(rows)))
    loss, grad = jax.value_and_grad(loss_of)(w)
    return jax.tree.map(lambda a, g: jnp.clip(a - 2.0 * g, 0, 1), w, grad), loss
  expected, _ = step(weights, [start, start + 1])
  expected, expected_last = step(expected, [start + 2])
  chex.assert_trees_all_close(learned, expected, atol=1e-6)
  np.testing.assert_allclose(last, expected_last, rtol=1e-6)
  # The batches do not depend on the epoch: two epochs are the same two steps twice.
  twice, _, _ = ala.learn_weights(trainer.loss, config._replace(max_epochs=2, threshold=-1.0,
                                                                num_pre_loss=2),
                                  local, global_params, weights, jnp.asarray(1), train, key)
  again, _ = step(step(expected, [start, start + 1])[0], [start + 2])
  chex.assert_trees_all_close(twice, again, atol=1e-6)
  with pytest.raises(ConfigError, match="ala: sample"):
    ala.validate(config._replace(sample="contiguous"))
  with pytest.raises(ConfigError, match="ala: epoch_loss"):
    ala.validate(config._replace(epoch_loss="first"))


@pytest.mark.parametrize("name", algorithms.ala_hosts())
def test_ala_composes_with_each_host(name):
  algorithm, state = _two_rounds(name, ala=ala.AlaConfig(batch_size=4, max_epochs=5))
  assert algorithm.name == f"{name}+ala"
  np.testing.assert_array_equal(state.algorithm.clients.rounds, [2, 2, 2, 2])


def test_at_partial_participation_only_the_sampled_clients_run_ala():
  # docs/algorithms/ala.md's definition: a client that sits a round out keeps theta_i, W_i
  # and its count of rounds; ALA's schedule counts the client's own rounds (rest, converge,
  # one epoch).
  data, _ = tiny_data([5, 6, 7, 9])
  model = tiny_model(hidden=(5,))
  trainer = tiny_trainer(model, batch_size=4)
  config = ala.AlaConfig(batch_size=4, max_epochs=5)  # 10 losses never collect in 5 epochs
  algorithm = algorithms.build("fedala", config, trainer)
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (4,) + a.shape), init_params(model))
  state = RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(
      InitContext(params=stacked, data=data, trainer=trainer, key=jax.random.key(0))))
  round_fn = jax.jit(build_train_round(algorithm, trainer, data, participation=0.5))
  schedule_seen = set()
  for _ in range(4):
    before = state.algorithm.clients
    state, metrics = round_fn(state, data.buckets, jax.random.key(1))
    after = state.algorithm.clients
    took_part = np.asarray(after.rounds - before.rounds) == 1
    assert took_part.sum() == 2 and np.all(np.asarray(after.rounds - before.rounds) <= 1)
    for k in np.flatnonzero(~took_part):  # untouched: local model, W and host state
      chex.assert_trees_all_equal(jax.tree.map(lambda a, k=k: a[k], after),
                                  jax.tree.map(lambda a, k=k: a[k], before))
    for k in np.flatnonzero(took_part):
      expected = {0: 0, 1: 5}.get(int(before.rounds[k]), 1)
      assert int(metrics.extra["ala_epochs"][k]) == expected
      schedule_seen.add(expected)
  assert int(state.algorithm.clients.rounds.sum()) == 8
  assert schedule_seen == {0, 5, 1}, schedule_seen


def test_fedala_is_fedavg_with_ala_and_evaluates_local_models():
  _, state = _two_rounds("fedala")
  clients = state.algorithm.clients
  fedala = algorithms.build("fedala", ala.AlaConfig(), tiny_trainer(tiny_model()))
  chex.assert_trees_all_equal(fedala.personalized_params(state.algorithm.server, clients),
                              clients.local)
  weights = np.concatenate([np.ravel(w) for w in jax.tree.leaves(clients.weights)])
  assert weights.min() >= 0.0 and weights.max() <= 1.0 and weights.min() < 1.0


@pytest.mark.slow  # the command in a subprocess
@pytest.mark.parametrize("args, message", [
    (["--algorithm=local", "--ala"], "--ala needs an algorithm that sends a global model"),
    (["--algorithm=fedora", "--aggregation=confree"], "--aggregation=confree needs"),
])
def test_cli_refuses_unsupported_plugins_in_one_line_before_loading_data(args, message,
                                                                          tmp_path):
  from test_main import run_main
  proc = run_main(f"--workdir={tmp_path / 'run'}", "--rounds=1", *args)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
  assert not (tmp_path / "run").exists()  # refused before claiming the workdir
