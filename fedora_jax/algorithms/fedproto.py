"""FedProto: clients keep their own models and exchange class prototypes, the mean
representation of each class, instead of parameters.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang. "FedProto: Federated Prototype Learning across
Heterogeneous Clients." AAAI 2022. https://arxiv.org/abs/2105.00243
(code: github.com/yuetan031/fedproto)

Each client trains its own whole model on cross-entropy + lam (1) times the distance of its
representations to their class's global prototype (distance "mse"), then uploads its class
prototypes and counts; the server averages them per class (aggregation "weighted"). A client
is scored by the nearest global prototype among its own classes (inference "global_own").

Departures: Eq. 6 without its extra 1/|N_j| ("weighted"); the authors' code's MSE distance
and "with protos" scoring are the defaults; prototypes "training" is PFLlib's.
Details (every option, the departures, measurements): docs/algorithms/fedproto.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer,
                                          representations)
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any

AGGREGATIONS = ("weighted", "mean")
DISTANCES = ("mse", "squared")
INFERENCES = ("global_own", "global", "local", "head")
PROTOTYPE_SOURCES = ("trained", "training")
# The logit of a class without a prototype: below any 2 <z, C> - ||C||^2 of real features.
ABSENT_SCORE = -1e9


class FedProtoConfig(NamedTuple):
  lam: float = 1.0                      # lambda, the prototype regulariser's weight
  distance: str = "mse"                 # "mse" (authors' code) or "squared" (Appendix B)
  aggregation: str = "weighted"         # "weighted" (Eq. 6) or "mean" (authors' code)
  inference: str = "global_own"         # or "global", "local", "head"
  prototypes: str = "trained"           # "trained" (Eq. 3) or "training" (the codes')


FLAG_HELP = {
    "lam": "FedProto: weight lambda of the prototype regulariser; 1 is the paper's on MNIST"
           " and FEMNIST, 0.1 on CIFAR-10",
    "distance": "FedProto: regulariser mse (the authors' code: ||f(x) - C_y||^2 / d) or"
                " squared (the paper's ||f(x) - C_y||^2)",
    "aggregation": "FedProto: global prototype as the class-count weighted mean of the"
                   " clients' (weighted, Eq. 6) or their plain mean (mean, authors' code)",
    "inference": "FedProto: classify by the nearest global prototype of the client's own"
                 " classes (global_own, authors' code), of all classes (global, Eq. 4), by"
                 " the client's own prototypes (local) or by its classifier (head)",
    "prototypes": "FedProto: local prototypes from the trained model (trained, Eq. 3) or"
                  " averaged over the representations the training steps computed"
                  " (training, PFLlib's and the authors' code)",
}


class Prototypes(NamedTuple):
  means: jax.Array   # [..., C, d] class prototypes (0 where a class has none)
  counts: jax.Array  # [..., C] samples behind each (global: > 0 where a prototype exists)


class FedProtoClient(NamedTuple):
  params: Params           # [K, ...] the client's own model, never shared
  prototypes: Prototypes   # [K, C, d], [K, C] its latest local prototypes


def class_prototypes(z: jax.Array, y: jax.Array, mask: jax.Array,
                     num_classes: int) -> Prototypes:
  """Eq. 3: the mean representation z [N, d] of each class among the real samples."""
  one_hot = jax.nn.one_hot(y, num_classes) * mask[:, None]     # [N, C]
  counts = jnp.sum(one_hot, axis=0)
  return Prototypes(means=(one_hot.T @ z) / jnp.maximum(counts, 1.0)[:, None],
                    counts=counts)


def step_representation_sums(apply_fn, head: str, num_classes: int):
  """observe(params, x, y, weights) for trainer.train: a step's class sums [C, d] of its
  batch's representations and their counts [C] (real samples only)."""
  def observe(params, x, y, weights):
    _, z = apply_with_representation(apply_fn, params, x, head)
    one_hot = jax.nn.one_hot(y, num_classes) * weights[:, None]
    return one_hot.T @ z, jnp.sum(one_hot, axis=0)
  return observe


def aggregate_prototypes(uploads: Prototypes, weights: jax.Array, previous: Prototypes,
                         aggregation: str) -> Prototypes:
  """Global prototypes [C, d] from the clients' [K, C, d]; weight-0 clients are ignored and
  a class no counted client holds keeps its previous prototype."""
  counts = uploads.counts * (weights > 0)[:, None]                  # [K, C]
  mix = counts if aggregation == "weighted" else (counts > 0).astype(counts.dtype)
  total = jnp.sum(mix, axis=0)                                      # [C]
  means = jnp.einsum("kc,kcd->cd", mix, uploads.means) / jnp.maximum(total, 1e-12)[:, None]
  held = jnp.sum(counts, axis=0) > 0
  return Prototypes(means=jnp.where(held[:, None], means, previous.means),
                    counts=jnp.where(held, jnp.sum(counts, axis=0), previous.counts))


def prototype_distance(z: jax.Array, targets: jax.Array, distance: str) -> jax.Array:
  """[B] d(z, C^(y)): squared L2, divided by d for the authors' MSE."""
  squared = jnp.sum(jnp.square(z - targets), axis=-1)
  return squared / z.shape[-1] if distance == "mse" else squared


