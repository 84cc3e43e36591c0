"""Client subspaces and principal-angle similarity (FEDORA, section 4.1).

Wu, Bao, Ainsworth, He. "Personalized Federated Learning with Parameter Propagation."
KDD 2023. https://doi.org/10.1145/3580305.3599464

Each client k summarises its data `Z_k = [X_k, onehot(Y_k)]` (n_k x D) by `U_k`, its top-p
right singular vectors (D x p); the server never sees `Z_k`. Two clients are similar when
their subspaces are close: `w_kk' = sum_i cos(zeta_i)`, where the cosines of the principal
angles zeta_i between span(U_k) and span(U_k') are the singular values of `U_k^T U_k'`
(Golub & Van Loan, Matrix Computations, 6.4.3).

Table 4 (section 5.3.2) replaces this measure by three others, each named after the work
it comes from; the paper gives no formula for them, so each is read from that work:
  - random similarity, FedU [7] (Dinh et al., TNNLS 2022; github.com/CharlieDinh/FedU_FMTL,
    serverFedU.py): B ~ U(0, 1)^{K x K}, w = (B + B^T) / 2 with entries below 0.25 set
    to 0, drawn once. FedU never uses w_kk; here w_kk = 1, the largest value, as every
    other measure gives a client its full similarity to itself (`random_similarity`);
  - parameter similarity, FedAMP [13] (Huang et al., AAAI 2021, the HeurFedAMP attention):
    the cosine of two clients' model parameters, all layers flattened into one vector;
  - gradient similarity, clustered FL [31] (Sattler et al., TNNLS 2020): the cosine of
    two clients' weight updates dtheta_k = theta_k(after local training) - theta_k(before),
    which that paper computes in place of the gradients of the clients' risks.
Both cosines come from the Gram matrix of the stacked vectors (`cosine_similarity`); they
lie in [-1, 1], unlike the principal-angle sum in [0, p] (see FEDORA's graph for how a
negative one enters W).

U_k is found by randomized subspace iteration (Halko, Martinsson & Tropp, "Finding
structure with randomness", SIAM Review 2011, Algorithms 4.4 and 5.1): a block of
l = p + 10 vectors is multiplied by Z and Z^T, and rotated onto its Ritz vectors by the
SVD of the small [l, D] block, until a residual bound on their angle to the true
subspace is below 1e-5 (`subspace_iteration`). Each
step costs two [n, D] x [D, l] products, where the full SVD costs O(n D min(n, D)) and
the [D, D] Gram matrix Z^T Z with `eigh` O(n D^2 + D^3); the iteration is the fastest of
the three on MNIST and CIFAR-10 clients (docs/measurements/2026-11-26-benchmark-method.md).
The Gram route also squares Z's condition number
in float32; the iteration never forms Z^T Z.
"""

import functools

import jax
import jax.numpy as jnp

from fedora_jax import linalg
from fedora_jax.errors import ConfigError


def client_features(x: jax.Array, y: jax.Array, num_classes: int) -> jax.Array:
  """`Z = [X, onehot(Y)]`: flattened inputs (uint8 pixels scaled to [0, 1]) and labels.

  Real-valued (regression) targets enter as one column, `Z = [X, y]`.
  """
  x = x.reshape((x.shape[0], -1))
  x = x.astype(jnp.float32) / 255.0 if x.dtype == jnp.uint8 else x.astype(jnp.float32)
  if jnp.issubdtype(y.dtype, jnp.floating):
    return jnp.concatenate([x, y.astype(jnp.float32)[:, None]], axis=1)
  return jnp.concatenate([x, jax.nn.one_hot(y, num_classes, dtype=jnp.float32)], axis=1)


SUBSPACE_METHODS = ("iteration", "svd")


def client_subspace(z: jax.Array, p: int, mask: jax.Array | None = None,
                    method: str = "iteration", oversample: int = 10,
                    tol: float = 1e-5, max_iters: int = 50) -> jax.Array:
  """Top-p right singular vectors of one client's n x D matrix `z`, as a D x p matrix.

  Rows where `mask` is False (padding) are zeroed first; zero rows leave the right
  singular vectors of the non-zero singular values unchanged. `method`: "iteration"
  (randomized subspace iteration, see the module docstring; it falls back to the SVD
  when p + oversample >= min(n, D)) or "svd" (the full thin SVD). Each column's sign
  is fixed so that its largest-magnitude entry is positive, so both give the same U.
  """
  if method not in SUBSPACE_METHODS:
    raise ConfigError(f"unknown subspace method {method!r}; known: {', '.join(SUBSPACE_METHODS)}")
  if mask is not None:
    z = jnp.where(mask[:, None], z, 0.0)
  if method == "svd" or p + oversample >= min(z.shape):
    _, _, vt = linalg.svd(z)
    return fix_signs(vt[:p].T)
  return fix_signs(subspace_iteration(z, p, oversample, tol, max_iters))


def fix_signs(vectors: jax.Array) -> jax.Array:
  """Flips each column of [D, p] so that its largest-magnitude entry is positive."""
  largest = jnp.take_along_axis(vectors, jnp.argmax(jnp.abs(vectors), axis=0)[None], axis=0)
  return vectors * jnp.where(largest < 0, -1.0, 1.0).astype(vectors.dtype)


