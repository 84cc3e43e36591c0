"""Mixed precision: the model computed in bfloat16, its parameters and optimizer in float32.

`compute_in(dtype, apply)` wraps a flax `model.apply`: floating parameters and inputs are
cast to `dtype` on the way in and the outputs back to float32, so the loss, the
gradients (through the casts) and every update stay float32, as in the usual mixed-
precision recipe (Micikevicius et al., ICLR 2018). On accelerators with bfloat16 matrix
units the forward and backward products then run at their rate; on a CPU they are slower.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

PRECISIONS = ("float32", "bfloat16")


def _cast(tree: Any, dtype) -> Any:
  return jax.tree.map(
      lambda a: a.astype(dtype) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a,
      tree)


def compute_in(precision: str, apply: Callable[..., Any]) -> Callable[..., Any]:
  """`apply` computing in `precision` ("float32": `apply` itself)."""
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
  if precision == "float32":
    return apply
  dtype = jnp.dtype(precision)

  def apply_in_precision(variables, x, *args, **kwargs):
    return _cast(apply(_cast(variables, dtype), _cast(x, dtype), *args, **kwargs),
                 jnp.float32)
  return apply_in_precision
