"""pFedMe: personalised models as Moreau envelopes of the clients' losses around a global
model.

T. Dinh, Tran, Nguyen. "Personalized Federated Learning with Moreau Envelopes."
NeurIPS 2020. https://arxiv.org/abs/2006.08848
(authors' code: github.com/CharlieDinh/pFedMe, FLAlgorithms/users/userpFedMe.py,
optimizers/fedoptimizer.py, servers/serverbase.py; also TsingZ0/PFLlib clientpFedMe.py)

Each local iteration a client solves its personal model theta_i ~ argmin f_i(theta) +
lam/2 ||theta - w||^2 on a batch by k gradient steps of size personal_lr, then moves its
copy w <- w - eta lam (w - theta_i); it uploads w, and the server sets w <- (1 - beta) w
+ beta mean (weighted by training-set size). Each client is scored with theta_i.
PfedmeConfig: lam 15, k 5, personal_lr 0.09, eta 0.005, beta 1 (the authors' MNIST run);
every client trains each round (train_clients "all", as Algorithm 1).

Departures of the authors' code, both offered: an L2 term 0.001 theta in the inner steps
(theta_l2, default 0), and the local model w scored (personal_model "local").

Details (every option, the departures, measurements): docs/algorithms/pfedme.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import model_message
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import (ClientTrainer, TrainStats, epoch_batches,
                                               within_budget)
from fedora_jax.errors import FieldError, check_one_of

Params = Any

PERSONAL_MODELS = ("theta", "local")
TRAIN_CLIENTS = ("all", "sampled")  # every client (paper, authors) or the sampled (PFLlib)


class PfedmeConfig(NamedTuple):
  lam: float = 15.0           # lambda: pull between theta_i and the local copy w_i
  k: int = 5                  # K: gradient steps solving h_i per local iteration
  personal_lr: float = 0.09   # step size of those K steps
  eta: float = 0.005          # step size of the local update of w_i
  beta: float = 1.0           # server mixing: w <- (1 - beta) w + beta mean
  theta_l2: float = 0.0       # the authors' extra mu theta in h_i's gradient (code: 0.001)
  personal_model: str = "theta"  # evaluated: "theta" (paper) or "local" (authors' code)
  train_clients: str = "all"  # at participation < 1 who trains: "all" or "sampled"


FLAG_HELP = {
    "lam": "pFedMe: lambda of h_i = f_i(theta) + lambda/2 ||theta - w_i||^2",
    "k": "pFedMe: K gradient steps on h_i per local iteration",
    "personal_lr": "pFedMe: step size of the K steps on theta",
    "eta": "pFedMe: step size of the local update w_i -= eta lambda (w_i - theta)",
    "beta": "pFedMe: server update w = (1 - beta) w + beta mean of the uploads",
    "theta_l2": "pFedMe: L2 weight added to theta's gradient (the authors' code: 0.001;"
                " the paper's h_i: 0)",
    "personal_model": "pFedMe: evaluated model, theta (theta_i, the paper's) or local"
                      " (w_i after local training, what the authors' code evaluates)",
    "train_clients": "pFedMe: who trains each round under --participation < 1: all (every"
                     " client, only the sampled aggregated: the paper's Algorithm 1 and"
                     " the authors' code) or sampled (PFLlib's)",
}


class PfedmeClient(NamedTuple):
  personal: Params  # [K, ...] the evaluated model: theta_i or w_{i,R}, per personal_model


def validate(config: PfedmeConfig) -> PfedmeConfig:
  for field in ("lam", "personal_lr", "eta", "theta_l2"):
    if getattr(config, field) < 0:
      raise FieldError("pfedme", field, f"must be >= 0, got {getattr(config, field)}")
  if config.k < 1:
    raise FieldError("pfedme", "k", f"must be >= 1, got {config.k}")
  if config.beta < 0:  # beta > 1 extrapolates (the paper runs beta = 2 and 4)
    raise FieldError("pfedme", "beta", f"must be >= 0, got {config.beta}")
  check_one_of("pfedme", config, "personal_model", PERSONAL_MODELS)
  check_one_of("pfedme", config, "train_clients", TRAIN_CLIENTS)
  return config


def solve_personal(loss_fn, config: PfedmeConfig, theta: Params, local: Params, x, y,
                   weights):
  """K gradient steps on h_i(theta; local, D) from `theta`; returns (theta, f(theta; D)
  before the last step). BatchNorm runs in train mode, each step moving theta's running
  averages (as the authors' train-mode forwards do)."""
  value_and_grad = batch_stats.value_and_grad(loss_fn)

  def step(theta, _):
    loss, grads, moved = value_and_grad(theta, x, y, weights, mask=weights > 0)
    stepped = jax.tree.map(
        lambda t, g, w: t - config.personal_lr * (g + config.lam * (t - w)
                                                   + config.theta_l2 * t),
        theta, grads, local)
    return batch_stats.take_statistics(stepped, moved), loss
  theta, losses = jax.lax.scan(step, theta, None, length=config.k)
  return theta, losses[-1]


def local_update(local: Params, theta: Params, config: PfedmeConfig) -> Params:
  """w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta_i). The running averages are
  theta_i's: the authors' theta and w are one PyTorch model's parameters, its BatchNorm
  buffers shared by both."""
  rate = config.eta * config.lam
  return batch_stats.take_statistics(
      jax.tree.map(lambda w, t: w - rate * (w - t), local, theta), theta)


def local_train(loss_fn, config: PfedmeConfig, global_params: Params, data: ClientData,
                key: jax.Array, epochs: int, batch_size: int):
  """ONE client's R local iterations; returns (theta_i, w_{i,R}, TrainStats)."""
  num_batches = max(1, -(-data.mask.shape[0] // batch_size))
  idx, weights = jax.vmap(
      lambda k: epoch_batches(k, data.mask, data.n, batch_size, num_batches))(
          jax.random.split(key, epochs))
  idx = idx.reshape(epochs * num_batches, batch_size)
  weights = within_budget(weights.reshape(epochs * num_batches, batch_size))  # stragglers

  def iteration(carry, batch):
    theta, local = carry
    batch_idx, batch_weights = batch
    new_theta, loss = solve_personal(loss_fn, config, theta, local, data.x[batch_idx],
                                     data.y[batch_idx], batch_weights)
    new_carry = (new_theta, local_update(local, new_theta, config))
    active = jnp.sum(batch_weights) > 0
    return optax.tree_utils.tree_where(active, new_carry, carry), (loss, active)

  (theta, local), (losses, active) = jax.lax.scan(
      iteration, (global_params, global_params), (idx, weights))
  real = active.astype(jnp.float32)
  stats = TrainStats(loss=jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1.0),
                     steps=jnp.sum(active).astype(jnp.int32))
  return theta, local, stats


def beta_mix(global_params: Params, mean: Params, beta: float) -> Params:
  """w^{t+1} = (1 - beta) w^t + beta mean."""
  return jax.tree.map(lambda w, m: (1.0 - beta) * w + beta * m, global_params, mean)


def pfedme(config: PfedmeConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  batch_size = batch_size_of(trainer)

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=tree.first(context.params),
                          clients=PfedmeClient(personal=context.params))

  def broadcast(global_params, clients: PfedmeClient):
    return tree.broadcast_to_clients(global_params, tree.leading_size(clients.personal))

  def client_update(clients_k: PfedmeClient, global_params, data, key):
    del clients_k
    theta, local, stats = local_train(trainer.loss, config, global_params,
                                      jax.tree.map(jnp.asarray, data.train), key,
                                      trainer.epochs, batch_size)
    personal = theta if config.personal_model == "theta" else local
    return ClientOutput(state=PfedmeClient(personal=personal), upload=local, train=stats,
                        metrics={"theta_distance": jnp.sqrt(
                            tree.squared_distance(theta, local))})

  def aggregate(global_params, clients, uploads, weights):
    return AlgorithmState(
        server=beta_mix(global_params, tree.weighted_mean(uploads, weights), config.beta),
        clients=clients)

  return Algorithm(name="pfedme", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: clients.personal,
                   # theta_hat starts w_i and theta's solver; theta_i is w_{i,R}, the upload,
                   # not the personalised theta (PFLlib's clientpFedMe.py).
                   ala_hooks=model_message(personal_is_local=False),
                   trains_unsampled=config.train_clients == "all")
