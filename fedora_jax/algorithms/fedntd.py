"""FedNTD: FedAvg whose clients distil the global model's predictions on the not-true
classes, to keep the global knowledge local training would forget.

Lee, Jeong, Shin, Yun. "Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning." NeurIPS 2022. https://arxiv.org/abs/2106.03097
(code: github.com/Lee-Gihun/FedNTD; reference run beside it: PFLlib's serverntd.py /
clientntd.py)

Client k trains the broadcast global model w_g on (Eq. 5)
  L = CE(q(w), y) + beta * KL(q~_tau(w_g) || q~_tau(w)),
q~_tau the softmax at temperature tau of the logits with the true class y's removed
(the not-true classes), the global model's fixed; both terms averaged over the batch.
The server averages the uploads with the run's client weights (training-set sizes by
default), as FedAvg's and the authors' code; the global model is scored.

Defaults: tau = 1, beta = 1 (the authors' config/fedntd.json). Departure options:
`tau_squared` (false: the paper and the authors' code; true: PFLlib's loss, the KL term
times tau^2) and `server_mean` ("weighted", the paper's; "uniform", PFLlib's 1/|S|).
Regression runs have no classes: FedNTD is for classification.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, ClientOutput
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError, check_one_of


class FedNtdConfig(NamedTuple):
  tau: float = 1.0   # temperature of the not-true softmax
  beta: float = 1.0  # weight of the not-true distillation
  tau_squared: bool = False  # true: PFLlib's KL times tau^2
  server_mean: str = "weighted"  # weighted: the paper's FedAvg mean; uniform: PFLlib's


FLAG_HELP = {
    "tau": "FedNTD temperature of the not-true softmax",
    "beta": "FedNTD weight beta of the not-true distillation loss",
    "tau_squared": "FedNTD: scale the distillation by tau^2 (PFLlib's loss; the paper's"
                   " has no such factor)",
    "server_mean": "FedNTD: the server mean with the run's client weights (weighted, the"
                   " paper) or uniform over the sampled clients (PFLlib)",
}


def validate(config: FedNtdConfig) -> FedNtdConfig:
  if config.tau <= 0:
    raise FieldError("fedntd", "tau", f"must be > 0, got {config.tau}")
  if config.beta < 0:
    raise FieldError("fedntd", "beta", f"must be >= 0, got {config.beta}")
  check_one_of("fedntd", config, "server_mean", server_optimizer.SERVER_MEANS)
  return config


def not_true_logits(logits: jax.Array, y: jax.Array) -> jax.Array:
  """[B, C-1]: each row's logits without its true class's, the others in order."""
  num_classes = logits.shape[-1]
  others = jnp.arange(num_classes - 1)[None, :]
  index = others + (others >= y[:, None])  # skip the column of y
  return jnp.take_along_axis(logits, index, axis=-1)


def not_true_distillation(logits, global_logits, y, weights, tau: float) -> jax.Array:
  """Mean over the real samples of KL(softmax(nt(global) / tau) || softmax(nt(local) / tau))."""
  local = jax.nn.log_softmax(not_true_logits(logits, y) / tau)
  target = jax.nn.log_softmax(not_true_logits(global_logits, y) / tau)
  kl = jnp.sum(jnp.exp(target) * (target - local), axis=-1)
  return jnp.sum(kl * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def ntd_loss(apply_fn, global_params, config: FedNtdConfig):
  """loss_fn(params, x, y, weights): cross-entropy + beta * the not-true distillation."""
  scale = config.beta * (config.tau ** 2 if config.tau_squared else 1.0)

  def loss_fn(params, x, y, weights):
    logits = apply_fn(params, x)
    global_logits = jax.lax.stop_gradient(apply_fn(global_params, x))
    return (masked_cross_entropy(logits, y, weights)
            + scale * not_true_distillation(logits, global_logits, y, weights, config.tau))
  return loss_fn


def fedntd(config: FedNtdConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  if trainer.task != "classification":
    raise ConfigError("fedntd distils class probabilities: it needs a classification task")
  base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)

  def client_update(client_state, global_params, data, key):
    params, stats = trainer.train(global_params, data.train, key,
                                  loss_fn=ntd_loss(trainer.apply, global_params, config))
    return ClientOutput(state=client_state, upload=params, train=stats)

  def aggregate(server, clients, uploads, weights):
    return base.aggregate(server, clients, uploads,
                          server_optimizer.sampled_weights(weights, config.server_mean))

  # Built afresh, not from FedAvg's by _replace: it hosts no plug-in.
  return Algorithm(name="fedntd", init=base.init, broadcast=base.broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=base.personalized_params,
                   shared_model=base.shared_model, uploads_unordered=True)
