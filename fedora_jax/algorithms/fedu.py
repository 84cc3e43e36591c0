"""FedU: federated multi-task learning with Laplacian regularization.

Dinh, Vu, Tran, Dao, Zhang. "A New Look and Convergence Rate of Federated Multi-Task
Learning with Laplacian Regularization." IEEE TNNLS 2022 (arXiv 2021, first titled "FedU:
A Unified Framework for Federated Multi-Task Learning with Laplacian Regularization").
https://arxiv.org/abs/2102.07148  (code: github.com/CharlieDinh/FedU_FMTL)

Each round every client runs its local SGD on its own loss f_k, then takes one step on the
Laplacian regulariser (lambda / 2) sum_k sum_l a_kl ||theta_k - theta_l||^2 of the paper:
theta_k <- theta_k - eta lambda sum_l a_kl (theta_k - theta_l), a_kl = 1 for every pair
(one mean over clients). Each client is scored with its theta_k. FedUConfig: lam 0.01 and
eta 0.03 (the authors' MNIST commands), update "all", step "paper", graph "complete".

Departures: the authors' code (FedU_FMTL@3e77db4) steps only the sampled users
(update="sampled"), by 0.5 local_epochs eta lambda (step="code"), on a random graph
(graph="random"), and one user after another in place (not offered).

Details (every option, the departures, measurements): docs/algorithms/fedu.md.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import similarity
from fedora_jax.algorithms import local
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

UPDATES = ("all", "sampled")
STEPS = ("paper", "code")
GRAPHS = ("complete", "random")
CODE_GRAPH_THRESHOLD = 0.25  # the code's a_kl below it are zeroed


class FedUConfig(NamedTuple):
  lam: float = 0.01  # lambda, the strength of the Laplacian regulariser (code: L_k)
  eta: float = 0.03  # step size of the Laplacian step (the paper's local learning rate)
  update: str = "all"      # "all": every client over every one; "sampled": the code's
  step: str = "paper"      # "paper": eta lambda; "code": 0.5 local_epochs eta lambda
  graph: str = "complete"  # "complete": a_kl = 1; "random": the code's K = 0 draw


def validate(config: FedUConfig) -> FedUConfig:
  if config.lam < 0:
    raise FieldError("fedu", "lam", f"must be >= 0, got {config.lam}")
  if config.eta < 0:
    raise FieldError("fedu", "eta", f"must be >= 0, got {config.eta}")
  for field, allowed in (("update", UPDATES), ("step", STEPS), ("graph", GRAPHS)):
    if getattr(config, field) not in allowed:
      raise FieldError("fedu", field, f"must be one of {', '.join(allowed)}, got"
                       f" {getattr(config, field)!r}")
  return config


def step_size(config: FedUConfig, local_epochs: int) -> float:
  """The step per unit a_kl: eta lambda, or the code's 0.5 beta local_epochs eta lambda
  (beta 1, its default)."""
  scale = 0.5 * local_epochs if config.step == "code" else 1.0
  return scale * config.eta * config.lam


def laplacian_step(stacked, eta: float, lam: float):
  """theta_k - eta * lambda * sum_{l != k} (theta_k - theta_l), all a_kl = 1."""
  def step(leaf):
    num_clients = leaf.shape[0]
    total = jnp.sum(leaf, axis=0, keepdims=True)
    return leaf - eta * lam * (num_clients * leaf - total)
  return jax.tree.map(step, stacked)


def masked_laplacian_step(stacked, step: float, graph: jax.Array, active: jax.Array):
  """theta_k - step * sum_{l active} a_kl (theta_k - theta_l) for an active k [K] bool;
  the others keep theta_k. a_kk plays no role (theta_k - theta_k = 0)."""
  weights = graph * active[None, :].astype(graph.dtype)  # [K, K]: a_kl, 0 off the set
  degree = jnp.sum(weights, axis=1)

  def update(leaf):
    flat = leaf.reshape(leaf.shape[0], -1)
    moved = flat - step * (degree[:, None] * flat - weights @ flat)
    return jnp.where(active[:, None], moved, flat).reshape(leaf.shape)
  return jax.tree.map(update, stacked)


def fedu(config: FedUConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  step = step_size(config, trainer.epochs)
  base = local.local(local.LocalConfig(), trainer)

  def init(context: InitContext) -> AlgorithmState:
    state = base.init(context)
    if config.graph == "complete":
      return state
    # Drawn once, as the code draws it when its server is built.
    num_clients = jax.tree.leaves(context.params)[0].shape[0]
    graph = similarity.random_similarity(context.key, num_clients, CODE_GRAPH_THRESHOLD)
    return state._replace(server=graph)

  def aggregate(server, client_params, uploads, weights):
    del uploads
    if config.update == "all" and config.graph == "complete":
      # All a_kl = 1 over every client: one mean, no K x K matrix.
      return AlgorithmState(server=server,
                            clients=laplacian_step(client_params, step, 1.0))
    num_clients = weights.shape[0]
    graph = server if config.graph == "random" else jnp.ones((num_clients, num_clients))
    # weights > 0: the clients whose models arrived this round (rounds.py).
    active = weights > 0 if config.update == "sampled" else jnp.ones(num_clients, bool)
    return AlgorithmState(server=server, clients=masked_laplacian_step(
        client_params, step, graph, active))

  # Clients train their own models exactly as in LOCAL; only the server's Laplacian
  # step after local training differs.
  return base._replace(name="fedu", init=init, aggregate=aggregate,
                       state_upload=lambda params: params)
