"""FEDORA's "5-layer CNN" for CIFAR-10: two convolutions and three dense layers.

The paper (Wu et al., KDD 2023, section 5) names only "a 5-layer CNN". The authors'
public code (github.com/junwu6/FEDORA, models/networks.py, class `CNN`, taken from pFedHN)
defines it as LeNet-5 with 16 kernels:

  conv 5x5, 16 kernels (valid) -> ReLU -> max-pool 2x2
  conv 5x5, 32 kernels (valid) -> ReLU -> max-pool 2x2
  dense 120 -> ReLU -> dense 84 -> ReLU -> dense num_classes

On 32x32x3 inputs: 32 -> 28 -> 14 -> 10 -> 5, so the first dense layer sees 5*5*32 = 800
features; 121,182 parameters for 10 classes. PFLlib's FedAvgCNN (32/64 kernels, one
hidden dense layer of 512) is four layers and ~8x larger, so we follow the authors.

Weights and biases use PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as the MLP
does. Pixels arrive as uint8 and are standardised here: scaled to [0, 1], then per
channel with the statistics the authors' CIFAR-10 loader uses (pFedHN's
Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))); single-channel images
use MNIST's (0.1307, 0.3081). Float inputs pass through unscaled.

Convolutions are matmuls, in one of three formulations with the same parameters and
the same result up to float rounding:
- `conv="im2col"`: the 25 shifted slices of the input are concatenated and multiplied
  by the [25*C_in, C_out] kernel;
- `conv="banded"`: the output's columns in blocks of a few (`banded_block_width`); each
  block's input window (5 rows x (block + 4) columns x C_in) is one row of the patches,
  multiplied by a banded [5 (block + 4) C_in, block C_out] matrix that holds the kernel
  at each output column's offset. Smaller patches and wider matmuls than im2col for
  some multiplications by zero: the registry's default on CPUs, where it is faster than
  im2col (docs/measurements/2026-11-26-cnn-round-profile.md);
- `conv="xla"`: `lax.conv_general_dilated`. XLA's CPU backend runs convolutions inside a
  while loop (our `lax.scan` over SGD steps) through a slow generic path
  (github.com/jax-ml/jax/issues/12868), several times slower than im2col
  (docs/measurements/2026-11-26-performance.md).
Vmapped over clients, the matmuls become batched matmuls rather than grouped
convolutions.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.mlp import _torch_uniform, dense_layers, torch_dense
from fedora_jax.models.norm import BATCH_STATS, batch_norm

CONVS = ("im2col", "banded", "xla")  # Conv's formulations; see the module docstring
# channels -> (mean, std) of [0, 1] pixels.
CHANNEL_STATS = {
    3: ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    1: ((0.1307,), (0.3081,)),
}


def standardize_images(x: jax.Array) -> jax.Array:
  """[B, H, W(, C)] uint8 -> [B, H, W, C] float32, per-channel standardised."""
  if x.ndim == 3:
    x = x[..., None]
  if x.dtype != jnp.uint8:
    return x.astype(jnp.float32)
  x = x.astype(jnp.float32) / 255.0
  stats = CHANNEL_STATS.get(x.shape[-1])
  if stats is None:
    return x
  mean, std = (jnp.asarray(s, jnp.float32) for s in stats)
  return (x - mean) / std


def max_pool_2x2(x: jax.Array) -> jax.Array:
  """[B, H, W, C] -> [B, H//2, W//2, C]: 2x2 max-pooling, stride 2, VALID (an odd last
  row or column is dropped), the same values and gradients as `nn.max_pool` and PyTorch's
  max_pool2d: the gradient goes to the first maximum of each window in row-major order.

  The window's maximum is picked by a one-hot of its argmax, so the backward pass is an
  elementwise product. `nn.max_pool`'s gradient is XLA's select-and-scatter, which the CPU
  backend runs slowly inside the SGD `lax.scan` (the timing, and the parameters after 40
  steps bit-identical, ties included: docs/measurements/2026-11-26-cnn-round-profile.md)."""
  b, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2]
  windows = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
  windows = windows.reshape(b, h // 2, w // 2, c, 4)
  first_max = jax.nn.one_hot(jnp.argmax(jax.lax.stop_gradient(windows), -1), 4,
                             dtype=x.dtype)
  return jnp.sum(windows * first_max, -1)


def im2col(x: jax.Array, size: int) -> jax.Array:
  """[B, H, W, C] -> [B, H-size+1, W-size+1, size*size*C] patches, ordered (row, col, C)
  like a flax kernel [size, size, C, C_out] flattened."""
  out_h, out_w = x.shape[1] - size + 1, x.shape[2] - size + 1
  return jnp.concatenate([x[:, i:i + out_h, j:j + out_w, :]
                          for i in range(size) for j in range(size)], axis=-1)


def banded_block_width(out_width: int, in_channels: int) -> int:
  """Output columns per block of the banded convolution: about 4 for a thin input (the
  first layer's 1-3 channels), 2 for a wide one, the largest such divisor of the output
  width (1 is im2col). Measured on the LeNet-5 (docs/performance.md): blocks of 4 and 2
  beat 2 / 7 / 14 and 5 for its two layers."""
  target = 4 if in_channels <= 4 else 2
  return max(d for d in range(1, target + 1) if out_width % d == 0)


def banded_conv(x: jax.Array, kernel: jax.Array, block: int) -> jax.Array:
  """[B, H, W, C] x [k, k, C, O] -> [B, H-k+1, W-k+1, O], VALID and stride 1, with the
  output's columns in blocks of `block` (which divides W-k+1); see the module docstring."""
  b, h, w, c = x.shape
  size, out_c = kernel.shape[0], kernel.shape[-1]
  out_h, out_w = h - size + 1, w - size + 1
  window = block + size - 1
  rows = jnp.stack([x[:, i:i + out_h] for i in range(size)], axis=2)  # [B, Ho, k, W, C]
  patches = jnp.stack([rows[:, :, :, j:j + window] for j in range(0, out_w, block)],
                      axis=2)  # [B, Ho, blocks, k, window, C]
  patches = patches.reshape(b, out_h, out_w // block, size * window * c)
  # banded[i, u, c, v, o] = kernel[i, u - v, c, o] where 0 <= u - v < k: input column u
  # of the window feeds output column v of the block through kernel column u - v. Built
  # by padding, not indexing: a gather of the kernel would carry a sharding that
  # shard_map's manual mesh refuses.
  banded = jnp.stack([jnp.pad(kernel, ((0, 0), (v, block - 1 - v), (0, 0), (0, 0)))
                      for v in range(block)], axis=3)  # [k, window, C, block, O]
  banded = banded.reshape(size * window * c, block * out_c)
  return (patches @ banded).reshape(b, out_h, out_w, out_c)


class Conv(nn.Module):
  """A VALID, stride-1 convolution with nn.Conv's parameters; see the module docstring."""
  features: int
  size: int = 5
  conv: str = "im2col"  # or "banded", or "xla": lax.conv_general_dilated
  kernel_init: Callable | None = None  # None: PyTorch's default, as the bias's

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    fan_in = x.shape[-1] * self.size * self.size
    kernel = self.param("kernel", self.kernel_init or _torch_uniform(fan_in),
                        (self.size, self.size, x.shape[-1], self.features))
    bias = self.param("bias", _torch_uniform(fan_in), (self.features,))
    if self.conv == "im2col":
      y = im2col(x, self.size) @ kernel.reshape(-1, self.features)
    elif self.conv == "banded":
      block = banded_block_width(x.shape[2] - self.size + 1, x.shape[-1])
      y = banded_conv(x, kernel, block)
    elif self.conv == "xla":
      y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "VALID",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    else:
      raise ValueError(f"unknown conv implementation {self.conv!r}; known: {CONVS}")
    return y + bias


class ConvBN(nn.Module):
  """Conv (with its bias, as PyTorch's nn.Conv2d) then BatchNorm."""
  features: int
  conv: str = "im2col"

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
    x = Conv(self.features, 5, self.conv)(x)
    return batch_norm(x, mask, self.is_mutable_collection(BATCH_STATS))


class DenseBN(nn.Module):
  """Dense (PyTorch's default init) then BatchNorm."""
  features: int

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
    x = torch_dense(self.features, x.shape[-1])(x)
    return batch_norm(x, mask, self.is_mutable_collection(BATCH_STATS))


class CNN(nn.Module):
  """LeNet-5-style CNN of the FEDORA authors' code; see the module docstring.

  `batch_norm=True` puts a BatchNorm after every convolution and hidden dense layer,
  before its ReLU, where FedBN's own CNN has them (Li et al., ICLR 2021; its code,
  github.com/med-air/FedBN nets/models.py DigitModel: conv-BN-ReLU-pool, fc-BN-ReLU); the
  modules are then ConvBN_<n> and DenseBN_<n>, and the logits layer Dense_0."""
  num_outputs: int = 10
  kernels: int = 16
  dense: tuple[int, ...] = (120, 84)
  conv: str = "im2col"
  batch_norm: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    x = standardize_images(x)
    for features in (self.kernels, 2 * self.kernels):
      x = ConvBN(features, self.conv)(x, mask) if self.batch_norm else Conv(
          features, 5, self.conv)(x)
      x = max_pool_2x2(nn.relu(x))
    x = x.reshape((x.shape[0], -1))
    if not self.batch_norm:
      return dense_layers(x, (*self.dense, self.num_outputs))
    for width in self.dense:
      x = nn.relu(DenseBN(width)(x, mask))
    return dense_layers(x, (self.num_outputs,))
