"""LG-FedAvg: local representations, global top layers. Each client keeps the layers near
the input to itself; only the top layers are averaged by the server.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency. "Think Locally, Act
Globally: Federated Learning with Local and Global Representations." NeurIPS 2019
Workshop on Federated Learning (arXiv 2020). https://arxiv.org/abs/2001.01523
(code: github.com/pliang279/LG-FedAvg)

Client k's model is a local representation (its bottom `local_layers` layers, never
sent) followed by the global layers theta^g (all the layers above). Each round the client
overwrites its global layers with the server's, trains the whole model on its own data,
and uploads only the global layers, which the server averages (weighted by
training-set size, full participation). Evaluation uses the client's own bottom layers
under the latest global top layers. (The authors start LG-FedAvg from a FedAvg-trained
model and keep each client's best local model by test accuracy; here, as for every
method of this project, all start from the shared initial model and the last round is
reported.)

local_layers: the authors' flag --num_layers_keep counts the top layers kept global:
3 of the 5 layers of their MNIST MLP (784-512-256-256-128-10), so the bottom 2 are local,
and 2 of the 5 of their CIFAR-10 CNN, so the bottom 3 are local. Neither count carries
over to FEDORA's 3-layer MLP (784-128-128-10) without making everything global or
everything local; the default 1 keeps the paper's split: the input layer, most of the
parameters (as in the authors' MNIST MLP), is the local representation and the small top
layers are global. The count is taken from the input side so that it stays valid on any
model with at least two layers.
"""

from typing import NamedTuple

from fedora_jax.algorithms.base import Algorithm
from fedora_jax.algorithms.layers import all_but_bottom_layers, partial_sharing
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class LgFedAvgConfig(NamedTuple):
  local_layers: int = 1  # bottom layers kept on the client; the layers above are averaged


FLAG_HELP = {"local_layers": "LG-FedAvg: number of bottom layers kept local (the"
                             " representation); the layers above are shared and averaged"}


def lg_fedavg(config: LgFedAvgConfig, trainer: ClientTrainer) -> Algorithm:
  if config.local_layers < 1:
    raise FieldError("lg_fedavg", "local_layers", f"must be >= 1, got {config.local_layers}")
  return partial_sharing("lg_fedavg", trainer,
                         all_but_bottom_layers(config.local_layers, "lg_fedavg_local_layers"))
