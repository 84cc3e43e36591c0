"""LG-FedAvg: local representations, global top layers. Each client keeps the layers near
the input to itself; only the top layers are averaged by the server.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency. "Think Locally, Act
Globally: Federated Learning with Local and Global Representations." NeurIPS 2019
Workshop on Federated Learning (arXiv 2020). https://arxiv.org/abs/2001.01523
(code: github.com/pliang279/LG-FedAvg)

Each round a sampled client puts the server's global layers above its own local_layers
(default 1, counted from local_side "input"; "output" counts from the top), trains the
whole model and uploads the global layers; the server averages them (weighted by
training-set size). A client is scored with its local layers under the latest global ones.

Departures: all clients start from the shared initial model (the authors: a FedAvg-trained
one) and the last round is reported (the authors: each client's best by test accuracy).

Details (every option, the departures, measurements): docs/algorithms/lg_fedavg.md.
"""

from typing import NamedTuple

from fedora_jax.algorithms.base import Algorithm
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, WHOLE_SERVER
from fedora_jax.algorithms.layers import (all_but_bottom_layers, all_but_top_layers,
                                           partial_sharing)
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class LgFedAvgConfig(NamedTuple):
  local_layers: int = 1  # layers kept on the client; the others are averaged
  local_side: str = "input"  # which end they are counted from: "input" (paper), "output"


LOCAL_SIDES = ("input", "output")


FLAG_HELP = {"local_layers": "LG-FedAvg: number of layers kept local, counted from"
                             " --lg_fedavg_local_side; the others are shared and averaged",
             "local_side": "LG-FedAvg: input (the paper: the layers nearest the input are"
                           " the local representation) or output (the layers nearest the"
                           " output local; with local_layers=3 on the CNN, the authors'"
                           " CIFAR-10 script, whose two convolutions are global)"}


def lg_fedavg(config: LgFedAvgConfig, trainer: ClientTrainer) -> Algorithm:
  if config.local_layers < 1:
    raise FieldError("lg_fedavg", "local_layers", f"must be >= 1, got {config.local_layers}")
  if config.local_side not in LOCAL_SIDES:
    raise FieldError("lg_fedavg", "local_side",
                     f"must be one of {', '.join(LOCAL_SIDES)}, got {config.local_side!r}")
  shared = all_but_bottom_layers if config.local_side == "input" else all_but_top_layers
  return partial_sharing("lg_fedavg", trainer,
                         shared(config.local_layers, "lg_fedavg_local_layers"))._replace(
                             shared_part=WHOLE_SERVER, upload_mean=SERVER_MODEL)
