"""FedAvgM: FedAvg whose server takes the averaged update with momentum.

Hsu, Qi, Brown. "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification." arXiv 2019. https://arxiv.org/abs/1909.06335

Clients train the broadcast global model x as FedAvg's do. The server forms the
pseudo-gradient g = x - sum_k p_k y_k (p_k: the run's client weights over the round's
sampled clients, training-set sizes by default, as FedAvg's) and steps with momentum
beta:  v <- beta v + g;  x <- x - lr v  (server lr 1 and beta 0 is FedAvg). The paper
sweeps beta and the server lr (effective lr lr / (1 - beta)); beta = 0.9 at server lr 1
is the default here and FL-bench's.

Departure option: `nesterov` (default false, the paper's heavy-ball step); true is
FL-bench's server (PyTorch SGD with nesterov=True). Clients that sit a round out send
nothing; the momentum keeps moving the model in rounds where they do not.
The server optimiser is fedora_jax/engine/server_optimizer.py's, shared with FedOpt.
"""

from typing import Any, NamedTuple

import optax

from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, InitContext
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class FedAvgMConfig(NamedTuple):
  server_lr: float = 1.0
  momentum: float = 0.9  # server momentum beta
  nesterov: bool = False  # true: FL-bench's Nesterov step


FLAG_HELP = {
    "server_lr": "FedAvgM server learning rate: x <- x - server_lr v",
    "momentum": "FedAvgM server momentum beta: v <- beta v + (x - mean of the uploads)",
    "nesterov": "FedAvgM: Nesterov's momentum step (FL-bench's server) instead of the"
                " paper's heavy ball",
}


def validate(config: FedAvgMConfig) -> FedAvgMConfig:
  if config.server_lr <= 0:
    raise FieldError("fedavgm", "server_lr", f"must be > 0, got {config.server_lr}")
  if not 0 <= config.momentum < 1:
    raise FieldError("fedavgm", "momentum", f"must be in [0, 1), got {config.momentum}")
  return config


class ServerState(NamedTuple):
  params: Any                # the global model x
  opt_state: Any             # the server optimiser's state


def with_server_optimizer(name: str, optimizer: optax.GradientTransformation,
                          server_mean: str, trainer: ClientTrainer) -> Algorithm:
  """FedAvg's clients under a server optimiser stepping on x - mean(uploads); the mean is
  over the round's sampled clients (server_optimizer.sampled_weights)."""
  base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)

  def init(context: InitContext) -> AlgorithmState:
    state = base.init(context)
    return state._replace(server=ServerState(params=state.server,
                                             opt_state=optimizer.init(state.server)))

  def broadcast(server, clients):
    return base.broadcast(server.params, clients)

  def aggregate(server, clients, uploads, weights):
    gradient = server_optimizer.pseudo_gradient(
        server.params, uploads, server_optimizer.sampled_weights(weights, server_mean))
    params, opt_state = server_optimizer.server_step(optimizer, server.params,
                                                     server.opt_state, gradient)
    return AlgorithmState(server=ServerState(params, opt_state), clients=clients)

  # Built afresh, not from FedAvg's by _replace: no plug-in takes this server state.
  return Algorithm(name=name, init=init, broadcast=broadcast,
                   client_update=base.client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: base.personalized_params(
                       server.params, clients),
                   shared_model=lambda server: server.params, uploads_unordered=True)


def fedavgm(config: FedAvgMConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  optimizer = optax.sgd(config.server_lr, momentum=config.momentum or None,
                        nesterov=config.nesterov)
  return with_server_optimizer("fedavgm", optimizer, "weighted", trainer)