def subspace_iteration(z: jax.Array, p: int, oversample: int = 10, tol: float = 1e-5,
                       max_iters: int = 50) -> jax.Array:
  """Top-p right singular vectors [D, p] of `z` [n, D] by randomized subspace iteration.

  Halko, Martinsson & Tropp (2011), Algorithm 4.4 with Rayleigh-Ritz (Algorithm 5.1) at
  every step: Q = orth(Z B^T), then the SVD Q^T Z = U_b S B' gives the next orthonormal
  right block B' [l, D] (rows ordered by Ritz value), l = p + oversample. The start
  block is a fixed Gaussian draw, so the result is deterministic. The error contracts by
  (sigma_{l+1} / sigma_p)^2 per step.

  Stopping: the Ritz triples (s_i, u_i = Q U_b e_i, v_i = B'_i) satisfy Z^T u_i = s_i v_i
  exactly, so by Wedin's theorem (Stewart & Sun, Matrix Perturbation Theory, V.4) the
  sines of the angles between span(v_1..v_p) and the true top-p right singular subspace
  are at most ||Z V_p - U_p S_p||_F / gap, with the gap estimated by s_p - s_{p+1}.
  Z V_p is the first p columns of the next step's product Z B'^T, so the check costs no
  pass over Z. It stops when that bound is below tol (float32 rounding keeps it near
  eps * sigma_1 / gap) or after max_iters steps.
  """
  width = p + oversample
  # Full float32 products: on GPUs the default precision may round to TF32 (~1e-3).
  matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  # The right block is kept as rows [l, D] so that both products read Z row-major
  # (Q^T Z and Z B^T; Z^T Q ran 2-3x slower on XLA:CPU, which transposes Z for it).
  start = jax.random.normal(jax.random.key(0), (width, z.shape[1]), z.dtype)

  def step(carry):
    i, product, _, _ = carry
    q = linalg.qr(product)[0]
    left, ritz_values, rows = linalg.svd(matmul(q.T, z))
    product = matmul(z, rows.T)  # the next step's Z B'^T; its first p columns are Z V_p
    residual = product[:, :p] - matmul(q, left[:, :p]) * ritz_values[:p]
    gap = ritz_values[p - 1] - ritz_values[p]
    bound = jnp.linalg.norm(residual) / jnp.maximum(gap, jnp.finfo(z.dtype).tiny)
    return i + 1, product, rows, bound

  def not_converged(carry):
    i, _, _, bound = carry
    return (i < max_iters) & (bound > tol)

  carry = (0, matmul(z, start.T), start, jnp.asarray(jnp.inf, z.dtype))
  _, _, rows, _ = jax.lax.while_loop(not_converged, step, carry)
  return rows[:p].T


def principal_angle_cosines(subspaces: jax.Array,
                            others: jax.Array | None = None) -> jax.Array:
  """Cosines of the principal angles of every pair, [K, K', p].

  subspaces: [K, D, p] orthonormal bases; others: [K', D, p] (default: `subspaces`).
  """
  others = subspaces if others is None else others
  overlaps = jnp.einsum("adp,bdq->abpq", subspaces, others)
  cosines = linalg.singular_values(overlaps)
  # Rounding can push a cosine of identical subspaces a hair above 1.
  return jnp.clip(cosines, 0.0, 1.0)


def principal_angle_similarity(subspaces: jax.Array,
                               others: jax.Array | None = None) -> jax.Array:
  """U: [K, D, p] -> W: [K, K], W[k, k'] = sum of the cosines of the principal angles.

  With `others` [K', D, p], the [K, K'] similarity of each subspace to each of those.
  """
  return principal_angle_cosines(subspaces, others).sum(axis=-1)


def cosine_similarity(gram: jax.Array) -> jax.Array:
  """[K, K] cosines <v_i, v_j> / (|v_i| |v_j|) from the Gram matrix of K vectors.

  A zero vector has no direction: its row and column are 0.
  """
  norms = jnp.sqrt(jnp.maximum(jnp.diagonal(gram), 0.0))
  scale = norms[:, None] * norms[None, :]
  cosines = jnp.where(scale > 0, gram / jnp.where(scale > 0, scale, 1.0), 0.0)
  # Rounding can push the cosine of parallel vectors a hair past 1.
  return jnp.clip(cosines, -1.0, 1.0)


def random_similarity(key: jax.Array, num_clients: int, threshold: float = 0.25) -> jax.Array:
  """FedU's random client graph [K, K]: symmetric, non-negative, 1 on the diagonal.

  (B + B^T) / 2 with B ~ U(0, 1)^{K x K}, entries below `threshold` zeroed (FedU's code).
  """
  b = jax.random.uniform(key, (num_clients, num_clients))
  symmetric = (b + b.T) / 2.0
  symmetric = jnp.where(symmetric < threshold, 0.0, symmetric)
  return jnp.where(jnp.eye(num_clients, dtype=bool), 1.0, symmetric)
