"""MetaFed: clients in a ring, each learning from its predecessor's model by copying it or
distilling from its features (cyclic knowledge distillation), then a personalisation
round distilling from one common model with an adaptive weight.

Chen, Lu, Wang, Qin, Wang. "MetaFed: Federated Learning among Federations with Cyclic
Knowledge Distillation for Personalized Healthcare." IEEE TNNLS 2023.
https://arxiv.org/abs/2206.08516
(code followed: the authors' github.com/microsoft/PersonalizedFL, alg/metafed.py,
util/traineval.py trainwithteacher, main.py's schedule; FL-bench's src/server/metafed.py
and src/client/metafed.py, KarhouTam/FL-bench, GPL: read, not run or copied. The paper's
full text is not on disk: this module follows the authors' code and names no equation
numbers. PFLlib has no MetaFed, so there is no verification row: the unit tests check
the loss, the adaptive weight, the stages and one client's round by hand.)

After a warm-up (`warmup_epochs` 30) client i copies, or above `threshold` 0.6 distils (`lam` 1),
its ring predecessor's model, the last round the last client's; each is scored with its own.

Departures: one hop a round (i's teacher is i - 1's model of the round before); the run's optimizer.
Details (every option, the departures, measurements): docs/algorithms/metafed.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import (Algorithm, AlgorithmState, ClientOutput, InitContext,
                                        RoundCost)
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer)
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, traced

Params = Any


class MetaFedConfig(NamedTuple):
  lam: float = 1.0                  # lambda: the feature distillation's weight
  threshold: float = 0.6            # validation accuracy above which a client distils
  personal_threshold: float = 0.5   # the personalisation's floor on the teacher's accuracy
  warmup_epochs: int = 30           # local epochs every client trains alone first
  rounds: int = 100                 # the run's rounds (a train field)


FLAG_HELP = {
    "lam": "MetaFed: weight of the feature distillation from the teacher (the predecessor"
           " in the ring; the last client's model in the personalisation round)",
    "threshold": "MetaFed: validation accuracy above which a client distils from its"
                 " teacher; below it, it copies the teacher's model",
    "personal_threshold": "MetaFed: personalisation: no distillation where the teacher is"
                          " no better than the client's model and below this accuracy",
    "warmup_epochs": "MetaFed: local epochs of training alone before the ring (the first"
                     " ceil(warmup_epochs / local_epochs) rounds, at most rounds - 2)",
}


class MetaFedServer(NamedTuple):
  round: jax.Array   # [] int32 t, rounds aggregated so far


class MetaFedClient(NamedTuple):
  model: Params
  flag: jax.Array    # [] bool: distil (True) or copy (False) the teacher


class MetaFedMessage(NamedTuple):
  teacher: Params
  has_teacher: jax.Array   # [] bool: False in the warm-up
  personal: jax.Array      # [] bool: the personalisation round (adaptive lambda)
  update_flag: jax.Array   # [] bool: set the flag from the trained model's accuracy


def warmup_rounds(config: MetaFedConfig, local_epochs: int) -> int:
  """The warm-up's rounds: ceil(warmup_epochs / local_epochs), at most rounds - 2."""
  return min(math.ceil(config.warmup_epochs / local_epochs), max(config.rounds - 2, 0))


def personal_lambda(teacher_acc: jax.Array, own_acc: jax.Array, lam: float,
                    personal_threshold: float) -> jax.Array:
  """The personalisation's lambda: 0 where the teacher is no better than the client's own
  model and below `personal_threshold`, else lam 10^min(1, 5 (a_T - a)) / 10."""
  off = (teacher_acc <= own_acc) & (teacher_acc < personal_threshold)
  return jnp.where(off, 0.0,
                   jnp.power(10.0, jnp.minimum(1.0, 5.0 * (teacher_acc - own_acc))) / 10.0
                   * lam)


def feature_mse(z: jax.Array, z_teacher: jax.Array, weights: jax.Array) -> jax.Array:
  """Mean over the real samples (weights > 0) and features of (z - z_teacher)^2."""
  per_sample = jnp.mean(jnp.square(z - z_teacher), axis=-1)
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def metafed_loss(apply_fn, head: str, teacher: Params, lam: jax.Array):
  """The client's loss(params, x, y, weights): mean CE + lam * the feature MSE to the
  teacher's (fixed, on its running averages: the authors' tmodel.eval())."""
  def loss(params, x, y, weights):
    logits, z = apply_with_representation(apply_fn, params, x, head)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    mean_ce = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    with batch_stats.inference():
      z_teacher = apply_with_representation(apply_fn, teacher, x, head)[1]
    return mean_ce + lam * feature_mse(z, jax.lax.stop_gradient(z_teacher), weights)
  return loss


