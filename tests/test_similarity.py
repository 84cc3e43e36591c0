"""Client subspaces and principal-angle similarity against closed-form values."""

import json
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import similarity


def _orthonormal(key, k, d, p):
  return jnp.linalg.qr(jax.random.normal(key, (k, d, p)))[0]


def test_similarity_is_symmetric_and_bounded():
  subspaces = _orthonormal(jax.random.key(0), 6, 12, 2)
  w = similarity.principal_angle_similarity(subspaces)
  chex.assert_shape(w, (6, 6))
  np.testing.assert_allclose(w, w.T, atol=1e-6)
  assert np.all((np.asarray(w) >= 0) & (np.asarray(w) <= 2 + 1e-6))


@pytest.mark.parametrize("p", [1, 3])
def test_identical_subspaces_score_p_and_orthogonal_ones_zero(p):
  eye = jnp.eye(8)
  first, second = eye[:, :p], eye[:, p:2 * p]
  rotated = first @ jnp.linalg.qr(jax.random.normal(jax.random.key(1), (p, p)))[0]
  w = similarity.principal_angle_similarity(jnp.stack([first, rotated, second]))
  # Same span in another basis still scores p; disjoint coordinate axes score 0.
  np.testing.assert_allclose(w[0, 1], p, atol=1e-5)
  np.testing.assert_allclose(w[0, 0], p, atol=1e-5)
  np.testing.assert_allclose(w[0, 2], 0.0, atol=1e-6)


def test_two_lines_at_known_angle():
  angle = 0.3
  u = jnp.array([[1.0], [0.0], [0.0]])
  v = jnp.array([[np.cos(angle)], [np.sin(angle)], [0.0]])
  w = similarity.principal_angle_similarity(jnp.stack([u, v]))
  np.testing.assert_allclose(w[0, 1], np.cos(angle), atol=1e-6)


def test_principal_angles_of_planes_in_closed_form():
  # Plane span(e1, e2) against span(e1, cos(t) e2 + sin(t) e3): angles 0 and t.
  t = 0.7
  a = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
  b = jnp.array([[1.0, 0.0], [0.0, np.cos(t)], [0.0, np.sin(t)]])
  cosines = similarity.principal_angle_cosines(jnp.stack([a, b]))
  np.testing.assert_allclose(np.sort(cosines[0, 1]), np.sort([1.0, np.cos(t)]), atol=1e-6)
  np.testing.assert_allclose(similarity.principal_angle_similarity(jnp.stack([a, b]))[0, 1],
                             1.0 + np.cos(t), atol=1e-6)


def test_client_subspace_matches_numpy_and_ignores_padding():
  rng = np.random.default_rng(0)
  z = rng.normal(size=(20, 7)).astype(np.float32)
  u = similarity.client_subspace(jnp.asarray(z), p=2)
  chex.assert_shape(u, (7, 2))
  expected = np.linalg.svd(z, full_matrices=False)[2][:2].T
  # Singular vectors are defined up to sign.
  np.testing.assert_allclose(np.abs(np.sum(u * expected, axis=0)), 1.0, atol=1e-5)
  padded = np.concatenate([z, rng.normal(size=(5, 7)).astype(np.float32)])
  mask = np.arange(25) < 20
  u_padded = similarity.client_subspace(jnp.asarray(padded), 2, jnp.asarray(mask))
  np.testing.assert_allclose(np.abs(np.sum(u_padded * expected, axis=0)), 1.0, atol=1e-5)


def test_client_features_scale_pixels_and_append_onehot():
  x = jnp.array([[[0, 255], [51, 102]]], jnp.uint8)
  z = similarity.client_features(x, jnp.array([2]), num_classes=3)
  np.testing.assert_allclose(z, [[0.0, 1.0, 0.2, 0.4, 0.0, 0.0, 1.0]], atol=1e-6)


def test_cosine_similarity_of_hand_made_vectors():
  # Rows: e1, e1 + e2, -2 e2, and a zero vector (no direction: its row and column are 0).
  vectors = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, -2.0], [0.0, 0.0]])
  r = 1.0 / np.sqrt(2.0)
  expected = [[1.0, r, 0.0, 0.0],
              [r, 1.0, -r, 0.0],
              [0.0, -r, 1.0, 0.0],
              [0.0, 0.0, 0.0, 0.0]]
  np.testing.assert_allclose(similarity.cosine_similarity(vectors @ vectors.T), expected,
                             atol=1e-6)


def test_random_similarity_is_fedus_symmetric_thresholded_draw():
  key = jax.random.key(3)
  w = np.asarray(similarity.random_similarity(key, 6))
  # FedU's code: (B + B^T) / 2 with B ~ U(0, 1), entries below 0.25 zeroed; here w_kk = 1.
  b = np.asarray(jax.random.uniform(key, (6, 6)))
  expected = (b + b.T) / 2
  expected[expected < 0.25] = 0.0
  np.fill_diagonal(expected, 1.0)
  np.testing.assert_allclose(w, expected, atol=1e-7)
  np.testing.assert_array_equal(w, w.T)
  assert np.all((w == 0) | ((w >= 0.25) & (w <= 1)))
  # Deterministic per key, another key another graph.
  np.testing.assert_array_equal(w, similarity.random_similarity(jax.random.key(3), 6))
  assert not np.allclose(w, similarity.random_similarity(jax.random.key(4), 6))


