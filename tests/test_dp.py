"""User-level DP (fedora_jax/algorithms/dp.py): each client's clipped update and the
server's noise against their closed forms, adaptive clipping's step, Poisson's clients
that sit out, the fixed denominator, and a run with neither noise nor clipping equal to
FedAvg with uniform weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from fedora_jax import algorithms, tree
from fedora_jax.algorithms import dp
from fedora_jax.algorithms.base import InitContext
from fedora_jax.algorithms.extended_server import Extended
from fedora_jax.errors import ConfigError, TrainingDivergedError
from fedora_jax.simulation import TrainConfig, run_algorithm

KEY = jax.random.key(0)


def random_update(key, scale):
  first, second = jax.random.split(key)
  return {"w": scale * jax.random.normal(first, (7, 3)), "b": scale * jax.random.normal(second, (3,))}


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clip_is_the_update_scaled_to_norm_at_most_c(scale):
  update = random_update(KEY, scale)
  flat = np.concatenate([np.ravel(update["b"]), np.ravel(update["w"])])
  norm = np.linalg.norm(flat)
  clipped, reported = dp.clip(update, jnp.float32(1.5))
  np.testing.assert_allclose(reported, norm, rtol=1e-6)
  factor = min(1.0, 1.5 / norm)
  for name in update:
    np.testing.assert_allclose(clipped[name], factor * np.asarray(update[name]), rtol=1e-6)
  assert dp.global_norm(clipped) <= 1.5 * (1 + 1e-6)


def fedavg_with_dp(config: dp.DpConfig, trainer=None):
  trainer = trainer or tiny.tiny_trainer(tiny.tiny_model())
  return algorithms.build("fedavg", algorithms.default_config("fedavg"), trainer, dp=config)


def initial_state(algorithm, data, model, num_clients):
  params = tree.broadcast_to_clients(
      model.init(jax.random.key(1), jnp.asarray(data.buckets[0].train.x[0, :1])), num_clients)
  return algorithm.init(InitContext(params=params, data=data, trainer=None, key=KEY))


def test_each_sampled_client_uploads_its_own_update_clipped_to_c():
  """Inside the vmapped round: client k sends clip_C(trained_k - theta), trained_k what
  FedAvg's own client update trains from theta with the same key."""
  data, _ = tiny.tiny_data([6, 6, 6, 6])
  model = tiny.tiny_model()
  trainer = tiny.tiny_trainer(model, lr=0.5)
  clip_norm = 0.05
  algorithm = fedavg_with_dp(dp.DpConfig(clip_norm=clip_norm, noise_multiplier=0.0), trainer)
  host = algorithms.build("fedavg", algorithms.default_config("fedavg"), trainer)
  state = initial_state(algorithm, data, model, 4)
  messages = algorithm.broadcast(state.server, state.clients)
  keys = jax.random.split(KEY, 4)
  splits = data.buckets[0]
  out = jax.vmap(algorithm.client_update)(state.clients, messages, splits, keys)
  plain = jax.vmap(host.client_update)(state.clients,
                                       tree.broadcast_to_clients(state.server.host, 4),
                                       splits, keys)
  for k in range(4):
    update = jax.tree.map(jnp.subtract, tree.take(plain.upload, k), state.server.host)
    norm = float(dp.global_norm(update))
    assert norm > clip_norm  # the test clips something
    np.testing.assert_allclose(out.metrics["dp_update_norm"][k], norm, rtol=1e-5)
    assert out.metrics["dp_clipped"][k] == 1.0
    sent = tree.take(out.upload.update, k)
    np.testing.assert_allclose(float(dp.global_norm(sent)), clip_norm, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(sent), jax.tree.leaves(update)):
      np.testing.assert_allclose(got, clip_norm / norm * np.asarray(want), rtol=1e-5,
                                 atol=1e-8)


def big_server(width=400_000):
  """A server state with one wide leaf, as DP's aggregate sees it (theta = 0)."""
  return {"w": jnp.zeros((width,), jnp.float32)}


