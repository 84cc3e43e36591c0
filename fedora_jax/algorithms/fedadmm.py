"""FedADMM: clients minimise the augmented Lagrangian of the consensus problem, each with
its own dual variable; the server moves the global model by the mean change of the
clients' w_i + y_i / rho.

Gong, Li, Freris. "FedADMM: A Robust Federated Deep Learning Framework with Adaptivity
to System Heterogeneity." ICDE 2022. https://arxiv.org/abs/2204.03529
(code followed: the authors' YonghaiGong/FedADMM, FedADMM/src/update.py and
federated_main.py, and FL-bench's src/client/fedadmm.py / src/server/fedadmm.py,
KarhouTam/FL-bench, GPL: both read, not run or copied. The paper's full text is not on
disk, so this module follows the authors' code and names no equation numbers. PFLlib
has no FedADMM, so there is no verification row: the unit tests check the core step by
hand. Other algorithms of the same name, Wang, Marella, Anderson 2022 (FedDR's dual
form) and Zhou, Li 2023 (exact and inexact ADMM), are not built.)

Client i trains on L_i(w) + <y_i, w> + rho/2 ||w - theta||^2 and updates y_i; theta, the model
scored, moves by eta times the uploads' mean. Defaults (the authors'): rho 0.01, server_lr 1, then
late_server_lr 0.5 from late_round 60; `epochs` "random" (1..E) or "fixed"; `server_mean` "uniform".

Details (every option, the departures, measurements): docs/algorithms/fedadmm.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.scaffold import linear_term
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer, step_budget
from fedora_jax.errors import FieldError, check_one_of, traced

Params = Any
EPOCHS = ("random", "fixed")


class FedAdmmConfig(NamedTuple):
  rho: float = 0.01             # penalty of the augmented Lagrangian (the authors' 0.01)
  server_lr: float = 1.0        # eta
  late_server_lr: float = 0.5   # eta_2, from round late_round on
  late_round: int = 60          # the code's target_round
  epochs: str = "random"        # random: 1..E epochs a client and round (the code's default)
  server_mean: str = "uniform"  # uniform: the authors'; weighted: FL-bench's


FLAG_HELP = {
    "rho": "FedADMM: penalty rho of local loss + <y_i, w> + rho/2 ||w - theta||^2",
    "server_lr": "FedADMM: server step eta on the mean of the clients' Delta_i",
    "late_server_lr": "FedADMM: the server step from round late_round on (eta_2)",
    "late_round": "FedADMM: round (from 0) at which the server step becomes late_server_lr",
    "epochs": "FedADMM: local epochs drawn uniformly from 1..--local_epochs per client and"
              " round (random, the authors' default) or all of them (fixed)",
    "server_mean": "FedADMM: mean of the Delta_i over the round's clients, uniform (the"
                   " authors') or with the run's client weights (weighted, FL-bench)",
}


class AdmmServer(NamedTuple):
  params: Params     # theta^t
  round: jax.Array   # [] int32 t, rounds aggregated so far


def validate(config: FedAdmmConfig) -> FedAdmmConfig:
  if not traced(config.rho) and config.rho <= 0:
    raise FieldError("fedadmm", "rho", f"must be > 0, got {config.rho}")
  if config.late_round < 0:
    raise FieldError("fedadmm", "late_round", f"must be >= 0, got {config.late_round}")
  check_one_of("fedadmm", config, "epochs", EPOCHS)
  check_one_of("fedadmm", config, "server_mean", server_optimizer.SERVER_MEANS)
  return config


def augmented_lagrangian(rho: float, dual: Params, server_params: Params):
  """w -> <y_i, w> + rho/2 ||w - theta||^2, the terms added to the client's loss."""
  linear = linear_term(dual)

  def regularizer(params):
    return linear(params) + 0.5 * rho * tree.squared_distance(params, server_params)
  return regularizer


def dual_step(rho: float, dual: Params, params: Params, server_params: Params):
  """(y_i + rho (w_i - theta), Delta_i = (w_i - theta) + (y_new - y_old) / rho)."""
  new_dual = jax.tree.map(lambda y, w, s: y + rho * (w - s), dual, params, server_params)
  delta = jax.tree.map(lambda w, s, new, old: (w - s) + (new - old) / rho,
                       params, server_params, new_dual, dual)
  return new_dual, delta


def epoch_fraction(key: jax.Array, epochs: int) -> jax.Array:
  """E' / E with E' drawn uniformly from 1..E: the share of its steps a client takes."""
  return jax.random.randint(key, (), 1, epochs + 1) / epochs


def fedadmm(config: FedAdmmConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  rho = config.rho

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(
        server=AdmmServer(tree.first(context.params), jnp.zeros((), jnp.int32)),
        clients=jax.tree.map(jnp.zeros_like, context.params))

  def broadcast(server: AdmmServer, clients):
    return tree.broadcast_to_clients(server.params, tree.leading_size(clients))

  def client_update(dual, server_params, data, key):
    epochs_key, key = jax.random.split(key)
    regularizer = augmented_lagrangian(rho, dual, server_params)
    if config.epochs == "random":
      with step_budget(epoch_fraction(epochs_key, trainer.epochs)):
        params, stats = trainer.train(server_params, data.train, key,
                                      regularizer=regularizer)
    else:
      params, stats = trainer.train(server_params, data.train, key, regularizer=regularizer)
    new_dual, delta = dual_step(rho, dual, params, server_params)
    return ClientOutput(state=new_dual, upload=delta, train=stats)

  def aggregate(server: AdmmServer, clients, uploads, weights):
    eta = jnp.where(server.round >= config.late_round, config.late_server_lr,
                    config.server_lr)
    step = tree.weighted_mean(uploads,
                              server_optimizer.sampled_weights(weights, config.server_mean))
    params = jax.tree.map(lambda p, d: p + eta * d, server.params, step)
    return AlgorithmState(server=AdmmServer(params, server.round + 1), clients=clients)

  def personalized_params(server: AdmmServer, clients):
    return tree.broadcast_to_clients(server.params, tree.leading_size(clients))

  return Algorithm(name="fedadmm", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.params, uploads_unordered=True)