def _matrix_with_spectrum(rng, n, d, singular_values):
  """n x d float32 with these leading singular values (the rest 0), random vectors."""
  r = len(singular_values)
  left = np.linalg.qr(rng.normal(size=(n, r)))[0]
  right = np.linalg.qr(rng.normal(size=(d, r)))[0]
  return ((left * singular_values) @ right.T).astype(np.float32)


@pytest.mark.parametrize("p", [1, 3])
def test_subspace_iteration_matches_the_full_svd(p):
  # Decaying spectrum with a small gap after the p-th value (1.2x): the iteration must
  # run several steps, and still land on the SVD's subspace and, sign-fixed, its vectors.
  spectrum = np.concatenate([[50.0, 40.0, 30.0][:p], 25.0 * 0.9 ** np.arange(37)])
  z = _matrix_with_spectrum(np.random.default_rng(p), 80, 60, spectrum)
  subspace = jax.jit(similarity.client_subspace, static_argnums=(1,),
                     static_argnames=("method",))
  iterated = subspace(z, p)  # p + 10 < min(80, 60): the iteration
  exact = subspace(z, p, method="svd")
  chex.assert_shape(iterated, (60, p))
  np.testing.assert_allclose(iterated @ iterated.T, exact @ exact.T, atol=1e-5)
  np.testing.assert_allclose(iterated, exact, atol=1e-5)
  np.testing.assert_allclose(iterated.T @ iterated, np.eye(p), atol=1e-5)
  # Principal angles to the SVD's subspace: all zero.
  cosines = similarity.principal_angle_cosines(iterated[None], exact[None])
  np.testing.assert_allclose(cosines, 1.0, atol=1e-5)


def test_subspace_signs_are_deterministic_and_padding_ignored():
  rng = np.random.default_rng(1)
  z = rng.uniform(size=(40, 30)).astype(np.float32)
  subspace = jax.jit(similarity.client_subspace, static_argnums=(1,))
  u = subspace(z, 2)
  largest = np.take_along_axis(np.asarray(u), np.argmax(np.abs(u), axis=0)[None], axis=0)
  assert np.all(largest > 0)
  padded = np.concatenate([z, rng.normal(size=(9, 30)).astype(np.float32)])
  u_padded = subspace(padded, 2, np.arange(49) < 40)
  np.testing.assert_allclose(u_padded, u, atol=1e-5)
  expected = np.linalg.svd(z.astype(np.float64), full_matrices=False)[2][:2].T
  np.testing.assert_allclose(u @ u.T, expected @ expected.T, atol=1e-5)


def test_similarity_of_real_mnist_clients_matches_the_svd_path():
  # Rotated MNIST, 12 clients of 128 training images: the similarity the propagation
  # graph is built from must not depend on how the subspaces were computed.
  from fedora_jax.algorithms import fedora  # pylint: disable=import-outside-toplevel
  from fedora_jax.data import datasets  # pylint: disable=import-outside-toplevel
  data = datasets.build_federated_dataset("rmnist", None, 12, "balanced", 0).data
  subspaces = jax.jit(lambda b, method: fedora.client_subspaces(
      data._replace(buckets=b), 2, method), static_argnums=1)
  iterated, exact = subspaces(data.buckets, "iteration"), subspaces(data.buckets, "svd")
  np.testing.assert_allclose(iterated @ iterated.transpose(0, 2, 1),
                             exact @ exact.transpose(0, 2, 1), atol=1e-4)
  for p in (1, 2):
    np.testing.assert_allclose(similarity.principal_angle_similarity(iterated[..., :p]),
                               similarity.principal_angle_similarity(exact[..., :p]),
                               atol=1e-4)


_TWO_DEVICES = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path[:0] = [{root!r}, {tests!r}]
    from fedora_jax.algorithms import fedora
    from fedora_jax.engine import sharding
    import tiny

    assert jax.device_count() == 2, jax.devices()
    data, _ = tiny.tiny_data([128] * 4, num_features=784, num_classes=10)
    results = []
    for count in (1, 2):
      mesh = sharding.client_mesh(jax.devices()[:count])
      buckets = sharding.place_buckets(data.buckets, mesh)
      with jax.set_mesh(mesh):
        subspaces = jax.jit(lambda b: fedora.client_subspaces(data._replace(buckets=b), 2),
                            out_shardings=sharding.replicated(mesh))
        results.append(np.asarray(subspaces(buckets)))
    print(json.dumps({{"max_diff": float(np.max(np.abs(results[0] - results[1])))}}))
""")


@pytest.mark.slow
def test_client_subspaces_on_two_cpu_devices():
  # Vmapped, jaxlib's batched LAPACK kernels deadlocked here (both devices' thread-pool
  # workers waiting in ParallelBatchMap): the init hung before the first round.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  script = _TWO_DEVICES.format(root=root, tests=os.path.join(root, "tests"))
  proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1])["max_diff"] < 1e-5
