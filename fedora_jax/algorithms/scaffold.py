"""SCAFFOLD: local SGD corrected by control variates for the client drift.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning." ICML 2020. https://arxiv.org/abs/1910.06378
(reference run beside it: PFLlib's serverscaffold.py / clientscaffold.py)

Option II of Algorithm 1: a sampled client takes its K local steps on the gradient
corrected by c - c_i, sets c_i+ = c_i - c + (x - y) / (K lr) and uploads
(y - x, c_i+ - c_i); the server moves x by `server_lr` (1) times their mean and c by 1/N of
their sum. The global model x is scored.

Departures: with the run's heavy-ball momentum beta, c_i+ divides by K_beta lr (K lr at
beta = 0); K counts a partial last batch; `server_mean` "weighted" (default "uniform").

Details (every option, the departures, measurements): docs/algorithms/scaffold.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

Params = Any


class ScaffoldConfig(NamedTuple):
  server_lr: float = 1.0  # eta_g (the paper's experiments, PFLlib's default)
  server_mean: str = "uniform"  # uniform: the paper's 1/|S|; weighted: the run's weights
  lr: float = 5e-3  # the clients' lr eta_l in c_i+ (train field: the run's --lr)
  momentum: float = 0.0  # their heavy-ball momentum in c_i+ (train field: --momentum)


FLAG_HELP = {
    "server_lr": "SCAFFOLD global step size eta_g: x <- x + eta_g mean(y_i - x)",
    "server_mean": "SCAFFOLD: mean of the model updates over the sampled clients, uniform"
                   " (the paper, PFLlib) or with the run's client weights (weighted)",
}


def validate(config: ScaffoldConfig) -> ScaffoldConfig:
  if config.server_lr <= 0:
    raise FieldError("scaffold", "server_lr", f"must be > 0, got {config.server_lr}")
  if config.lr <= 0:
    raise FieldError("scaffold", "lr", f"must be > 0, got {config.lr}")
  if not 0 <= config.momentum < 1:
    raise FieldError("scaffold", "momentum", f"must be in [0, 1), got {config.momentum}")
  check_one_of("scaffold", config, "server_mean", server_optimizer.SERVER_MEANS)
  return config


class ServerState(NamedTuple):
  params: Params   # the global model x
  control: Params  # the server control variate c


class Upload(NamedTuple):
  model_delta: Params    # y_i - x
  control_delta: Params  # c_i+ - c_i


def linear_term(direction: Params):
  """regularizer(params) = <direction, params>: adds `direction` to every gradient."""
  return lambda params: sum(jnp.vdot(d, p) for d, p in
                            zip(jax.tree.leaves(direction), jax.tree.leaves(params)))


def momentum_steps(steps: jax.Array, momentum: float) -> jax.Array:
  """K_beta: how many plain SGD steps K steps of heavy-ball momentum beta, started from
  zero, move as far on a constant gradient (sum over t <= K of (1 - beta^t) / (1 -
  beta)); K at beta = 0."""
  steps = steps.astype(jnp.float32)
  if momentum == 0:
    return steps
  return (steps - momentum * (1 - momentum ** steps) / (1 - momentum)) / (1 - momentum)


def new_client_control(client_control, control, global_params, params, steps, lr: float,
                       momentum: float = 0.0):
  """Option II: c_i+ = c_i - c + (x - y) / (K_beta lr); c_i unchanged where K = 0."""
  scale = 1.0 / (jnp.maximum(momentum_steps(steps, momentum), 1.0) * lr)
  updated = jax.tree.map(lambda ci, c, x, y: ci - c + scale * (x - y),
                         client_control, control, global_params, params)
  return jax.tree.map(lambda new, old: jnp.where(steps > 0, new, old), updated,
                      client_control)


def scaffold(config: ScaffoldConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    global_params = tree.first(context.params)
    zeros = jax.tree.map(jnp.zeros_like, context.params)
    return AlgorithmState(server=ServerState(global_params, tree.first(zeros)),
                          clients=zeros)

  def broadcast(server, clients):
    return tree.broadcast_to_clients(server, tree.leading_size(clients))

  def client_update(client_control, server, data, key):
    global_params, control = server
    correction = jax.tree.map(jnp.subtract, control, client_control)
    params, stats = trainer.train(global_params, data.train, key,
                                  regularizer=linear_term(correction))
    new_control = new_client_control(client_control, control, global_params, params,
                                     stats.steps, config.lr, config.momentum)
    upload = Upload(model_delta=jax.tree.map(jnp.subtract, params, global_params),
                    control_delta=jax.tree.map(jnp.subtract, new_control, client_control))
    return ClientOutput(state=new_control, upload=upload, train=stats)

  def aggregate(server, clients, uploads, weights):
    num_clients = tree.leading_size(clients)
    mean_delta = tree.weighted_mean(
        uploads.model_delta, server_optimizer.sampled_weights(weights, config.server_mean))
    params = jax.tree.map(lambda x, d: x + config.server_lr * d, server.params, mean_delta)
    # (1/N) sum over the sampled clients: a sum of their uploads, fillers (weight 0) out.
    sampled = (weights > 0).astype(jnp.float32)
    control = jax.tree.map(
        lambda c, d: c + jnp.tensordot(sampled, d, axes=(0, 0)) / num_clients,
        server.control, uploads.control_delta)
    return AlgorithmState(server=ServerState(params, control), clients=clients)

  def personalized_params(server, clients):
    return tree.broadcast_to_clients(server.params, tree.leading_size(clients))

  return Algorithm(name="scaffold", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.params, uploads_unordered=True)
