"""BatchNorm statistics (flax's `batch_stats` collection) as part of each client's model.

Where they live
---------------
The engine's model is a flax variables dict `{"params": ...}`, and every algorithm
stacks, sends, mixes, averages and checkpoints that pytree. A model with BatchNorm also
has running means and variances, flax's mutable `batch_stats` collection. Carrying them
as a separate model state would make each of the 40+ algorithms thread it through its
client state, messages, server maths and evaluation, and several build the variables
dict themselves layer by layer (`{"params": {name: ...}}`: FedRep, FedRoD, FedProto,
coaching, pFedLA, PartialFed), which would silently drop a second collection. So the
engine *folds* the statistics into the parameters instead: each BatchNorm module's
running averages sit beside its scale and bias under the reserved key `batch_stats`,

  {"params": {"ConvBN_0": {"Conv_0": {"kernel": ...},
                           "BatchNorm_0": {"scale": ..., "bias": ...,
                                           "batch_stats": {"mean": ..., "var": ...}}}}}

(`fold`; `unfold` gives flax back its two collections, and only `model_apply` calls
flax with them). They thus belong to their layer (algorithms/layers.py: a layer is a
top-level module) and every algorithm treats them exactly as it treats that layer's
other parameters, without a line of its own: FedAvg averages them, LOCAL keeps them,
FedPer keeps its personal layers', coaching and pFedLA mix them with their layer, the
checkpoint saves and restores them with the rest of the round state. FedBN
(algorithms/fedbn.py) is the algorithm that keeps them, and BatchNorm's scale and bias,
on the client (`is_batch_norm`). Models without BatchNorm have no `batch_stats` key and
run exactly the code they ran before (tests/test_golden_results.py).

Modes
-----
`model_apply(model.apply)` is the trainer's forward (`ClientTrainer.apply`, and through
it `loss` and `evaluate`). Outside local training it runs inference mode: BatchNorm
normalises with the running averages, which no gradient reaches there (stop_gradient);
a running variance below zero, which a mixture with negative weights or an extrapolating
step can make, normalises as zero variance instead of NaN.
That is evaluation and representations read after training. ALA's weight learning runs
its loss inside `training` (train mode, as the authors' temporary model does) over the
local model's averages, which W does not mix, so nothing it carries back is kept.
Per-FedAvg and pFedMe, whose gradient loops are their own rather than
`ClientTrainer.train`'s, take their gradients through `train_mode_value_and_grad` and
set the running averages each pass carries (`apply_carried_update`), as PyTorch's
train-mode forward passes would. Inside the objective of `ClientTrainer.train` (the
`training` context, entered at trace time) every forward pass runs in train mode,
flax's `mutable=["batch_stats"]`: BatchNorm normalises with the statistics of the
batch's real samples (`mask`: the padded slots of a partial last batch are left out, as
a PyTorch DataLoader's smaller last batch would be) and computes new running averages.
A model with BatchNorm takes that mask as the keyword argument `mask` ([B] bool) and
hands it to its BatchNorm layers, which are flax's nn.BatchNorm (models/resnet.py).

How the new running averages reach the trained parameters
---------------------------------------------------------
An algorithm's loss may build the model it runs from what it trains in any way:
merging trained layers into fixed ones (FedBABU), masking phases (FedRep), mixing two
models (APFL), reading fixed models beside it (MOON's global and previous models). The
forward pass knows only the statistics it was given, not where they came from. So the
update travels back the way gradients do: in train mode every flax nn.BatchNorm's output
gets a zero added (a method interceptor) from `_carry_statistics`, a custom_vjp whose
backward pass returns SCALE * (used - new) for the statistics that layer used. Any use
of the layer's output downstream (the logits, FedCP's and MOON's representations) brings
that backward pass about. The trainer reads those entries off the gradient
(`is_statistic` paths) and sets each trained statistic to old - grad / SCALE: where the
model's statistics are the trained ones (the common case) that is exactly the new
running average; through a merge or a mask it lands on the statistic it came from;
through a mixture a v + (1 - a) w it moves v and w by their share; constants (MOON's
fixed models, stop_gradient) receive nothing; two forward passes over the same
parameters in one step update them twice, as two train-mode passes in PyTorch do.
SCALE = 2^-20 keeps that entry's side effect on other trained leaves negligible (APFL's
mixing weight alpha also receives the derivative of the mixed statistics, 2^-20 of it)
and, being a power of two, loses no precision.

The statistics are never trained by the optimizer: the data loss does not read them in
train mode, regularisers (proximal terms) see them through stop_gradient, their gradient
entries are zeroed before the optimizer (no momentum, no weight decay) and their value
is set as above after it; steps of padding (a smaller client in a bucket of larger ones)
leave them unchanged as they leave the parameters. The algorithm's `post_step` then sees
them as any parameter.

Algorithms that make models rather than train them decide for themselves: pFedHN's
hypernetwork generates the running averages as it generates every parameter, its heads
for them starting at the initial model's values (algorithms/pfedhn.py). PyTorch stores
the unbiased batch variance in its running average and flax the biased one (n / (n - 1)
apart: 1.6 % at batch 64).
"""

