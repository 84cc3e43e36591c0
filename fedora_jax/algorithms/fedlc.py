"""FedLC: FedAvg whose clients train on logits calibrated by their label counts.

Zhang, Li, Li, Xu, Wu, Ding, Wu. "Federated Learning with Label Distribution Skew via
Logits Calibration." ICML 2022. https://arxiv.org/abs/2209.00189
(reference run beside it: PFLlib's serverlc.py / clientlc.py)

Client m trains the broadcast global model on the calibrated cross-entropy (Section 5):
each logit f_c(x) is lowered by tau n_{m,c}^{-1/4}, n_{m,c} the client's training samples
of class c (a pairwise label margin favouring its rare classes), and
  L_cal = -log( exp(f_y - tau n_y^{-1/4}) / sum_{c != y} exp(f_c - tau n_c^{-1/4}) ),
the true class left out of the denominator as the paper writes it. The server averages
as FedAvg's (the run's client weights); the global model is scored on raw logits.

Departure, by default: `denominator` "all", the softmax cross-entropy of the calibrated
logits (PFLlib's and FL-bench's code). The paper's sum over c != y ("others") has no
lower bound (its gradient in f_y is -1 whatever f_y): FL-bench reports its training
collapsed, and here it reached an infinite loss in the first round of MNIST
pathological (20 clients, MLP, lr 0.01). Option `counts`: "client" (the paper's and
FL-bench's n_{m,c}) or "global" (PFLlib's: every client calibrated by the federation's
class counts). A class a client lacks has n = 1e-8 (margin 100 tau, FL-bench's stand-in for
the paper's infinite one). tau = 1: PFLlib's and FL-bench's default.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
DENOMINATORS = ("others", "all")
COUNTS = ("client", "global")
ABSENT_COUNT = 1e-8  # a class the client lacks (FL-bench's floor)


class FedLcConfig(NamedTuple):
  tau: float = 1.0
  denominator: str = "all"  # all: the codes' softmax; others: the paper's c != y (diverges)
  counts: str = "client"  # client: the paper's n_{m,c}; global: PFLlib's federation counts


FLAG_HELP = {
    "tau": "FedLC calibration strength: logit_c - tau n_c^(-1/4)",
    "denominator": "FedLC loss: all (PFLlib's and FL-bench's cross-entropy) or others (the"
                   " paper's, the true class out of the denominator; unbounded below)",
    "counts": "FedLC class counts n_c: client (each client's own, the paper) or global"
              " (the whole federation's, PFLlib)",
}


def validate(config: FedLcConfig) -> FedLcConfig:
  if config.tau < 0:
    raise FieldError("fedlc", "tau", f"must be >= 0, got {config.tau}")
  check_one_of("fedlc", config, "denominator", DENOMINATORS)
  check_one_of("fedlc", config, "counts", COUNTS)
  return config


class ServerState(NamedTuple):
  params: Params         # the global model
  class_counts: jax.Array  # [C] the federation's training samples per class


def class_counts(y: jax.Array, mask: jax.Array, num_classes: int) -> jax.Array:
  """[C] real samples per class (y and mask of any matching shape)."""
  return jnp.sum(jax.nn.one_hot(y, num_classes) * mask[..., None], axis=tuple(range(y.ndim)))


def calibration(counts: jax.Array, tau: float) -> jax.Array:
  """[C] tau n_c^{-1/4}, an absent class's n taken as ABSENT_COUNT."""
  return tau * jnp.power(jnp.maximum(counts, ABSENT_COUNT), -0.25)


def calibrated_loss(logits, y, weights, offsets, denominator: str) -> jax.Array:
  """Mean over the real samples of L_cal on logits - offsets."""
  calibrated = logits - offsets
  true = jnp.take_along_axis(calibrated, y[:, None], axis=-1)[:, 0]
  if denominator == "others":
    is_true = jax.nn.one_hot(y, logits.shape[-1], dtype=bool)
    calibrated = jnp.where(is_true, -jnp.inf, calibrated)
  per_sample = jax.nn.logsumexp(calibrated, axis=-1) - true
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def fedlc(config: FedLcConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  if trainer.task != "classification":
    raise ConfigError("fedlc calibrates class logits: it needs a classification task")
  base = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)

  def init(context: InitContext) -> AlgorithmState:
    state = base.init(context)
    num_classes = context.data.num_classes
    counts = jnp.asarray(sum(class_counts(jnp.asarray(b.train.y), jnp.asarray(b.train.mask),
                                          num_classes) for b in context.data.buckets))
    return state._replace(server=ServerState(state.server, counts))

  def broadcast(server, clients):
    return tree.broadcast_to_clients(server, tree.leading_size(clients))

  def client_update(client_state, server, data, key):
    global_params, federation_counts = server
    counts = (federation_counts if config.counts == "global" else
              class_counts(data.train.y, data.train.mask, federation_counts.shape[0]))
    offsets = calibration(counts, config.tau)

    def loss_fn(params, x, y, weights):
      return calibrated_loss(trainer.apply(params, x), y, weights, offsets, config.denominator)
    params, stats = trainer.train(global_params, data.train, key, loss_fn=loss_fn)
    return ClientOutput(state=client_state, upload=params, train=stats)

  def aggregate(server, clients, uploads, weights):
    return AlgorithmState(server=server._replace(params=tree.weighted_mean(uploads, weights)),
                          clients=clients)

  # Built afresh, not from FedAvg's by _replace: it hosts no plug-in.
  return Algorithm(name="fedlc", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: base.personalized_params(
                       server.params, clients),
                   shared_model=lambda server: server.params, uploads_unordered=True)
