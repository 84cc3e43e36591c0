"""ResNet-18 for 32x32 images, with BatchNorm.

He, Zhang, Ren, Sun. "Deep Residual Learning for Image Recognition." CVPR 2016.
https://arxiv.org/abs/1512.03385

The CIFAR variant federated papers use (knowledge-aware parameter coaching, Zhi et al.,
AAAI 2024, for CIFAR-10/100; kuangliu/pytorch-cifar's `ResNet18`): a 3x3 stem convolution
of 64 kernels with BatchNorm and ReLU and no max-pool (the ImageNet stem's 7x7 stride-2
convolution and pooling would leave 8x8 maps of a 32x32 image), four stages of two
BasicBlocks of 64, 128, 256 and 512 kernels (the first block of stages 2-4 strides 2),
global average pooling and a dense classifier. A BasicBlock is
relu(BN(conv3x3(relu(BN(conv3x3(x))))) + shortcut(x)), the shortcut the identity, or a
1x1 strided convolution with BatchNorm where the shape changes. Convolutions have no
bias (BatchNorm's shift replaces it). 11,173,962 parameters for 10 classes, plus 9,600
running averages (tests/test_split_layers.py counts them by hand).

Its layers for the layer-wise methods (algorithms/layers.py) are its top-level modules,
in forward order: ConvBN_0 (the stem), BasicBlock_0 ... BasicBlock_7, Dense_0 (the head;
its input, the 512 pooled features, is the representation). models.LAYER_TYPE_ORDER
ranks ConvBN before BasicBlock before Dense.

BatchNorm runs in train mode while flax's `batch_stats` collection is mutable (the
engine's local training, engine/batch_stats.py), in inference mode otherwise, and
computes its batch statistics over the real samples that `mask` ([B] bool) marks.
PyTorch's conventions: running averages take 0.1 of each batch (flax momentum 0.9),
epsilon 1e-5, scale 1 and shift 0 at init; convolution and dense weights
U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as PyTorch's default init and the project's other
models. Pixels are standardised per channel (models/cnn.py standardize_images).

`conv="xla"` (default) is lax.conv_general_dilated; `conv="im2col"` the same
convolution as shifted slices times a matrix (see models/cnn.py for why the CNN uses
it on CPUs); docs/resnet.md has the measurements behind the default.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.cnn import standardize_images
from fedora_jax.models.mlp import _torch_uniform, dense_layers
from fedora_jax.models.norm import BATCH_STATS, batch_norm


def _patches(x: jax.Array, size: int, stride: int) -> jax.Array:
  """[B, H, W, C] (padded) -> [B, H', W', size*size*C], ordered like a flattened kernel."""
  out_h = (x.shape[1] - size) // stride + 1
  out_w = (x.shape[2] - size) // stride + 1
  return jnp.concatenate(
      [x[:, i:i + stride * (out_h - 1) + 1:stride, j:j + stride * (out_w - 1) + 1:stride]
       for i in range(size) for j in range(size)], axis=-1)


class Conv(nn.Module):
  """A bias-free convolution, padding (size - 1) // 2 on each side (PyTorch's
  padding=1 for 3x3, 0 for 1x1)."""
  features: int
  size: int = 3
  stride: int = 1
  conv: str = "xla"  # or "im2col"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    fan_in = x.shape[-1] * self.size * self.size
    kernel = self.param("kernel", _torch_uniform(fan_in),
                        (self.size, self.size, x.shape[-1], self.features))
    pad = (self.size - 1) // 2
    if self.conv == "xla":
      return jax.lax.conv_general_dilated(
          x, kernel, (self.stride, self.stride), ((pad, pad), (pad, pad)),
          dimension_numbers=("NHWC", "HWIO", "NHWC"))
    if self.conv == "im2col":
      x = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
      return _patches(x, self.size, self.stride) @ kernel.reshape(-1, self.features)
    raise ValueError(f"unknown conv implementation {self.conv!r}")


class ConvBN(nn.Module):
  """Conv then BatchNorm (no activation)."""
  features: int
  size: int = 3
  stride: int = 1
  conv: str = "xla"

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    x = Conv(self.features, self.size, self.stride, self.conv)(x)
    return batch_norm(x, mask, self.is_mutable_collection(BATCH_STATS))


class BasicBlock(nn.Module):
  """relu(ConvBN(relu(ConvBN(x))) + shortcut(x)); the shortcut a 1x1 ConvBN where the
  stride or the width changes."""
  features: int
  stride: int = 1
  conv: str = "xla"

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    y = nn.relu(ConvBN(self.features, 3, self.stride, self.conv)(x, mask))
    y = ConvBN(self.features, 3, 1, self.conv)(y, mask)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = ConvBN(self.features, 1, self.stride, self.conv)(x, mask)
    return nn.relu(y + x)


class ResNet(nn.Module):
  """The CIFAR ResNet; the defaults are ResNet-18 (module docstring)."""
  num_outputs: int = 10
  blocks: tuple[int, ...] = (2, 2, 2, 2)
  widths: tuple[int, ...] = (64, 128, 256, 512)
  conv: str = "xla"

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    x = standardize_images(x)
    x = nn.relu(ConvBN(self.widths[0], 3, 1, self.conv)(x, mask))
    for stage, (blocks, width) in enumerate(zip(self.blocks, self.widths)):
      for block in range(blocks):
        x = BasicBlock(width, 2 if stage > 0 and block == 0 else 1, self.conv)(x, mask)
    x = jnp.mean(x, axis=(1, 2))  # global average pooling
    return dense_layers(x, (self.num_outputs,))
