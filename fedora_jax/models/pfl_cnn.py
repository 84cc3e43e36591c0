"""pfl-research's `simple_cnn`, the CNN of its CIFAR-10 benchmark (--model=pfl_cnn).

pfl-research (Granqvist et al., "pfl-research: simulation framework for accelerating
research in Private Federated Learning", arXiv 2404.06430; github.com/apple/pfl-research,
Apache-2.0), benchmarks/model/pytorch/cnn.py `simple_cnn`, selected by
benchmarks/image_classification/configs/baseline.yaml (model_name: simple_cnn):

  conv 3x3, 32 kernels (valid) -> ReLU -> conv 3x3, 64 kernels (valid) -> ReLU
  -> max-pool 2x2 -> dropout 0.25 -> dense 128 -> ReLU -> dropout 0.5 -> dense classes

On 32x32x3 images: 32 -> 30 -> 28 -> 14, so 14*14*64 = 12,544 features into the dense
layer; 1,626,442 parameters for 10 classes (896 + 18,496 + 1,605,760 + 1,290).
Weights are Glorot (Xavier) uniform, as that file initialises them; biases keep
PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

Inputs are standardised per channel with the training set's own statistics, as
pfl-research's CIFAR-10 loader (benchmarks/dataset/cifar10/numpy.py) computes them;
ours are those of ../shared/data's CIFAR-10 training set (uint8 / 255).

Not reproduced: the two dropout layers. Our local training applies a model without a
dropout key (engine/local_training.py), so this is the CNN in evaluation mode during
training too; the arithmetic of a step is the same but for two elementwise masks.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.cnn import Conv, max_pool_2x2
from fedora_jax.models.mlp import _torch_uniform

# ../shared/data's CIFAR-10 training set, per channel, of pixels / 255 (pfl-research
# standardises by the training set's own mean and standard deviation).
CIFAR10_MEAN = (0.4913, 0.4821, 0.4465)
CIFAR10_STD = (0.2452, 0.2428, 0.2606)


def standardize(x: jax.Array) -> jax.Array:
  """[B, H, W, C] uint8 -> float32 standardised per channel; float inputs pass through,
  and images of other than three channels are only scaled to [0, 1]."""
  if x.ndim == 3:
    x = x[..., None]
  if x.dtype != jnp.uint8:
    return x.astype(jnp.float32)
  x = x.astype(jnp.float32) / 255.0
  if x.shape[-1] != len(CIFAR10_MEAN):
    return x
  return (x - jnp.asarray(CIFAR10_MEAN)) / jnp.asarray(CIFAR10_STD)


class PflCNN(nn.Module):
  """pfl-research's simple_cnn without dropout; see the module docstring. Layers Conv_0,
  Conv_1, Dense_0 and Dense_1 (the logits)."""
  num_outputs: int = 10
  conv: str = "im2col"  # models/cnn.py's formulations

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = standardize(x)
    for features in (32, 64):
      x = nn.relu(Conv(features, 3, self.conv,
                       kernel_init=nn.initializers.xavier_uniform())(x))
    x = max_pool_2x2(x)
    x = x.reshape((x.shape[0], -1))
    for layer, width in enumerate((128, self.num_outputs)):
      x = nn.Dense(width, kernel_init=nn.initializers.xavier_uniform(),
                   bias_init=_torch_uniform(x.shape[-1]))(x)
      if layer == 0:
        x = nn.relu(x)
    return x
