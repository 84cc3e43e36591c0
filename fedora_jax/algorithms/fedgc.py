"""FedGC: a shared body (FedAvg) and a classifier per client over the classes it holds,
whose rows the server pushes apart across clients (gradient correction).

Niu, Deng. "Federated Learning for Face Recognition with Gradient Correction." AAAI 2022.
https://arxiv.org/abs/2112.07246
(code: PFLlib's servergc.py / clientgc.py, which the verification runs beside this
module. The paper's full text is not on disk: this module follows that code, PFLlib's
form of the paper's face-recognition setting for classes that clients may share, and
names no equation numbers.)

A sampled client trains the global body and its own bias-free head (a row per class it holds)
on the cross-entropy over its classes and uploads both; the server averages the bodies, keeps
the heads and takes one SGD step (the client lr times `lam`, default 1) on every head, pushing
its rows away from the mean rows of the classes its client lacks. A client is scored with the
global body and its head over its classes (a test sample of another class counts wrong).

Departures: a partial last batch trains, as for every method (PFLlib drops it).

Details (every option, the departures, measurements): docs/algorithms/fedgc.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedlc import class_counts
from fedora_jax.algorithms.layers import (check_representation_trainer, head_layer,
                                          merge_layers, split_body_head, take_layers)
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError, traced

Params = Any
# An excluded class's logit sits this far below the client's top one: exp(-200) is 0 in
# float32, so training is the softmax over the held classes exactly, and a test sample
# of an excluded class gets a large but finite loss.
EXCLUDED_GAP = 200.0


class FedGcConfig(NamedTuple):
  lam: float = 1.0     # the server's step is lam times the client lr (PFLlib's --lamda)
  lr: float = 5e-3     # the run's client lr (train field)


FLAG_HELP = {
    "lam": "FedGC: the server's SGD step on the class embeddings is lam times the client"
           " lr",
}


class GcServer(NamedTuple):
  body: Params        # {"params": body layers} the global body
  heads: Params       # [K] {"params": {head: {kernel, bias (0)}}} every client's head
  held: jax.Array     # [K, C] bool: the classes each client holds


class GcMessage(NamedTuple):
  body: Params
  head: Params
  held: jax.Array     # [C] bool


class GcModel(NamedTuple):
  """A client's scored model: the body and head, and the classes of its softmax."""
  model: Params
  held: jax.Array


def validate(config: FedGcConfig, trainer: ClientTrainer) -> FedGcConfig:
  for field in ("lam", "lr"):
    value = getattr(config, field)
    if not traced(value) and value < 0:
      raise FieldError("fedgc", field, f"must be >= 0, got {value}")
  check_representation_trainer("fedgc", trainer)
  if trainer.evaluate_with is None:
    raise ConfigError("fedgc scores over each client's classes: it needs the trainer's"
                      " evaluate_with")
  return config


