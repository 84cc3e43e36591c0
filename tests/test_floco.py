"""Floco: the simplex projection and the Riesz energy by hand, the PCA against
scikit-learn's, the clients' points against a numpy loop over the codes' grid of z, the
sampling's ranges, the server's projection round, and bad values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import floco
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model, tiny_trainer


def test_simplex_projection_by_hand():
  out = floco.project_simplex(jnp.array([[0.5, 0.2, -0.1], [2.0, 0.0, 0.0]]), 1.0)
  # Row 0: every coordinate stays, theta = (0.6 - 1) / 3; row 1: only the first, theta 1.
  np.testing.assert_allclose(out, [[0.5 + 0.4 / 3, 0.2 + 0.4 / 3, -0.1 + 0.4 / 3],
                                   [1.0, 0.0, 0.0]], rtol=1e-6, atol=1e-7)


def test_riesz_energy_by_hand():
  points = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  # Pairs (0, 1) and (1, 2) at sqrt(2): 1/2 each; (0, 2) at 0, clamped to 1e-4: 1e8.
  np.testing.assert_allclose(floco.log_riesz_energy(points), np.log((1e8 + 1.0) / 3),
                             rtol=1e-6)


@pytest.mark.parametrize("rows,components", [(5, 3), (3, 4)])
def test_pca_scores_against_scikit_learn(rows, components):
  decomposition = pytest.importorskip(
      "sklearn.decomposition", reason="needs scikit-learn, in the verify extra: pip install -e '.[verify]'")
  x = np.random.default_rng(0).normal(size=(rows, 7))
  ours = np.asarray(floco.pca_scores(jnp.asarray(x, jnp.float32), components))
  usable = min(components, rows - 1)     # the centred rows' rank
  theirs = decomposition.PCA(n_components=usable).fit_transform(x)
  np.testing.assert_allclose(ours[:, :usable], theirs, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ours[:, usable:], 0.0, atol=1e-3)


def numpy_centers(kappas):
  """The codes' selection, written as a loop: the z of lowest finite log energy."""
  best, best_betas = np.inf, None
  for z in np.linspace(1e-4, 1, 1000):
    betas = []
    for v in kappas:
      u = np.sort(v)[::-1]
      cssv = np.cumsum(u) - z
      count = np.sum(u - cssv / np.arange(1, len(v) + 1) > 0)
      betas.append(np.maximum(v - cssv[count - 1] / count, 0))
    betas = np.array(betas)
    betas /= betas.sum(axis=1, keepdims=True)
    d = np.sqrt(((betas[:, None] - betas[None]) ** 2).sum(-1))[np.triu_indices(len(betas), 1)]
    energy = np.log(np.sum(1 / np.maximum(d, 1e-4) ** 2)) - np.log(len(d))
    if np.isfinite(energy) and energy < best:
      best, best_betas = energy, betas
  return best_betas


def test_client_points_against_numpy():
  signals = np.random.default_rng(1).normal(size=(6, 12)).astype(np.float32)
  kappas = np.asarray(floco.pca_scores(jnp.asarray(signals), 3), np.float64)
  centers = floco.simplex_centers(jnp.asarray(signals), 3)
  np.testing.assert_allclose(centers, numpy_centers(kappas), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.sum(centers, axis=1), 1.0, rtol=1e-6)


def test_sampled_points_stay_in_their_regions():
  keys = jax.random.split(jax.random.key(0), 200)
  uniform = jax.vmap(lambda k: floco.uniform_simplex(k, 4))(keys)
  assert (uniform >= 0).all() and np.allclose(uniform.sum(axis=1), 1.0, rtol=1e-6)
  center = jnp.array([0.7, 0.1, 0.1, 0.1])
  ball = jax.vmap(lambda k: floco.l1_ball(k, center, 0.3))(keys)
  radii = np.abs(np.asarray(ball) - np.asarray(center)).sum(axis=1)
  assert radii.max() <= 0.3 + 1e-6 and radii.max() > 0.2   # it reaches across the ball


@pytest.mark.parametrize("round_,projects", [(0, True), (1, False)])
def test_the_server_places_the_clients_in_round_tau(round_, projects):
  model = tiny_model()
  params = init_params(model)
  algorithm = floco.floco(floco.FlocoConfig(endpoints=2, tau=1.0, rounds=1),
                          tiny_trainer(model))
  endpoints = jnp.stack([jnp.ones((5, 3)), 3 * jnp.ones((5, 3))])
  server = floco.FlocoServer(floco.FlocoModel(params, endpoints), jnp.int32(round_))
  signals = jnp.asarray(np.random.default_rng(2).normal(size=(4, 30)), jnp.float32)
  clients = floco.FlocoClient(signals, jnp.full((4, 2), 0.5))
  uploads = jax.tree.map(lambda a: jnp.stack([a] * 4), server.model)
  new = algorithm.aggregate(server, clients, uploads, jnp.ones(4))
  expected = floco.simplex_centers(signals, 2) if projects else clients.center
  np.testing.assert_allclose(new.clients.center, expected, rtol=1e-6)
  assert int(new.server.round) == round_ + 1
  # A client's classifier is its point's mixture of the kernels: 1 b_1 + 3 b_2.
  kernels = algorithm.personalized_params(new.server, new.clients)["params"]["Dense_1"]
  np.testing.assert_allclose(kernels["kernel"][:, 0, 0],
                             new.clients.center @ np.array([1.0, 3.0]), rtol=1e-5)


@pytest.mark.parametrize("field,value", [("endpoints", 0), ("rho", -0.1), ("tau", 0.0),
                                         ("tau", 200.0), ("signal", "grad")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"floco: {field}"):
    floco.floco(floco.FlocoConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
