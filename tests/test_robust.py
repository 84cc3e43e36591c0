"""Robust aggregators (robust.py): each rule against a hand-computed value on a small
stack, uploaders only (weight 0 rows never count), weights where the rule takes them,
the plug-in's move of the shared part, and the attackers each rule refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import byzantine, confree, robust
from fedora_jax.errors import ConfigError
from tiny import default_config, run_rounds, tiny_data, tiny_model, tiny_trainer

# A far-away row that a rule must ignore: a client that did not upload this round.
ABSENT = [1e3, -1e3]


def _step(rows, weights, **config):
  """The rule's move for stacked 2-D updates `rows` split over two leaves (so every rule
  is checked across leaves, as over a model's)."""
  stack = np.asarray(rows, np.float32)
  updates = {"a": jnp.asarray(stack[:, :1]), "b": jnp.asarray(stack[:, 1:])}
  move = robust.robust_step(updates, jnp.asarray(weights, jnp.float32),
                            robust.RobustConfig(**config))
  return np.concatenate([np.asarray(move["a"]), np.asarray(move["b"])])


def test_median_is_the_middle_value_per_coordinate_and_the_weighted_one_by_hand():
  rows = [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -5.0], ABSENT]
  # Four uploads: (2 + 3) / 2 and (10 + 20) / 2.
  np.testing.assert_allclose(_step(rows, [1, 1, 1, 1, 0], rule="median"), [2.5, 15.0])
  # Weights 1, 1, 1, 3 (total 6, half 3). First coordinate sorted 1, 2, 3, 100 with
  # cumulative weights 1, 2, 3, 6: exactly half at 3, so (3 + 100) / 2. Second sorted
  # -5 (w 3), 10, 20, 30: exactly half at -5, so (-5 + 10) / 2.
  np.testing.assert_allclose(_step(rows, [1, 1, 1, 3, 0], rule="median"), [51.5, 2.5])
  # An odd count: the middle one.
  np.testing.assert_allclose(_step(rows, [1, 1, 1, 0, 0], rule="median"), [2.0, 20.0])


def test_trimmed_mean_drops_floor_beta_n_at_each_end_and_weighs_the_rest():
  rows = [[1.0, 50.0], [2.0, -1.0], [3.0, 0.0], [4.0, 7.0], [100.0, 3.0], ABSENT]
  # n = 5, beta 0.2: one value dropped at each end. First: 2, 3, 4 -> 3; second:
  # sorted -1, 0, 3, 7, 50 -> 0, 3, 7 -> 10 / 3.
  np.testing.assert_allclose(_step(rows, [1, 1, 1, 1, 1, 0], rule="trimmed_mean", beta=0.2),
                             [3.0, 10 / 3], rtol=1e-6)
  # Client 1 weighs 3: first coordinate keeps 2 (w 3), 3, 4 -> (6 + 3 + 4) / 5; in the
  # second its -1 is trimmed, so the kept 0, 7, 3 (weight 1 each) -> 10 / 3.
  np.testing.assert_allclose(_step(rows, [1, 3, 1, 1, 1, 0], rule="trimmed_mean", beta=0.2),
                             [2.6, 10 / 3], rtol=1e-6)
  # beta 0.1: floor(0.5) = 0, the plain mean.
  np.testing.assert_allclose(_step(rows, [1, 1, 1, 1, 1, 0], rule="trimmed_mean", beta=0.1),
                             [22.0, 11.8], rtol=1e-6)


# a, b, c, d (far), e; n = 5 and byzantine 0.2: f = 1, so each score sums the n - f - 2 = 2
# smallest squared distances to the others:
#   a: b 1.44, e 0.5           -> 1.94      b: a 1.44, e 0.74        -> 2.18
#   c: a 4, e 2.5              -> 6.5       d: c 164, b 177.44       -> 341.44
#   e: a 0.5, b 0.74           -> 1.24
KRUM_ROWS = [[0.0, 0.0], [1.2, 0.0], [0.0, 2.0], [10.0, 10.0], [0.5, 0.5], [0.4, 0.4]]
KRUM_WEIGHTS = [1, 2, 1, 1, 1, 0]  # the last (next to e) did not upload


