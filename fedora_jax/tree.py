"""Pytree arithmetic on models, one model or stacked ones (leaves with a leading axis [N, ...]).

Every algorithm's server and regulariser maths goes through here: distances, weighted
means over the client axis, broadcasting to clients, taking and mixing models. Every
function works leaf by leaf, so no model is ever flattened into one long vector and no
[K, K, d] array of pairwise differences is built. Selecting between two trees is
`optax.tree_utils.tree_where`.
"""

import jax
import jax.numpy as jnp


def leading_size(stacked) -> int:
  """N, the size of the leading (client or model) axis every leaf shares."""
  return jax.tree.leaves(stacked)[0].shape[0]


def take(stacked, index):
  """The models at `index` (an int, or an int array of any shape [...] -> leaves [..., ...])."""
  return jax.tree.map(lambda leaf: leaf[index], stacked)


def first(stacked):
  """The first model of a stack (the run's shared initial model, in `InitContext.params`)."""
  return take(stacked, 0)


def broadcast_to_clients(tree, num_clients: int):
  """One model copied to [num_clients, ...] leaves (a view, no copy until written)."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients,) + a.shape), tree)


def weighted_mean(stacked, weights: jax.Array):
  """Mean over the leading axis of every leaf, weighted by `weights` [N] (normalised here)."""
  weights = weights / jnp.sum(weights)
  return jax.tree.map(lambda leaf: jnp.tensordot(weights, leaf, axes=(0, 0)), stacked)


def squared_distance(params, target) -> jax.Array:
  """||params - target||^2 over every leaf of two single models (a proximal term)."""
  return jnp.asarray(sum(jnp.sum(jnp.square(a - b)) for a, b in  # 0 for an empty tree
                         zip(jax.tree.leaves(params), jax.tree.leaves(target))))


def squared_distances(models, centers) -> jax.Array:
  """[N, C]: ||models_n - centers_c||^2, summed over every leaf.

  Differences are taken directly (not through ||a||^2 + ||b||^2 - 2ab), which would
  cancel catastrophically in float32 for nearby models.
  """
  def leaf_distances(a, c):
    diff = a[:, None] - c[None]
    return jnp.sum(jnp.square(diff).reshape(diff.shape[0], diff.shape[1], -1), axis=-1)
  return jnp.asarray(sum(jax.tree.leaves(jax.tree.map(leaf_distances, models, centers))))


def pairwise_squared_distances(stacked) -> jax.Array:
  """[K, K]: ||theta_i - theta_j||^2, one row at a time so memory stays O(K d)."""
  def row(model_i):
    single = jax.tree.map(lambda leaf: leaf[None], model_i)
    return squared_distances(single, stacked)[0]
  return jax.lax.map(row, stacked)


def gram(stacked) -> jax.Array:
  """[K, K]: <theta_i, theta_j> over all parameters."""
  def leaf_gram(leaf):
    flat = leaf.reshape(leaf.shape[0], -1)
    return flat @ flat.T
  return jnp.asarray(sum(jax.tree.leaves(jax.tree.map(leaf_gram, stacked))))


def mix(weights: jax.Array, stacked):
  """sum_j weights[..., j] theta_j: leaves [..., ...] from weights [..., N] and models [N, ...]."""
  if weights.ndim == 1:
    # One mixture as a matrix-vector product of the flattened leaves: the same values,
    # and XLA's CPU backend differentiates it w.r.t. the weights faster than the
    # tensordot over a leaf's trailing axes (docs/measurements/2026-11-26-cpu-kernels.md;
    # APPLE takes this gradient every local step).
    return jax.tree.map(
        lambda leaf: (weights @ leaf.reshape(leaf.shape[0], -1)).reshape(leaf.shape[1:]),
        stacked)
  return jax.tree.map(lambda leaf: jnp.tensordot(weights, leaf, axes=(-1, 0)), stacked)


def group_means(stacked, assignment: jax.Array, previous, members: jax.Array | None = None):
  """Mean of the models assigned to each group; a group nobody chose keeps `previous`.

  `assignment` [N] int holds each model's group in [0, C); `previous` has leaves [C, ...];
  `members` [N] bool, if given, says which models count (a round's sampled clients); [N]
  float weights give each model's weight in its group's mean.
  """
  num_groups = leading_size(previous)
  one_hot = jax.nn.one_hot(assignment, num_groups, dtype=jnp.float32)   # [N, C]
  if members is not None:
    one_hot = one_hot * members[:, None]
  counts = jnp.sum(one_hot, axis=0)                                       # [C]
  sums = mix(one_hot.T, stacked)                                          # [C, ...]

  def mean_or_keep(total, old):
    count = counts.reshape((-1,) + (1,) * (old.ndim - 1))
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), old)
  return jax.tree.map(mean_or_keep, sums, previous)


def random_models(params, key: jax.Array, num: int):
  """`num` fresh random models [num, ...] drawn like `params` (one model, no leading axis).

  Each leaf's entries are independently shuffled. Initialisers draw a layer's entries
  i.i.d. (PyTorch's uniform default, flax's normal ones), and a random permutation of an
  i.i.d. sample is another sample of the same distribution, so this re-initialises the
  model without knowing its initialiser. Constant leaves (zero biases) stay constant.
  """
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))

  def shuffled(leaf, leaf_key):
    model_keys = jax.random.split(leaf_key, num)
    return jax.vmap(
        lambda k: jax.random.permutation(k, leaf.reshape(-1)).reshape(leaf.shape))(model_keys)
  return jax.tree.unflatten(treedef, [shuffled(leaf, k) for leaf, k in zip(leaves, keys)])


def initial_centers(context_params, key: jax.Array, num: int):
  """[num, ...] distinct starting models: the run's initial model, then random ones."""
  initial = first(context_params)
  if num == 1:
    return jax.tree.map(lambda leaf: leaf[None], initial)
  others = random_models(initial, key, num - 1)
  return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), initial, others)
