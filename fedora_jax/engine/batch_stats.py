"""BatchNorm statistics (flax's `batch_stats` collection) as part of each client's model.

Layout. The engine's model is one flax variables dict `{"params": ...}` that every
algorithm stacks, sends, mixes and checkpoints, several building it layer by layer. So
each BatchNorm module's running averages are folded in beside its scale and bias under
the key `batch_stats` (`fold`; `unfold` gives flax its two collections back):

  {"params": {"ConvBN_0": {"Conv_0": {...}, "BatchNorm_0": {"scale": ..., "bias": ...,
                                        "batch_stats": {"mean": ..., "var": ...}}}}}

They belong to their layer (algorithms/layers.py), so each algorithm treats them as that
layer's other parameters: FedAvg averages them, LOCAL and FedPer keep them, coaching and
pFedLA mix them, checkpoints hold them; FedBN keeps them and BatchNorm's scale and bias
on the client (`is_batch_norm`); pFedHN generates them. Models without BatchNorm have no
such key and run the code they ran before.

Modes, as in flax's examples (imagenet/train.py). Forward passes (`model_apply`) run
inference mode, `use_running_average=True`: evaluation and everything outside a training
step; a negative running variance (a mixture with negative weights) counts as zero.
Inside `training(mask)` they run train mode, `model.apply(..., mask=mask,
mutable=["batch_stats"])`: statistics of the batch's real samples, and flax returns the
new running averages, which the context records beside those the pass used.
`value_and_grad` takes a step's gradient and returns those new running averages
explicitly, set on the trained parameters they came from (a step that trains no running
averages, a head over a fixed body, runs inference mode): the step (ClientTrainer.train,
Per-FedAvg's and pFedMe's loops) writes them into its state in place of the optimizer's
update (their gradient entries are zero). A loss may build the model it runs from what
it trains (FedBABU's merge, FedRep's masks, APFL's mixture, a fixed model beside it; MOON
runs its fixed models in inference mode, `inference`), so each pass's update `used - new`
is pulled back through the map from the trained parameters to the averages that pass
used (a vjp of that map alone): the trained model's
own averages become the new ones, a mixture a v + (1 - a) w moves v and w by their
share, constants receive nothing, and two passes over the same averages move them
twice, as two train-mode passes in PyTorch do. PyTorch stores the unbiased batch
variance in its running average and flax the biased one (n / (n - 1) apart: 1.6 % at
batch 64).
"""

import contextlib
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util

from fedora_jax.errors import ConfigError

Params = Any
BATCH_STATS = "batch_stats"  # flax's collection, and the reserved key it is folded under
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


class Pass(NamedTuple):
  """One train-mode forward pass: the running averages it was given, flax's new ones."""
  used: dict
  new: dict


# The train-mode contexts being traced, innermost last: (mask, the passes recorded).
# Trace-time Python state, as flax's module contexts; none of it reaches compiled code.
_TRAINING: list[tuple[jax.Array, list[Pass]]] = []


@contextlib.contextmanager
def training(mask: jax.Array):
  """Forward passes of `model_apply` traced inside run in train mode over the samples
  `mask` ([B] bool) marks; yields the list of their `Pass`es."""
  passes: list[Pass] = []
  # A step of padding only: normalise with all its slots (the step is discarded anyway)
  # rather than divide by zero samples.
  _TRAINING.append((mask | ~jnp.any(mask), passes))
  try:
    yield passes
  finally:
    _TRAINING.pop()


@contextlib.contextmanager
def inference():
  """Forward passes of `model_apply` traced inside run in inference mode, on their running
  averages, even within `training`: a fixed model beside the trained one (MOON's global
  and previous models, which its authors' code puts in eval()). Records no `Pass`."""
  outer = _TRAINING[:]
  _TRAINING.clear()
  try:
    yield
  finally:
    _TRAINING[:] = outer


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
    if not _TRAINING:  # no gradient reaches a running average here
      statistics = _nonnegative_variances(jax.lax.stop_gradient(variables[BATCH_STATS]))
      return apply_fn({**variables, BATCH_STATS: statistics}, x)
    mask, passes = _TRAINING[-1]
    if mask.shape != x.shape[:1]:  # another batch than the step's: all of it is real
      mask = jnp.ones(x.shape[:1], bool)
    used = jax.tree.map(lambda leaf: leaf, variables[BATCH_STATS])  # flax may update dicts
    outputs, updated = apply_fn(variables, x, mask=mask, mutable=[BATCH_STATS])
    passes.append(Pass(used, jax.lax.stop_gradient(updated[BATCH_STATS])))
    return outputs
  return apply


def value_and_grad(fun: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
  """`jax.value_and_grad(fun, has_aux)` of `fun(params, *args)` with its forward passes
  in train mode over the samples `mask` marks (a keyword argument, [B] bool), when
  `params` holds running averages; otherwise (a head trained over a fixed body) plain
  `jax.value_and_grad`, the passes in inference mode.

  Returns (value, grads, updated): the gradients, zero at the running averages, and
  `params` with its running averages moved by the passes (module docstring), which the
  step writes into its state with `take_statistics`.
  """
  def run(params: Params, *args, mask: jax.Array):
    if not has_statistics(params):  # a head over a fixed body, say: inference mode
      out, grads = jax.value_and_grad(fun, has_aux=has_aux)(params, *args)
      return out, grads, params

    def traced(p):
      with training(mask) as passes:
        out = fun(p, *args)
      value, aux = out if has_aux else (out, None)
      return value, (aux, passes)

    (value, (aux, passes)), grads = jax.value_and_grad(traced, has_aux=True)(params)
    grads = jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_statistic(path) else g, grads)
    updated = params
    if passes:
      # The averages each pass used, as a function of params: a second trace of `fun`,
      # of which the compiled step keeps only that map (its vjp) and drops the rest.
      _, pull = jax.vjp(lambda p: [used for used, _ in traced(p)[1][1]], params)
      (moved,) = pull([jax.tree.map(jnp.subtract, used, new) for used, new in passes])
      updated = jax.tree_util.tree_map_with_path(
          lambda path, p, m: p - m if is_statistic(path) else p, params, moved)
    return ((value, aux) if has_aux else value), grads, updated
  return run


def take_statistics(params: Params, source: Params) -> Params:
  """`params` with the running averages of `source` (a model of the same structure)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p, s: s if is_statistic(path) else p, params, source)
