"""FedMD: clients keep their own models and distil towards the mean of their class
scores on a public dataset.

Li, Wang. "FedMD: Heterogenous Federated Learning via Model Distillation." NeurIPS 2019
Workshop on Federated Learning for Data Privacy and Confidentiality.
https://arxiv.org/abs/1910.03581
(code read, not run or copied: the authors' github.com/diogenes0319/FedMD_clean
(FedMD.py, conf/*.json) and FL-bench's src/server/fedmd.py and src/client/fedmd.py,
KarhouTam/FL-bench, GPL. The paper's full text is not on disk: this module follows its
abstract's protocol and the authors' code, and names no equation numbers. PFLlib has no
FedMD, so there is no verification row: the unit tests check the consensus, the digest
loss and one client's round by hand.)

Each round a client digests the consensus (the mean of the clients' logits on alignment_size
5000 public samples) for digest_epochs 1 (loss "mae"), trains on its own data and uploads its
logits on the next round's set; it is scored with its own model. public_size 5000.

Departures: no transfer-learning phase; the run's optimizer and batch; the consensus lags.
Details (every option, the departures, measurements): docs/algorithms/fedmd.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
LOSSES = ("mae", "mse")


class FedMdConfig(NamedTuple):
  public_size: int = 5000      # the public set's size (--public_size overrides)
  alignment_size: int = 5000   # A: public samples scored and digested a round
  digest_epochs: int = 1       # passes over the alignment set towards the consensus
  loss: str = "mae"            # "mae" (the authors') or "mse" (FL-bench's)


FLAG_HELP = {
    "public_size": "FedMD: training samples held out as the public set when --public_size"
                   " is unset",
    "alignment_size": "FedMD: public samples scored and digested each round (the authors'"
                      " N_alignment)",
    "digest_epochs": "FedMD: epochs of training towards the consensus on them",
    "loss": "FedMD: digest loss on the logits, mae (the authors') or mse (FL-bench's)",
}


class FedMdServer(NamedTuple):
  public_x: jax.Array       # [P, ...] the public set's inputs
  key: jax.Array            # raw key drawing the alignment sets
  round: jax.Array          # [] int32
  alignment: jax.Array      # [A] the indices the consensus is on
  consensus: jax.Array      # [A, C]
  received: jax.Array       # [] bool: a consensus exists (digest on)
  next_alignment: jax.Array  # [A] the indices this round's clients score


class FedMdMessage(NamedTuple):
  x: jax.Array              # [A, ...] the alignment set the consensus is on
  consensus: jax.Array      # [A, C]
  received: jax.Array       # [] bool
  next_x: jax.Array         # [A, ...] the set to score after training


def validate(config: FedMdConfig, trainer: ClientTrainer) -> FedMdConfig:
  for field in ("public_size", "alignment_size", "digest_epochs"):
    if getattr(config, field) < 1:
      raise FieldError("fedmd", field, f"must be >= 1, got {getattr(config, field)}")
  check_one_of("fedmd", config, "loss", LOSSES)
  if trainer.task != "classification" or trainer.apply is None:
    raise ConfigError("fedmd needs a classification task and the model's forward")
  return config


def consensus_of(scores: jax.Array, weights: jax.Array) -> jax.Array:
  """[A, C]: the plain mean of the clients' scores [K, A, C] over those with weight > 0."""
  scored = (weights > 0).astype(scores.dtype)
  return jnp.einsum("k,kac->ac", scored, scores) / jnp.maximum(jnp.sum(scored), 1.0)


def matching_loss(outputs: jax.Array, targets: jax.Array, weights: jax.Array,
                  loss: str) -> jax.Array:
  """Mean over real samples and classes of |f - c| (mae) or (f - c)^2 (mse)."""
  gap = outputs - targets
  per_sample = jnp.mean(jnp.abs(gap) if loss == "mae" else jnp.square(gap), axis=-1)
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def digest_loss(apply_fn, consensus: jax.Array, loss: str):
  """The digest's batch loss; a sample's label is its row in the alignment set."""
  def batch_loss(params, x, rows, weights):
    return matching_loss(apply_fn(params, x), consensus[rows], weights, loss)
  return batch_loss


def alignment_data(x: jax.Array, on: jax.Array) -> ClientData:
  """The alignment set as one client's split, labels its row numbers; `on` False: no real
  sample, so training on it takes no step."""
  size = x.shape[0]
  return ClientData(x=x, y=jnp.arange(size, dtype=jnp.int32),
                    mask=jnp.broadcast_to(on, (size,)),
                    n=jnp.where(on, size, 0).astype(jnp.int32))


def draw_alignment(key: jax.Array, round_number: jax.Array, public_size: int,
                   alignment_size: int) -> jax.Array:
  """[A] distinct public indices, a fresh draw each round."""
  key = jax.random.fold_in(jax.random.wrap_key_data(key), round_number)
  return jax.random.permutation(key, public_size)[:alignment_size].astype(jnp.int32)


def fedmd(config: FedMdConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None  # validate checked it

  def init(context: InitContext) -> AlgorithmState:
    public = context.data.public
    if public is None:
      raise ConfigError("fedmd distils on a public set; the run holds none (--public_size"
                        " must be > 0)")
    size = len(public.y)
    if config.alignment_size > size:
      raise FieldError("fedmd", "alignment_size", f"({config.alignment_size}) exceeds the"
                       f" public set's {size} samples")
    key = raw_key(context.key)
    num_classes = context.data.num_classes
    server = FedMdServer(
        public_x=jnp.asarray(public.x), key=key, round=jnp.zeros((), jnp.int32),
        alignment=jnp.zeros((config.alignment_size,), jnp.int32),
        consensus=jnp.zeros((config.alignment_size, num_classes), jnp.float32),
        received=jnp.array(False),
        next_alignment=draw_alignment(key, jnp.zeros((), jnp.int32), size,
                                      config.alignment_size))
    return AlgorithmState(server=server, clients=context.params)

  def broadcast(server: FedMdServer, models):
    message = FedMdMessage(x=server.public_x[server.alignment], consensus=server.consensus,
                           received=server.received,
                           next_x=server.public_x[server.next_alignment])
    return tree.broadcast_to_clients(message, tree.leading_size(models))

  def client_update(model, message: FedMdMessage, data, key):
    digest_key, revisit_key = jax.random.split(key)
    model, _ = trainer.train(model, alignment_data(message.x, message.received), digest_key,
                             loss_fn=digest_loss(apply_fn, message.consensus, config.loss),
                             epochs=config.digest_epochs)
    model, stats = trainer.train(model, data.train, revisit_key)
    return ClientOutput(state=model, upload=apply_fn(model, message.next_x), train=stats)

  def aggregate(server: FedMdServer, models, scores, weights):
    next_round = server.round + 1
    server = server._replace(
        round=next_round, alignment=server.next_alignment,
        consensus=consensus_of(scores, weights),
        received=server.received | jnp.any(weights > 0),
        next_alignment=draw_alignment(server.key, next_round, server.public_x.shape[0],
                                      config.alignment_size))
    return AlgorithmState(server=server, clients=models)

  def personalized_params(server, models):
    del server
    return models

  return Algorithm(name="fedmd", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   preshared=lambda message: (message.x, message.next_x))


def public_size(config: FedMdConfig) -> int:
  return config.public_size
