"""FedU: federated multi-task learning with Laplacian regularization.

Dinh, Vu, Tran, Dao, Zhang. "A New Look and Convergence Rate of Federated Multi-Task
Learning with Laplacian Regularization." IEEE TNNLS 2022 (arXiv 2021, first titled "FedU:
A Unified Framework for Federated Multi-Task Learning with Laplacian Regularization").
https://arxiv.org/abs/2102.07148  (code: github.com/CharlieDinh/FedU_FMTL)

FedU solves min_Theta sum_k f_k(theta_k) + (lambda / 2) sum_k sum_l a_kl ||theta_k - theta_l||^2
(a Laplacian regulariser over the client graph) by alternating, every round:
  1. each client runs its local SGD on its own loss f_k;
  2. every client takes one gradient step on the regulariser with the local step size,
       theta_k <- theta_k - eta * lambda * sum_l a_kl (theta_k - theta_l).
The experiments connect every pair of clients with a_kl = 1 (a_kk plays no role). On
that graph sum_{l != k} (theta_k - theta_l) = K theta_k - sum_l theta_l, which costs one
mean over clients instead of a K x K matrix. A client's personalized model is theta_k.

eta and lambda default to the authors' MNIST settings (learning rate 0.03, L_k 0.01, in
their README's commands). eta is the paper's local learning rate; it is its own field
here because the engine's client optimizer may use another (--lr).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax.algorithms import local
from fedora_jax.algorithms.base import Algorithm, AlgorithmState
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class FedUConfig(NamedTuple):
  lam: float = 0.01  # lambda, the strength of the Laplacian regulariser (code: L_k)
  eta: float = 0.03  # step size of the Laplacian step (the paper's local learning rate)


def validate(config: FedUConfig) -> FedUConfig:
  if config.lam < 0:
    raise FieldError("fedu", "lam", f"must be >= 0, got {config.lam}")
  if config.eta < 0:
    raise FieldError("fedu", "eta", f"must be >= 0, got {config.eta}")
  return config


def laplacian_step(stacked, eta: float, lam: float):
  """theta_k - eta * lambda * sum_{l != k} (theta_k - theta_l), all a_kl = 1."""
  def step(leaf):
    num_clients = leaf.shape[0]
    total = jnp.sum(leaf, axis=0, keepdims=True)
    return leaf - eta * lam * (num_clients * leaf - total)
  return jax.tree.map(step, stacked)


def fedu(config: FedUConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def aggregate(server, client_params, uploads, weights):
    del uploads, weights
    return AlgorithmState(server=server,
                          clients=laplacian_step(client_params, config.eta, config.lam))

  # Clients train their own models exactly as in LOCAL; only the server's Laplacian
  # step after local training differs.
  return local.local(local.LocalConfig(), trainer)._replace(
      name="fedu", aggregate=aggregate, state_upload=lambda params: params)