def test_krum_scores_and_selection_by_hand():
  updates = jnp.asarray(KRUM_ROWS)
  scores = robust.krum_scores(updates, jnp.asarray(KRUM_WEIGHTS, jnp.float32), 0.2)
  np.testing.assert_allclose(scores[:5], [1.94, 2.18, 6.5, 341.44, 1.24], rtol=1e-5)
  assert scores[5] == np.inf
  np.testing.assert_allclose(_step(KRUM_ROWS, KRUM_WEIGHTS, rule="krum", byzantine=0.2),
                             [0.5, 0.5])


def test_multi_krum_averages_the_m_best_with_their_weights():
  # m = 3: e, a, b with weights 1, 1, 2: (e + a + 2 b) / 4.
  np.testing.assert_allclose(
      _step(KRUM_ROWS, KRUM_WEIGHTS, rule="multi_krum", byzantine=0.2, m=3),
      [(0.5 + 2.4) / 4, 0.5 / 4], rtol=1e-6)
  # m = 0: n - f = 4, so c joins: (e + a + 2 b + c) / 5.
  np.testing.assert_allclose(
      _step(KRUM_ROWS, KRUM_WEIGHTS, rule="multi_krum", byzantine=0.2),
      [(0.5 + 2.4) / 5, (0.5 + 2.0) / 5], rtol=1e-6)


def test_centered_clipping_by_hand():
  rows = [[3.0, 0.0], [0.0, 4.0], [0.0, 0.0], ABSENT]
  weights = [1, 1, 1, 0]
  # From v = 0, tau = 1: clip([3, 0]) = [1, 0], clip([0, 4]) = [0, 1], [0, 0] stays.
  one = _step(rows, weights, rule="centered_clip", tau=1.0, iterations=1)
  np.testing.assert_allclose(one, [1 / 3, 1 / 3], rtol=1e-6)
  # A second step from v = [1/3, 1/3]: x - v = [8/3, -1/3] (norm sqrt(65) / 3),
  # [-1/3, 11/3] (norm sqrt(122) / 3), [-1/3, -1/3] (norm sqrt(2) / 3 < 1, kept).
  second = (np.array([8.0, -1.0]) / np.sqrt(65) + np.array([-1.0, 11.0]) / np.sqrt(122)
            + np.array([-1.0, -1.0]) / 3) / 3
  np.testing.assert_allclose(_step(rows, weights, rule="centered_clip", tau=1.0, iterations=2),
                             one + second, rtol=1e-5)
  # A large radius clips nothing: one step from 0 is the weighted mean.
  np.testing.assert_allclose(_step(rows, [1, 2, 1, 0], rule="centered_clip", tau=100.0),
                             [0.75, 2.0], rtol=1e-6)


def test_norm_bounding_by_hand():
  rows = [[3.0, 4.0], [0.0, 0.5], ABSENT]
  # [3, 4] (norm 5) -> [0.6, 0.8]; [0, 0.5] is within the bound.
  np.testing.assert_allclose(_step(rows, [1, 1, 0], rule="norm_bound", bound=1.0),
                             [0.3, 0.65], rtol=1e-6)
  np.testing.assert_allclose(_step(rows, [1, 3, 0], rule="norm_bound", bound=1.0),
                             [0.15, 0.575], rtol=1e-6)


def _fedavg(trainer, config, attackers=0.0):
  host = algorithms.build("fedavg", default_config("fedavg"), trainer)
  return robust.with_robust(host, config, attackers)