def validate(config: MetaFedConfig, trainer: ClientTrainer) -> MetaFedConfig:
  check_representation_trainer("metafed", trainer)
  if not traced(config.lam) and not (math.isfinite(config.lam) and config.lam >= 0):
    raise FieldError("metafed", "lam", f"must be a finite number >= 0, got {config.lam}")
  for field in ("threshold", "personal_threshold"):
    value = getattr(config, field)
    if not traced(value) and not 0 <= value <= 1:
      raise FieldError("metafed", field, f"must be an accuracy in [0, 1], got {value}")
  if config.warmup_epochs < 0:
    raise FieldError("metafed", "warmup_epochs", f"must be >= 0, got {config.warmup_epochs}")
  if config.rounds < 1:
    raise FieldError("metafed", "rounds", f"must be >= 1, got {config.rounds}")
  return config


def metafed(config: MetaFedConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None  # validate checked it
  warmup = warmup_rounds(config, trainer.epochs)
  last_round = config.rounds - 1   # the personalisation

  def init(context: InitContext) -> AlgorithmState:
    head_layer(context.params, "metafed")  # an affine classifier on top, or one line
    num_clients = tree.leading_size(context.params)
    if num_clients < 2:
      raise ConfigError("metafed passes models around a ring: it needs at least 2 clients")
    clients = MetaFedClient(model=context.params, flag=jnp.zeros((num_clients,), bool))
    return AlgorithmState(server=MetaFedServer(round=jnp.zeros((), jnp.int32)),
                          clients=clients)

  def broadcast(server: MetaFedServer, clients: MetaFedClient):
    models = clients.model
    num_clients = tree.leading_size(models)
    personal = server.round >= last_round
    predecessor = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), models)
    common = tree.broadcast_to_clients(tree.take(models, num_clients - 1), num_clients)
    teacher = jax.tree.map(lambda c, p: jnp.where(personal, c, p), common, predecessor)
    flags = (server.round >= warmup, personal,
             (server.round >= warmup - 1) & ~personal)
    return MetaFedMessage(teacher, *(jnp.broadcast_to(f, (num_clients,)) for f in flags))

  def client_update(client: MetaFedClient, message: MetaFedMessage, data, key):
    head = head_layer(client.model, "metafed")
    own_acc = trainer.evaluate(client.model, data.val).score
    teacher_acc = trainer.evaluate(message.teacher, data.val).score
    lam = jnp.where(message.personal,
                    personal_lambda(teacher_acc, own_acc, config.lam,
                                    config.personal_threshold),
                    config.lam)
    copy = message.has_teacher & ~client.flag
    distil = message.has_teacher & client.flag
    start = jax.tree.map(lambda t, o: jnp.where(copy, t, o), message.teacher, client.model)
    model, stats = trainer.train(
        start, data.train, key,
        loss_fn=metafed_loss(apply_fn, head, message.teacher, jnp.where(distil, lam, 0.0)))
    passed = trainer.evaluate(model, data.val).score > config.threshold
    flag = jnp.where(message.update_flag, client.flag | passed, client.flag)
    metrics = {"copied": copy.astype(jnp.float32),
               "distil_lambda": jnp.where(distil, lam, 0.0)}
    return ClientOutput(state=MetaFedClient(model=model, flag=flag), upload=(), train=stats,
                        metrics=metrics)

  def aggregate(server: MetaFedServer, clients: MetaFedClient, uploads, weights):
    del uploads, weights
    return AlgorithmState(server=MetaFedServer(round=server.round + 1), clients=clients)

  return Algorithm(name="metafed", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: clients.model,
                   # The teachers the server hands on are the clients' own models.
                   state_upload=lambda client: client.model)


def round_cost(config: MetaFedConfig) -> RoundCost:
  """A trained client scores its own model, its teacher and its trained model on its
  validation split."""
  del config
  return RoundCost(extra_validation_passes=3)
