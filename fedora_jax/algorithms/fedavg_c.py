"""FedAvg-C: FedAvg's global model with its classifier (C) fine-tuned by each client on its
own data, the fine-tuning baseline of FedALA's tables.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning." AAAI 2023. https://arxiv.org/abs/2212.01197 ; its
poster (../shared/papers/fedala_poster.txt) lists FedAvg-C and FedProx-C as its "2
fine-tuning-based pFL methods". Global training: McMahan et al., AISTATS 2017
(fedavg.py).

The definition, and what is uncertain. The FedALA paper's full text is not on disk, and
neither its repository (TsingZ0/FedALA holds ALA only) nor PFLlib (TsingZ0/PFLlib, every
version in its history) has code for FedAvg-C or FedProx-C; the poster names them
fine-tuning-based and gives their cost (24.28 min per iteration against FedAvg's 1.59:
fine-tuning every round, on every client). We read "-C" as "classifier": each client
fine-tunes the classifier head of the received global model on its own training data,
the feature extractor (body) frozen, and uses global body + fine-tuned head as its
personalised model. Not pinned down by any source we hold: that only the classifier is
fine-tuned (rather than the whole model, which is fedavg_ft), the number of fine-tuning
epochs (here the run's --local_epochs; the poster's 15x cost over FedAvg suggests the
authors fine-tune for longer), and its optimizer (here the run's local SGD).

How it is done (as fedavg_ft.py, whose `with_fine_tuning` this reuses): the server
trajectory is FedAvg's, untouched. In round t client k trains the global model w^(t-1)
as FedAvg does and, alongside, trains only the top `head_layers` layers of w^(t-1) on its
cross-entropy for the run's local epochs with its round key (the body held fixed, so the
optimizer sees the head alone). That copy, w^(t-1)'s body under the fine-tuned head, is
kept in the client state and is its personalised model: "FedAvg for t - 1 rounds, then
the classifier fine-tuned". Before round 1 it is the shared initial model. A client that
sits a round out keeps its last fine-tuned copy.

head_layers: PFLlib's (and the authors') models split off `fc`, the last Linear layer,
as the head; 1 is that layer here.

The other reading (`fine_tune="model"`). The only code that names FedAvg-C is a comment
in PFLlib's `serveras.py` (copied in 2025 from FedAS, github.com/xiyuanyang45/FedAS,
whose `serveravg.py` reads "# FedAvg-C, test the personalized model then train"): each
client is scored, before the next global model arrives, on the model its last local
training left, i.e. the whole received global model trained for the round's local
epochs. That is the client's own upload, kept as its personalised model: for FedAvg-C the
same computation as fedavg_ft, for FedProx-C FedProx's proximal local model (as
`--fedprox_evaluate=local`). The FedALA paper's own definition would settle which one its
tables report; its text is not reachable here, so "head" stays the default and "model"
is one flag away (`--fedavg_c_fine_tune=model`, `--fedprox_c_fine_tune=model`).
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