def test_the_plugin_moves_the_shared_model_by_the_rule_over_the_uploads():
  model = tiny_model()
  trainer = tiny_trainer(model)
  theta = {"w": jnp.array([1.0, -1.0])}
  updates = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -5.0]], np.float32)
  uploads = {"w": theta["w"][None] + updates}
  weights = jnp.array([1.0, 1.0, 1.0, 1.0])
  algorithm = _fedavg(trainer, robust.RobustConfig(rule="median"))
  state = algorithm.aggregate(theta, jnp.zeros(4), uploads, weights)
  np.testing.assert_allclose(state.server["w"], [1.0 + 2.5, -1.0 + 15.0])
  # Centered clipping from the previous aggregate keeps it beside the host's server.
  algorithm = _fedavg(trainer, robust.RobustConfig(rule="centered_clip", tau=1e6))
  server = robust.Extended(theta, {"w": jnp.zeros(2)})
  state = algorithm.aggregate(server, jnp.zeros(4), uploads, weights)
  mean = updates.mean(axis=0)
  np.testing.assert_allclose(state.server.host["w"], theta["w"] + mean, rtol=1e-6)
  np.testing.assert_allclose(state.server.extra["w"], mean, rtol=1e-6)


@pytest.mark.slow  # a compiled round each; the algorithm matrix runs them on every path
@pytest.mark.parametrize("rule", robust.RULES)
def test_each_rule_runs_on_fedavg_at_partial_participation(rule):
  data, _ = tiny_data((5, 6, 9, 5, 8, 7))
  model = tiny_model()
  trainer = tiny_trainer(model)
  algorithm = algorithms.build("fedavg", default_config("fedavg"), trainer,
                               aggregation=robust.RobustConfig(rule=rule, byzantine=0.0))
  state, metrics, _, _ = run_rounds(algorithm, trainer, data, model, rounds=2,
                                    participation=0.5)
  assert np.all(np.isfinite(np.asarray(metrics.val_loss)))
  assert algorithm.name == f"fedavg+{rule}"
  assert jax.tree.structure(state.algorithm.server) is not None


def test_tolerance_bad_input_is_one_line():
  krum = robust.RobustConfig(rule="krum")
  robust.check_tolerance(krum, 0.2, 36)  # f = 7: 36 > 16
  with pytest.raises(ConfigError, match=r"needs n > 2f \+ 2 .* n = 10 and f = 4"):
    robust.check_tolerance(krum, 0.4, 10)
  with pytest.raises(ConfigError, match="tolerates f = 1 of 10 uploads a round, fewer than"
                                        " the 3 attackers"):
    robust.check_tolerance(krum._replace(byzantine=0.1), 0.3, 10)
  with pytest.raises(ConfigError, match="median tolerates fewer than half"):
    robust.check_tolerance(robust.RobustConfig(rule="median"), 0.5, 10)
  with pytest.raises(ConfigError, match="trims 1 of 10 values at each end"):
    robust.check_tolerance(robust.RobustConfig(rule="trimmed_mean", beta=0.1), 0.2, 10)
  robust.check_tolerance(robust.RobustConfig(rule="trimmed_mean", beta=0.2), 0.2, 10)
  for rule in ("centered_clip", "norm_bound"):
    robust.check_tolerance(robust.RobustConfig(rule=rule), 0.45, 10)
    with pytest.raises(ConfigError, match=f"{rule} cannot tolerate half or more"):
      robust.check_tolerance(robust.RobustConfig(rule=rule), 0.5, 10)
  for bad in ({"rule": "mode"}, {"beta": 0.5}, {"tau": 0.0}, {"iterations": 0},
              {"start": "middle"}, {"bound": -1.0}, {"byzantine": 0.7}):
    with pytest.raises(ConfigError):
      robust.validate(robust.RobustConfig(**bad))
  for config in (robust.RobustConfig(rule="krum"), byzantine.AttackConfig()):
    kind = "aggregation" if isinstance(config, robust.RobustConfig) else "attack"
    with pytest.raises(ConfigError, match="needs an algorithm whose server averages"):
      algorithms.check_plugins("fedora", **{kind: config})
  with pytest.raises(ConfigError, match="--aggregation=krum needs"):
    algorithms.check_plugins("local", aggregation=robust.RobustConfig(rule="krum"))
  # ConFREE's message is unchanged.
  with pytest.raises(ConfigError, match="--aggregation=confree needs"):
    algorithms.check_plugins("local", aggregation=confree.ConfreeConfig())
