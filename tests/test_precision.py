"""Mixed precision (engine/precision.py): bfloat16 compute, float32 parameters and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.engine import precision
from tiny import tiny_model


def test_bfloat16_compute_keeps_float32_parameters_and_gradients():
  model = tiny_model()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  params = model.init(jax.random.key(0), x)
  apply = precision.compute_in("bfloat16", model.apply)
  out = apply(params, x)
  assert out.dtype == jnp.float32
  # The forward is the float32 one with every input and weight rounded to bfloat16.
  rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
  np.testing.assert_allclose(out, model.apply(rounded, x.astype(jnp.bfloat16).astype(
      jnp.float32)), rtol=2e-2, atol=2e-2)
  grads = jax.grad(lambda p: jnp.sum(apply(p, x) ** 2))(params)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  apply_fn = model.apply
  assert precision.compute_in("float32", apply_fn) is apply_fn
  with pytest.raises(ValueError, match="precision must be one of"):
    precision.compute_in("float16", model.apply)
