"""FedOpt (FedAdam, FedYogi, FedAdagrad): FedAvg under an adaptive server optimiser.

Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar, McMahan. "Adaptive Federated
Optimization." ICLR 2021. https://arxiv.org/abs/2003.00295

Algorithm 2: clients train the broadcast global model x with the run's SGD; the server
takes Delta = (1/|S|) sum_{i in S} (y_i - x) over the round's sampled clients S and
steps m = beta1 m + (1 - beta1) Delta, v by Adagrad's, Adam's or Yogi's rule,
x += server_lr m / (sqrt(v) + tau) (fedora_jax/engine/server_optimizer.adaptive: no bias
correction, v starts at tau^2). `server_optimizer` picks the rule (--fedopt_variant
fedadam / fedyogi / fedadagrad sets it).

Defaults: beta1 0.9 and beta2 0.99, the paper's fixed values; tau and the server lr are
tuned per task in the paper (grids 1e-5..1e-1 and 1e-3..1e1); the defaults, tau 1e-3 and
server lr 1e-2, are points of those grids, not tuned here.
Departure option: `server_mean` "uniform" (the paper's 1/|S|) or "weighted" (the run's
client weights, FL-bench's server). Unsampled clients send nothing (the paper's
partial participation).
"""

from typing import NamedTuple

from fedora_jax.algorithms.fedavgm import with_server_optimizer
from fedora_jax.algorithms.base import Algorithm
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of


class FedOptConfig(NamedTuple):
  server_optimizer: str = "adam"  # adam | yogi | adagrad
  server_lr: float = 1e-2
  beta1: float = 0.9
  beta2: float = 0.99
  tau: float = 1e-3  # adaptivity: the denominator's sqrt(v) + tau
  server_mean: str = "uniform"  # uniform: the paper's 1/|S|; weighted: the run's weights


FLAG_HELP = {
    "server_optimizer": "FedOpt server rule: adam (FedAdam), yogi (FedYogi) or adagrad"
                        " (FedAdagrad)",
    "server_lr": "FedOpt server learning rate eta",
    "beta1": "FedOpt first-moment decay beta1",
    "beta2": "FedOpt second-moment decay beta2 (adam, yogi)",
    "tau": "FedOpt adaptivity tau: x += eta m / (sqrt(v) + tau); v starts at tau^2",
    "server_mean": "FedOpt: the clients' update averaged uniformly over the sampled ones"
                   " (uniform, the paper) or with the run's client weights (weighted)",
}

PRESETS = {"fedadam": {"server_optimizer": "adam"}, "fedyogi": {"server_optimizer": "yogi"},
           "fedadagrad": {"server_optimizer": "adagrad"}}
DEFAULT_VARIANT = "fedadam"
PRESET_HELP = "FedOpt's server optimiser: fedadam, fedyogi or fedadagrad"


def validate(config: FedOptConfig) -> FedOptConfig:
  check_one_of("fedopt", config, "server_optimizer", server_optimizer.ADAPTIVE)
  check_one_of("fedopt", config, "server_mean", server_optimizer.SERVER_MEANS)
  for field in ("server_lr", "tau"):
    if getattr(config, field) <= 0:
      raise FieldError("fedopt", field, f"must be > 0, got {getattr(config, field)}")
  for field in ("beta1", "beta2"):
    if not 0 <= getattr(config, field) < 1:
      raise FieldError("fedopt", field, f"must be in [0, 1), got {getattr(config, field)}")
  return config


def fedopt(config: FedOptConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  optimizer = server_optimizer.adaptive(config.server_optimizer, config.server_lr,
                                        config.beta1, config.beta2, config.tau)
  return with_server_optimizer("fedopt", optimizer, config.server_mean, trainer)