def aggregate_zero_updates(config, rows, weights, clip_norm=2.0, round_=0):
  algorithm = fedavg_with_dp(config)
  theta = big_server()
  server = Extended(theta, dp.DpState(key=jax.random.key_data(KEY),
                                      round=jnp.int32(round_), clip_norm=jnp.float32(clip_norm)))
  uploads = dp.DpUpload(update=tree.broadcast_to_clients(jax.tree.map(jnp.zeros_like, theta),
                                                         rows),
                        unclipped=jnp.ones((rows,)), included=jnp.ones((rows,)))
  state = algorithm.aggregate(server, jnp.zeros((rows,)), uploads, weights)
  return state.server


@pytest.mark.parametrize("noise,expected", [(1.0, 4.0), (0.3, 10.0)])
def test_server_noise_has_std_z_c_over_the_expected_cohort(noise, expected):
  config = dp.DpConfig(clip_norm=2.0, noise_multiplier=noise, delta=1e-5,
                       expected_clients=expected)
  server = aggregate_zero_updates(config, 4, jnp.ones(4))
  released = np.asarray(server.host["w"])
  want = noise * 2.0 / expected
  # 400k draws: the sample std is within 0.5% of sigma with overwhelming probability.
  assert abs(released.std() / want - 1) < 5e-3
  assert abs(released.mean()) < 5 * want / math.sqrt(released.size)
  assert int(server.extra.round) == 1


def test_adaptive_clipping_splits_the_noise_and_steps_c_geometrically():
  z, sigma_b, quantile, rate = 1.0, 2.0, 0.3, 0.2
  config = dp.DpConfig(clip_norm=2.0, noise_multiplier=z, delta=1e-5, expected_clients=4.0,
                       adaptive_clip_quantile=quantile, clipped_count_stddev=sigma_b,
                       clip_learning_rate=rate)
  z_update, count_std = dp.noise_split(config)
  assert count_std == sigma_b
  # Andrew et al., Theorem 1: the two releases together cost one of noise multiplier z.
  np.testing.assert_allclose(z_update ** -2 + (2 * sigma_b) ** -2, z ** -2)
  server = aggregate_zero_updates(config, 4, jnp.ones(4))
  assert abs(np.asarray(server.host["w"]).std() / (z_update * 2.0 / 4.0) - 1) < 5e-3
  # Every update was under C: b = 1 plus the count's noise over m.
  _, _, count_key = dp._round_keys(dp.DpState(jax.random.key_data(KEY), jnp.int32(0),  # pylint: disable=protected-access
                                               jnp.float32(2.0)))
  fraction = (4 * 0.5 + sigma_b * float(jax.random.normal(count_key, ()))) / 4.0 + 0.5
  np.testing.assert_allclose(server.extra.clip_norm,
                             2.0 * math.exp(-rate * (fraction - quantile)), rtol=1e-5)


def test_adaptive_clipping_default_count_noise_and_its_bound():
  config = dp.DpConfig(clip_norm=1.0, noise_multiplier=0.5, delta=1e-5, expected_clients=100.0,
                       adaptive_clip_quantile=0.5)
  assert dp.noise_split(config)[1] == 5.0  # sigma_b = m / 20
  with pytest.raises(ConfigError, match="2 sigma_b > z"):
    dp.noise_split(config._replace(noise_multiplier=10.0))


def test_the_sum_is_divided_by_the_expected_cohort_not_by_who_came():
  """A client that dropped (weight 0) lowers the sum, not the denominator."""
  algorithm = fedavg_with_dp(dp.DpConfig(clip_norm=10.0, noise_multiplier=0.0,
                                         expected_clients=4.0))
  theta = {"w": jnp.zeros((3,))}
  server = Extended(theta, dp.DpState(jax.random.key_data(KEY), jnp.int32(0),
                                      jnp.float32(10.0)))
  updates = {"w": jnp.arange(12.0).reshape(4, 3)}
  uploads = dp.DpUpload(update=updates, unclipped=jnp.ones(4), included=jnp.ones(4))
  weights = jnp.array([5.0, 0.0, 2.0, 9.0])  # sample counts play no part: every client is 1
  state = algorithm.aggregate(server, jnp.zeros(4), uploads, weights)
  expected = np.asarray(updates["w"])[[0, 2, 3]].sum(0) / 4.0
  np.testing.assert_allclose(state.server.host["w"], expected)


