"""FedDistill (FD, federated distillation): clients keep their own models and exchange
per-class average logits; each distils from the global average logit of a sample's
label while training on its labels.

Jeong, Oh, Kim, Park, Bennis, Kim. "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data." NeurIPS 2018
Workshop on Machine Learning on the Phone and other Consumer Devices.
https://arxiv.org/abs/1811.11479
(code: PFLlib's clientfd.py / serverfd.py ("FD"), which the verification runs beside
this module)

A sampled client trains its own model F_i (never sent) on CE + lam * soft-label cross-entropy
against the global logit of its label (target "softmax"; "raw": PFLlib's form), lam 1, and
uploads its per-class mean logits; the server averages them per class; F_i is scored.

Departure: a partial last batch trains and counts in the logits (PFLlib's loader drops it).

Details (every option, the departures, measurements): docs/algorithms/feddistill.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
TARGETS = ("softmax", "raw")


class FedDistillConfig(NamedTuple):
  lam: float = 1.0          # weight of the distillation term (PFLlib's --lamda)
  target: str = "softmax"   # "softmax" (knowledge distillation) or "raw" (PFLlib)


FLAG_HELP = {
    "lam": "FedDistill: weight lambda of the distillation from the global logit of each"
           " sample's label",
    "target": "FedDistill: distil towards the softmax of that logit (softmax) or use the raw"
              " logit vector as the target's class weights, a label without one targeting"
              " the sample's own logits (raw, PFLlib)",
}


class GlobalLogits(NamedTuple):
  logits: jax.Array    # [C, C] the global logit of each class (0 where none)
  present: jax.Array   # [C] bool: the class has one
  received: jax.Array  # [] bool: an aggregation has happened (distillation on)


class LocalLogits(NamedTuple):
  logits: jax.Array    # [C, C] the client's mean logit of each class
  present: jax.Array   # [C] bool: the client holds the class


def validate(config: FedDistillConfig, trainer: ClientTrainer) -> FedDistillConfig:
  if config.lam < 0:
    raise FieldError("feddistill", "lam", f"must be >= 0, got {config.lam}")
  check_one_of("feddistill", config, "target", TARGETS)
  if trainer.task != "classification" or trainer.apply is None:
    raise ConfigError("feddistill needs a classification task and the model's forward")
  return config


def distillation(outputs: jax.Array, y: jax.Array, weights: jax.Array,
                 teacher: GlobalLogits, target: str) -> jax.Array:
  """The batch's distillation term (a mean over its real samples)."""
  log_probs = jax.nn.log_softmax(outputs)
  has_teacher = teacher.present[y]
  if target == "softmax":
    targets = jax.nn.softmax(teacher.logits[y])
    per_sample = -jnp.sum(targets * log_probs, axis=-1) * has_teacher
  else:
    targets = jnp.where(has_teacher[:, None], teacher.logits[y],
                        jax.lax.stop_gradient(outputs))
    per_sample = -jnp.sum(targets * log_probs, axis=-1)
  mean = jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.where(teacher.received, mean, 0.0)


def distill_loss(apply_fn, teacher: GlobalLogits, config: FedDistillConfig):
  def loss(params, x, y, weights):
    outputs = apply_fn(params, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, y)
    mean_ce = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return mean_ce + config.lam * distillation(outputs, y, weights, teacher, config.target)
  return loss


def logit_sums(apply_fn, num_classes: int):
  """observe(params, x, y, weights): the step's class sums [C, C] of its logits and
  their counts [C] (real samples only)."""
  def observe(params, x, y, weights):
    one_hot = jax.nn.one_hot(y, num_classes) * weights[:, None]
    return one_hot.T @ apply_fn(params, x), jnp.sum(one_hot, axis=0)
  return observe


def aggregate_logits(uploads: LocalLogits, sampled: jax.Array) -> GlobalLogits:
  """Each class's plain mean over the sampled clients that hold it."""
  holds = (uploads.present & sampled[:, None]).astype(jnp.float32)      # [K, C]
  count = jnp.sum(holds, axis=0)
  means = jnp.einsum("kc,kcd->cd", holds, uploads.logits) / jnp.maximum(count, 1.0)[:, None]
  return GlobalLogits(logits=means, present=count > 0, received=jnp.array(True))


def feddistill(config: FedDistillConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)

  def init(context: InitContext) -> AlgorithmState:
    num_classes = context.data.num_classes
    empty = GlobalLogits(logits=jnp.zeros((num_classes, num_classes), jnp.float32),
                         present=jnp.zeros((num_classes,), bool), received=jnp.array(False))
    return AlgorithmState(server=empty, clients=context.params)

  def broadcast(teacher: GlobalLogits, models):
    return tree.broadcast_to_clients(teacher, tree.leading_size(models))

  def client_update(model, teacher: GlobalLogits, data, key):
    num_classes = teacher.present.shape[-1]
    params, stats, (sums, counts) = trainer.train(
        model, data.train, key, loss_fn=distill_loss(trainer.apply, teacher, config),
        observe=logit_sums(trainer.apply, num_classes))
    local = LocalLogits(logits=sums / jnp.maximum(counts, 1.0)[:, None], present=counts > 0)
    return ClientOutput(state=params, upload=local, train=stats)

  def aggregate(teacher, models, uploads: LocalLogits, weights):
    del teacher
    return AlgorithmState(server=aggregate_logits(uploads, weights > 0), clients=models)

  def personalized_params(teacher, models):
    del teacher
    return models

  return Algorithm(name="feddistill", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
