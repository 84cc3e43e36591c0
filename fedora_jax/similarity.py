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
"""

import jax
import jax.numpy as jnp


def client_features(x: jax.Array, y: jax.Array, num_classes: int) -> jax.Array:
  """`Z = [X, onehot(Y)]`: flattened inputs (uint8 pixels scaled to [0, 1]) and labels.

  Real-valued (regression) targets enter as one column, `Z = [X, y]`.
  """
  x = x.reshape((x.shape[0], -1))
  x = x.astype(jnp.float32) / 255.0 if x.dtype == jnp.uint8 else x.astype(jnp.float32)
  if jnp.issubdtype(y.dtype, jnp.floating):
    return jnp.concatenate([x, y.astype(jnp.float32)[:, None]], axis=1)
  return jnp.concatenate([x, jax.nn.one_hot(y, num_classes, dtype=jnp.float32)], axis=1)


def client_subspace(z: jax.Array, p: int, mask: jax.Array | None = None) -> jax.Array:
  """Top-p right singular vectors of one client's n x D matrix `z`, as a D x p matrix.

  Rows where `mask` is False (padding) are zeroed first; zero rows leave the right
  singular vectors of the non-zero singular values unchanged.
  """
  if mask is not None:
    z = jnp.where(mask[:, None], z, 0.0)
  _, _, vt = jnp.linalg.svd(z, full_matrices=False)
  return vt[:p].T


def principal_angle_cosines(subspaces: jax.Array,
                            others: jax.Array | None = None) -> jax.Array:
  """Cosines of the principal angles of every pair, [K, K', p].

  subspaces: [K, D, p] orthonormal bases; others: [K', D, p] (default: `subspaces`).
  """
  others = subspaces if others is None else others
  overlaps = jnp.einsum("adp,bdq->abpq", subspaces, others)
  cosines = jnp.linalg.svd(overlaps, compute_uv=False)
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
