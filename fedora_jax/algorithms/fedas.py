"""FedAS: a client aligns the received global feature extractor with its own class
prototypes before training it under its own head; the server averages the trained
models weighted by the trace of each one's Fisher information.

Yang, Huang, Ye. "FedAS: Bridging Inconsistency in Personalized Federated Learning."
CVPR 2024. https://openaccess.thecvf.com/content/CVPR2024/papers/Yang_FedAS_Bridging_Inconsistency_in_Personalized_Federated_Learning_CVPR_2024_paper.pdf
(code: PFLlib's clientas.py / serveras.py, which the verification runs beside this
module. The paper's full text is not on disk: this module follows that code, and names
no equation numbers.)

A sampled client aligns the received extractor f to its own class prototypes (align_epochs
1, align_lr 0.01, align_batch_size 16), trains (f, its head h_i) by the run's local training
and uploads it with its Fisher trace F_i; the server averages the whole models weighted by
F_i and sends only the extractor. Every client is scored with its own theta_i.

Departures: prototypes over every training sample, and partial last batches train and
count in the trace (the code's loaders drop them).

Details (every option, the departures, measurements): docs/algorithms/fedas.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedproto import class_prototypes
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer,
                                          merge_layers, representations, split_body_head,
                                          take_layers)
from fedora_jax.engine.local_training import (ClientTrainer, epoch_batches,
                                              make_client_trainer, make_optimizer)
from fedora_jax.errors import FieldError

Params = Any


class FedAsConfig(NamedTuple):
  align_lr: float = 0.01       # the alignment's SGD learning rate (the code's)
  align_epochs: int = 1        # its epochs over the training set (the code's)
  align_batch_size: int = 16   # its batch size (the code's)


FLAG_HELP = {
    "align_lr": "FedAS: learning rate of the plain SGD aligning the received feature"
                " extractor with the client's class prototypes",
    "align_epochs": "FedAS: epochs of that alignment (0: none)",
    "align_batch_size": "FedAS: batch size of that alignment",
}


class AsUpload(NamedTuple):
  model: Params          # theta_i after training
  fisher: jax.Array      # [] F_i, its Fisher information's trace


def validate(config: FedAsConfig, trainer: ClientTrainer) -> FedAsConfig:
  if not config.align_lr > 0:
    raise FieldError("fedas", "align_lr", f"must be > 0, got {config.align_lr}")
  if config.align_epochs < 0:
    raise FieldError("fedas", "align_epochs", f"must be >= 0, got {config.align_epochs}")
  if config.align_batch_size < 1:
    raise FieldError("fedas", "align_batch_size",
                     f"must be >= 1, got {config.align_batch_size}")
  check_representation_trainer("fedas", trainer)
  return config


def alignment_loss(apply_fn, head: str, prototypes: jax.Array):
  """loss_fn(params, x, y, weights): sum over the batch's classes of the mean squared
  difference between their features and their prototype [C, d]."""
  def loss(params, x, y, weights):
    _, features = apply_with_representation(apply_fn, params, x, head)
    one_hot = jax.nn.one_hot(y, prototypes.shape[0]) * weights[:, None]     # [B, C]
    per_sample = jnp.sum(jnp.square(features[:, None, :] - prototypes[None]), axis=-1)
    counts = jnp.sum(one_hot, axis=0)                                          # [C]
    sums = jnp.sum(one_hot * per_sample, axis=0)
    dim = features.shape[-1]
    return jnp.sum(jnp.where(counts > 0, sums / (jnp.maximum(counts, 1.0) * dim), 0.0))
  return loss


def fisher_trace(loss_fn, params: Params, data, key: jax.Array, batch_size: int) -> jax.Array:
  """Sum over one shuffled epoch's batches of the squared norm of the gradient of the
  batch's mean loss `loss_fn(params, x, y, weights)`."""
  num_batches = max(1, -(-data.mask.shape[0] // batch_size))
  indices, weights = epoch_batches(key, data.mask, data.n, batch_size, num_batches)

  def one_batch(batch):
    idx, w = batch
    grads = jax.grad(loss_fn)(params, data.x[idx], data.y[idx], w)
    squared = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    return jnp.where(jnp.sum(w) > 0, squared, 0.0)
  return jnp.sum(jax.lax.map(one_batch, (indices, weights)))


def fedas(config: FedAsConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  batch_size = batch_size_of(trainer)
  # The alignment's own plain SGD (its loss reads the model through trainer.apply).
  aligner = make_client_trainer(lambda params, x: x, make_optimizer(config.align_lr, 0.0),
                                max(config.align_epochs, 1), config.align_batch_size)

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=tree.first(context.params), clients=context.params)

  def broadcast(global_model, models):
    return tree.broadcast_to_clients(global_model, tree.leading_size(models))

  def client_update(model, global_model, data, key):
    head = head_layer(model, "fedas")
    body_names = split_body_head(model, 1, "fedas")[0]
    align_key, train_key, fisher_key = jax.random.split(key, 3)
    num_classes = model["params"][head]["kernel"].shape[-1]
    features = representations(trainer.apply, model, data.train.x, head)
    prototypes = class_prototypes(features, data.train.y, data.train.mask, num_classes).means
    aligned = global_model
    if config.align_epochs > 0:
      aligned, _ = aligner.train(global_model, data.train, align_key,
                                 loss_fn=alignment_loss(trainer.apply, head, prototypes),
                                 epochs=config.align_epochs)
    start = merge_layers(model, take_layers(aligned, body_names))
    params, stats = trainer.train(start, data.train, train_key)
    fisher = fisher_trace(trainer.loss, params, data.train, fisher_key, batch_size)
    return ClientOutput(state=params, upload=AsUpload(model=params, fisher=fisher),
                        train=stats, metrics={"fisher_trace": fisher})

  def aggregate(global_model, models, uploads: AsUpload, weights):
    del global_model
    fisher = jnp.where(weights > 0, uploads.fisher, 0.0)
    return AlgorithmState(server=tree.weighted_mean(uploads.model, fisher), clients=models)

  def personalized_params(global_model, models):
    del global_model
    return models

  return Algorithm(name="fedas", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
