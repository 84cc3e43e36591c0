"""FedProx: FedAvg whose clients add a proximal term pulling them towards the global model.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in Heterogeneous
Networks." MLSys 2020. https://arxiv.org/abs/1812.06127  (code: github.com/litian96/FedProx)

Client k trains the broadcast global model w^t with the run's local SGD on F_k(w) +
mu/2 ||w - w^t||^2 (the paper's Eq. 2) and uploads it; the server averages the uploads as
FedAvg (weighted by training-set size). mu 1, the paper's best on MNIST. `evaluate`: "global"
(default, as the paper) scores the global model, "local" each client's latest local model.
Under --ala the term pulls towards w^t (`ala_anchor` "global") or ALA's model ("theta_hat").

Departures: every sampled client runs its full local epochs, so FedProx's partial-work /
straggler handling never comes into play.

Details (every option, the departures, measurements): docs/algorithms/fedprox.md.
"""

from typing import Any, NamedTuple

import jax

from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import model_message
from fedora_jax import tree
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of, traced

EVALUATIONS = ("global", "local")
ALA_ANCHORS = ("global", "theta_hat")


class FedProxConfig(NamedTuple):
  mu: float = 1.0  # proximal strength; the paper's best value on MNIST
  evaluate: str = "global"  # "global": the global model (paper); "local": local models
  # Under --ala, what the proximal term pulls towards: "global", w^t as the paper's Eq. 2
  # has it (ALA changes only where training starts, FedALA Section 4.1); "theta_hat",
  # ALA's initialised model, our form before 2026-12-05 (docs/verification_departures.md).
  ala_anchor: str = "global"


FLAG_HELP = {
    "mu": "FedProx proximal strength: local loss + mu/2 ||w - w_global||^2",
    "evaluate": "FedProx: evaluate the global model (global, the paper) or each client's"
                " latest local model (local)",
    "ala_anchor": "FedProx under --ala: the proximal term pulls towards the received global"
                  " model (global, the paper's w^t) or ALA's initialised model (theta_hat)",
}


def validate(config: FedProxConfig) -> FedProxConfig:
  if not traced(config.mu) and config.mu < 0:
    raise FieldError("fedprox", "mu", f"must be >= 0, got {config.mu}")
  check_one_of("fedprox", config, "evaluate", EVALUATIONS)
  check_one_of("fedprox", config, "ala_anchor", ALA_ANCHORS)
  return config


def proximal_term(mu: float, anchor):
  """regularizer(params) = mu/2 ||params - anchor||^2; its gradient is mu (params - anchor)."""
  return lambda params: 0.5 * mu * tree.squared_distance(params, anchor)


class AlaStart(NamedTuple):
  """The message under ALA with ala_anchor "global": train from ALA's theta_hat, pull
  towards the received global model w^t."""
  start: Any
  anchor: Any


def proximal_train(trainer: ClientTrainer, mu: float, message, data, key: jax.Array):
  """FedProx's local solver: the run's SGD on F_k(w) + mu/2 ||w - w^t||^2 from w^t (from
  theta_hat, anchored at w^t, where the message is an AlaStart)."""
  start, anchor = ((message.start, message.anchor) if isinstance(message, AlaStart)
                   else (message, message))
  return trainer.train(start, data.train, key, regularizer=proximal_term(mu, anchor))


def ala_hooks(config: FedProxConfig):
  """FedAvg's (ALA's theta_hat in place of the whole message), with the anchor kept at the
  received model under ala_anchor "global"."""
  hooks = model_message(personal_is_local=True)
  if config.ala_anchor == "theta_hat":
    return hooks
  return hooks._replace(
      replace=lambda state, message, theta_hat: (state, AlaStart(theta_hat, message)))


def fedprox(config: FedProxConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  # Same server state, broadcast and aggregation as FedAvg; only local training differs.
  # ConFREE does not count FedProx among its hosts.
  base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)._replace(ala_hooks=ala_hooks(config))

  def client_update(client_state, global_params, data, key):
    params, stats = proximal_train(trainer, config.mu, global_params, data, key)
    return ClientOutput(state=client_state, upload=params, train=stats)

  if config.evaluate == "global":
    return base._replace(name="fedprox", client_update=client_update, shared_part=None)

  # "local": each client keeps the model it last trained, and is scored on it.
  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=tree.first(context.params), clients=context.params)

  def local_update(client_params, global_params, data, key):
    params, stats = proximal_train(trainer, config.mu, global_params, data, key)
    return ClientOutput(state=params, upload=params, train=stats)

  return base._replace(name="fedprox", init=init, client_update=local_update,
                       personalized_params=lambda global_params, clients: clients,
                       shared_model=None, shared_part=None)
