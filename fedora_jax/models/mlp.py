"""Multi-layer perceptron; the default is FEDORA's 784-128-128-10 (authors' code)."""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def _torch_uniform(fan_in: int):
  """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's nn.Linear default for weights and bias.

  The authors' models use that default, so we match it rather than flax's lecun_normal.
  """
  bound = 1.0 / jnp.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


def normalize_inputs(x: jax.Array) -> jax.Array:
  """uint8 pixels -> float32 in [0, 1]; float inputs pass through unchanged."""
  if x.dtype == jnp.uint8:
    return x.astype(jnp.float32) / 255.0
  return x.astype(jnp.float32)


class MLP(nn.Module):
  """Flattens its input, then Dense-ReLU for each hidden width, then a linear head."""
  hidden: Sequence[int] = (128, 128)
  num_outputs: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = normalize_inputs(x).reshape((x.shape[0], -1))
    return dense_layers(x, (*self.hidden, self.num_outputs))


def torch_dense(features: int, fan_in: int) -> nn.Dense:
  """nn.Dense with PyTorch's default init of nn.Linear, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  for weights and bias; created inside a compact method, whose parameters it becomes."""
  return nn.Dense(features, kernel_init=_torch_uniform(fan_in),
                  bias_init=_torch_uniform(fan_in))


def dense_layers(x: jax.Array, widths: Sequence[int]) -> jax.Array:
  """Dense-ReLU for each width but the last, a linear last layer; PyTorch's default init.
  Called inside a module's compact method, whose parameters these layers become."""
  for layer, width in enumerate(widths):
    x = torch_dense(width, x.shape[-1])(x)
    if layer < len(widths) - 1:
      x = nn.relu(x)
  return x
