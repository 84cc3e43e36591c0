"""A pool of samples the clients shared, held by every client, and each client's draws
from it: FedFed's global dataset of noised performance-sensitive features (Yang et al.,
NeurIPS 2023), and any method whose clients train on data others uploaded.

Unlike the public set (data/public.py: training samples set aside before the clients are
cut), a pool is built during a run from what the clients computed: `pool_of` flattens
their stacked [K, N, ...] uploads (padding rows kept, masked) into one [P, ...] set.
A client then trains on `size` rows drawn from it, `n` of them counted:
  * `draw_uniform`: n distinct real rows, uniformly (FL-bench's FedFed);
  * `draw_balanced`: n // C distinct rows of each class, the n - C (n // C) left over
    distinct and uniform over the whole pool (FedFed's authors'
    sample_iid_data_from_share_dataset). A class with fewer rows than n // C repeats
    them; one with none gives its slots to uniform rows.
Rows past n are filled by more draws (uniform) so every index is a real row; their
weights are 0.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SharedPool(NamedTuple):
  x: jax.Array     # [P, ...] the shared samples
  y: jax.Array     # [P] int32 their labels
  mask: jax.Array  # [P] bool: a real row (False: an uploading client's padding)


def pool_of(x: jax.Array, y: jax.Array, mask: jax.Array) -> SharedPool:
  """The pool of stacked uploads x [K, N, ...], y [K, N], mask [K, N]."""
  rows = x.shape[0] * x.shape[1]
  return SharedPool(x=x.reshape((rows,) + x.shape[2:]), y=y.reshape(rows),
                    mask=mask.reshape(rows))


def concatenate(pools) -> SharedPool:
  """One pool of the rows of `pools`, in order."""
  return SharedPool(*(jnp.concatenate(parts) for parts in zip(*pools)))


def _shuffled_real(key: jax.Array, mask: jax.Array) -> jax.Array:
  """[P] row indices: the real rows in random order, then the padding."""
  return jnp.argsort(jnp.where(mask, jax.random.uniform(key, mask.shape), 2.0))


def _cycled(order: jax.Array, count: jax.Array, slots: int) -> jax.Array:
  """[slots] the first `count` entries of `order`, repeated."""
  return order[jnp.arange(slots) % jnp.maximum(count, 1)]


def draw_uniform(key: jax.Array, mask: jax.Array, n: jax.Array,
                 size: int) -> tuple[jax.Array, jax.Array]:
  """(indices [size], weights [size]): n distinct real rows of a pool with `mask`, then
  repeats of them (weight 0)."""
  indices = _cycled(_shuffled_real(key, mask), jnp.sum(mask), size)
  return indices, (jnp.arange(size) < n).astype(jnp.float32)


def draw_balanced(key: jax.Array, y: jax.Array, mask: jax.Array, n: jax.Array,
                  size: int, num_classes: int) -> tuple[jax.Array, jax.Array]:
  """(indices [size], weights [size]): slots j < C (n // C) take row j mod (n // C) of
  class j // (n // C) (its rows in random order), the rest uniform real rows."""
  class_key, rest_key = jax.random.split(key)
  per_class = n // num_classes
  # Real rows sorted by class, in random order within it; padding last (class C).
  classes = jnp.where(mask, y, num_classes)
  order = jnp.lexsort((jax.random.uniform(class_key, mask.shape), classes))
  counts = jnp.bincount(classes, length=num_classes + 1)[:num_classes]
  starts = jnp.cumsum(counts) - counts
  slots = jnp.arange(size)
  label = jnp.minimum(slots // jnp.maximum(per_class, 1), num_classes - 1)
  within = (slots % jnp.maximum(per_class, 1)) % jnp.maximum(counts[label], 1)
  balanced = order[starts[label] + within]
  uniform = _cycled(_shuffled_real(rest_key, mask), jnp.sum(mask), size + size)
  # The leftover slots start at the uniform order's beginning, distinct from each other.
  rest = uniform[jnp.maximum(slots - per_class * num_classes, 0)]
  in_class = (slots < per_class * num_classes) & (counts[label] > 0)
  # An empty class's slots take uniform rows past the leftover ones.
  indices = jnp.where(in_class, balanced, jnp.where(
      slots < per_class * num_classes, uniform[size + slots % size], rest))
  return indices, (slots < n).astype(jnp.float32)
