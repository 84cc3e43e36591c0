"""A conditional feature generator G(z | y): noise and a one-hot label in, a vector in
the space of a classifier's representation out (FedGen's, Zhu et al. ICML 2021; the
authors' FLAlgorithms/trainmodel/generator.py and PFLlib's servergen.Generative).

Dense(hidden) -> BatchNorm -> ReLU -> Dense(features), on [noise, one_hot(y)]. The
BatchNorm always normalises with the batch's own statistics (PyTorch's train mode, biased
variance, epsilon 1e-5) and keeps no running averages: both codes never switch their
generator to eval mode, so its running averages are never read. Dense layers take
PyTorch's default init, as every registered model does (models/mlp.py).

`draw_inputs` draws a batch's labels from a class distribution (np.random.choice over a
list holding each label once per training sample, in both codes) and its noise,
uniform in [0, 1) (torch.rand in both codes, whose comment says Gaussian).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.mlp import torch_dense

Params = Any
BATCH_NORM_EPSILON = 1e-5


class FeatureGenerator(nn.Module):
  """G(noise, labels) -> [B, features]."""
  features: int
  num_classes: int
  hidden: int = 512

  @nn.compact
  def __call__(self, noise: jax.Array, labels: jax.Array) -> jax.Array:
    x = jnp.concatenate([noise, jax.nn.one_hot(labels, self.num_classes)], axis=-1)
    h = torch_dense(self.hidden, x.shape[-1])(x)
    h = batch_normalized(h, self.param("scale", nn.initializers.ones, (self.hidden,)),
                         self.param("offset", nn.initializers.zeros, (self.hidden,)))
    return torch_dense(self.features, self.hidden)(nn.relu(h))


def batch_normalized(h: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
  """(h - batch mean) / sqrt(biased batch variance + eps) * scale + offset."""
  mean = jnp.mean(h, axis=0)
  variance = jnp.mean(jnp.square(h - mean), axis=0)
  return (h - mean) * jax.lax.rsqrt(variance + BATCH_NORM_EPSILON) * scale + offset


def init_generator(generator: FeatureGenerator, key: jax.Array, noise_dim: int) -> Params:
  noise = jnp.zeros((2, noise_dim), jnp.float32)
  return generator.init(key, noise, jnp.zeros((2,), jnp.int32))


def draw_inputs(key: jax.Array, class_weights: jax.Array, batch_size: int,
                noise_dim: int) -> tuple[jax.Array, jax.Array]:
  """(labels [B] int32, drawn with probabilities proportional to `class_weights` [C];
  noise [B, noise_dim] uniform in [0, 1)), from `key`'s two halves in that order."""
  label_key, noise_key = jax.random.split(key)
  logits = jnp.where(class_weights > 0, jnp.log(jnp.maximum(class_weights, 1e-30)), -jnp.inf)
  labels = jax.random.categorical(label_key, logits, shape=(batch_size,)).astype(jnp.int32)
  return labels, jax.random.uniform(noise_key, (batch_size, noise_dim), jnp.float32)
