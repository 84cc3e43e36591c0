"""Byzantine attackers (byzantine.py): each attack's upload against its definition, who
attacks (fixed or sampled, from the seed), the plug-in's poisoned mean, and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from fedora_jax import algorithms
from fedora_jax.algorithms import byzantine, robust
from fedora_jax.algorithms.extended_server import Extended
from fedora_jax.errors import ConfigError
import tiny
from tiny import default_config, run_rounds, tiny_data, tiny_model, tiny_trainer

# Five clients; 3 and 4 attack, 1 did not upload this round (weight 0).
UPDATES = np.array([[1.0, 2.0], [7.0, 7.0], [3.0, 4.0], [-2.0, 1.0], [0.5, -3.0]], np.float32)
HONEST_ROWS = [0, 2]
UPLOADED = jnp.array([True, False, True, True, True])
ATTACKER = jnp.array([False, True, False, True, True])  # client 1 attacks but sat out


def _sent(attack, **config):
  updates = {"w": jnp.asarray(UPDATES)}
  sent = byzantine.malicious_updates(byzantine.AttackConfig(attack=attack, **config), updates,
                                     UPLOADED, ATTACKER, jax.random.key(3))
  return np.asarray(sent["w"])


def test_sign_flip_reverses_each_attackers_own_update():
  sent = _sent("sign_flip")
  np.testing.assert_array_equal(sent[3:], -UPDATES[3:])
  np.testing.assert_array_equal(sent[:3], UPDATES[:3])  # honest, and the absent attacker


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
  mean = UPDATES[HONEST_ROWS].mean(axis=0)  # [2, 3]
  sent = _sent("ipm", epsilon=0.1)
  np.testing.assert_allclose(sent[3:], np.stack([-0.1 * mean] * 2), rtol=1e-6)
  np.testing.assert_array_equal(sent[:3], UPDATES[:3])


def test_alie_sends_the_mean_minus_z_deviations_with_z_from_n_and_f():
  honest = UPDATES[HONEST_ROWS]
  mean, std = honest.mean(axis=0), honest.std(axis=0, ddof=1)  # [2, 3], [sqrt 2, sqrt 2]
  # n = 4 uploads, f = 2 of them attack: s = floor(4 / 2 + 1) - 2 = 1 supporter needed,
  # z = Phi^-1((n - s) / n) = Phi^-1(0.75).
  z = stats.norm.ppf(0.75)
  np.testing.assert_allclose(byzantine.alie_z(jnp.int32(4), jnp.int32(2)), z, rtol=1e-5)
  np.testing.assert_allclose(_sent("alie")[3:], np.stack([mean - z * std] * 2), rtol=1e-5)
  np.testing.assert_allclose(_sent("alie", z=1.5)[3], mean - 1.5 * std, rtol=1e-6)
  # n = 36, f = 7 (20 %): s = 19 - 7 = 12, z = Phi^-1(24 / 36).
  np.testing.assert_allclose(byzantine.alie_z(jnp.int32(36), jnp.int32(7)),
                             stats.norm.ppf(24 / 36), rtol=1e-5)


def test_gaussian_attackers_send_independent_noise_of_the_given_std():
  big = {"w": jnp.zeros((3, 20000))}
  attacker = jnp.array([True, True, False])
  sent = np.asarray(byzantine.malicious_updates(
      byzantine.AttackConfig(attack="gaussian", std=2.0), big, jnp.ones(3, bool), attacker,
      jax.random.key(0))["w"])
  for row in sent[:2]:
    assert abs(row.mean()) < 0.05 and abs(row.std() - 2.0) < 0.05
  assert abs(np.corrcoef(sent[0], sent[1])[0, 1]) < 0.05
  np.testing.assert_array_equal(sent[2], 0.0)
  np.testing.assert_array_equal(_sent("gaussian")[:3], UPDATES[:3])


def test_label_flip_changes_the_attackers_training_labels_only():
  data, _ = tiny_data((4, 4), num_classes=3)
  splits = jax.tree.map(lambda a: a[0], data.buckets[0])
  flipped = byzantine.flip_labels(splits, jnp.bool_(True), jnp.int32(3))
  np.testing.assert_array_equal(flipped.train.y, 2 - np.asarray(splits.train.y))
  np.testing.assert_array_equal(flipped.val.y, splits.val.y)
  kept = byzantine.flip_labels(splits, jnp.bool_(False), jnp.int32(3))
  np.testing.assert_array_equal(kept.train.y, splits.train.y)
  np.testing.assert_array_equal(_sent("label_flip"), UPDATES)  # uploads as trained


def _attacked_fedavg(attack="sign_flip", **config):
  model = tiny_model()
  trainer = tiny_trainer(model)
  return algorithms.build("fedavg", default_config("fedavg"), trainer,
                          attack=byzantine.AttackConfig(attack=attack, **config))


def test_the_server_averages_the_poisoned_uploads():
  algorithm = _attacked_fedavg(fraction=0.4)
  theta = {"w": jnp.array([1.0, 1.0])}
  server = Extended(theta, byzantine.AttackServer(
      jax.random.key_data(jax.random.key(0)), jnp.int32(0)))
  clients = byzantine.AttackClient(host=jnp.zeros(5), attacker=ATTACKER,
                                   num_classes=jnp.full(5, 3, jnp.int32))
  uploads = {"w": theta["w"][None] + UPDATES}
  weights = jnp.where(UPLOADED, jnp.array([1.0, 1.0, 2.0, 1.0, 1.0]), 0.0)
  state = algorithm.aggregate(server, clients, uploads, weights)
  sent = UPDATES.copy()
  sent[3:] *= -1
  expected = theta["w"] + (sent[0] + 2 * sent[2] + sent[3] + sent[4]) / 5
  np.testing.assert_allclose(state.server.host["w"], expected, rtol=1e-6)
  assert int(state.server.extra.round) == 1
  # The fixed set stays the round-0 draw for the run.
  np.testing.assert_array_equal(state.clients.attacker, byzantine.attackers_of_round(
      byzantine.AttackConfig(fraction=0.4), server.extra.key, jnp.int32(7), 5))


def test_attackers_are_a_fixed_set_from_the_seed_or_resampled_each_round():
  key = jax.random.key_data(jax.random.key(5))
  fixed = byzantine.AttackConfig(fraction=0.25)
  sampled = fixed._replace(sampled=True)
  rounds = [np.asarray(byzantine.attackers_of_round(sampled, key, jnp.int32(r), 20))
            for r in range(6)]
  assert all(r.sum() == 5 for r in rounds)
  assert len({r.tobytes() for r in rounds}) > 1
  assert all(np.array_equal(np.asarray(byzantine.attackers_of_round(fixed, key, jnp.int32(r),
                                                                     20)), rounds[0])
             for r in range(6))


@pytest.mark.slow  # a compiled round each; the algorithm matrix runs them on every path
@pytest.mark.parametrize("attack", byzantine.ATTACKS)
def test_each_attack_runs_under_a_robust_rule_at_partial_participation(attack):
  data, _ = tiny_data((5, 6, 9, 5, 8, 7))
  model = tiny_model()
  trainer = tiny_trainer(model)
  algorithm = algorithms.build(
      "fedavg", default_config("fedavg"), trainer,
      aggregation=robust.RobustConfig(rule="trimmed_mean", beta=0.4),
      attack=byzantine.AttackConfig(attack=attack, fraction=0.34, sampled=True))
  state, metrics, _, _ = run_rounds(algorithm, trainer, data, model, rounds=2,
                                    participation=0.5)
  assert algorithm.name == f"fedavg+trimmed_mean+{attack}"
  assert np.all(np.isfinite(np.asarray(metrics.val_loss)))
  # The round's trained clients report whether they attacked (the others NaN).
  reported = np.asarray(metrics.extra["attacker"])
  assert np.sum(np.isfinite(reported)) == 3
  assert int(state.algorithm.server.extra.round) == 2
  assert int(np.sum(state.algorithm.clients.attacker)) == 2


def test_label_flip_attackers_train_on_flipped_labels_and_the_others_on_theirs():
  data, _ = tiny_data((6, 6), num_classes=3)
  splits = jax.tree.map(lambda a: a[0], data.buckets[0])
  model = tiny_model()
  trainer = tiny_trainer(model)
  host = algorithms.build("fedavg", default_config("fedavg"), trainer)
  attacked = byzantine.with_attackers(host, byzantine.AttackConfig(attack="label_flip"))
  params = tiny.init_params(model)
  key = jax.random.key(2)
  flipped = byzantine.flip_labels(splits, jnp.bool_(True), jnp.int32(3))
  for attacker, trained_on in ((True, flipped), (False, splits)):
    client = byzantine.AttackClient(host=jnp.zeros(()), attacker=jnp.bool_(attacker),
                                    num_classes=jnp.int32(3))
    out = attacked.client_update(client, params, splits, key)
    expected = host.client_update(jnp.zeros(()), params, trained_on, key)
    chex.assert_trees_all_close(out.upload, expected.upload)
    assert float(out.metrics["attacker"]) == float(attacker)
  honest = host.client_update(jnp.zeros(()), params, splits, key).upload
  dishonest = host.client_update(jnp.zeros(()), params, flipped, key).upload
  assert not np.allclose(honest["params"]["Dense_0"]["kernel"],
                         dishonest["params"]["Dense_0"]["kernel"])


def test_bad_input_is_one_line():
  for bad in ({"fraction": 1.0}, {"fraction": -0.1}, {"attack": "poison"}, {"std": -1.0},
              {"epsilon": -1.0}, {"z": -2.0}):
    with pytest.raises(ConfigError):
      byzantine.validate(byzantine.AttackConfig(**bad))
  with pytest.raises(ConfigError, match="fraction must be in \\[0, 1\\), got 1.0"):
    byzantine.validate(byzantine.AttackConfig(fraction=1.0))
  for name in ("fedora", "local", "ditto"):
    with pytest.raises(ConfigError, match=f"--attack needs an algorithm whose server averages"
                                          f" a shared part its clients upload; not {name}"):
      algorithms.check_plugins(name, attack=byzantine.AttackConfig())


def test_the_wrappers_hand_the_host_its_own_server_and_client_state():
  trainer = tiny_trainer(tiny_model())
  host = algorithms.build("fedavg", default_config("fedavg"), trainer)._replace(
      sampled_broadcast=lambda server, clients, sampled: (server, clients, sampled),
      state_upload=lambda client: ("read", client))
  attacked = byzantine.with_attackers(host, byzantine.AttackConfig())
  server = Extended("server", byzantine.AttackServer(key=None, round=None))
  clients = byzantine.AttackClient(host="clients", attacker=None, num_classes=None)
  assert attacked.sampled_broadcast(server, clients, "m") == ("server", "clients", "m")
  assert attacked.state_upload(clients) == ("read", "clients")
  assert attacked.shared_part.of_server(server) == "server"
  clipped = robust.with_robust(host, robust.RobustConfig(rule="centered_clip"))
  assert clipped.sampled_broadcast(Extended("server", None), "clients", "m") == (
      "server", "clients", "m")
  assert clipped.shared_model(Extended("server", None)) == "server"
