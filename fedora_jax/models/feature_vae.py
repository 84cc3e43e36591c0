"""FedFed's feature generator: a beta-VAE whose reconstruction x_r = G(x) is the
performance-robust part of an input, x - x_r its performance-sensitive part (Yang et al.,
NeurIPS 2023; the authors' model/FL_VAE.py FL_CVAE_cifar and FL-bench's VAE in
src/server/fedfed.py, both read, not copied).

`conv` (images [H, W, C], H and W divisible by 4), the two codes' residual network at
block depth d:
  encoder  Conv(d/2, 4x4, stride 2, no bias) BN ReLU  Conv(d, 4x4, stride 2, no bias) BN
           ReLU  Res  BN  Res                          -> h, F = d (H/4) (W/4) features
  latent   mu = Dense(F)(h), logvar = Dense(F)(h),  z = mu + exp(logvar / 2) eps in training,
           z = mu otherwise
  decoder  Dense(F)(z) as [H/4, W/4, d]  Res BN Res BN  ConvT(d/2, 4x4, stride 2, no bias)
           BN LeakyReLU tanh  ConvT(C, 4x4, stride 2, no bias) BN sigmoid
  Res(x) = x + Conv(d, 1x1)(LeakyReLU(BN(Conv(d, 3x3)(LeakyReLU(x)))))
(the latent as wide as the encoder's output: FL-bench's; the authors' z = 2048 is that
width on 32x32 images at d = 32). `mlp` (feature vectors, which neither code has):
Dense(d) ReLU Dense(d) ReLU, mu and logvar Dense(d), decoder Dense(d) ReLU Dense(D)
sigmoid. BatchNorm is PyTorch's (models/norm.py): train mode over the batch's real samples,
running averages otherwise. Layers take flax's default init (the codes': PyTorch's).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.mlp import normalize_inputs
from fedora_jax.models.norm import batch_norm

Params = Any
ARCHITECTURES = ("conv", "mlp")


class _Residual(nn.Module):
  depth: int

  @nn.compact
  def __call__(self, x, mask, training):
    h = nn.Conv(self.depth, (3, 3), padding=((1, 1), (1, 1)))(nn.leaky_relu(x))
    h = nn.leaky_relu(batch_norm(h, mask, training))
    return x + nn.Conv(self.depth, (1, 1))(h)


class FeatureVAE(nn.Module):
  """(x [B, ...], key, mask [B] bool, training) -> (x_r [B, ...] in (0, 1), mu, logvar)."""
  architecture: str = "conv"
  depth: int = 32

  @nn.compact
  def __call__(self, x: jax.Array, key: jax.Array, mask: jax.Array | None = None,
               training: bool = False):
    x = normalize_inputs(x)
    if self.architecture == "conv":
      h, shape = self._encode_conv(x, mask, training)
    else:
      h = x.reshape((x.shape[0], -1))
      for _ in range(2):
        h = nn.relu(nn.Dense(self.depth)(h))
      shape = None
    width = h.shape[-1]
    mu, logvar = nn.Dense(width)(h), nn.Dense(width)(h)
    z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape) if training else mu
    if self.architecture == "conv":
      x_r = self._decode_conv(nn.Dense(width)(z), shape, x.shape[-1], mask, training)
    else:
      x_r = nn.sigmoid(nn.Dense(x[0].size)(nn.relu(nn.Dense(self.depth)(z))))
    return x_r.reshape(x.shape), mu, logvar

  def _encode_conv(self, x, mask, training):
    d = self.depth
    h = nn.Conv(d // 2, (4, 4), strides=2, padding=((1, 1), (1, 1)), use_bias=False)(x)
    h = nn.relu(batch_norm(h, mask, training))
    h = nn.Conv(d, (4, 4), strides=2, padding=((1, 1), (1, 1)), use_bias=False)(h)
    h = nn.relu(batch_norm(h, mask, training))
    h = _Residual(d)(h, mask, training)
    h = _Residual(d)(batch_norm(h, mask, training), mask, training)
    return h.reshape((h.shape[0], -1)), h.shape[1:]

  def _decode_conv(self, h, shape, channels, mask, training):
    d = self.depth
    h = h.reshape((h.shape[0],) + tuple(shape))
    h = batch_norm(_Residual(d)(h, mask, training), mask, training)
    h = batch_norm(_Residual(d)(h, mask, training), mask, training)
    h = nn.ConvTranspose(d // 2, (4, 4), strides=(2, 2), padding="SAME", use_bias=False)(h)
    h = jnp.tanh(nn.leaky_relu(batch_norm(h, mask, training)))
    h = nn.ConvTranspose(channels, (4, 4), strides=(2, 2), padding="SAME", use_bias=False)(h)
    return nn.sigmoid(batch_norm(h, mask, training))


def architecture_for(x_shape: tuple[int, ...], architecture: str) -> str | None:
  """The architecture `architecture` ("auto", "conv", "mlp") resolves to for one input of
  `x_shape`: auto takes conv for images whose sides divide by 4; None: conv cannot."""
  image = len(x_shape) == 3 and x_shape[0] % 4 == 0 and x_shape[1] % 4 == 0
  if architecture == "auto":
    return "conv" if image else "mlp"
  return None if architecture == "conv" and not image else architecture


def init_vae(vae: FeatureVAE, key: jax.Array, x_shape: tuple[int, ...]) -> dict:
  """flax variables {"params", "batch_stats" (conv only)} for inputs of `x_shape`."""
  init_key, noise_key = jax.random.split(key)
  return dict(vae.init(init_key, jnp.zeros((2,) + tuple(x_shape), jnp.float32), noise_key))
