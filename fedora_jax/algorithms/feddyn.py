"""FedDyn: clients minimise a dynamically regularised loss whose stationary points agree
with the global objective's.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama. "Federated Learning Based on Dynamic
Regularization." ICLR 2021. https://arxiv.org/abs/2111.04263
(code: github.com/alpemreacar/FedDyn; reference run beside it: PFLlib's serverdyn.py /
clientdyn.py)

Client k trains from the server model on its loss - <g_k, theta> + alpha/2 ||theta -
theta^{t-1}||^2, updates g_k and uploads its model; the server moves h by -alpha / N times
the sum of the round's updates and sets theta^t to the mean of the uploads minus h / alpha.
The global model is scored. `alpha` 0.01, the authors' code's alpha_coef.

Departures, as options: `penalty` "norm" (PFLlib's unsquared distance; default "squared",
the paper's); `server_mean` "weighted" (default "uniform", the paper's 1/|P_t|).

Details (every option, the departures, measurements): docs/algorithms/feddyn.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.scaffold import linear_term
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of, traced

Params = Any
PENALTIES = ("squared", "norm")


class FedDynConfig(NamedTuple):
  alpha: float = 0.01  # the paper's grid {0.1, 0.01, 0.001}; its code's alpha_coef
  penalty: str = "squared"  # squared: the paper's; norm: PFLlib's unsquared distance
  server_mean: str = "uniform"  # uniform: the paper's 1/|P_t|; weighted: the run's weights


FLAG_HELP = {
    "alpha": "FedDyn alpha: local loss - <g_k, theta> + alpha/2 ||theta - theta_server||^2",
    "penalty": "FedDyn proximal term: squared (the paper's alpha/2 ||.||^2) or norm"
               " (PFLlib's alpha/2 ||.||)",
    "server_mean": "FedDyn: mean of the uploaded models over the sampled clients, uniform"
                   " (the paper, PFLlib) or with the run's client weights (weighted)",
}


def validate(config: FedDynConfig) -> FedDynConfig:
  if not traced(config.alpha) and config.alpha <= 0:
    raise FieldError("feddyn", "alpha", f"must be > 0, got {config.alpha}")
  check_one_of("feddyn", config, "penalty", PENALTIES)
  check_one_of("feddyn", config, "server_mean", server_optimizer.SERVER_MEANS)
  return config


class ServerState(NamedTuple):
  params: Params  # theta^t
  h: Params       # the server's state h^t


def safe_norm(squared: jax.Array) -> jax.Array:
  """sqrt(squared) whose gradient at 0 is 0 (PyTorch's norm), not NaN."""
  positive = squared > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def dynamic_regularizer(alpha: float, penalty: str, client_gradient, server_params):
  """theta -> -<g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2 (or ||.|| unsquared)."""
  linear = linear_term(jax.tree.map(jnp.negative, client_gradient))

  def regularizer(params):
    distance = tree.squared_distance(params, server_params)
    if penalty == "norm":
      distance = safe_norm(distance)
    return linear(params) + 0.5 * alpha * distance
  return regularizer


def feddyn(config: FedDynConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  alpha = config.alpha

  def init(context: InitContext) -> AlgorithmState:
    zeros = jax.tree.map(jnp.zeros_like, context.params)
    return AlgorithmState(server=ServerState(tree.first(context.params), tree.first(zeros)),
                          clients=zeros)

  def broadcast(server, clients):
    return tree.broadcast_to_clients(server.params, tree.leading_size(clients))

  def client_update(client_gradient, server_params, data, key):
    params, stats = trainer.train(
        server_params, data.train, key,
        regularizer=dynamic_regularizer(alpha, config.penalty, client_gradient, server_params))
    new_gradient = jax.tree.map(lambda g, p, s: g - alpha * (p - s), client_gradient,
                                params, server_params)
    return ClientOutput(state=new_gradient, upload=params, train=stats)

  def aggregate(server, clients, uploads, weights):
    num_clients = tree.leading_size(clients)
    sampled = (weights > 0).astype(jnp.float32)
    # sum over the sampled clients of theta_k - theta^{t-1}; fillers (weight 0) out.
    drift = jax.tree.map(
        lambda u, s: jnp.tensordot(sampled, u, axes=(0, 0)) - jnp.sum(sampled) * s,
        uploads, server.params)
    h = jax.tree.map(lambda h, d: h - alpha * d / num_clients, server.h, drift)
    mean = tree.weighted_mean(uploads,
                              server_optimizer.sampled_weights(weights, config.server_mean))
    params = jax.tree.map(lambda m, h: m - h / alpha, mean, h)
    return AlgorithmState(server=ServerState(params, h), clients=clients)

  def personalized_params(server, clients):
    return tree.broadcast_to_clients(server.params, tree.leading_size(clients))

  return Algorithm(name="feddyn", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.params, uploads_unordered=True)