def test_poisson_clients_not_drawn_sit_the_round_out():
  data, _ = tiny.tiny_data([6] * 8)
  model = tiny.tiny_model()
  trainer = tiny.tiny_trainer(model)
  config = dp.DpConfig(clip_norm=1.0, noise_multiplier=0.0, sampling="poisson",
                       sampling_rate=0.5, expected_clients=4.0)
  algorithm = algorithms.build("ditto", algorithms.default_config("ditto"), trainer, dp=config)
  state = initial_state(algorithm, data, model, 8)
  messages = algorithm.broadcast(state.server, state.clients)
  drawn = np.asarray(messages.included)
  assert 0 < drawn.sum() < 8  # this key draws some of each
  out = jax.vmap(algorithm.client_update)(state.clients, messages, data.buckets[0],
                                          jax.random.split(KEY, 8))
  steps = np.asarray(out.train.steps)
  assert (steps[drawn] > 0).all() and (steps[~drawn] == 0).all()
  assert np.isnan(np.asarray(out.train.loss)[~drawn]).all()
  for new, old in zip(jax.tree.leaves(out.state), jax.tree.leaves(state.clients)):
    np.testing.assert_array_equal(np.asarray(new)[~drawn], np.asarray(old)[~drawn])
    assert not np.allclose(np.asarray(new)[drawn], np.asarray(old)[drawn])
  assert (np.asarray(out.upload.included) == drawn).all()
  for leaf in jax.tree.leaves(out.upload.update):
    assert not np.asarray(leaf)[~drawn].any()


def test_without_noise_or_clipping_it_is_fedavg_with_uniform_weights():
  data, _ = tiny.tiny_data([5, 6, 9, 5, 8, 7])
  train = TrainConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.1, log_every=0,
                      client_weights="uniform")
  plain = run_algorithm(algorithms.make("fedavg"), tiny.tiny_model(), data, train,
                        progress=None)
  private = run_algorithm(
      algorithms.make("fedavg", algorithms.Plugged(
          algorithms.default_config("fedavg"),
          dp=dp.DpConfig(clip_norm=1e6, noise_multiplier=0.0, expected_clients=6.0))),
      tiny.tiny_model(), data, train, progress=None)
  for field in ("val_loss", "test_score", "train_loss"):
    np.testing.assert_allclose(getattr(private.history, field), getattr(plain.history, field),
                               rtol=1e-4, atol=1e-6)
  assert (np.asarray(private.history.extra["dp_clipped"]) == 0).all()


def test_a_host_that_sends_nothing_refuses_dp_in_one_line():
  with pytest.raises(ConfigError) as error:
    algorithms.check_plugins("local", dp=dp.DpConfig(clip_norm=1.0, noise_multiplier=1.0,
                                                     delta=1e-5))
  assert "\n" not in str(error.value) and "fedavg" in str(error.value)


@pytest.mark.parametrize("config,words", [
    (dp.DpConfig(clip_norm=1.0, noise_multiplier=-1.0, delta=1e-5), "noise_multiplier must be >= 0"),
    (dp.DpConfig(clip_norm=1.0, target_epsilon=2.0), "delta must be given"),
    (dp.DpConfig(clip_norm=1.0, noise_multiplier=1.0), "delta must be given"),
    (dp.DpConfig(clip_norm=1.0, delta=1e-5), "needs --dp_noise_multiplier or"),
    (dp.DpConfig(clip_norm=0.0, noise_multiplier=1.0, delta=1e-5), "clip_norm must be > 0"),
    (dp.DpConfig(clip_norm=1.0, noise_multiplier=1.0, delta=2.0), "delta must be in (0, 1)"),
])
def test_bad_settings_are_one_line_errors(config, words):
  with pytest.raises(ConfigError) as error:
    dp.validate(config)
  assert words in str(error.value) and "\n" not in str(error.value)


