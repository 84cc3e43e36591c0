"""FedALA: FedAvg whose clients initialise local training by Adaptive Local Aggregation.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning." AAAI 2023. https://arxiv.org/abs/2212.01197
(code: github.com/TsingZ0/FedALA; also TsingZ0/PFLlib)

The paper's Algorithm 1: the server averages the uploaded local models (FedAvg, weighted
by training-set size over the round's sampled clients); each sampled client builds
theta_hat from the received global model and its own previous local model by ALA (see
docs/algorithms/ala.md for the equations, what --participation < 1 does, and the departures from the
authors' code), trains theta_hat with the run's local SGD, keeps the result as its local
(personalised) model and uploads it.

Hyperparameters are ALA's and share the --ala_* flags with the --ala plug-in. Defaults
are the authors': s = 80 (rand_percent), eta = 1.0, threshold 0.1 over 10 losses, and
p = 1 layer (their layer_idx=2 counts the head's weight and bias tensors); their sample
and convergence loss are --ala_sample=slice --ala_epoch_loss=last (docs/algorithms/ala.md).

Evaluation: each client's local model as it ends the round (trained from theta_hat).
The authors evaluate after the next round's ALA, i.e. theta_hat of the next round before
its training; the two differ by one round of local training.
"""

from fedora_jax.algorithms import ala, fedavg
from fedora_jax.algorithms.base import Algorithm
from fedora_jax.engine.local_training import ClientTrainer

FedAlaConfig = ala.AlaConfig
FLAG_HELP = ala.FLAG_HELP
# FedALA reads the ALA plug-in's flags: --ala_s, --ala_p, ...
FLAG_NAMES = {field: f"ala_{field}" for field in ala.AlaConfig._fields}


def fedala(config: ala.AlaConfig, trainer: ClientTrainer) -> Algorithm:
  return ala.with_ala(fedavg.fedavg(fedavg.FedAvgConfig(), trainer), config, trainer,
                      name="fedala")
