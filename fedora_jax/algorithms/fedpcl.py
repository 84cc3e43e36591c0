"""FedPCL: clients share class prototypes of their normalised representations, and each
trains its representation by contrasting it with the global prototypes and with every
client's prototypes.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang. "Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach." NeurIPS 2022. https://arxiv.org/abs/2209.10083
(code: PFLlib's clientpcl.py / serverpcl.py, which the verification runs beside this
module, and the authors' github.com/yuetan031/FedPCL, read for its temperature and
inference. The paper's full text is not on disk; the losses (docs/algorithms/fedpcl.md) are
PFLlib's, which its prototype-wise contrastive terms take; no equation numbers.)

Each round a sampled client trains its body's normalised representation on contrastive losses
(temperature tau 0.07) against the global prototypes and every client's prototype set, then
uploads its class prototypes; the server averages them into the global ones. A client is
scored by its nearest prototype (predict "similarity"); clip_norm 0 (none).

Departures: the representation is the body's output, trained from the initial model (no
pre-trained backbone); PFLlib's form behind tau=1, clip_norm=10; a partial last batch trains.
Details (every option, the departures, measurements): docs/algorithms/fedpcl.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedproto import class_prototypes
from fedora_jax.algorithms.fml import clipped_gradient_surrogate
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer,
                                          representations)
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
PREDICTIONS = ("similarity", "distance")
# The logit of a class without a prototype: below any <r, C> / tau or -||r - C||^2.
ABSENT_SCORE = -1e9


class FedPclConfig(NamedTuple):
  tau: float = 0.07              # temperature (the authors' code; PFLlib's --tau 1)
  clip_norm: float = 0.0         # the gradient clipped to this global norm (0: none;
                                 # PFLlib 10)
  predict: str = "similarity"    # "similarity" (PFLlib) or "distance" (the authors' code)


FLAG_HELP = {
    "tau": "FedPCL: temperature of the prototype contrastive losses (the authors' code"
           " 0.07; PFLlib's --tau default 1)",
    "clip_norm": "FedPCL: the gradient clipped to this global norm before each step (0:"
                 " none; PFLlib 10)",
    "predict": "FedPCL: score by the client's prototype set, the largest similarity"
               " (similarity, PFLlib) or the nearest of its own classes' prototypes in"
               " squared distance (distance, the authors' code)",
}


class PclServer(NamedTuple):
  prototypes: jax.Array   # [C, d] the global prototypes
  present: jax.Array      # [C] bool: classes some client holds


class PclClient(NamedTuple):
  params: Params          # [K, ...] the client's model (its head unused)
  prototypes: jax.Array   # [K, C, d] its set P_i: own prototypes, the global for the rest
  own: jax.Array          # [K, C] bool: the classes it holds


class PclMessage(NamedTuple):
  server: PclServer
  sets: jax.Array         # [K, C, d] every client's set
  own: jax.Array          # [K, C]


class PclUpload(NamedTuple):
  prototypes: jax.Array   # [C, d] the client's own prototypes (0 where it has none)
  own: jax.Array          # [C] bool


class PclPersonal(NamedTuple):
  params: Params
  prototypes: jax.Array   # [C, d]
  scored: jax.Array       # [C] bool: the classes it may predict


def validate(config: FedPclConfig, trainer: ClientTrainer) -> FedPclConfig:
  if not config.tau > 0:
    raise FieldError("fedpcl", "tau", f"must be > 0, got {config.tau}")
  if config.clip_norm < 0:
    raise FieldError("fedpcl", "clip_norm", f"must be >= 0, got {config.clip_norm}")
  check_one_of("fedpcl", config, "predict", PREDICTIONS)
  check_representation_trainer("fedpcl", trainer)
  if trainer.evaluate_with is None:
    raise ConfigError("fedpcl scores by prototypes: it needs the trainer's evaluate_with")
  return config


def normalised(h: jax.Array) -> jax.Array:
  """Rows of h [..., d] over max(||h||, 1e-12) (torch's F.normalize), written as
  sqrt(max(||h||^2, 1e-24)) so that a zero row (every ReLU off) has a zero gradient, not
  NaN (the norm's derivative at 0), as in PyTorch."""
  squared = jnp.sum(jnp.square(h), axis=-1, keepdims=True)
  return h / jnp.sqrt(jnp.maximum(squared, 1e-24))


def local_prototypes(apply_fn, params: Params, data: ClientData, head: str,
                     num_classes: int) -> PclUpload:
  """A client's own prototypes: the mean normalised representation of each class it
  holds among its training samples."""
  r = normalised(representations(apply_fn, params, jnp.asarray(data.x), head))
  prototypes = class_prototypes(r, jnp.asarray(data.y), jnp.asarray(data.mask), num_classes)
  return PclUpload(prototypes=prototypes.means, own=prototypes.counts > 0)


def global_prototypes(uploads: PclUpload, counted: jax.Array, previous: PclServer
                      ) -> PclServer:
  """The plain mean over the counted clients [K] of their prototypes of each class; a
  class none of them holds keeps its previous prototype."""
  holds = (uploads.own & counted[:, None]).astype(uploads.prototypes.dtype)   # [K, C]
  total = jnp.sum(holds, axis=0)
  means = jnp.einsum("kc,kcd->cd", holds, uploads.prototypes) / jnp.maximum(total, 1.0)[:, None]
  held = total > 0
  return PclServer(prototypes=jnp.where(held[:, None], means, previous.prototypes),
                   present=held | previous.present)


def padded_sets(uploads: PclUpload, server: PclServer) -> jax.Array:
  """[K, C, d]: each client's own prototypes, the global one for a class it lacks."""
  return jnp.where(uploads.own[..., None], uploads.prototypes, server.prototypes)


def contrastive(r: jax.Array, prototypes: jax.Array, present: jax.Array, y: jax.Array,
                tau: float) -> jax.Array:
  """[B, ...] -log softmax_c(<r, P^(c)> / tau)[y] for prototypes [..., C, d] (absent
  classes left out)."""
  logits = jnp.einsum("bd,...cd->b...c", r, prototypes) / tau
  logits = jnp.where(present, logits, ABSENT_SCORE)
  labels = jnp.broadcast_to(y.reshape(y.shape + (1,) * (logits.ndim - 2)), logits.shape[:-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def fedpcl_loss(apply_fn, head: str, message: PclMessage, config: FedPclConfig):
  """loss_fn((params,), x, y, weights): L_g + the mean over the K sets of L_j."""
  def loss(trained, x, y, weights):
    _, h = apply_with_representation(apply_fn, trained[0], x, head)
    r = normalised(h)
    present = message.server.present
    per_sample = (contrastive(r, message.server.prototypes, present, y, config.tau)
                  + jnp.mean(contrastive(r, message.sets, present, y, config.tau), axis=1))
    return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  if config.clip_norm > 0:
    return clipped_gradient_surrogate(loss, config.clip_norm)
  return loss


def prototype_forward(apply_fn, head: str, config: FedPclConfig):
  """forward(PclPersonal, x) -> [B, C] scores: <r, P^(c)> / tau, or -||r - P^(c)||^2."""
  def forward(model: PclPersonal, x):
    _, h = apply_with_representation(apply_fn, model.params, x, head)
    r = normalised(h)
    if config.predict == "similarity":
      scores = r @ model.prototypes.T / config.tau
    else:
      scores = -jnp.sum(jnp.square(r[:, None] - model.prototypes), axis=-1)
    return jnp.where(model.scored, scores, ABSENT_SCORE)
  return forward


def fedpcl(config: FedPclConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply, evaluate_with = trainer.apply, trainer.evaluate_with
  assert apply is not None and evaluate_with is not None  # validate() checked them

  def shapes(params: Params) -> tuple[str, int, int]:
    head = head_layer(params, "fedpcl")
    dim, num_classes = params["params"][head]["kernel"].shape
    return head, dim, num_classes

  def init(context: InitContext) -> AlgorithmState:
    head, dim, num_classes = shapes(tree.first(context.params))
    num_clients = tree.leading_size(context.params)
    data = context.data
    uploads = map_over_buckets(
        lambda params, splits: local_prototypes(apply, params, splits.train, head,
                                                num_classes),
        (context.params,), data.buckets, data.client_ids, num_clients)
    empty = PclServer(prototypes=jnp.zeros((num_classes, dim), jnp.float32),
                      present=jnp.zeros((num_classes,), bool))
    server = global_prototypes(uploads, jnp.ones(num_clients, bool), empty)
    return AlgorithmState(server=server, clients=PclClient(
        params=context.params, prototypes=padded_sets(uploads, server), own=uploads.own))

  def broadcast(server: PclServer, clients: PclClient):
    message = PclMessage(server=server, sets=clients.prototypes, own=clients.own)
    return tree.broadcast_to_clients(message, clients.own.shape[0])

  def client_update(client: PclClient, message: PclMessage, data, key):
    head, _, num_classes = shapes(client.params)
    (params,), stats = trainer.train((client.params,), data.train, key,
                                     loss_fn=fedpcl_loss(apply, head, message, config))
    upload = local_prototypes(apply, params, data.train, head, num_classes)
    return ClientOutput(state=client._replace(params=params), upload=upload, train=stats)

  def aggregate(server: PclServer, clients: PclClient, uploads: PclUpload, weights):
    sampled = weights > 0
    new = global_prototypes(uploads, sampled, server)
    sets = jnp.where(sampled[:, None, None], padded_sets(uploads, new), clients.prototypes)
    own = jnp.where(sampled[:, None], uploads.own, clients.own)
    return AlgorithmState(server=new, clients=PclClient(params=clients.params,
                                                        prototypes=sets, own=own))

  def personalized_params(server: PclServer, clients: PclClient):
    scored = (clients.own if config.predict == "distance"
              else jnp.broadcast_to(server.present, clients.own.shape))
    return PclPersonal(params=clients.params, prototypes=clients.prototypes, scored=scored)

  def evaluate(model: PclPersonal, data: ClientData):
    head = shapes(model.params)[0]
    return evaluate_with(prototype_forward(apply, head, config))(model, data)

  return Algorithm(name="fedpcl", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, evaluate=evaluate)
