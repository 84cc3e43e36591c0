"""FedProx-C: FedProx's global model with its classifier (C) fine-tuned by each client on
its own data, the second fine-tuning baseline of FedALA's tables.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning." AAAI 2023. https://arxiv.org/abs/2212.01197 . Global
training: Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020 (fedprox.py).

Exactly FedAvg-C (fedavg_c.py, where the definition and what is uncertain about it are
written down) on FedProx's server trajectory: each client trains the received global
model with FedProx's proximal term and uploads it; alongside, it fine-tunes the top
`head_layers` layers of the received global model on its plain cross-entropy (no
proximal term: the fine-tuned classifier is the client's own) and keeps that copy as its
personalised model. `fine_tune="model"` keeps the proximal local model itself instead
(the other reading of "-C", fedavg_c.py).

mu: the default is FedProx's own best value on MNIST, as for fedprox and fedprox_ft. The
FedALA tables run 0.001, the value of every FedProx run recorded in PFLlib's
system/auto_train.sh at the paper's time (commit a41f7ba, 2022-11-30).
"""

from typing import NamedTuple

from fedora_jax.algorithms import fedprox
from fedora_jax.algorithms.base import Algorithm
from fedora_jax.algorithms.fedavg_c import FINE_TUNES, with_head_fine_tuning
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import check_one_of


class FedProxCConfig(NamedTuple):
  mu: float = 1.0        # FedProx's proximal strength during global training (paper, MNIST)
  head_layers: int = 1   # top layers forming the classifier each client fine-tunes
  fine_tune: str = "head"  # "head": the classifier; "model": the round's local model


FLAG_HELP = {
    "mu": "FedProx-C: proximal strength of the global training (not of the fine-tuning)",
    "head_layers": "FedProx-C: number of top layers (the classifier) each client fine-tunes"
                   " on the received global model, the rest frozen",
    "fine_tune": "FedProx-C: head (the classifier fine-tuned, default) or model (the"
                 " client's proximal local model of the round; docs/algorithms/fedavg_c.md)",
}


def fedprox_c(config: FedProxCConfig, trainer: ClientTrainer) -> Algorithm:
  check_one_of("fedprox_c", config, "fine_tune", FINE_TUNES)
  base = fedprox.fedprox(fedprox.FedProxConfig(mu=config.mu), trainer)
  return with_head_fine_tuning(base, "fedprox_c", trainer, config.head_layers,
                               config.fine_tune)
