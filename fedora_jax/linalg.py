"""LAPACK-backed linear algebra that is safe on several CPU devices.

Every eigendecomposition, SVD, QR, LU and dense solve in the library goes through here.

Why: jaxlib's CPU kernels for these (`lapack_*_ffi`, jax 0.10) split a batch of matrices
over XLA's intra-op thread pool and block that thread until the pieces are done
(`ParallelBatchMap` -> `BlockingCounter::Wait`). With several CPU devices, each device's
program runs on a thread of that same pool, so when every pool thread is inside such a
kernel at once (two devices, two cores: the project's default mesh), the pieces they
wait for can never run and the process hangs forever at 0 % CPU. Seen in coaching's
batched `eigvalsh` over the layers' Gram matrices, and before in FEDORA's batched QR.
A kernel given one matrix has nothing to split and never waits on the pool, so on the
CPU backend these functions hand LAPACK one matrix at a time: the leading batch axes are
flattened and looped over with `lax.map`, and a `jax.vmap` of them (the engine's client
axis) becomes that loop as well (`jax.custom_batching.sequential_vmap`) instead of one
batched call. On GPUs and TPUs they are jnp's own calls, batched.

These are forward-only: nothing in the library differentiates through them.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl


def _one_matrix_at_a_time(fn: Callable, matrix_ndims: tuple[int, ...]) -> Callable:
  """`fn` over arrays whose trailing `matrix_ndims[i]` axes are one problem, any leading
  batch axes (the same on every argument) looped over on CPU, passed through elsewhere."""
  sequential = jax.custom_batching.sequential_vmap(fn)

  def call(*args):
    if jax.default_backend() != "cpu":
      return fn(*args)
    batch_shape = args[0].shape[:args[0].ndim - matrix_ndims[0]]
    if not batch_shape:
      return sequential(*args)  # one matrix, or many under an enclosing vmap
    flat = [a.reshape((-1,) + a.shape[a.ndim - d:]) for a, d in zip(args, matrix_ndims)]
    out = jax.vmap(sequential)(*flat)
    return jax.tree.map(lambda o: o.reshape(batch_shape + o.shape[1:]), out)
  return call


# Lambdas, not jnp's functions themselves: custom_vmap would take their keyword defaults
# (UPLO, symmetrize_input, ...) as traced arguments.
_eigh = _one_matrix_at_a_time(lambda a: tuple(jnp.linalg.eigh(a)), (2,))
_eigvalsh = _one_matrix_at_a_time(lambda a: jnp.linalg.eigvalsh(a), (2,))
_qr = _one_matrix_at_a_time(lambda a: tuple(jnp.linalg.qr(a)), (2,))


def _finite(*arrays: jax.Array) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))


def _unless_gesdd_failed(a: jax.Array, answer, qr_answer: Callable):
  """`answer`, jnp's SVD of `a` (LAPACK's divide and conquer, gesdd), or on the CPU,
  where it is not finite for a finite `a`, `qr_answer()`, the QR iteration's (gesvd).
  The CPU's gesdd fails so on some matrices (LAPACK: "SLASCL parameter number 4 had an
  illegal value"); NumPy's and PyTorch's SVDs of the same matrix do not."""
  if jax.default_backend() != "cpu":
    return answer
  return jax.lax.cond(_finite(a) & ~_finite(*jax.tree.leaves(answer)), qr_answer,
                      lambda: answer)


def _thin_svd(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  return _unless_gesdd_failed(
      a, tuple(jnp.linalg.svd(a, full_matrices=False)),
      lambda: tuple(jax.lax.linalg.svd(a, full_matrices=False,
                                       algorithm=jax.lax.linalg.SvdAlgorithm.QR)))


def _thin_singular_values(a: jax.Array) -> jax.Array:
  return _unless_gesdd_failed(
      a, jnp.linalg.svd(a, compute_uv=False),
      lambda: jax.lax.linalg.svd(a, full_matrices=False, compute_uv=False,
                                 algorithm=jax.lax.linalg.SvdAlgorithm.QR))


_svd = _one_matrix_at_a_time(_thin_svd, (2,))
_singular_values = _one_matrix_at_a_time(_thin_singular_values, (2,))
_solve_matrix = _one_matrix_at_a_time(lambda a, b: jnp.linalg.solve(a, b), (2, 2))
_lu_factor = _one_matrix_at_a_time(lambda a: tuple(jsl.lu_factor(a)), (2,))
_lu_solve = _one_matrix_at_a_time(lambda lu, pivots, b: jsl.lu_solve((lu, pivots), b),
                                  (2, 1, 2))


def eigh(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Eigenvalues (ascending) [..., n] and eigenvectors [..., n, n] of symmetric `a`."""
  return _eigh(a)


def eigvalsh(a: jax.Array) -> jax.Array:
  """Eigenvalues (ascending) [..., n] of symmetric `a` [..., n, n]."""
  return _eigvalsh(a)


def qr(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Reduced QR of `a` [..., m, n]: Q [..., m, k], R [..., k, n], k = min(m, n)."""
  return _qr(a)


def svd(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Thin SVD of `a` [..., m, n]: U [..., m, k], s [..., k] (descending), Vt [..., k, n]."""
  return _svd(a)


def singular_values(a: jax.Array) -> jax.Array:
  """Singular values [..., k] (descending) of `a` [..., m, n]."""
  if a.shape[-2:] == (1, 1):  # a 1 x 1 matrix's singular value is its magnitude
    return jnp.abs(a[..., 0])
  return _singular_values(a)


def solve(a: jax.Array, b: jax.Array) -> jax.Array:
  """X with a X = b, `a` [..., n, n], `b` [..., n, m] (a matrix right-hand side)."""
  return _solve_matrix(a, b)


def lu_factor(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """LU factorisation of `a` [..., n, n] with partial pivoting, for `lu_solve`."""
  return _lu_factor(a)


def lu_solve(lu_and_pivots: tuple[jax.Array, jax.Array], b: jax.Array) -> jax.Array:
  """X with a X = b from `lu_factor(a)`, `b` [..., n, m]."""
  lu, pivots = lu_and_pivots
  return _lu_solve(lu, pivots, b)
