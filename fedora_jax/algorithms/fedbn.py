"""FedBN: FedAvg for every parameter but BatchNorm's, which stay on their client.

Li, Jiang, Zhang, Kamp, Dou. "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization." ICLR 2021. https://arxiv.org/abs/2102.07623
(code: github.com/med-air/FedBN)

Client k trains the whole model for the run's local epochs under its own BatchNorm layers
(scale, shift and running statistics) and uploads the rest; the server averages the uploads
and client k is scored with them under its own BatchNorm layers. On a model without
BatchNorm FedBN is FedAvg (a warning is logged); resnet18 and coaching_cnn_bn have it.

Departures: clients weighted by their n_k training samples (`weighting` "samples", as
FedAvg); "uniform" is Algorithm 1's 1/K.

Details (every option, the departures, measurements): docs/algorithms/fedbn.md.
"""

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.batch_stats import is_batch_norm
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import check_one_of

Params = Any
WEIGHTINGS = ("samples", "uniform")


class FedBnConfig(NamedTuple):
  weighting: str = "samples"  # "samples": n_k / n (FedAvg's); "uniform": 1/K (Algorithm 1)


FLAG_HELP = {
    "weighting": "FedBN: average the non-BatchNorm parameters weighted by training samples"
                 " (samples, as FedAvg) or uniformly over clients (uniform, the paper's"
                 " Algorithm 1)",
}


class FedBnClient(NamedTuple):
  # [K] int32, the client's index (keeps the K axis on BN-free models). The name shadows
  # tuple.index, never called here; checkpoints store it, so it stays.
  index: jax.Array  # type: ignore[assignment]
  batch_norm: Params     # [K, ...] the client's BatchNorm leaves (empty without BatchNorm)


def _is_local(path: tuple) -> bool:
  """For flax.traverse_util paths (tuples of dict keys)."""
  return is_batch_norm([jax.tree_util.DictKey(key) for key in path])


def split_batch_norm(params: Params) -> tuple[Params, Params]:
  """(shared, batch_norm): the variables dict split into its non-BatchNorm and BatchNorm
  leaves, each a nested dict of the same layout (possibly empty)."""
  flat = traverse_util.flatten_dict(params)
  shared = {path: leaf for path, leaf in flat.items() if not _is_local(path)}
  local = {path: leaf for path, leaf in flat.items() if _is_local(path)}
  return traverse_util.unflatten_dict(shared), traverse_util.unflatten_dict(local)


def with_batch_norm(shared: Params, batch_norm: Params) -> Params:
  """The whole variables dict: the shared leaves and a client's BatchNorm leaves."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(shared),
                                       **traverse_util.flatten_dict(batch_norm)})


def validate(config: FedBnConfig) -> FedBnConfig:
  check_one_of("fedbn", config, "weighting", WEIGHTINGS)
  return config


def fedbn(config: FedBnConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    shared, batch_norm = split_batch_norm(tree.first(context.params))
    num_clients = tree.leading_size(context.params)
    if not jax.tree.leaves(batch_norm):
      logging.getLogger("fedora_jax").warning(
          "fedbn: the model has no BatchNorm layers, so FedBN is FedAvg here")
    local = split_batch_norm(context.params)[1]
    return AlgorithmState(server=shared, clients=FedBnClient(
        index=jnp.arange(num_clients, dtype=jnp.int32), batch_norm=local))

  def broadcast(shared, clients: FedBnClient):
    return tree.broadcast_to_clients(shared, clients.index.shape[0])

  def client_update(client: FedBnClient, shared, data, key):
    params, stats = trainer.train(with_batch_norm(shared, client.batch_norm), data.train,
                                  key)
    shared, batch_norm = split_batch_norm(params)
    return ClientOutput(state=client._replace(batch_norm=batch_norm), upload=shared,
                        train=stats)

  def aggregate(server, clients, uploads, weights):
    del server
    if config.weighting == "uniform":
      weights = (weights > 0).astype(weights.dtype)  # 1/K over the round's clients
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(shared, clients: FedBnClient):
    return with_batch_norm(broadcast(shared, clients), clients.batch_norm)

  return Algorithm(name="fedbn", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
