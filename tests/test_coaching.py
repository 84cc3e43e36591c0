"""Knowledge-aware parameter coaching: the relation cube's gradient step (Eq. 11) and the
coaching models (Eq. 14) against hand-computed values, the objective's gradient against
finite differences, the initial cube, the simplex_others deviation, and the client's
regularised step (Eq. 16)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import coaching
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from fedora_jax.plots import relation_figure
from fedora_jax.rounds import sampled_clients
from tiny import init_params, mean_ce, run_rounds, tiny_data, tiny_model, tiny_trainer

K = 4

# Two clients, two layers. Layer 0: w_0 = (1, 0), w_1 = (0, 2); layer 1: w_0 = 3, w_1 = -1.
TWO_CLIENTS = {"params": {"Dense_0": {"kernel": jnp.array([[1.0, 0.0], [0.0, 2.0]])},
                          "Dense_1": {"bias": jnp.array([[3.0], [-1.0]])}}}
# relation[i, l] = client i's weights (on client 0, on client 1) at layer l.
RELATION = jnp.array([[[0.75, 0.25], [0.5, 1.0]],
                      [[0.5, 0.5], [0.25, 0.5]]])


def test_coaching_models_combine_every_client_layer_by_layer():
  coach = coaching.coaching_models(RELATION, TWO_CLIENTS)
  # s_0^0 = 0.75 (1, 0) + 0.25 (0, 2); s_1^0 = 0.5 (1, 0) + 0.5 (0, 2); client i's own
  # model counts (Eq. 14 sums over all j).
  np.testing.assert_allclose(coach["params"]["Dense_0"]["kernel"], [[0.75, 0.5], [0.5, 1.0]])
  # s_0^1 = 0.5 * 3 + 1.0 * -1; s_1^1 = 0.25 * 3 + 0.5 * -1.
  np.testing.assert_allclose(coach["params"]["Dense_1"]["bias"], [[0.5], [0.25]])


def test_relation_step_is_the_plain_gradient_step_of_eq_11():
  config = coaching.CoachingConfig(lam=1.0, beta=2.0, lr_r=0.1, r_steps=1, lr_r_rule="fixed")
  grams = coaching.layer_grams(TWO_CLIENTS)
  np.testing.assert_allclose(grams, [[[1, 0], [0, 4]], [[9, -3], [-3, 1]]])
  # r_ij^l <- r_ij^l - 0.1 (2 lam <s_i^l - w_i^l, w_j^l> + beta (r_ij^l - 1/2)):
  # client 0, layer 0: s - w_0 = (-0.25, 0.5); gradient (-0.5 + 0.5, 2 - 0.5) = (0, 1.5).
  # client 1, layer 0: s - w_1 = (0.5, -1); gradient (1 + 0, -4 + 0).
  # client 0, layer 1: s - w_0 = -2.5; gradient (-15 + 0, 5 + 1).
  # client 1, layer 1: s - w_1 = 1.25; gradient (7.5 - 0.5, -2.5 + 0).
  expected = [[[0.75, 0.10], [2.0, 0.4]],
              [[0.4, 0.9], [-0.45, 0.75]]]
  np.testing.assert_allclose(coaching.relation_step(RELATION, grams, config), expected,
                             atol=1e-6)
  # E_r steps are E_r such steps; the row sums and signs are left free (no projection).
  np.testing.assert_allclose(coaching.update_relation(RELATION, grams, config), expected,
                             atol=1e-6)
  twice = coaching.relation_step(jnp.array(expected), grams, config)
  np.testing.assert_allclose(
      coaching.update_relation(RELATION, grams, config._replace(r_steps=2)), twice, atol=1e-5)


def test_norm_coaching_loss_steps_by_the_unit_residual():
  # f_s = ||s - w|| (fs="norm"): grad_{r_ij^l} = <s_i^l - w_i^l, w_j^l> / ||s_i^l - w_i^l||.
  config = coaching.CoachingConfig(lam=1.0, beta=2.0, lr_r=0.1, lr_r_rule="fixed", fs="norm")
  grams = coaching.layer_grams(TWO_CLIENTS)
  # client 0, layer 0: s - w_0 = (-0.25, 0.5), norm sqrt(0.3125); (<., w_0>, <., w_1>) =
  #   (-0.25, 1) over it, plus beta (r - 1/2) = (0.5, -0.5).
  # client 1, layer 0: s - w_1 = (0.5, -1), norm sqrt(1.25); (0.5, -2) over it, beta term 0.
  # client 0, layer 1: s - w_0 = -2.5, norm 2.5; (-7.5, 2.5) / 2.5 + (0, 1) = (-3, 2).
  # client 1, layer 1: s - w_1 = 1.25, norm 1.25; (3.75, -1.25) / 1.25 + (-0.5, 0) = (2.5, -1).
  root_a, root_b = np.sqrt(0.3125), np.sqrt(1.25)
  expected = [[[0.75 - 0.1 * (-0.25 / root_a + 0.5), 0.25 - 0.1 * (1 / root_a - 0.5)],
               [0.5 + 0.3, 1.0 - 0.2]],
              [[0.5 - 0.1 * 0.5 / root_b, 0.5 + 0.1 * 2 / root_b],
               [0.25 - 0.25, 0.5 + 0.1]]]
  np.testing.assert_allclose(coaching.relation_step(RELATION, grams, config), expected,
                             atol=1e-5)


def test_exact_deviation_sets_r_to_the_minimiser_of_eq_10():
  config = coaching.CoachingConfig(lam=1.0, beta=2.0, lr_r_rule="exact")
  grams = coaching.layer_grams(TWO_CLIENTS)
  # mu = beta / (2 lam) = 1, r_i = 1/2 + (G + I)^-1 G (e_i - 1/2).
  # Layer 0, G = diag(1, 4): (G + I)^-1 G = diag(1/2, 4/5).
  # Layer 1, G = [[9, -3], [-3, 1]] = 10 v v^T, v = (3, -1) / sqrt(10): (10 / 11) v v^T
  #   = [[9, -3], [-3, 1]] / 11; on e_0 - 1/2 = (1/2, -1/2): (6, -2) / 11.
  expected = [[[0.75, 0.1], [0.5 + 6 / 11, 0.5 - 2 / 11]],
              [[0.25, 0.9], [0.5 - 6 / 11, 0.5 + 2 / 11]]]
  exact = coaching.update_relation(RELATION, grams, config)
  np.testing.assert_allclose(exact, expected, atol=1e-6)
  # It is where Eq. 11's gradient vanishes, whatever R was before.
  np.testing.assert_allclose(coaching.relation_gradient(exact, grams, 1.0, 2.0), 0.0,
                             atol=1e-5)


def test_lipschitz_deviation_steps_each_layer_by_one_over_its_smoothness():
  config = coaching.CoachingConfig(lam=1.0, beta=2.0, lr_r_rule="lipschitz")
  grams = coaching.layer_grams(TWO_CLIENTS)
  # lambda_max(G_0 = diag(1, 4)) = 4 -> L = 2 + 2 * 4 = 10; G_1 has eigenvalues 0 and 10
  # -> L = 2 + 2 * 10 = 22.
  np.testing.assert_allclose(coaching.step_sizes(grams, config), [[0.1], [1 / 22]], rtol=1e-6)
  stepped = coaching.relation_step(RELATION, grams, config)
  # Layer 0 takes the 0.1 step of the test above; layer 1 the gradients there over 22.
  np.testing.assert_allclose(stepped[:, 0], [[0.75, 0.10], [0.4, 0.9]], atol=1e-6)
  np.testing.assert_allclose(stepped[:, 1], [[0.5 + 15 / 22, 1.0 - 6 / 22],
                                             [0.25 - 7 / 22, 0.5 + 2.5 / 22]], atol=1e-6)


def test_fixed_step_diverges_on_large_layers_where_the_lipschitz_step_descends():
  # Ten similar clients (trained from one initial model) with one layer of squared norm
  # 50 each, a realistic layer's: the objective's curvature along the all-ones direction
  # is about 2 * 10 * 50 = 1000, past 2 / 0.01, so the paper's stated eta_r = 0.01
  # amplifies any error there ~9x per step.
  rng = np.random.default_rng(0)
  layer = rng.normal(size=(1, 500)) + 0.1 * rng.normal(size=(10, 500))
  layer *= np.sqrt(50.0 / np.mean(np.sum(layer ** 2, axis=1)))
  grams = coaching.layer_grams({"params": {"Dense_0": {"kernel": jnp.asarray(layer)}}})
  start = coaching.initial_relation(jax.random.key(0), 10, 1, coaching.CoachingConfig())
  objective = lambda r, c: float(coaching.relation_objective(r, grams, c.lam, c.beta))
  fixed = coaching.CoachingConfig(r_steps=5, lr_r_rule="fixed")
  lipschitz = fixed._replace(lr_r_rule="lipschitz")
  assert objective(coaching.update_relation(start, grams, fixed), fixed) > 100 * objective(
      start, fixed)
  values = [objective(start, lipschitz)]
  for steps in range(1, 6):
    values.append(objective(coaching.update_relation(start, grams,
                                                     lipschitz._replace(r_steps=steps)),
                            lipschitz))
  assert all(b < a for a, b in zip(values, values[1:]))


def _stacked(model):
  return jax.vmap(lambda s: init_params(model, seed=s))(jnp.arange(K))


def _direct_objective(relation, stacked, lam, beta, fs="squared"):
  """sum_i of Eq. (10) straight from the parameters:
  lam sum f_s(w_i^l, sum_j r_ij^l w_j^l) + beta/2 ||R - 1/N||^2, f_s the squared
  distance or the distance of each layer (all its leaves)."""
  total = 0.0
  for l, name in enumerate(sorted(stacked["params"])):
    squares = sum(jnp.sum(jnp.square(flat - relation[:, l, :] @ flat), axis=1)
                  for flat in (leaf.reshape(K, -1)
                               for leaf in jax.tree.leaves(stacked["params"][name])))
    total += jnp.sum(squares if fs == "squared" else jnp.sqrt(squares))
  return lam * total + beta / 2 * jnp.sum(jnp.square(relation - 1.0 / K))


@pytest.mark.parametrize("fs", ["squared", "norm"])
def test_relation_gradient_matches_finite_differences(fs):
  with jax.enable_x64(True):
    model = tiny_model(hidden=(5,))
    stacked = jax.tree.map(lambda a: a.astype(jnp.float64), _stacked(model))
    relation = jax.random.normal(jax.random.key(0), (K, 2, K), jnp.float64)
    lam, beta = 0.7, 0.3
    grams = coaching.layer_grams(stacked)
    # The norm's guard (NORM_GUARD ||w_i^l||^2 under the root) moves it by < 1e-6.
    np.testing.assert_allclose(coaching.relation_objective(relation, grams, lam, beta, fs),
                               _direct_objective(relation, stacked, lam, beta, fs),
                               rtol=1e-10 if fs == "squared" else 1e-6)
    gradient = coaching.relation_gradient(relation, grams, lam, beta, fs)
    eps = 1e-5
    bumps = eps * jnp.eye(relation.size, dtype=jnp.float64).reshape((-1,) + relation.shape)
    objective = jax.jit(jax.vmap(lambda r: _direct_objective(r, stacked, lam, beta, fs)))
    numeric = ((objective(relation + bumps) - objective(relation - bumps)) / (2 * eps)
               ).reshape(relation.shape)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-6 if fs == "squared" else 1e-5,
                               atol=1e-8 if fs == "squared" else 1e-6)


def test_initial_relation_is_random_rows_on_the_simplex():
  config = coaching.CoachingConfig()
  relation = coaching.initial_relation(jax.random.key(0), K, 3, config)
  assert relation.shape == (K, 3, K)
  np.testing.assert_allclose(jnp.sum(relation, axis=-1), 1.0, atol=1e-6)
  assert bool(jnp.all(relation >= 0)) and bool(jnp.all(jnp.diagonal(relation[:, 0]) > 0))
  assert len(np.unique(np.round(np.asarray(relation), 6))) == relation.size  # all distinct
  uniform = coaching.initial_relation(jax.random.key(0), K, 3, config._replace(r_init="uniform"))
  np.testing.assert_allclose(uniform, 1.0 / K)
  others = coaching.initial_relation(jax.random.key(0), K, 3,
                                     config._replace(r_constraint="simplex_others"))
  np.testing.assert_allclose(jnp.sum(others, axis=-1), 1.0, atol=1e-6)
  assert bool(jnp.all(jnp.where(coaching.others_mask(K), 0.0, others) == 0))


def test_round_one_starts_after_the_relation_steps_at_the_initial_model():
  # Algorithm 1 updates R (lines 5-8) before sending s_i (line 9). All clients start from
  # one model w, so G_l = ||w^l||^2 (ones) and, rows summing to 1, s_i = w: the coaching
  # term's gradient vanishes and one step leaves R0 - lr beta (R0 - 1/N).
  model = tiny_model(hidden=(5,))
  data, _ = tiny_data([6] * K)
  trainer = tiny_trainer(model)
  config = coaching.CoachingConfig(beta=3.0, lr_r=0.1, lr_r_rule="fixed")
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (K,) + a.shape), init_params(model))
  key = jax.random.key(5)
  state = coaching.coaching(config, trainer).init(
      InitContext(params=stacked, data=data, trainer=trainer, key=key))
  start = coaching.initial_relation(key, K, 2, config)
  np.testing.assert_allclose(state.server.relation, start - 0.1 * 3.0 * (start - 1.0 / K),
                             atol=1e-5)


def test_simplex_others_deviation_projects_each_row_onto_the_other_clients():
  allowed = coaching.others_mask(3)[:, 0, :]
  values = jnp.array([[5.0, 0.2, 0.4], [0.5, 9.0, 0.5], [3.0, -1.0, 0.0]])
  projected = coaching.project_to_simplex(values, allowed)
  # Row 0 ignores its own 5.0: (0.2, 0.4) shifted by tau = -0.2 -> (0.4, 0.6); row 2
  # projects (3, -1) (its own 0.0 ignored) to (1, 0).
  np.testing.assert_allclose(projected, [[0.0, 0.4, 0.6], [0.5, 0.0, 0.5], [1.0, 0.0, 0.0]],
                             atol=1e-6)
  # A constant added to a row does not move its projection: so beta/2 ||r - 1/N||^2 and
  # beta/2 ||r||^2 (gradients differing by beta/N) give the same projected steps.
  np.testing.assert_allclose(coaching.project_to_simplex(values + 0.7, allowed), projected,
                             atol=1e-6)

  model = tiny_model(hidden=(5,))
  grams = coaching.layer_grams(_stacked(model))
  config = coaching.CoachingConfig(lr_r=0.05, r_steps=20, r_constraint="simplex_others",
                                   lr_r_rule="fixed")
  start = coaching.initial_relation(jax.random.key(0), K, 2, config)
  updated = coaching.update_relation(start, grams, config)
  assert (coaching.relation_objective(updated, grams, config.lam, config.beta)
          < coaching.relation_objective(start, grams, config.lam, config.beta))
  np.testing.assert_allclose(jnp.sum(updated, axis=-1), 1.0, atol=1e-5)
  assert bool(jnp.all(updated >= 0))
  assert bool(jnp.all(jnp.where(coaching.others_mask(K), 0.0, updated) == 0))
  assert relation_figure(np.asarray(updated), client=1).axes


def test_bad_settings_are_config_errors():
  trainer = tiny_trainer(tiny_model())
  for bad in ({"r_init": "zeros"}, {"r_constraint": "simplex"}, {"r_steps": -1},
              {"beta": -1.0}, {"lr_r_rule": "adaptive"}, {"fs": "l1"},
              {"fs": "norm"},  # the norm has no Lipschitz step, the default rule
              {"lr_r_rule": "exact", "r_constraint": "simplex_others"},
              {"lr_r_rule": "exact", "beta": 0.0}):
    with pytest.raises(ConfigError, match="coaching: "):
      coaching.coaching(coaching.CoachingConfig()._replace(**bad), trainer)


def test_client_trains_towards_its_layerwise_coaching_model():
  model = tiny_model(hidden=(5,))
  stacked = _stacked(model)
  relation = jax.random.dirichlet(jax.random.key(1), jnp.ones(K), (K, 2))
  coach = coaching.coaching_models(relation, stacked)
  np.testing.assert_allclose(coach["params"]["Dense_1"]["kernel"][2],
                             jnp.tensordot(relation[2, 1], stacked["params"]["Dense_1"]["kernel"],
                                           axes=1), atol=1e-6)
  data, clients = tiny_data([6] * K)
  lr, lam = 0.1, 0.3
  algorithm = coaching.coaching(coaching.CoachingConfig(lam=lam),
                                tiny_trainer(model, lr=lr, batch_size=8))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  own, coach_0 = (tree.first(t) for t in (stacked, coach))
  out = algorithm.client_update(own, coach_0, splits, jax.random.key(0))
  grad = jax.grad(lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(own)
  # Eq. (16): w - lr (grad f_i + lam grad ||w - s||^2).
  expected = jax.tree.map(lambda w, g, s: w - lr * (g + 2 * lam * (w - s)), own, grad, coach_0)
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)


def test_norm_coaching_loss_pulls_each_layer_by_a_unit_vector():
  model = tiny_model(hidden=(5,))
  stacked = _stacked(model)
  relation = jax.random.dirichlet(jax.random.key(1), jnp.ones(K), (K, 2))
  coach = coaching.coaching_models(relation, stacked)
  data, clients = tiny_data([6] * K)
  lr, lam = 0.1, 0.3
  config = coaching.CoachingConfig(lam=lam, fs="norm", lr_r_rule="fixed")
  algorithm = coaching.coaching(config, tiny_trainer(model, lr=lr, batch_size=8))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  own, coach_0 = (tree.first(t) for t in (stacked, coach))
  out = algorithm.client_update(own, coach_0, splits, jax.random.key(0))
  grad = jax.grad(lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(own)
  # Eq. (16) with f_s = sum_l ||w^l - s^l||: w^l - lr (grad f_i + lam (w^l - s^l) / ||.||).
  expected = {"params": {}}
  for name, layer in own["params"].items():
    norm = np.sqrt(float(tree.squared_distance(layer, coach_0["params"][name])))
    expected["params"][name] = jax.tree.map(
        lambda w, g, s, norm=norm: w - lr * (g + lam * (w - s) / norm), layer, grad["params"][name],
        coach_0["params"][name])
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)


# Client selection, checked by hand: numpy from the paper's equations, nothing from the
# module but the random initial cube (Algorithm 1, line 2, gives no distribution) and
# the engine's draw of the round's clients.

def _np_forward(params, x):
  """The tiny MLP, Dense_0 -> ReLU -> Dense_1, in float64; returns (hidden, logits)."""
  hidden = np.maximum(x @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"], 0.0)
  return hidden, hidden @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]


def _np_cross_entropy_gradient(params, x, y):
  """grad f_i (Eq. 1): the mean cross-entropy's gradient, backpropagated by hand."""
  hidden, logits = _np_forward(params, x)
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  d_logits = (probs - np.eye(logits.shape[1])[y]) / len(y)
  d_hidden = (d_logits @ params["Dense_1"]["kernel"].T) * (hidden > 0)
  return {"Dense_0": {"kernel": x.T @ d_hidden, "bias": d_hidden.sum(0)},
          "Dense_1": {"kernel": hidden.T @ d_logits, "bias": d_logits.sum(0)}}