def test_resolve_finds_the_noise_for_a_target_epsilon_and_the_cohort():
  config = dp.resolve(dp.DpConfig(clip_norm=1.0, target_epsilon=4.0, delta=1e-5),
                      rounds=20, num_clients=30, participation=0.5, sampled=15)
  assert config.expected_clients == 15.0
  eps = dp.epsilons(config, 20, 30)
  assert eps.shape == (20,) and (np.diff(eps) > 0).all()
  assert 3.99 < eps[-1] <= 4.0
  assert dp.resolve(config, 20, 30, 0.5, 15) == config  # resolving again: the same run
  assert dp.resolve(config, 40, 30, 0.5, 15).noise_multiplier > config.noise_multiplier
  with pytest.raises(ConfigError, match="got both"):
    dp.resolve(dp.DpConfig(clip_norm=1.0, noise_multiplier=1.0, target_epsilon=2.0,
                           delta=1e-5), 20, 30, 0.5, 15)
  poisson = dp.resolve(dp.DpConfig(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5,
                                   sampling="poisson", accountant="pld"),
                       rounds=5, num_clients=30, participation=0.2, sampled=6)
  assert poisson.sampling_rate == 0.2 and poisson.expected_clients == pytest.approx(6.0)
  with pytest.raises(ConfigError, match="Poisson sampling only"):
    dp.resolve(dp.DpConfig(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5, accountant="pld"),
               rounds=5, num_clients=30, participation=0.2, sampled=6)


def test_each_client_reports_the_model_it_received_and_the_noise_on_the_mean():
  """dp_received_norm is ||theta||; dp_noise_norm is z C sqrt(P) / m, the norm the
  server's noise on the mean then has (400,000 coordinates: within 1 %)."""
  data, _ = tiny.tiny_data([6, 6, 6, 6])
  model = tiny.tiny_model()
  config = dp.DpConfig(clip_norm=0.5, noise_multiplier=3.0, delta=1e-5, expected_clients=4.0)
  algorithm = fedavg_with_dp(config, tiny.tiny_trainer(model))
  state = initial_state(algorithm, data, model, 4)
  messages = algorithm.broadcast(state.server, state.clients)
  out = jax.vmap(algorithm.client_update)(state.clients, messages, data.buckets[0],
                                          jax.random.split(KEY, 4))
  theta = state.server.host
  size = sum(leaf.size for leaf in jax.tree.leaves(theta))
  np.testing.assert_allclose(out.metrics["dp_received_norm"], dp.global_norm(theta), rtol=1e-6)
  np.testing.assert_allclose(out.metrics["dp_noise_norm"], 3.0 * 0.5 * math.sqrt(size) / 4.0,
                             rtol=1e-6)
  wide = big_server()
  released = aggregate_zero_updates(config, 4, jnp.ones(4), clip_norm=0.5).host
  want = float(dp.noise_norm(jnp.float32(3.0 * 0.5), wide, 4.0))
  assert abs(float(dp.global_norm(released)) / want - 1) < 1e-2
  assert math.isnan(float(dp.noise_norm(jnp.float32(1.0), wide, 0.0)))  # m not known


def test_a_divergence_says_dp_noise_only_when_it_dominates_the_model_trained_from():
  noisy = {"dp_noise_norm": np.full(3, 281.1), "dp_received_norm": np.array([281.3] * 3)}
  line = dp.divergence_hint(noisy, 2)
  assert "norm 281" in line and "mostly DP noise" in line and "\n" not in line
  assert dp.divergence_hint(noisy, 1) is None  # round 1 trains from the initial model
  small = {"dp_noise_norm": np.full(3, 1.0), "dp_received_norm": np.full(3, 14.0)}
  assert dp.divergence_hint(small, 5) is None
  assert dp.divergence_hint({}, 5) is None  # no DP


def test_a_run_that_diverges_under_dp_noise_stops_with_the_noise_against_the_model():
  """Noise of norm 2.4e5 on a 3-hidden-layer MLP: round 2's SGD from the release is not
  finite, and the line names the noise, not the learning rate."""
  data, _ = tiny.tiny_data([5, 6, 9, 5, 8, 7])
  train = TrainConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.1, log_every=0,
                      client_weights="uniform")
  config = dp.DpConfig(clip_norm=1.0, noise_multiplier=1e5, delta=1e-5, expected_clients=6.0)
  with pytest.raises(TrainingDivergedError) as error:
    run_algorithm(algorithms.make("fedavg", algorithms.Plugged(
        algorithms.default_config("fedavg"), dp=config)),
        tiny.tiny_model(hidden=(8, 8, 8)), data, train, progress=None)
  line = str(error.value)
  assert "in round 2" in line and "mostly DP noise" in line and "--lr" not in line
