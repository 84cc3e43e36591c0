"""FEDORA's parameter propagation (section 4.2, Eq. (3)-(5)).

Wu, Bao, Ainsworth, He. "Personalized Federated Learning with Parameter Propagation."
KDD 2023. https://doi.org/10.1145/3580305.3599464

Given the K x d matrix `Theta` of flattened client parameters and the client similarity
`W`, the auxiliary models minimise (with D = diag(W 1))

    Q(Theta_hat) = alpha/2 * sum_kk' w_kk' ||theta_hat_k - theta_hat_k'||^2
                   + sum_k d_k ||theta_hat_k - theta_k||^2,

whose stationary point  alpha (D - W) Theta_hat + D (Theta_hat - Theta) = 0  is the closed
form  Theta_hat = (1 - kappa) (I - kappa D^-1 W)^-1 Theta  with kappa = alpha / (1 + alpha),
and also the fixed point of  Theta_hat <- kappa D^-1 W Theta_hat + (1 - kappa) Theta.
The K x K system is factored once and applied to all d columns.
"""

import jax
import jax.numpy as jnp

from fedora_jax import linalg


def kappa_from_alpha(alpha: float) -> float:
  return alpha / (1.0 + alpha)


def transition_matrix(similarity: jax.Array) -> jax.Array:
  """D^-1 W, the row-normalised similarity. Rows of all zeros (masked clients) stay zero."""
  degree = similarity.sum(axis=1, keepdims=True)
  return jnp.where(degree > 0, similarity / jnp.where(degree > 0, degree, 1.0), 0.0)


def _system_matrix(similarity: jax.Array, kappa: float) -> jax.Array:
  k = similarity.shape[0]
  return jnp.eye(k, dtype=similarity.dtype) - kappa * transition_matrix(similarity)


def propagate(theta: jax.Array, similarity: jax.Array, alpha: float = 1.0,
              kappa: float | None = None) -> jax.Array:
  """Closed form: theta [K, d] -> theta_hat [K, d]. `kappa` overrides alpha/(1+alpha)."""
  kappa = kappa_from_alpha(alpha) if kappa is None else kappa
  lu_and_pivots = linalg.lu_factor(_system_matrix(similarity, kappa))
  return linalg.lu_solve(lu_and_pivots, (1.0 - kappa) * theta)


def propagate_iterative(theta: jax.Array, similarity: jax.Array, alpha: float = 1.0,
                        num_steps: int = 100, kappa: float | None = None) -> jax.Array:
  """Iterates theta_hat <- kappa D^-1 W theta_hat + (1 - kappa) theta from theta_hat = theta.

  The error contracts by kappa per step (D^-1 W is row-stochastic).
  """
  kappa = kappa_from_alpha(alpha) if kappa is None else kappa
  transition = transition_matrix(similarity)

  def step(_, theta_hat):
    return kappa * transition @ theta_hat + (1.0 - kappa) * theta
  return jax.lax.fori_loop(0, num_steps, step, theta)


def propagation_matrix(similarity: jax.Array, alpha: float = 1.0,
                       kappa: float | None = None) -> jax.Array:
  """P = (1 - kappa)(I - kappa D^-1 W)^-1 [K, K], so that Theta_hat = P Theta.

  Computed once per run (W is fixed); each round then costs one K x K x d product.
  """
  kappa = kappa_from_alpha(alpha) if kappa is None else kappa
  k = similarity.shape[0]
  return linalg.solve(_system_matrix(similarity, kappa),
                          (1.0 - kappa) * jnp.eye(k, dtype=similarity.dtype))


def apply_to_clients(matrix: jax.Array, stacked_params) -> object:
  """Applies a K x K matrix to the client axis of every leaf of a stacked pytree."""
  return jax.tree.map(
      lambda leaf: jnp.tensordot(matrix, leaf, axes=(1, 0)).astype(leaf.dtype),
      stacked_params)
