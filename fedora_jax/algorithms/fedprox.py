"""FedProx: FedAvg whose clients add a proximal term pulling them towards the global model.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in Heterogeneous
Networks." MLSys 2020. https://arxiv.org/abs/1812.06127  (code: github.com/litian96/FedProx)

Client k approximately minimises h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2 from the
broadcast global model w^t (the paper's Eq. 2), here with the run's local SGD; the server
averages the uploads as FedAvg does (weighted by training-set size, every client taking
part each round, so FedProx's partial-work / straggler handling never comes into play).

mu: the paper tunes it per dataset from {0.001, 0.01, 0.1, 1} and reports mu = 1 as the
best for MNIST (also for Synthetic and FEMNIST; 0.001 Shakespeare, 0.01 Sent140); its
README says mu must be re-tuned for other settings. The default is the MNIST value.
"""

from typing import NamedTuple

import jax

from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, ClientOutput
from fedora_jax import tree
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class FedProxConfig(NamedTuple):
  mu: float = 1.0  # proximal strength; the paper's best value on MNIST


FLAG_HELP = {"mu": "FedProx proximal strength: local loss + mu/2 ||w - w_global||^2"}


def validate(config: FedProxConfig) -> FedProxConfig:
  if config.mu < 0:
    raise FieldError("fedprox", "mu", f"must be >= 0, got {config.mu}")
  return config


def proximal_term(mu: float, anchor):
  """regularizer(params) = mu/2 ||params - anchor||^2; its gradient is mu (params - anchor)."""
  return lambda params: 0.5 * mu * tree.squared_distance(params, anchor)


def proximal_train(trainer: ClientTrainer, mu: float, global_params, data, key: jax.Array):
  """FedProx's local solver: the run's SGD on F_k(w) + mu/2 ||w - w^t||^2 from w^t."""
  return trainer.train(global_params, data.train, key,
                       regularizer=proximal_term(mu, global_params))


def fedprox(config: FedProxConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  # Same server state, broadcast and aggregation as FedAvg; only local training differs.
  base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)

  def client_update(client_state, global_params, data, key):
    params, stats = proximal_train(trainer, config.mu, global_params, data, key)
    return ClientOutput(state=client_state, upload=params, train=stats)

  return base._replace(name="fedprox", client_update=client_update)
