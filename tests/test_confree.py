"""ConFREE: the projection, the guidance vector (Eq. 3), w* (Eq. 5), d* (Eq. 4), the hosts."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import ala, confree
from fedora_jax.errors import ConfigError
from tiny import default_config, run_rounds, tiny_data, tiny_model, tiny_trainer


def test_update_is_projected_onto_the_normal_plane_of_the_one_it_conflicts_with():
  updates = jnp.array([[1.0, 0.0, 0.0], [-1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
  projected = confree.project_conflicts(updates)
  # g0 . g1 = -1 < 0 (their only conflict): g0' = g0 - (g0.g1 / ||g1||^2) g1.
  np.testing.assert_allclose(projected[0], [0.5, 0.5, 0.0], atol=1e-6)
  np.testing.assert_allclose(projected[0] @ updates[1], 0.0, atol=1e-6)
  np.testing.assert_allclose(projected[1], [0.0, 1.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(projected[1] @ updates[0], 0.0, atol=1e-6)
  np.testing.assert_allclose(projected[2], updates[2])  # conflicts with nobody
  # The authors' code subtracts min(dot, 0) g_j without dividing by ||g_j||^2.
  code = confree.project_conflicts(updates, "code")
  np.testing.assert_allclose(code[0], [1.0, 0.0, 0.0] - (-1.0) * np.array([-1.0, 1.0, 0.0]),
                             atol=1e-6)


def test_guidance_vector_by_hand_with_two_conflicts():
  updates = jnp.array([[2.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
  # g0: conflicts with g2 only:  g0 - (-2 / 2) g2 = [1, -1].
  # g1: conflicts with g2 only:  g1 - (-1 / 2) g2 = [-0.5, 0.5].
  # g2: with g0 (dot -2):        g2 - (-2 / 4) g0 = [0, -1];
  #     then with g1 (dot -1):   [0, -1] - (-1 / 1) g1 = [0, 0].
  np.testing.assert_allclose(confree.project_conflicts(updates),
                             [[1.0, -1.0], [-0.5, 0.5], [0.0, 0.0]], atol=1e-6)
  np.testing.assert_allclose(confree.guidance_vector(updates), [1 / 6, -1 / 6], atol=1e-6)


def _grid_minimum(gram, g_dot_g0, radius, steps=300):
  grid = np.array([(a, b, steps - a - b) for a, b in itertools.product(range(steps + 1), repeat=2)
                   if a + b <= steps]) / steps
  values = jax.vmap(lambda w: confree.dual_objective(w, gram, g_dot_g0, radius))(grid)
  return float(jnp.min(values))


def test_direction_is_eq4_at_the_eq5_optimum():
  updates = jnp.array([[2.0, 0.0, 0.5], [0.0, 1.0, 0.2], [-1.0, -0.5, 1.0]])
  config = confree.ConfreeConfig(c=0.5)
  direction, g0, w = confree.conflict_free_step(updates, config)
  np.testing.assert_allclose(g0, confree.guidance_vector(updates), atol=1e-6)
  np.testing.assert_allclose(jnp.sum(w), 1.0, atol=1e-5)
  assert bool(jnp.all(w >= 0))
  radius = np.sqrt(0.5) * np.linalg.norm(g0)
  gram, g_dot_g0 = updates @ updates.T, updates @ g0
  found = float(confree.dual_objective(w, gram, g_dot_g0, radius))
  assert found <= _grid_minimum(gram, g_dot_g0, radius) + 1e-4
  g_w = w @ updates
  np.testing.assert_allclose(direction, g0 + radius / np.linalg.norm(g_w) * g_w, atol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(direction - g0), radius, rtol=1e-5)
  rescaled, _, _ = confree.conflict_free_step(updates, config._replace(rescale=True))
  np.testing.assert_allclose(rescaled, direction / 1.5, atol=1e-5)


def test_server_moves_shared_parameters_by_d_star():
  host = algorithms.build("fedavg", algorithms.get("fedavg").config_class(),
                          tiny_trainer(tiny_model()))
  server = {"a": jnp.array([1.0, 1.0]), "b": jnp.array([0.0])}
  uploads = {"a": jnp.array([[3.0, 1.0], [1.0, 2.0], [0.0, 0.0]]),
             "b": jnp.array([[1.0], [-1.0], [0.5]])}
  for granularity in ("model", "leaf"):
    config = confree.ConfreeConfig(granularity=granularity)
    wrapped = confree.with_confree(host, config)
    state = wrapped.aggregate(server, jnp.zeros((3,)), uploads, jnp.ones((3,)))
    updates = {k: uploads[k] - server[k][None] for k in server}
    if granularity == "model":
      flat = jnp.concatenate([updates["a"], updates["b"]], axis=1)
      step = confree.conflict_free_step(flat, config)[0]
      expected = {"a": server["a"] + step[:2], "b": server["b"] + step[2:]}
    else:
      expected = {k: server[k] + confree.conflict_free_step(updates[k], config)[0]
                  for k in server}
    chex.assert_trees_all_close(state.server, expected, atol=1e-5)


def _fedavg_with_confree(config):
  host = algorithms.build("fedavg", algorithms.get("fedavg").config_class(),
                          tiny_trainer(tiny_model()))
  return confree.with_confree(host, config)


def test_clients_that_sat_the_round_out_do_not_enter_the_step():
  # Issue 17: uploads [1,0], [0,1], [-5,-5]; client 3 unsampled (weight 0) must give the
  # two-client step. By hand: [1,0] and [0,1] do not conflict, so g0 = [.5,.5]; by
  # symmetry w* = [.5,.5], g_w = g0, and d* = g0 + c ||g0|| g0 / ||g0|| = (1 + c) g0.
  wrapped = _fedavg_with_confree(confree.ConfreeConfig(c=0.5))
  server = {"w": jnp.zeros(2)}
  three = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0], [-5.0, -5.0]])}
  two = {"w": three["w"][:2]}
  pair = wrapped.aggregate(server, jnp.zeros(2), two, jnp.array([3.0, 5.0]))
  sat_out = wrapped.aggregate(server, jnp.zeros(3), three, jnp.array([3.0, 5.0, 0.0]))
  chex.assert_trees_all_close(sat_out.server, pair.server, atol=1e-6)
  np.testing.assert_allclose(pair.server["w"], [0.75, 0.75], atol=1e-5)
  # The engine sends zeros for an unsampled client's upload: still the same step.
  zeros = {"w": three["w"].at[2].set(0.0)}
  zeroed = wrapped.aggregate(server, jnp.zeros(3), zeros, jnp.array([3.0, 5.0, 0.0]))
  chex.assert_trees_all_close(zeroed.server, pair.server, atol=1e-6)
  # Sampled, client 3 does count.
  everyone = wrapped.aggregate(server, jnp.zeros(3), three, jnp.array([3.0, 5.0, 1.0]))
  assert not np.allclose(everyone.server["w"], pair.server["w"], atol=1e-2)


def _two_rounds(name, **plugins):
  data, _ = tiny_data([5, 6, 7, 9])  # one size bucket (test_registry covers two): one vmap
  model = tiny_model(hidden=(5,))
  trainer = tiny_trainer(model, batch_size=4, epochs=2, momentum=0.9)
  algorithm = algorithms.build(name, default_config(name), trainer, **plugins)
  state, metrics, _, traces = run_rounds(algorithm, trainer, data, model)
  assert traces == 1
  chex.assert_tree_all_finite((metrics, state))
  return algorithm, state


@pytest.mark.parametrize("name", confree.HOSTS)
def test_confree_composes_with_each_host(name):
  algorithm, _ = _two_rounds(name, aggregation=confree.ConfreeConfig())
  assert algorithm.name == f"{name}+confree"


def test_unsupported_plugins_fail_before_any_work():
  for name in ("local", "fedora", "ditto", "fedamp", "coaching"):
    with pytest.raises(ConfigError, match="aggregation=confree"):
      algorithms.check_plugins(name, aggregation=confree.ConfreeConfig())
  for name in ("local", "fedora", "fedala", "fedper", "coaching"):
    with pytest.raises(ConfigError, match="--ala"):
      algorithms.check_plugins(name, ala=ala.AlaConfig())
  with pytest.raises(ConfigError, match="confree_projection"):
    confree.validate(confree.ConfreeConfig(projection="other"))
