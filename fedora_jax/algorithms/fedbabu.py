"""FedBABU: only the body is trained and averaged; the head stays at its random
initialisation during federated training and is fine-tuned by each client to personalise.

Oh, Kim, Yun. "FedBABU: Towards Enhanced Representation for Federated Image
Classification." ICLR 2022. https://arxiv.org/abs/2106.06042
(code: github.com/jhoon-oh/FedBABU)

The model is a body (every layer below the classifier: fedora_jax.algorithms.layers) and a
head (the top layer). Each round (the paper's training procedure):
  1. the server sends the global model: the averaged body theta_ext under the head
     theta_cls fixed at the run's initial model (all clients share it);
  2. client i trains the body alone on its cross-entropy for the run's local epochs, the
     head frozen (the authors' code: head_lr = 0), and uploads the body;
  3. the server averages the bodies, weighted by training-set size (over the round's
     sampled clients). The head never changes.
Personalisation (the paper's evaluation): each client fine-tunes the global model on its
own training data for tau epochs, the whole model (body and head, one learning rate: the
authors' analysis.ipynb) by default, or the head alone (finetune_part="head"), with the
run's optimizer and learning rate. tau = 5 (the paper's and notebook's
personalization_epoch).

How it runs here: personalized_params sees no data, so the fine-tuning is computed in the
client update, from the global model the client received (as fedavg_ft does): round t's
personalised model of a sampled client is "FedBABU for t - 1 rounds, then tau epochs of
fine-tuning", the paper's protocol evaluated every round, at the cost of tau more epochs
per client and round. A client not sampled this round keeps its last fine-tuned model.
finetune_epochs = 0 evaluates the global model itself (the paper's "initial" accuracy).
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
