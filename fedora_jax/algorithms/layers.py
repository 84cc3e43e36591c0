"""Splitting a flax model into shared and personal layers, and the algorithm both
LG-FedAvg (lg_fedavg.py) and FedPer (fedper.py) are built on.

Layers are the top-level entries of `params["params"]`, ordered from input to output by module
type (convolutions first) and then by flax's index; every layer-wise method takes them from
`layer_names` and its body / head split from `split_body_head` (the head: the top `head_layers`
layers). `apply_with_representation` reads the body's output (the head's input) off the
model's forward pass; `affine_head` applies a head of a method's own to such features.

In a partial-sharing method the server holds only the shared layers; each client trains its
whole model after taking the global shared layers, uploads its shared layers, and is scored
with the latest global shared layers under its own personal ones.

Details (every option, the departures, measurements): docs/algorithms/layers.md.
"""

import math
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError
from fedora_jax.models import LAYER_TYPE_ORDER

Params = Any
# select_shared(ordered layer names, input to output) -> the names whose weights are shared.
SelectShared = Callable[[list[str]], list[str]]


def _type_and_index(name: str) -> tuple[str, int]:
  match = re.fullmatch(r"(.*)_(\d+)", name)
  if match is None:
    raise ConfigError(f"cannot order layer {name!r}: expected flax's <Module>_<index> names")
  return match.group(1), int(match.group(2))


def layer_names(params: Params) -> list[str]:
  """The model's layers, input to output: by module type in LAYER_TYPE_ORDER, then by the
  index flax numbers each type with in creation order."""
  names = list(params["params"])
  types = {_type_and_index(n)[0] for n in names}
  unranked = sorted(types - set(LAYER_TYPE_ORDER))
  if len(types) > 1 and unranked:
    raise ConfigError(f"layer order is ambiguous across module types {sorted(types)}:"
                      f" {unranked} not in fedora_jax.models.LAYER_TYPE_ORDER")
  rank = {t: i for i, t in enumerate(LAYER_TYPE_ORDER)}

  def key(name: str) -> tuple[int, int]:
    module_type, index = _type_and_index(name)
    return rank.get(module_type, 0), index
  return sorted(names, key=key)


def split_body_head(params: Params, head_layers: int, role: str) -> tuple[list[str], list[str]]:
  """(body layer names, head layer names), input to output: the head is the top
  `head_layers` layers. `role` names the setting in the error message."""
  names = layer_names(params)
  if not 1 <= head_layers < len(names):
    raise ConfigError(f"{role} must be between 1 and {len(names) - 1} for a model with"
                      f" {len(names)} layers, got {head_layers}")
  return names[:len(names) - head_layers], names[len(names) - head_layers:]


def apply_with_representation(apply_fn: Callable[[Params, jax.Array], jax.Array],
                              params: Params, x: jax.Array,
                              head: str) -> tuple[jax.Array, jax.Array]:
  """(outputs [B, ...], representation [B, d]): one forward pass of `apply_fn`, and the
  input of the top-level layer `head` (flattened per sample), i.e. the body's output."""
  captured = []

  def record(next_fun, args, kwargs, context):
    scope = context.module.scope
    if (context.method_name == "__call__" and scope is not None
        and tuple(scope.path) == (head,)):
      captured.append(args[0])
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(record):
    outputs = apply_fn(params, x)
  if len(captured) != 1:
    raise ConfigError(f"the model called its layer {head!r} {len(captured)} times in one"
                      " forward pass; a representation needs exactly one call")
  return outputs, captured[0].reshape(captured[0].shape[0], -1)


def in_chunks(array: Any, chunk: int) -> jax.Array:
  """[num_chunks, chunk, ...]: `array`'s rows zero-padded (False for a mask) to whole
  chunks, for a lax.map or scan over them."""
  array = jnp.asarray(array)
  num_chunks = math.ceil(array.shape[0] / chunk)
  pad = num_chunks * chunk - array.shape[0]
  if pad:
    array = jnp.concatenate([array, jnp.zeros((pad,) + array.shape[1:], array.dtype)])
  return array.reshape((num_chunks, chunk) + array.shape[1:])


