"""FedAvg-C: FedAvg's global model with its classifier (C) fine-tuned by each client on its
own data, the fine-tuning baseline of FedALA's tables.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning." AAAI 2023. https://arxiv.org/abs/2212.01197 ; its
poster (../shared/papers/fedala_poster.txt) lists FedAvg-C and FedProx-C as its "2
fine-tuning-based pFL methods". Global training: McMahan et al., AISTATS 2017
(fedavg.py).

Each round a client trains the global model as FedAvg does and, alongside, fine-tunes the top
head_layers (1) layers of the received global model for the run's local epochs, the body
frozen; that copy is its personalised model, the one it is scored with. The server's
trajectory is FedAvg's. fine_tune "head" (default) or "model" (the round's local model).

Not pinned down by any source (the paper's text is not on disk; no code defines FedAvg-C):
"-C" read as "classifier"; the fine-tuning's epochs and optimizer are the run's.
Details (every option, the departures, measurements): docs/algorithms/fedavg_c.md.
"""

from typing import NamedTuple

from fedora_jax import tree
from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, InitContext
from fedora_jax.algorithms.fedavg_ft import FineTune, upload_is_fine_tuned, with_fine_tuning
from fedora_jax.algorithms.layers import merge_layers, split_body_head, take_layers
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of


FINE_TUNES = ("head", "model")


class FedAvgCConfig(NamedTuple):
  head_layers: int = 1  # top layers forming the classifier each client fine-tunes
  fine_tune: str = "head"  # "head": the classifier; "model": the round's local model


FLAG_HELP = {"head_layers": "FedAvg-C: number of top layers (the classifier) each client"
                            " fine-tunes on the received global model, the rest frozen",
             "fine_tune": "FedAvg-C: head (the classifier fine-tuned, default) or model (the"
                          " client's locally trained model of the round, PFLlib's comment)"}


def head_fine_tune(trainer: ClientTrainer, head_layers: int, role: str) -> FineTune:
  """The received global model with only its top `head_layers` layers trained on the
  client's cross-entropy (the run's local SGD, epochs and batches)."""
  def fine_tune(global_params, data, key, base_output):
    del base_output
    body_names, head_names = split_body_head(global_params, head_layers, role)
    body = take_layers(global_params, body_names)

    def head_loss(head, x, y, weights):
      return trainer.loss(merge_layers(body, head), x, y, weights)
    head, _ = trainer.train(take_layers(global_params, head_names), data.train, key,
                            loss_fn=head_loss)
    return merge_layers(global_params, head)
  return fine_tune


def with_head_fine_tuning(base: Algorithm, name: str, trainer: ClientTrainer,
                          head_layers: int, fine_tune: str = "head") -> Algorithm:
  """`base` with each client's global model under its fine-tuned classifier as its
  personalised model (`base`'s broadcast must be its global model); with
  fine_tune="model", its locally trained model of the round."""
  role = f"{name}_head_layers"
  if head_layers < 1:
    raise FieldError(name, "head_layers", f"must be >= 1, got {head_layers}")
  if fine_tune == "model":
    return with_fine_tuning(base, name, upload_is_fine_tuned)
  algorithm = with_fine_tuning(base, name, head_fine_tune(trainer, head_layers, role))

  def init(context: InitContext):
    split_body_head(tree.first(context.params), head_layers, role)  # one-line error early
    return algorithm.init(context)
  return algorithm._replace(init=init)


def fedavg_c(config: FedAvgCConfig, trainer: ClientTrainer) -> Algorithm:
  check_one_of("fedavg_c", config, "fine_tune", FINE_TUNES)
  return with_head_fine_tuning(fedavg.fedavg(fedavg.FedAvgConfig(), trainer), "fedavg_c",
                               trainer, config.head_layers, config.fine_tune)
