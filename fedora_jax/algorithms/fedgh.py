"""FedGH: clients keep their own feature extractors and share one generalized global
header, which the server trains on the class prototypes the clients upload.

Yi, Wang, Liu, Shi, Yu. "FedGH: Heterogeneous Federated Learning with Generalized Global
Header." ACM Multimedia 2023. https://arxiv.org/abs/2303.13137
(code: PFLlib's clientgh.py / servergh.py, which the verification runs beside this
module. The paper's full text is not on disk: this module follows that code, and names
no equation numbers.)

Client i trains its own feature extractor f_i under the global header h (the top layer) for
the run's local epochs and uploads its class prototypes (mean features per class); the
server trains h on them, one epoch of plain SGD at `server_lr` (1, PFLlib's), and sends it
to every client. Client i is scored with (f_i, h). `server_head_start` "global"
("first_client": PFLlib's).

Departures: prototypes average every training sample; partial last batches train (PFLlib: dropped).

Details (every option, the departures, measurements): docs/algorithms/fedgh.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.fedproto import Prototypes, class_prototypes
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.algorithms.layers import (affine_head, check_representation_trainer,
                                          head_layer, merge_layers, representations,
                                          split_body_head, take_layers)
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import (ClientTrainer, make_client_trainer,
                                              make_optimizer, masked_cross_entropy)
from fedora_jax.errors import FieldError, check_one_of

Params = Any
HEAD_STARTS = ("global", "first_client")


class FedGhConfig(NamedTuple):
  server_lr: float = 1.0                 # the server's SGD on the header (PFLlib's default)
  server_head_start: str = "global"      # or "first_client" (PFLlib's aliasing)


FLAG_HELP = {
    "server_lr": "FedGH: learning rate of the server's SGD training the global header on"
                 " the clients' class prototypes",
    "server_head_start": "FedGH: the server trains the header from the one it sent (global)"
                         " or from client 0's locally trained one (first_client, PFLlib)",
}


class GhServer(NamedTuple):
  head: Params        # {"params": {head: ...}} the global header h
  key: jax.Array      # raw key data of the server's shuffles
  round: jax.Array    # [] int32


class GhUpload(NamedTuple):
  prototypes: Prototypes   # [C, d], [C]
  head: Params             # the client's trained header


def validate(config: FedGhConfig, trainer: ClientTrainer) -> FedGhConfig:
  if not config.server_lr > 0:
    raise FieldError("fedgh", "server_lr", f"must be > 0, got {config.server_lr}")
  check_one_of("fedgh", config, "server_head_start", HEAD_STARTS)
  check_representation_trainer("fedgh", trainer)
  return config


def header_loss(head: str):
  """loss_fn(header, prototypes, classes, weights): cross-entropy of h(P)."""
  def loss(header, x, y, weights):
    return masked_cross_entropy(affine_head(header["params"][head], x), y, weights)
  return loss


def prototype_pairs(prototypes: Prototypes, sampled: jax.Array) -> ClientData:
  """The uploaded (P_ic, c) pairs as one dataset: slot i C + c, real where client i was
  sampled and holds class c."""
  num_clients, num_classes, dim = prototypes.means.shape
  mask = ((prototypes.counts > 0) & sampled[:, None]).reshape(-1)
  return ClientData(x=prototypes.means.reshape(num_clients * num_classes, dim),
                    y=jnp.tile(jnp.arange(num_classes, dtype=jnp.int32), num_clients),
                    mask=mask, n=jnp.sum(mask).astype(jnp.int32))


def fedgh(config: FedGhConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  server_trainer = make_client_trainer(lambda params, x: x,
                                       make_optimizer(config.server_lr, 0.0), 1,
                                       batch_size_of(trainer))

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    body_names = split_body_head(first, 1, "fedgh")[0]
    server = GhServer(head=take_layers(first, [head_layer(first, "fedgh")]),
                      key=raw_key(context.key), round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=take_layers(context.params, body_names))

  def broadcast(server: GhServer, bodies):
    return tree.broadcast_to_clients(server.head, tree.leading_size(bodies))

  def client_update(body, header, data, key):
    model = merge_layers(body, header)
    head = head_layer(model, "fedgh")
    num_classes = model["params"][head]["kernel"].shape[-1]
    params, stats = trainer.train(model, data.train, key)
    features = representations(trainer.apply, params, data.train.x, head)
    prototypes = class_prototypes(features, data.train.y, data.train.mask, num_classes)
    return ClientOutput(state=take_layers(params, list(body["params"])),
                        upload=GhUpload(prototypes=prototypes,
                                        head=take_layers(params, [head])),
                        train=stats)

  def aggregate(server: GhServer, bodies, uploads: GhUpload, weights):
    sampled = weights > 0
    head = list(server.head["params"])[0]
    start = server.head
    if config.server_head_start == "first_client":
      start = jax.tree.map(lambda new, old: jnp.where(sampled[0], new[0], old),
                           uploads.head, server.head)
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
    trained, _ = server_trainer.train(start, prototype_pairs(uploads.prototypes, sampled),
                                      key, loss_fn=header_loss(head))
    return AlgorithmState(server=server._replace(head=trained, round=server.round + 1),
                          clients=bodies)

  def personalized_params(server: GhServer, bodies):
    return merge_layers(bodies, broadcast(server, bodies))

  return Algorithm(name="fedgh", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
