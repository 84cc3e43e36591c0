"""FedIIR: FedAvg whose clients' local loss penalises the distance between their
classifier's gradient and the clients' mean classifier gradient (an implicit invariant
relationship across clients, for out-of-distribution generalisation).

Guo, Guo, Cao, Wu, Chang. "Out-of-Distribution Generalization of Federated Learning via
Implicit Invariant Relationships." ICML 2023. https://proceedings.mlr.press/v202/guo23b.html
(code followed: the authors' github.com/YamingGuo98/FedIIR, domainbed/algorithms.py's
FedIIR and hparams_registry.py, read through the search tools, not run or copied;
FL-bench's src/server/fediir.py is the same method. The paper's full text is not on disk,
so this module names no equation numbers. PFLlib has no FedIIR, so there is no
verification row: the unit tests check the gradient, the penalty and the server's mean
by hand.)

Clients train on CE + penalty (1e-3) ||grad_w CE - g||^2, w the classifier, g the server's
running mean (ema 0.95) of their classifier gradients; FedAvg; scored: the global model.

Departures: g holds the clients' gradients up to the round before (taken at the model each
received); a client's gradient is its split's mean, weighted by its batches.
Details (every option, the departures, measurements): docs/algorithms/fediir.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.algorithms.layers import (affine_head, apply_with_representation,
                                          check_representation_trainer, head_layer,
                                          representations)
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import FieldError

Params = Any


class FedIirConfig(NamedTuple):
  penalty: float = 1e-3   # gamma, the gradient penalty's weight (authors' default)
  ema: float = 0.95       # the server's running mean of the classifier gradients


FLAG_HELP = {
    "penalty": "FedIIR: weight gamma of ||grad_w R_k - g||^2, the client's classifier"
               " gradient against the clients' mean (authors: 1e-3; RotatedMNIST 1e-2)",
    "ema": "FedIIR: the server's running mean g <- ema g + (1 - ema) (this round's mean"
           " classifier gradient)",
}


class IirServer(NamedTuple):
  model: Params        # the global model
  grad_mean: Params    # g, shaped as the classifier's {"kernel", "bias"}


class IirUpload(NamedTuple):
  params: Params       # the client's trained model
  grad: Params         # its mean classifier gradient at the received model
  batches: jax.Array   # [] its number of batches, the gradient's weight


def validate(config: FedIirConfig, trainer: ClientTrainer) -> FedIirConfig:
  if not config.penalty >= 0:
    raise FieldError("fediir", "penalty", f"must be >= 0, got {config.penalty}")
  if not 0 <= config.ema < 1:
    raise FieldError("fediir", "ema", f"must be in [0, 1), got {config.ema}")
  check_representation_trainer("fediir", trainer)
  return config


def head_gradient(head_params: Params, z: jax.Array, y: jax.Array,
                  weights: jax.Array) -> Params:
  """grad_w of the weighted mean cross-entropy of the classifier w on features z [B, d]."""
  return jax.grad(lambda h: masked_cross_entropy(affine_head(h, z), y, weights))(head_params)


def iir_loss(apply_fn, head: str, grad_mean: Params, penalty: float):
  """loss_fn(params, x, y, weights): cross-entropy + penalty ||grad_w CE - g||^2."""
  def loss(params, x, y, weights):
    logits, z = apply_with_representation(apply_fn, params, x, head)
    erm = masked_cross_entropy(logits, y, weights)
    gap = jax.tree.map(jnp.subtract, head_gradient(params["params"][head], z, y, weights),
                       grad_mean)
    return erm + penalty * sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(gap))
  return loss


def updated_mean(grad_mean: Params, grads: Params, batches: jax.Array, sampled: jax.Array,
                 ema: float) -> Params:
  """ema g + (1 - ema) sum_k b_k g_k / sum_k b_k over the sampled clients; g where none."""
  counts = batches * sampled
  total = jnp.sum(counts)
  new = jax.tree.map(lambda g: jnp.tensordot(counts, g, axes=1) / jnp.maximum(total, 1.0),
                     grads)
  return jax.tree.map(lambda old, n: jnp.where(total > 0, ema * old + (1 - ema) * n, old),
                      grad_mean, new)


def fediir(config: FedIirConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  batch_size = batch_size_of(trainer)

  def init(context: InitContext) -> AlgorithmState:
    model = tree.first(context.params)
    head = head_layer(model, "fediir")
    server = IirServer(model=model,
                       grad_mean=jax.tree.map(jnp.zeros_like, model["params"][head]))
    return AlgorithmState(server=server,
                          clients=jnp.zeros((tree.leading_size(context.params),)))

  def broadcast(server: IirServer, clients):
    return tree.broadcast_to_clients(server, tree.leading_size(clients))

  def client_update(client, message, data, key):
    model = message.model
    head = head_layer(model, "fediir")
    train = data.train
    z = representations(trainer.apply, model, train.x, head)
    grad = head_gradient(model["params"][head], z, train.y, train.mask.astype(z.dtype))
    batches = jnp.ceil(train.n / batch_size).astype(jnp.float32)
    params, stats = trainer.train(model, train, key,
                                  loss_fn=iir_loss(trainer.apply, head, message.grad_mean,
                                                   config.penalty))
    return ClientOutput(state=client, upload=IirUpload(params, grad, batches), train=stats)

  def aggregate(server: IirServer, clients, uploads: IirUpload, weights):
    grad_mean = updated_mean(server.grad_mean, uploads.grad, uploads.batches, weights > 0,
                             config.ema)
    return AlgorithmState(server=IirServer(tree.weighted_mean(uploads.params, weights),
                                           grad_mean),
                          clients=clients)

  def personalized_params(server: IirServer, clients):
    return tree.broadcast_to_clients(server.model, tree.leading_size(clients))

  return Algorithm(name="fediir", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.model, uploads_unordered=True)