def _np_layer_vectors(models, name):
  """[K, d_l]: each client's layer l (kernel and bias) as one vector."""
  return np.stack([np.concatenate([m[name]["kernel"].ravel(), m[name]["bias"]])
                   for m in models])


def _np_relation_step(relation, models, lam, beta):
  """Eq. (11) on every row r_i^l, with eta_r = 1 / L_r, L_r = beta + 2 lam
  lambda_max(G_l) (Theorem 1): grad = 2 lam (<s_i^l, w_j^l> - <w_i^l, w_j^l>) + beta (r - 1/N)."""
  num = len(models)
  new = relation.copy()
  for l, name in enumerate(("Dense_0", "Dense_1")):
    vectors = _np_layer_vectors(models, name)
    gram = vectors @ vectors.T
    grad = 2 * lam * (relation[:, l, :] @ gram - gram) + beta * (relation[:, l, :] - 1 / num)
    new[:, l, :] = relation[:, l, :] - grad / (beta + 2 * lam * np.linalg.eigvalsh(gram)[-1])
  return new


def _np_coaching_model(relation, models, i):
  """Eq. (14): s_i^l = sum_j r_ij^l w_j^l."""
  return {name: {leaf: sum(relation[i, l, j] * models[j][name][leaf]
                           for j in range(len(models)))
                 for leaf in ("kernel", "bias")}
          for l, name in enumerate(("Dense_0", "Dense_1"))}


