"""BatchNorm as the registered models use it: PyTorch's defaults, train mode while flax's
`batch_stats` collection is mutable (the engine's local training,
engine/batch_stats.py), statistics over the real samples of a padded batch."""

import flax.linen as nn
import jax

BATCH_STATS = "batch_stats"


def batch_norm(x: jax.Array, mask: jax.Array | None, training: bool) -> jax.Array:
  """flax BatchNorm with PyTorch's defaults (running averages take 0.1 of each batch,
  epsilon 1e-5), inside a compact method; in train mode its statistics are those of the
  samples `mask` ([B] bool) marks."""
  if mask is not None:
    mask = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
  return nn.BatchNorm(use_running_average=not training, momentum=0.9,
                      epsilon=1e-5)(x, mask=mask if training else None)