import contextlib
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from fedora_jax.errors import ConfigError

Params = Any
BATCH_STATS = "batch_stats"  # flax's collection, and the reserved key it is folded under
SCALE = 2.0 ** -20
_BATCH_NORM = re.compile(r"BatchNorm_\d+")


def fold(variables: dict) -> dict:
  """flax's {"params", "batch_stats"} -> {"params"} with each module's statistics under
  its "batch_stats" key. Variables without batch_stats are returned as they are."""
  if BATCH_STATS not in variables:
    return variables
  unknown = sorted(set(variables) - {"params", BATCH_STATS})
  if unknown:
    raise ConfigError(f"models may hold params and batch_stats only, not {unknown}")
  flat = traverse_util.flatten_dict(variables["params"])
  for path, value in traverse_util.flatten_dict(variables[BATCH_STATS]).items():
    flat[path[:-1] + (BATCH_STATS, path[-1])] = value
  return {"params": traverse_util.unflatten_dict(flat)}


def unfold(params: dict) -> dict:
  """The inverse of `fold`: {"params": ..., "batch_stats": ...} for flax (variables in
  that layout already are returned as they are)."""
  if BATCH_STATS in params:
    return params
  flat = traverse_util.flatten_dict(params["params"])
  weights, statistics = {}, {}
  for path, value in flat.items():
    if BATCH_STATS in path:
      at = path.index(BATCH_STATS)
      statistics[path[:at] + path[at + 1:]] = value
    else:
      weights[path] = value
  return {"params": traverse_util.unflatten_dict(weights),
          BATCH_STATS: traverse_util.unflatten_dict(statistics)}


def _keys(path) -> list[str]:
  return [str(getattr(entry, "key", getattr(entry, "name", ""))) for entry in path]


def is_statistic(path) -> bool:
  """Whether a leaf at this key path (jax.tree_util) is a folded running average."""
  return BATCH_STATS in _keys(path)


def is_batch_norm(path) -> bool:
  """Whether a leaf belongs to a BatchNorm layer: its running averages, scale and bias
  (flax names those modules BatchNorm_<n>). FedBN keeps these on the client."""
  return any(key == BATCH_STATS or _BATCH_NORM.fullmatch(key) for key in _keys(path))


def has_statistics(tree: Any) -> bool:
  """Whether any leaf of `tree` is a folded running average (decided when tracing)."""
  return any(is_statistic(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree))


def statistics_mask(tree: Any) -> Any:
  """A tree of bools like `tree`: True at the running averages."""
  return jax.tree_util.tree_map_with_path(lambda path, _: is_statistic(path), tree)


def without_statistics_gradient(tree: Any) -> Any:
  """`tree` with stop_gradient on its running averages (what regularisers see)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: jax.lax.stop_gradient(leaf) if is_statistic(path) else leaf, tree)


# The masks of the local-training objectives being traced, innermost last. Trace-time
# Python state, like flax's method interceptors: nothing of it reaches the compiled code.
_TRAINING: list[jax.Array] = []


@contextlib.contextmanager
def training(mask: jax.Array):
  """Forward passes of `model_apply` run in train mode while this is entered; `mask`
  [B] bool marks the batch's real samples."""
  # A step of padding only: normalise with all its slots (the step is discarded anyway)
  # rather than divide by zero samples.
  _TRAINING.append(mask | ~jnp.any(mask))
  try:
    yield
  finally:
    _TRAINING.pop()


