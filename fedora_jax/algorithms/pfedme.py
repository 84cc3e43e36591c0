"""pFedMe: personalised models as Moreau envelopes of the clients' losses around a global
model.

T. Dinh, Tran, Nguyen. "Personalized Federated Learning with Moreau Envelopes."
NeurIPS 2020. https://arxiv.org/abs/2006.08848
(authors' code: github.com/CharlieDinh/pFedMe, FLAlgorithms/users/userpFedMe.py,
optimizers/fedoptimizer.py, servers/serverbase.py; also TsingZ0/PFLlib clientpFedMe.py)

Objective (the paper's bi-level problem):
  min_w 1/N sum_i F_i(w),   F_i(w) = min_theta { f_i(theta) + lambda/2 ||theta - w||^2 },
the personalised model of client i being theta_hat_i(w) = prox_{f_i / lambda}(w), the
argmin, and grad F_i(w) = lambda (w - theta_hat_i(w)).

Client i, every round (the paper's Algorithm 1), from w_{i,0} = w^t the received global
model, for r = 0 .. R-1 local iterations, each on its own minibatch D of B samples:
  theta_i <- approximately argmin_theta h_i(theta; w_{i,r}, D)
             = f_i(theta; D) + lambda/2 ||theta - w_{i,r}||^2,
             by K gradient steps of size `personal_lr` on that batch,
  w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta_i)          (local update)
and it uploads w_{i,R}. Server, over the round's sampled clients S (weighted by
training-set size, as the authors' code):
  w^{t+1} = (1 - beta) w^t + beta mean_{i in S} w_{i,R}.
Who trains under partial participation: the paper's Algorithm 1 sends w^t to all N
clients, all of them run the R local iterations, and only then does the server sample
S^t, whose w_{i,R} it averages; the authors' serverpFedMe.py does the same ("do update
for all users not only selected users"). So every client trains every round, its
theta_i and w_{i,R} kept (`train_clients="all"`, the default: Algorithm.trains_unsampled),
and the clients not sampled upload nothing. PFLlib's serverpFedMe.py trains only the
selected clients (`train_clients="sampled"`; a client that sits a round out keeps its
model). The two are the same at full participation; "all" costs every client's
training each round.
R is the run's local epochs times its batches per epoch (the authors' code takes
--local_epochs = R single batches; PFLlib, like this, every batch of every epoch). The
solver of h_i starts from w^t at the start of a round and warm-starts from the previous
theta_i at each later iteration (both codes). The steps are plain gradient steps of the
stated sizes (paper and code); the run's --lr, --momentum and --weight_decay do not apply.

The authors' code departs from the paper in two ways, both offered:
  * its inner steps add mu theta to the gradient, mu = 0.001 (an L2 term the paper's h_i
    lacks; PFLlib keeps it): `theta_l2` (default 0, the paper's h_i);
  * the model it evaluates as personalised is not theta_i: the list it keeps as
    theta_i aliases the model's parameters, which it then overwrites with w_{i,R}, so it
    evaluates the local model w_{i,R} (issue CharlieDinh/pFedMe#5 notes the copy "is just
    a copy of local_model"). `personal_model="local"` evaluates w_{i,R};
    "theta" (default) evaluates theta_i, the personalised model the paper defines, at the
    end of the client's last round. A client that sits a round out (train_clients
    "sampled") keeps its model.

Defaults: lambda = 15, K = 5, eta = 0.005, beta = 1 and personal_lr = 0.09: the authors'
MNIST comparison with the non-convex model (README: --learning_rate 0.005
--personal_learning_rate 0.09 --beta 1 --lamda 15 --K 5 --model dnn, an MLP as here;
0.09 is also main.py's default). Their Synthetic and CIFAR-10 runs, and PFLlib's default,
take personal_lr = 0.01; their tuned MNIST runs take beta = 2.
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
