"""ConFREE: the projection, the guidance vector (Eq. 3), w* (Eq. 5), d* (Eq. 4), the hosts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from fedora_jax import algorithms
from fedora_jax.algorithms import ala, confree, fedcp, fedpac
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
  code = confree.project_conflicts(updates, projection="code")
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


def test_sequential_projection_and_eq3_as_printed_by_hand():
  # a = [1,0], b = [-1,1], c = [-1,3]: a.b = -1, a.c = -1, b.c = 4; ||b||^2 = 2, ||c||^2 = 10.
  updates = jnp.array([[1.0, 0.0], [-1.0, 1.0], [-1.0, 3.0]])
  # Sequential (j ascending, against the partially projected a'):
  #   a' = a - (-1/2) b = [0.5, 0.5];  then a'.c = 1 >= 0: c is no longer a conflict.
  #   b' = b - (-1/1) a = [0, 1];      then b'.c = 3 >= 0.
  #   c' = c - (-1/1) a = [0, 3];      then c'.b = 3 >= 0.
  sequential = [[0.5, 0.5], [0.0, 1.0], [0.0, 3.0]]
  np.testing.assert_allclose(confree.project_conflicts(updates), sequential, atol=1e-6)
  np.testing.assert_allclose(confree.guidance_vector(updates), [1 / 6, 1.5], atol=1e-6)
  # Eq. 3 as printed (every term from the original a): a conflicts with b and c,
  #   a' = a - (-1/2) b - (-1/10) c = [0.4, 0.8];  b and c as above.
  eq3 = [[0.4, 0.8], [0.0, 1.0], [0.0, 3.0]]
  np.testing.assert_allclose(confree.project_conflicts(updates, order="eq3"), eq3, atol=1e-6)
  np.testing.assert_allclose(confree.guidance_vector(updates, order="eq3"), [2 / 15, 1.6],
                             atol=1e-6)
  # The authors' unnormalised subtraction, in Eq. 3's form: a' = a + b + c = [-1, 4].
  np.testing.assert_allclose(
      confree.project_conflicts(updates, projection="code", order="eq3")[0], [-1.0, 4.0],
      atol=1e-6)
  # Outside the sample: no row, and no conflict with it (b alone is a's only conflict).
  sampled = jnp.array([True, True, False])
  np.testing.assert_allclose(confree.project_conflicts(updates, sampled, order="eq3"),
                             [[0.5, 0.5], [0.0, 1.0], [0.0, 0.0]], atol=1e-6)


def test_projection_onto_the_simplex_of_the_sampled_clients_by_hand():
  v = jnp.array([0.5, 2.0, -1.0, 0.3])
  # Sorted 2, 0.5, ...: only the largest stays positive with shift 2 - 1 = 1.
  np.testing.assert_allclose(confree.project_to_simplex(v, jnp.ones(4, bool)), [0, 1, 0, 0])
  # Without client 1: 0.5, 0.3 stay (shift (0.8 - 1) / 2 = -0.1), -1 + 0.1 < 0 does not.
  np.testing.assert_allclose(
      confree.project_to_simplex(v, jnp.array([True, False, True, True])),
      [0.6, 0.0, 0.0, 0.4], atol=1e-6)


def _reference_weights(updates, g0, radius):
  """Eq. 5 by scipy's SLSQP (the authors' solver) with exact gradients, in float64."""
  updates, g0 = np.asarray(updates, np.float64), np.asarray(g0, np.float64)
  gram, g_dot_g0 = updates @ updates.T, updates @ g0
  num = len(updates)
  result = optimize.minimize(
      lambda w: w @ g_dot_g0 + radius * np.sqrt(w @ gram @ w), np.full(num, 1.0 / num),
      jac=lambda w: g_dot_g0 + radius * gram @ w / np.sqrt(w @ gram @ w),
      method="SLSQP", bounds=[(0.0, 1.0)] * num,
      constraints={"type": "eq", "fun": lambda w: 1.0 - w.sum(), "jac": lambda w: -np.ones(num)},
      options={"ftol": 1e-15, "maxiter": 1000})
  assert result.success, result.message
  return result.x


def test_w_star_and_d_star_match_a_reference_solver_on_the_sampled_clients():
  rng = np.random.default_rng(0)
  updates = jnp.asarray(0.3 + rng.normal(size=(8, 5)), jnp.float32)  # many conflicts
  sampled = jnp.array([True, True, False, True, True, True, False, True])
  config = confree.ConfreeConfig(c=0.4)
  direction, g0, w = confree.conflict_free_step(updates, config, sampled)
  live = np.asarray(updates)[np.asarray(sampled)]
  np.testing.assert_allclose(g0, confree.guidance_vector(jnp.asarray(live)), atol=1e-6)
  radius = 0.4 * np.linalg.norm(g0)
  reference = _reference_weights(live, g0, radius)
  np.testing.assert_array_equal(w[~sampled], 0.0)
  g_w, g_ref = w @ updates, reference @ live
  objective = lambda g: g @ np.asarray(g0, np.float64) + radius * np.linalg.norm(g)
  np.testing.assert_allclose(objective(np.asarray(g_w, np.float64)), objective(g_ref),
                             rtol=1e-5)
  expected = g0 + radius * g_ref / np.linalg.norm(g_ref)
  np.testing.assert_allclose(direction, expected, rtol=1e-4, atol=1e-5)
  # Eq. 4's d* sits on the ball's boundary.
  np.testing.assert_allclose(np.linalg.norm(direction - g0), radius, rtol=1e-5)
  rescaled, _, _ = confree.conflict_free_step(updates, config._replace(rescale=True), sampled)
  np.testing.assert_allclose(rescaled, direction / (1 + 0.4 ** 2), rtol=1e-5)


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


@pytest.mark.parametrize("order", ["sequential", "eq3"])
def test_clients_that_sat_the_round_out_do_not_enter_the_step(order):
  # Uploads [1,0], [0,1], [-5,-5]; client 3 unsampled (weight 0) must give the
  # two-client step. By hand: [1,0] and [0,1] do not conflict, so g0 = [.5,.5]; by
  # symmetry w* = [.5,.5], g_w = g0, and d* = g0 + c ||g0|| g0 / ||g0|| = (1 + c) g0.
  wrapped = _fedavg_with_confree(confree.ConfreeConfig(c=0.5, projection_order=order))
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


def _sat_out_body():
  """theta_g and three uploads of it whose ConFREE step is known (see the test above): with
  client 2 out of the round and c = 0.5, theta_g moves by [0.75, 0.75]; the weighted mean
  would move it by [0.375, 0.625]."""
  body = {"params": {"Dense_0": {"bias": jnp.zeros(2)}}}
  uploads = {"params": {"Dense_0": {"bias": jnp.array([[1.0, 0.0], [0.0, 1.0], [-5.0, -5.0]])}}}
  return body, uploads, jnp.array([3.0, 5.0, 0.0])


def _fedcp_case():
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  head = lambda *lead: {"params": {"Dense_1": {"kernel": normal(*lead, 2, 3),
                                               "bias": normal(*lead, 3)}}}
  policy = lambda *lead: {"kernel": normal(*lead, 2, 4), "bias": normal(*lead, 4)}
  body, body_uploads, weights = _sat_out_body()
  server = fedcp.FedCpServer(body=body, global_head=head(), policy=policy())
  clients = fedcp.FedCpClient(personal_head=head(3), global_head=head(3), policy=policy(3),
                              context=normal(3, 2))
  uploads = fedcp.FedCpServer(body=body_uploads, global_head=head(3), policy=policy(3))
  return server, clients, uploads, weights


def _fedpac_case():
  body, body_uploads, weights = _sat_out_body()
  server = fedpac.FedPacServer(body=body, protos=jnp.zeros((2, 1)),
                               has_proto=jnp.zeros(2, bool), combination=jnp.zeros((3, 3)))
  heads = {"params": {"Dense_1": {"bias": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])}}}
  uploads = fedpac.FedPacUpload(
      body=body_uploads, head=jax.tree.map(lambda a: 2.0 * a, heads),
      proto_sums=jnp.array([[[2.0], [0.0]], [[6.0], [9.0]], [[0.0], [0.0]]]),
      counts=jnp.array([[1.0, 0.0], [2.0, 3.0], [0.0, 0.0]]),
      variance=jnp.array([1.0, 1.0, 0.0]), bias=jnp.array([0.0, 1.0, 0.0]).reshape(3, 1, 1))
  return server, heads, uploads, weights


@pytest.mark.parametrize("name, case", [("fedcp", _fedcp_case), ("fedpac", _fedpac_case)])
def test_confree_moves_only_the_feature_extractor_of_fedcp_and_fedpac(name, case):
  # theta_g is the body (the authors' FedCP and FedPAC hosts); FedCP's global head and
  # policy, FedPAC's prototypes and head combination stay the host's own.
  server, clients, uploads, weights = case()
  trainer = tiny_trainer(tiny_model(), epochs=2)
  host = algorithms.get(name).factory(default_config(name), trainer)
  wrapped = algorithms.build(name, default_config(name), trainer,
                             aggregation=confree.ConfreeConfig(c=0.5))
  assert wrapped.name == f"{name}+confree"
  plain = host.aggregate(server, clients, uploads, weights)
  moved = wrapped.aggregate(server, clients, uploads, weights)
  np.testing.assert_allclose(moved.server.body["params"]["Dense_0"]["bias"], [0.75, 0.75],
                             atol=1e-5)
  np.testing.assert_allclose(plain.server.body["params"]["Dense_0"]["bias"], [0.375, 0.625],
                             atol=1e-6)
  chex.assert_trees_all_equal(moved.server._replace(body=()), plain.server._replace(body=()))
  chex.assert_trees_all_equal(moved.clients, plain.clients)


def _two_rounds(name, **plugins):
  data, _ = tiny_data([5, 6, 7, 9])  # one size bucket (test_registry covers two): one vmap
  model = tiny_model(hidden=(5,))
  trainer = tiny_trainer(model, batch_size=4, epochs=2, momentum=0.9)
  algorithm = algorithms.build(name, default_config(name), trainer, **plugins)
  state, metrics, _, traces = run_rounds(algorithm, trainer, data, model)
  assert traces == 1
  chex.assert_tree_all_finite((metrics, state))
  return algorithm, state


@pytest.mark.parametrize("name", algorithms.confree_hosts())
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
  with pytest.raises(ConfigError, match="confree: projection"):
    confree.validate(confree.ConfreeConfig(projection="other"))
  with pytest.raises(ConfigError, match="confree: projection_order"):
    confree.validate(confree.ConfreeConfig(projection_order="parallel"))