def fedproto_loss(apply_fn, head: str, global_prototypes: Prototypes, config: FedProtoConfig):
  """loss_fn(params, x, y, weights): CE + lambda d(f(x), C^(y)), means over the batch; no
  regulariser for a sample whose class has no global prototype."""
  def loss(params, x, y, weights):
    logits, z = apply_with_representation(apply_fn, params, x, head)
    has_prototype = (global_prototypes.counts[y] > 0).astype(z.dtype)
    per_sample = (optax.softmax_cross_entropy_with_integer_labels(logits, y)
                  + config.lam * has_prototype
                  * prototype_distance(z, global_prototypes.means[y], config.distance))
    return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  return loss


def prototype_head(prototypes: Prototypes) -> dict:
  """The affine classifier whose logits are -||z - C_c||^2 up to a per-sample constant."""
  present = prototypes.counts > 0
  means = jnp.where(present[..., None], prototypes.means, 0.0)
  bias = jnp.where(present, -jnp.sum(jnp.square(means), axis=-1), ABSENT_SCORE)
  return {"kernel": 2.0 * jnp.swapaxes(means, -1, -2), "bias": bias}


def _head_shapes(params: Params) -> tuple[str, int, int]:
  head = head_layer(params)
  layer = params["params"][head]
  if set(layer) != {"kernel", "bias"} or layer["kernel"].ndim != 2:
    raise ConfigError(f"fedproto needs a dense classifier as the top layer; {head} has"
                      f" {sorted(layer)}")
  dim, num_classes = layer["kernel"].shape
  return head, dim, num_classes


def validate(config: FedProtoConfig, trainer: ClientTrainer) -> FedProtoConfig:
  if config.lam < 0:
    raise FieldError("fedproto", "lam", f"must be >= 0, got {config.lam}")
  for field, allowed in (("distance", DISTANCES), ("aggregation", AGGREGATIONS),
                         ("inference", INFERENCES), ("prototypes", PROTOTYPE_SOURCES)):
    check_one_of("fedproto", config, field, allowed)
  check_representation_trainer("fedproto", trainer)
  return config


def fedproto(config: FedProtoConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply = trainer.apply
  assert apply is not None  # validate() checked it

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    _, dim, num_classes = _head_shapes(tree.first(context.params))
    empty = Prototypes(means=jnp.zeros((num_classes, dim), jnp.float32),
                       counts=jnp.zeros((num_classes,), jnp.float32))
    return AlgorithmState(server=empty, clients=FedProtoClient(
        params=context.params, prototypes=tree.broadcast_to_clients(empty, num_clients)))

  def broadcast(global_prototypes: Prototypes, clients: FedProtoClient):
    return tree.broadcast_to_clients(global_prototypes, tree.leading_size(clients.params))

  def client_update(client: FedProtoClient, global_prototypes: Prototypes, data, key):
    head, _, num_classes = _head_shapes(client.params)
    loss_fn = fedproto_loss(apply, head, global_prototypes, config)
    if config.prototypes == "training":
      params, stats, (sums, seen) = trainer.train(
          client.params, data.train, key, loss_fn=loss_fn,
          observe=step_representation_sums(apply, head, num_classes))
      # The split's class counts weigh the aggregation, whatever the local epochs.
      counts = jnp.sum(jax.nn.one_hot(data.train.y, num_classes)
                       * data.train.mask[:, None], axis=0)
      local = Prototypes(means=sums / jnp.maximum(seen, 1.0)[:, None], counts=counts)
    else:
      params, stats = trainer.train(client.params, data.train, key, loss_fn=loss_fn)
      z = representations(apply, params, data.train.x, head)
      local = class_prototypes(z, data.train.y, data.train.mask, num_classes)
    return ClientOutput(state=FedProtoClient(params=params, prototypes=local), upload=local,
                        train=stats)

  def aggregate(server: Prototypes, clients: FedProtoClient, uploads: Prototypes, weights):
    return AlgorithmState(
        server=aggregate_prototypes(uploads, weights, server, config.aggregation),
        clients=clients)

  def personalized_params(global_prototypes: Prototypes, clients: FedProtoClient):
    if config.inference == "head":
      return clients.params
    head = _head_shapes(tree.first(clients.params))[0]
    local, shared = clients.prototypes, broadcast(global_prototypes, clients)
    own = local.counts > 0                             # [K, C]
    trained = jnp.any(own, axis=-1, keepdims=True)     # [K, 1] False: never sampled yet
    prototypes = shared
    if config.inference == "local":  # a client without prototypes of its own: Eq. 4's
      prototypes = Prototypes(means=jnp.where(trained[..., None], local.means, shared.means),
                              counts=jnp.where(trained, local.counts, shared.counts))
    if config.inference == "global_own":  # the classes of the client's training split;
      # a client never sampled knows none yet: every global prototype (Eq. 4's).
      prototypes = shared._replace(counts=shared.counts * jnp.where(trained, own, True))
    # No prototype at all (nobody has uploaded one yet): the client's own classifier,
    # not the arbitrary class 0 of an all-absent head.
    usable = jnp.any(prototypes.counts > 0, axis=-1)
    heads = jax.tree.map(
        lambda new, old: jnp.where(usable.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        jax.vmap(prototype_head)(prototypes), clients.params["params"][head])
    return {"params": {**clients.params["params"], head: heads}}

  return Algorithm(name="fedproto", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