@jax.custom_vjp
def _carry_statistics(used, new):
  """0.0; its backward pass returns SCALE * (used - new) for `used` (module docstring)."""
  del used, new
  return jnp.zeros((), jnp.float32)


def _carry_forward(used, new):
  return _carry_statistics(used, new), (used, new)


def _carry_backward(residuals, cotangent):
  del cotangent  # the update does not depend on how the outputs are used
  used, new = residuals
  return (jax.tree.map(lambda u, n: (u - n) * SCALE, used, new),
          jax.tree.map(jnp.zeros_like, new))


_carry_statistics.defvjp(_carry_forward, _carry_backward)


def _carry_at_batch_norm(next_fun, args, kwargs, context):
  """flax method interceptor: each BatchNorm call's output plus the zero that carries its
  running averages' update back (`_carry_statistics`)."""
  module = context.module
  if not isinstance(module, nn.BatchNorm) or context.method_name != "__call__":
    return next_fun(*args, **kwargs)
  if BATCH_STATS not in module.variables:  # initialisation: nothing to carry
    return next_fun(*args, **kwargs)
  # A copy of the tree (the same arrays): flax updates the collection's dicts in place.
  used = jax.tree.map(lambda leaf: leaf, module.variables[BATCH_STATS])
  outputs = next_fun(*args, **kwargs)
  new = jax.lax.stop_gradient(module.variables[BATCH_STATS])
  return outputs + _carry_statistics(used, new).astype(outputs.dtype)


def _nonnegative_variances(statistics: dict) -> dict:
  """Running variances below zero (a mixture with negative weights can make one) as 0."""
  flat = traverse_util.flatten_dict(statistics)
  return traverse_util.unflatten_dict(
      {path: jnp.maximum(leaf, 0.0) if path[-1] == "var" else leaf
       for path, leaf in flat.items()})


def model_apply(apply_fn: Callable[..., Any]) -> Callable[[Params, jax.Array], Any]:
  """`apply(params, x) -> outputs` for a flax `model.apply` on folded params: unchanged
  without statistics; else inference mode, or train mode inside `training`."""
  def apply(params: Params, x: jax.Array):
    if not has_statistics(params):
      return apply_fn(params, x)
    variables = unfold(params)
    if not _TRAINING:  # no gradient trains a running average (pFedMe's own loop, say)
      statistics = _nonnegative_variances(jax.lax.stop_gradient(variables[BATCH_STATS]))
      return apply_fn({**variables, BATCH_STATS: statistics}, x)
    mask = _TRAINING[-1]
    if mask.shape != x.shape[:1]:  # another batch than the step's: all of it is real
      mask = jnp.ones(x.shape[:1], bool)
    with nn.intercept_methods(_carry_at_batch_norm):
      outputs, _ = apply_fn(variables, x, mask=mask, mutable=[BATCH_STATS])
    return outputs
  return apply


def train_mode_value_and_grad(loss_fn: Callable[..., jax.Array]) -> Callable[..., Any]:
  """`jax.value_and_grad` of `loss_fn(params, x, y, weights)` with BatchNorm in train mode
  over the samples of nonzero weight: for algorithms with gradient loops of their own
  (Per-FedAvg, pFedMe). The gradient's statistic entries carry the new running averages
  (`apply_carried_update`); the other entries are the train-mode loss's gradient."""
  def value_and_grad(params: Params, x: jax.Array, y: jax.Array, weights: jax.Array):
    with training(weights > 0):  # entered while value_and_grad traces the loss
      return jax.value_and_grad(loss_fn)(params, x, y, weights)
  return value_and_grad


def take_statistics(params: Params, source: Params) -> Params:
  """`params` with the running averages of `source` (a model of the same structure)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p, s: s if is_statistic(path) else p, params, source)


def apply_carried_update(new_params: Params, old_params: Params, grads: Params) -> Params:
  """`new_params` with every running average set to old - grad / SCALE (the update
  the train-mode forward passes carried back through the gradient)."""
  def set_statistic(path, new, old, grad):
    return old - grad / SCALE if is_statistic(path) else new
  return jax.tree_util.tree_map_with_path(set_statistic, new_params, old_params, grads)


def zero_statistics(grads: Params) -> Params:
  """`grads` with the running averages' entries zeroed (what the optimizer sees)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, g: jnp.zeros_like(g) if is_statistic(path) else g, grads)
