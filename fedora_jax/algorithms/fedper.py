"""FedPer: base layers shared and averaged by FedAvg, personalisation layers (the top ones)
kept on each client.

Arivazhagan, Aggarwal, Singh, Choudhary. "Federated Learning with Personalization
Layers." arXiv 2019. https://arxiv.org/abs/1912.00818

Client k's model is the shared base (every layer below the top `personal_layers`)
followed by its own personalisation layers (K_P in the paper). Each round the client
overwrites its base with the server's, trains base and personal layers together on its
own data for the local epochs, and uploads only the base, which the server averages
(FedAvg, weighted by training-set size, full participation). Evaluation uses the latest
global base with the client's own personal layers. The personal layers never leave the
client.

personal_layers: the paper studies several numbers of personalisation layers on deep
CNNs; pFL baseline suites (e.g. PFLlib) personalise the classifier head alone, one layer,
the default here. On FEDORA's 3-layer MLP it may be 1 or 2.
"""

from typing import NamedTuple

from fedora_jax.algorithms.base import Algorithm
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, WHOLE_SERVER
from fedora_jax.algorithms.layers import all_but_top_layers, partial_sharing
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class FedPerConfig(NamedTuple):
  personal_layers: int = 1  # K_P: top layers kept on the client (the head)


FLAG_HELP = {"personal_layers": "FedPer: number of top layers kept personal (K_P); the"
                                " layers below are shared and averaged"}


def fedper(config: FedPerConfig, trainer: ClientTrainer) -> Algorithm:
  if config.personal_layers < 1:
    raise FieldError("fedper", "personal_layers", f"must be >= 1, got {config.personal_layers}")
  return partial_sharing("fedper", trainer,
                         all_but_top_layers(config.personal_layers,
                                            "fedper_personal_layers"))._replace(
                             shared_part=WHOLE_SERVER, upload_mean=SERVER_MODEL)
