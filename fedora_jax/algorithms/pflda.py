"""PFL-DA: personalised federated learning via domain adaptation. Each client keeps its
whole model; it fits its own head near a shared head, then trains its feature extractor
under the shared head, which the server averages.

"Personalized Federated Learning via Domain Adaptation with an Application to
Distributed 3D Printing." Technometrics, 2023 (two authors, University of Michigan; their
names are not on disk, see the DOI). https://doi.org/10.1080/00401706.2022.2157882
(code: PFLlib's clientda.py / serverda.py ("PFL-DA"), which the verification runs beside
this module. The paper's full text is not on disk: this module follows that code, and
names no equation numbers.)

A sampled client trains its head h_i on CE + lam ||g - h_i||_2 (lam 1), then its extractor f_i
with the global head g (h_i fixed), and uploads g; the server averages the g (FedAvg) and sends it
to every client. Client i is scored with (f_i, h_i); f_i is never sent.

Departures: the penalty is descended (`penalty_gradient` true; PFLlib's detached one moves
nothing: false); a partial last batch trains, as for every method (PFLlib's loader drops it).

Details (every option, the departures, measurements): docs/algorithms/pflda.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import (head_layer, merge_layers, split_body_head,
                                          take_layers)
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

Params = Any


class PflDaConfig(NamedTuple):
  lam: float = 1.0               # weight of ||g - h_i||_2 (PFLlib's --lamda)
  penalty_gradient: bool = True  # false: PFLlib's detached penalty (no gradient)


FLAG_HELP = {
    "lam": "PFL-DA: weight lambda of the distance ||g - h_i||_2 between the global and the"
           " client's head while the client's head trains",
    "penalty_gradient": "PFL-DA: descend that distance (true) or build it from detached"
                        " tensors as PFLlib does, which moves nothing (false)",
}


class DaTrained(NamedTuple):
  body: Params           # f_i
  global_head: Params    # g


def validate(config: PflDaConfig) -> PflDaConfig:
  if config.lam < 0:
    raise FieldError("pflda", "lam", f"must be >= 0, got {config.lam}")
  return config


def head_distance(global_head: Params, head: Params) -> jax.Array:
  """||g - h||_2 over every parameter, with a zero gradient where they are equal."""
  squared = tree.squared_distance(global_head, head)
  positive = squared > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def pflda(config: PflDaConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def parts(model: Params) -> tuple[list[str], list[str]]:
    head_layer(model, "pflda")
    return split_body_head(model, 1, "pflda")

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    return AlgorithmState(server=take_layers(first, parts(first)[1]), clients=context.params)

  def broadcast(global_head, models):
    return tree.broadcast_to_clients(global_head, tree.leading_size(models))

  def client_update(model, global_head, data, key):
    body_names, head_names = parts(model)
    body = take_layers(model, body_names)
    head_key, body_key = jax.random.split(key)

    def head_loss(head, x, y, weights):
      loss = trainer.loss(merge_layers(body, head), x, y, weights)
      if not config.penalty_gradient:
        return loss
      return loss + config.lam * head_distance(global_head, head)
    head, head_stats = trainer.train(take_layers(model, head_names), data.train, head_key,
                                     loss_fn=head_loss)

    def body_loss(p: DaTrained, x, y, weights):
      return trainer.loss(merge_layers(p.body, p.global_head), x, y, weights)
    trained, stats = trainer.train(DaTrained(body=body, global_head=global_head), data.train,
                                   body_key, loss_fn=body_loss)
    del head_stats
    return ClientOutput(state=merge_layers(trained.body, head), upload=trained.global_head,
                        train=stats)

  def aggregate(global_head, models, uploads, weights):
    del global_head
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=models)

  def personalized_params(global_head, models):
    del global_head
    return models

  return Algorithm(name="pflda", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, uploads_unordered=True)
