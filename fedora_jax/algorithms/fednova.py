"""FedNova: FedAvg with each client's update normalised by its number of local steps.

Wang, Liu, Liang, Joshi, Poor. "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization." NeurIPS 2020. https://arxiv.org/abs/2007.07481
(code: github.com/JYWa/FedNova)

Clients train the broadcast model x with the run's SGD, taking tau_i steps (more for more
data, or more epochs). Client i's update x - y_i = lr G_i a_i sums its gradients with
weights a_i; FedNova divides it by ||a_i||_1 (the normalised gradient d_i) and the server
steps x <- x - tau_eff sum_i p_i d_i with tau_eff = sum_i p_i ||a_i||_1 (Eq. 7 with
FedNova's choice of tau_eff), p_i the run's client weights over the round's sampled
clients (training-set sizes by default, the paper's n_i / n).
||a_i||_1: tau_i for plain SGD; with the run's momentum rho (a train field), as the
authors' code counts it, sum_{t=1}^{tau_i} (1 - rho^t) / (1 - rho)
= [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho). Weight decay is counted as part
of the gradient (as there). Not built: the code's proximal (FedProx) local solver and its
server momentum (gmf, 0 by default there). Equal step counts reduce it to FedAvg.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class FedNovaConfig(NamedTuple):
  momentum: float = 0.9  # the clients' SGD momentum rho (train field: the run's --momentum)


class Upload(NamedTuple):
  normalized: Any                 # d_i = (x - y_i) / ||a_i||_1
  norm: jax.Array                 # ||a_i||_1


def validate(config: FedNovaConfig) -> FedNovaConfig:
  if not 0 <= config.momentum < 1:
    raise FieldError("fednova", "momentum", f"must be in [0, 1), got {config.momentum}")
  return config


def step_weight_norm(steps: jax.Array, momentum: float) -> jax.Array:
  """||a_i||_1 of `steps` SGD steps with heavy-ball momentum (steps itself at 0)."""
  steps = steps.astype(jnp.float32)
  if momentum == 0:
    return steps
  rho = momentum
  return (steps - rho * (1.0 - rho ** steps) / (1.0 - rho)) / (1.0 - rho)


def fednova(config: FedNovaConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)

  def client_update(client_state, global_params, data, key):
    params, stats = trainer.train(global_params, data.train, key)
    norm = step_weight_norm(stats.steps, config.momentum)
    scale = 1.0 / jnp.maximum(norm, 1.0)  # no steps: y = x, d = 0
    normalized = jax.tree.map(lambda x, y: scale * (x - y), global_params, params)
    return ClientOutput(state=client_state, upload=Upload(normalized, norm), train=stats)

  def aggregate(global_params, clients, uploads, weights):
    p = weights / jnp.sum(weights)
    tau_eff = jnp.dot(p, uploads.norm)
    direction = tree.weighted_mean(uploads.normalized, weights)
    params = jax.tree.map(lambda x, d: x - tau_eff * d, global_params, direction)
    return AlgorithmState(server=params, clients=clients)

  # Built afresh, not from FedAvg's by _replace: it hosts no plug-in.
  return Algorithm(name="fednova", init=base.init, broadcast=base.broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=base.personalized_params,
                   shared_model=base.shared_model, uploads_unordered=True)
