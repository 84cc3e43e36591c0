"""FedProto: clients keep their own models and exchange class prototypes, the mean
representation of each class, instead of parameters.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang. "FedProto: Federated Prototype Learning across
Heterogeneous Clients." AAAI 2022. https://arxiv.org/abs/2105.00243
(code: github.com/yuetan031/fedproto)

Notation: f_i(phi_i; x) is client i's representation (its body's output, the input of its
classifier: fedora_jax.algorithms.layers.apply_with_representation), D_{i,j} its training
samples of class j, N_j = sum_i |D_{i,j}| (equations numbered in the order printed).
  Local prototype (Eq. 3):   C_i^(j) = 1/|D_{i,j}| sum_{(x, y) in D_{i,j}} f_i(phi_i; x).
  Global prototype (Eq. 6):  C^(j) = sum_{i in N_j} |D_{i,j}| / N_j  C_i^(j)
                             over the clients N_j that hold class j ("weighted", default).
  Local objective (Eq. 7-8, and Appendix B's per-sample form):
        L_S(F_i(x), y) + lambda * d(f_i(phi_i; x), C^(y)),
  d the squared L2 distance, for the classes that have a global prototype (none in the
  first round: no regulariser then, as in the authors' code).
  Inference (Eq. 4):         y^ = argmin_j ||f(phi; x) - C^(j)||.
Each client trains its own whole model for the run's local epochs and never uploads it;
after training it computes its prototypes on its training split and uploads them with its
class counts |D_{i,j}|. The server has no model.

Where the printed equations and the authors' code differ, behind config fields:
  * aggregation: Eq. 6 as printed also divides by |N_j|, which shrinks every prototype
    shared by several clients towards 0 (the weights |D_{i,j}| / N_j already sum to 1),
    contradicting its text ("aggregates the prototypes by averaging them"); "weighted"
    (default) is the weighted mean without that factor, the form Appendix B's
    C = sum_i q_i C_i uses. "mean" is the authors' proto_aggregation: the plain mean of
    the clients' prototypes of class j, unweighted.
  * distance: "mse" (default) is the authors' nn.MSELoss between f(x) and C^(y), the mean
    over the batch AND the d representation dimensions, i.e. ||f(x) - C^(y)||^2 / d;
    "squared" is Appendix B's lambda ||f(x) - C^(y)||^2. The default is the code's
    because the paper's lambda values were tuned with it (with d = 128, "squared" is 128x
    stronger at the same lambda).
  * prototypes: "trained" (default) is Eq. 3, the trained model on the whole training
    split, after training; "training" averages the representations the training steps
    compute (each before its step, in the loss's forward pass) over the local epochs, as
    PFLlib's clientproto.py does (the authors' code keeps the last epoch's: the same at
    one local epoch).
  * inference: "global_own" (default) is the authors' "with protos" accuracy: the nearest
    global prototype among the classes the client holds (its training classes); "global"
    is Eq. 4 over every global prototype; "local" uses the client's own prototypes; "head"
    the client's classifier (the authors' "w/o protos" accuracy). The default is the
    code's, whose accuracies the paper reports. A client never sampled has no classes
    (nor prototypes) of its own yet: under "global_own" and "local" it is scored by every
    global prototype, as under "global" (and as PFLlib scores every client); before any
    prototype exists, by its own classifier.
With partial participation the server averages the prototypes the round's sampled clients
upload (weight-0 clients are ignored); a class none of them holds keeps its previous
global prototype.

Prototype inference as a model: -||z - C_c||^2 = 2 <z, C_c> - ||C_c||^2 - ||z||^2, and the
last term is the same for every class, so the classifier with kernel 2 C^T and bias
-||C_c||^2 has the nearest prototype as its argmax and the softmax of the negative squared
distances as its softmax (the same cross-entropy). The personalised model is the client's
model with that head; a class without a prototype gets bias ABSENT_SCORE, never predicted.

Hyperparameters (Appendix A): lambda = 1 on MNIST and FEMNIST, 0.1 on CIFAR-10 (default:
MNIST's). The paper's local training (the run's flags): SGD lr 0.01, momentum 0.5, 1 local
epoch, batch 8.
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