def local_logits(logits: jax.Array, held: jax.Array) -> jax.Array:
  """The logits over the held classes; each other class's EXCLUDED_GAP below the top."""
  top = jax.lax.stop_gradient(jnp.max(jnp.where(held, logits, -jnp.inf), axis=-1,
                                      keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # a client holding no class
  return jnp.where(held, logits, top - EXCLUDED_GAP)


def without_bias(model: Params, head: str) -> Params:
  """The model with its head's bias a constant 0: a bias-free head, no gradient there."""
  layer = model["params"][head]
  return merge_layers(model, {"params": {head: {**layer, "bias": jnp.zeros_like(layer["bias"])}}})


def class_means(kernels: jax.Array, held: jax.Array) -> jax.Array:
  """[C, d] e_c: the mean row of class c over the clients holding it (0 where none);
  kernels [K, d, C], held [K, C]."""
  weights = held.astype(kernels.dtype)
  sums = jnp.einsum("kc,kdc->cd", weights, kernels)
  return sums / jnp.maximum(jnp.sum(weights, axis=0), 1.0)[:, None]


def regularizer(kernels: jax.Array, held: jax.Array, means: jax.Array) -> jax.Array:
  """Reg: sum over (client, held class c) of log(e^{e_c.e_c} + the excluded clients'
  sum of e^{W_jc'.e_c}) - e_c.e_c, each class's term once per client holding it."""
  holders = jnp.sum(held.astype(jnp.float32), axis=0)                     # [C]
  own = jnp.sum(means * means, axis=-1)                                   # [C]
  scores = jnp.einsum("kdj,cd->kjc", kernels, means)                      # [K, C', C]
  negative = held[:, :, None] & ~held[:, None, :]                         # j holds c', not c
  scores = jnp.where(negative, scores, -jnp.inf).reshape(-1, own.shape[0])
  total = jax.nn.logsumexp(jnp.concatenate([own[None], scores]), axis=0)  # [C]
  return jnp.sum(holders * (total - own))


def corrected_kernels(kernels: jax.Array, held: jax.Array, step: float) -> jax.Array:
  """One SGD step of every head's kernel [K, d, C] down Reg, the class means fixed."""
  means = jax.lax.stop_gradient(class_means(kernels, held))
  return kernels - step * jax.grad(regularizer)(kernels, held, means)


def held_classes(data, num_classes: int) -> jax.Array:
  """[K, C] bool: the classes in each client's training split, in client order."""
  held = jnp.zeros((data.num_clients, num_classes), bool)
  for ids, bucket in zip(data.client_ids, data.buckets):
    counts = jax.vmap(lambda y, m: class_counts(y, m, num_classes))(
        jnp.asarray(bucket.train.y), jnp.asarray(bucket.train.mask))
    held = held.at[jnp.asarray(ids)].set(counts > 0)
  return held


def fedgc(config: FedGcConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply, evaluate_with = trainer.apply, trainer.evaluate_with
  assert apply is not None and evaluate_with is not None  # validate() checked them
  server_step = config.lam * config.lr

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    head = head_layer(first, "fedgc")
    body_names = split_body_head(first, 1, "fedgc")[0]
    heads = take_layers(without_bias(context.params, head), [head])
    num_classes = first["params"][head]["kernel"].shape[-1]
    server = GcServer(body=take_layers(first, body_names), heads=heads,
                      held=held_classes(context.data, num_classes))
    return AlgorithmState(server=server, clients=jnp.zeros((tree.leading_size(context.params),)))

  def broadcast(server: GcServer, clients):
    body = tree.broadcast_to_clients(server.body, tree.leading_size(clients))
    return GcMessage(body=body, head=server.heads, held=server.held)

  def forward(model: GcModel, x: jax.Array) -> jax.Array:
    head = head_layer(model.model, "fedgc")
    return local_logits(apply(without_bias(model.model, head), x), model.held)

  def client_update(client_state, message: GcMessage, data, key):
    def loss(params, x, y, weights):
      return masked_cross_entropy(forward(GcModel(params, message.held), x), y, weights)
    params, stats = trainer.train(merge_layers(message.body, message.head), data.train, key,
                                  loss_fn=loss)
    upload = GcMessage(body=take_layers(params, list(message.body["params"])),
                       head=take_layers(params, list(message.head["params"])),
                       held=message.held)
    return ClientOutput(state=client_state, upload=upload, train=stats)

  def aggregate(server: GcServer, clients, uploads: GcMessage, weights):
    arrived = weights > 0
    heads = jax.tree.map(
        lambda new, old: jnp.where(arrived.reshape((-1,) + (1,) * (old.ndim - 1)), new, old),
        uploads.head, server.heads)
    (head,) = list(heads["params"])
    kernels = corrected_kernels(heads["params"][head]["kernel"], server.held, server_step)
    heads = {"params": {head: {**heads["params"][head], "kernel": kernels}}}
    server = GcServer(body=tree.weighted_mean(uploads.body, weights), heads=heads,
                      held=server.held)
    return AlgorithmState(server=server, clients=clients)

  def personalized_params(server: GcServer, clients):
    message = broadcast(server, clients)
    return GcModel(model=merge_layers(message.body, message.head), held=message.held)

  return Algorithm(name="fedgc", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   evaluate=evaluate_with(forward))