def representations(apply_fn: Callable[[Params, jax.Array], jax.Array], params: Params,
                    x: jax.Array, head: str, chunk: int = 256) -> jax.Array:
  """[N, d] body outputs of all N samples of `x`, `chunk` samples per forward pass."""
  size = x.shape[0]

  def one_chunk(xb):
    return apply_with_representation(apply_fn, params, xb, head)[1]
  features = jax.lax.map(one_chunk, in_chunks(x, min(size, chunk)))
  return features.reshape(-1, features.shape[-1])[:size]


def _check_count(count: int, names: list[str], role: str) -> None:
  # Zero or all layers would make the method FedAvg or LOCAL under another name.
  if not 1 <= count < len(names):
    raise ConfigError(f"{role} must be between 1 and {len(names) - 1} for a model with"
                      f" {len(names)} layers, got {count}")


def all_but_bottom_layers(count: int, role: str) -> SelectShared:
  """Shares every layer except the `count` nearest the input (LG-FedAvg's global layers)."""
  def select(names: list[str]) -> list[str]:
    _check_count(count, names, role)
    return names[count:]
  return select


def all_but_top_layers(count: int, role: str) -> SelectShared:
  """Shares every layer except the `count` nearest the output (FedPer's base layers)."""
  def select(names: list[str]) -> list[str]:
    _check_count(count, names, role)
    return names[:len(names) - count]
  return select


def check_representation_trainer(owner: str, trainer: ClientTrainer) -> None:
  """ConfigError unless `owner`, a method on the body's output of a classifier (MOON,
  FedProto), can read it: a classification task and the model's forward in the trainer."""
  if trainer.task != "classification":
    raise ConfigError(f"{owner} needs a classification task, not {trainer.task}")
  if trainer.apply is None:
    raise ConfigError(f"{owner} needs the model's apply function in the client trainer")


def head_layer(params: Params, role: str = "head_layers") -> str:
  """The model's top layer (the classifier), which must be affine with a bias (a Dense
  layer): its input is the body's output, the representation."""
  head = split_body_head(params, 1, role)[1][0]
  if sorted(params["params"][head]) != ["bias", "kernel"]:
    raise ConfigError(f"{role} needs an affine head layer (kernel and bias); {head} has"
                      f" {sorted(params['params'][head])}")
  return head


def affine_head(head_params: Params, features: jax.Array) -> jax.Array:
  """[B, C] = features @ kernel + bias: a Dense head (its layer's parameters) on features."""
  return features @ head_params["kernel"] + head_params["bias"]


def take_layers(params: Params, names: list[str]) -> Params:
  """The sub-tree {"params": {name: ...}} of the given layers."""
  return {"params": {name: params["params"][name] for name in names}}


def merge_layers(base: Params, override: Params) -> Params:
  """`base` with the layers present in `override` replaced by override's."""
  return {"params": {**base["params"], **override["params"]}}


def partial_sharing(name: str, trainer: ClientTrainer,
                    select_shared: SelectShared) -> Algorithm:
  """FedAvg over the layers `select_shared` picks; every other layer stays on its client."""
  def shared_of(params: Params) -> Params:
    return take_layers(params, select_shared(layer_names(params)))

  def init(context: InitContext) -> AlgorithmState:
    # All clients start from one model, so client 0's shared layers are everyone's.
    first = tree.first(context.params)
    return AlgorithmState(server=shared_of(first), clients=context.params)

  def broadcast(shared, client_params):
    return tree.broadcast_to_clients(shared, tree.leading_size(client_params))

  def client_update(params, shared, data, key):
    params, stats = trainer.train(merge_layers(params, shared), data.train, key)
    return ClientOutput(state=params, upload=shared_of(params), train=stats)

  def aggregate(server, client_params, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights),
                          clients=client_params)

  def personalized_params(shared, client_params):
    return merge_layers(client_params, broadcast(shared, client_params))

  return Algorithm(name=name, init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