def test_a_round_under_client_selection_matches_the_paper_by_hand():
  # Four clients, two sampled a round (participation 0.5), two rounds, one full-batch SGD
  # step per round. What Algorithm 1 does, read for client selection:
  #   * R steps (lines 5-8, Eq. 11) at the models the server holds, W^k: the sampled
  #     clients' latest and the others' last uploaded (here: the initial model);
  #   * each sampled client gets s_i = r_i W^k (Eq. 14) and trains ITS OWN w_i from where
  #     it stopped (Eq. 16); the others neither train nor change;
  #   * every client is scored with its own w_i (line 14), the unsampled ones too.
  num, lam, beta, lr = 4, 0.5, 0.2, 0.1
  model = tiny_model(hidden=(3,))
  data, clients = tiny_data([6] * num, seed=3)
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # 6 samples: one full-batch step
  config = coaching.CoachingConfig(lam=lam, beta=beta)
  algorithm = coaching.coaching(config, trainer)
  state, metrics, stacked, _ = run_rounds(algorithm, trainer, data, model, rounds=2,
                                          participation=0.5)

  initial = jax.tree.map(lambda a: np.asarray(a[0], np.float64), stacked["params"])
  models = [jax.tree.map(np.copy, initial) for _ in range(num)]
  relation = np.asarray(coaching.initial_relation(jax.random.key(0), num, 2, config),
                        np.float64)
  # Round 1's R step at the initial models (all equal, rows summing to 1: s_i = w, so
  # only beta's pull towards 1/N moves R).
  relation = _np_relation_step(relation, models, lam, beta)
  for round_index in range(2):
    sampled = np.flatnonzero(sampled_clients(jax.random.fold_in(jax.random.key(1),
                                                                round_index), num, 2))
    assert len(sampled) == 2
    coaches = {i: _np_coaching_model(relation, models, i) for i in sampled}
    trained = list(models)
    for i in sampled:
      grad = _np_cross_entropy_gradient(models[i], clients[i].x_train.astype(np.float64),
                                        clients[i].y_train)
      trained[i] = jax.tree.map(lambda w, g, s: w - lr * (g + 2 * lam * (w - s)),
                                models[i], grad, coaches[i])  # Eq. (16)
    models = trained
    # The next round's R step, at W^{k+1} (stale rows and models included).
    relation = _np_relation_step(relation, models, lam, beta)

  for i in range(num):
    chex.assert_trees_all_close(
        jax.tree.map(lambda a, i=i: a[i], state.algorithm.clients["params"]), models[i],
        atol=1e-5)
  np.testing.assert_allclose(state.algorithm.server.relation, relation, atol=1e-5)
  # Round 2: the sampled clients took one step, the others none and report no loss.
  np.testing.assert_array_equal(metrics.local_steps, np.isin(np.arange(num), sampled))
  assert np.isnan(np.asarray(metrics.train_loss)[~np.isin(np.arange(num), sampled)]).all()
  # Every client is scored with its own model on its own test data.
  expected_accuracy = [np.mean(np.argmax(_np_forward(models[i], clients[i].x_test)[1], 1)
                               == clients[i].y_test) for i in range(num)]
  np.testing.assert_allclose(metrics.test_score, expected_accuracy, atol=1e-6)
