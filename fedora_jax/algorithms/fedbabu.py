"""FedBABU: only the body is trained and averaged; the head stays at its random
initialisation during federated training and is fine-tuned by each client to personalise.

Oh, Kim, Yun. "FedBABU: Towards Enhanced Representation for Federated Image
Classification." ICLR 2022. https://arxiv.org/abs/2106.06042
(code: github.com/jhoon-oh/FedBABU)

Each round a sampled client trains the body under the frozen initial head (the top layer)
for the run's local epochs and uploads it; the server averages the bodies (weighted by
training-set size). A client is scored with the global model fine-tuned on its training
data for finetune_epochs = 5 epochs (tau), the whole model by default (finetune_part "full";
"head": the head alone). The fine-tuning runs in the client update, so the paper's protocol
is evaluated every round; an unsampled client keeps its last fine-tuned model.

Details (every option, the departures, measurements): docs/algorithms/fedbabu.md.
"""

from typing import Any, NamedTuple

import jax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import merge_layers, split_body_head, take_layers
from fedora_jax.algorithms.plugin_fields import UploadMean
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

Params = Any

FINETUNE_PARTS = ("full", "head")


class FedBabuConfig(NamedTuple):
  finetune_epochs: int = 5     # tau: local fine-tuning epochs of the personalised model
  finetune_part: str = "full"  # "full": body and head (authors' code); "head": head alone


FLAG_HELP = {
    "finetune_epochs": "FedBABU: epochs tau each client fine-tunes the global model to"
                       " personalise it (0: evaluate the global model)",
    "finetune_part": "FedBABU: fine-tune the whole model (full, the authors') or the head"
                     " alone (head)",
}


def train_layers(trainer: ClientTrainer, params: Params, names: list[str], data, key,
                 epochs: int | None = None):
  """Trains only the layers `names` of `params` (the others fixed, outside the optimizer)."""
  def loss_fn(trained, x, y, weights):
    return trainer.loss(merge_layers(params, trained), x, y, weights)
  trained, stats = trainer.train(take_layers(params, names), data, key, loss_fn=loss_fn,
                                 epochs=epochs)
  return merge_layers(params, trained), stats


def validate(config: FedBabuConfig) -> FedBabuConfig:
  if config.finetune_epochs < 0:
    raise FieldError("fedbabu", "finetune_epochs", f"must be >= 0, got {config.finetune_epochs}")
  check_one_of("fedbabu", config, "finetune_part", FINETUNE_PARTS)
  return config


def fedbabu(config: FedBabuConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def split(params: Params) -> tuple[list[str], list[str]]:
    return split_body_head(params, 1, "fedbabu's head")

  def body(params: Params) -> Params:
    return take_layers(params, split(params)[0])

  def init(context: InitContext) -> AlgorithmState:
    # The server's model: the averaged body under the initial head, which never changes.
    return AlgorithmState(server=tree.first(context.params), clients=context.params)

  def broadcast(global_params, fine_tuned):
    return tree.broadcast_to_clients(global_params, tree.leading_size(fine_tuned))

  def fine_tune(global_params, data, key):
    if config.finetune_epochs == 0:
      return global_params
    names = split(global_params)[1] if config.finetune_part == "head" else list(
        global_params["params"])
    return train_layers(trainer, global_params, names, data.train, key,
                        epochs=config.finetune_epochs)[0]

  def client_update(fine_tuned, global_params, data, key):
    del fine_tuned  # replaced by this round's fine-tuning of the received global model
    body = split(global_params)[0]
    params, stats = train_layers(trainer, global_params, body, data.train, key)
    personal = fine_tune(global_params, data, jax.random.fold_in(key, 1))
    return ClientOutput(state=personal, upload=take_layers(params, body), train=stats)

  def aggregate(global_params, fine_tuned, bodies, weights):
    return AlgorithmState(server=merge_layers(global_params, tree.weighted_mean(bodies, weights)),
                          clients=fine_tuned)

  def personalized_params(global_params, fine_tuned):
    if config.finetune_epochs == 0:
      return broadcast(global_params, fine_tuned)
    return fine_tuned

  return Algorithm(name="fedbabu", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   # the server's model is sent; its body is what clients upload
                   upload_mean=UploadMean(received=body, sent=body))
