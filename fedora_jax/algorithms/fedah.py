"""FedAH: each client starts its round from the global feature extractor and an
Aggregated Head, its own head moved element-wise towards the global head by weights it
learns; it trains the head, then the extractor; the server averages whole models.

Zhou, He, Zhai, Gao, Chen, Qin, Zhang, Guo. "FedAH: Aggregated Head for Personalized
Federated Learning." arXiv 2024. https://arxiv.org/abs/2412.01295
(code followed: the authors' heyuepeng/FedAH, system/flcore/clients/clientah.py and
servers/serverah.py, a PFLlib fork, and FL-bench's src/client/fedah.py /
src/server/fedah.py, KarhouTam/FL-bench; both GPL: read, not run or copied)

A sampled client learns W_i in h_hat = h_i + (Theta_h - h_i) * W_i, trains the head h_hat
(both for plocal_epochs = 1; W's step eta = 1), then the extractor for the run's local epochs,
uploads the whole model to the server's mean, and is scored with Theta_b under h_hat.

Departures: only sampled clients learn W_i (the authors': every client every round, scored
before training); the run's optimizer, fresh for each phase (the codes: their own SGD).

Details (every option, the departures, measurements): docs/algorithms/fedah.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.ala import aggregate_locally
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import head_layer, layer_names, merge_layers, take_layers
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer, TrainStats, epoch_batches
from fedora_jax.errors import FieldError, traced

Params = Any


class FedAhConfig(NamedTuple):
  eta: float = 1.0        # step size of the head weights W
  plocal_epochs: int = 1  # epochs of W's learning and of the head's training


FLAG_HELP = {
    "eta": "FedAH: step size of the element-wise head weights W",
    "plocal_epochs": "FedAH: epochs learning W, then epochs training the head (extractor"
                     " fixed), before the run's local epochs train the extractor",
}


class AhClient(NamedTuple):
  model: Params    # theta_i: the client's last trained model
  weights: Params  # W_i: {"params": {head: ...}}, in [0, 1]


def validate(config: FedAhConfig) -> FedAhConfig:
  if not traced(config.eta) and not config.eta > 0:
    raise FieldError("fedah", "eta", f"must be > 0, got {config.eta}")
  if config.plocal_epochs < 1:
    raise FieldError("fedah", "plocal_epochs", f"must be >= 1, got {config.plocal_epochs}")
  return config


def learn_head_weights(loss_fn, local: Params, global_params: Params, weights: Params,
                       data: ClientData, key: jax.Array, epochs: int, eta,
                       batch_size: int) -> Params:
  """W after `epochs` shuffled epochs of W <- clip(W - eta grad_W L(h_hat(W)), 0, 1), one
  step a batch; h_hat(W) = aggregate_locally(local, global, W) (global extractor)."""
  num_batches = max(1, -(-data.mask.shape[0] // batch_size))
  indices, batch_weights = jax.vmap(
      lambda k: epoch_batches(k, data.mask, data.n, batch_size, num_batches))(
          jax.random.split(key, epochs))

  def batch_loss(w, idx, bw):
    return loss_fn(aggregate_locally(local, global_params, w), data.x[idx], data.y[idx], bw)

  def step(w, batch):
    idx, bw = batch
    # BatchNorm in train mode, as the codes' temporary model runs; its new averages unused.
    with batch_stats.training(bw > 0):
      grad = jax.grad(batch_loss)(w, idx, bw)
    stepped = jax.tree.map(lambda a, g: jnp.clip(a - eta * g, 0.0, 1.0), w, grad)
    real = jnp.sum(bw) > 0
    return jax.tree.map(lambda a, b: jnp.where(real, a, b), stepped, w), None

  weights, _ = jax.lax.scan(step, weights, (indices.reshape(-1, batch_size),
                                            batch_weights.reshape(-1, batch_size)))
  return weights


def train_head_then_body(trainer: ClientTrainer, start: Params, head: str, data: ClientData,
                         key: jax.Array, head_epochs: int) -> tuple[Params, TrainStats]:
  """`head_epochs` epochs of the head alone, then the trainer's epochs of the rest."""
  body_names = [name for name in layer_names(start) if name != head]
  head_key, body_key = jax.random.split(key)

  def head_loss(h, x, y, w):
    return trainer.loss(merge_layers(start, h), x, y, w)
  trained_head, head_stats = trainer.train(take_layers(start, [head]), data, head_key,
                                           loss_fn=head_loss, epochs=head_epochs)

  def body_loss(b, x, y, w):
    return trainer.loss(merge_layers(b, trained_head), x, y, w)
  trained_body, body_stats = trainer.train(take_layers(start, body_names), data, body_key,
                                           loss_fn=body_loss)
  steps = head_stats.steps + body_stats.steps
  loss = ((head_stats.loss * head_stats.steps + body_stats.loss * body_stats.steps)
          / jnp.maximum(steps, 1))
  return (merge_layers(trained_body, trained_head),
          TrainStats(loss=loss, steps=steps.astype(jnp.int32)))


def fedah(config: FedAhConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    head = head_layer(context.params, "fedah")
    weights = jax.tree.map(jnp.ones_like, take_layers(context.params, [head]))
    return AlgorithmState(server=tree.first(context.params),
                          clients=AhClient(model=context.params, weights=weights))

  def broadcast(global_params, clients: AhClient):
    return tree.broadcast_to_clients(global_params, tree.leading_size(clients.weights))

  def client_update(client: AhClient, global_params, data, key):
    head = head_layer(global_params, "fedah")
    weights_key, train_key = jax.random.split(key)
    weights = learn_head_weights(trainer.loss, client.model, global_params, client.weights,
                                 data.train, weights_key, config.plocal_epochs, config.eta,
                                 trainer.batch_size)
    start = aggregate_locally(client.model, global_params, weights)
    params, stats = train_head_then_body(trainer, start, head, data.train, train_key,
                                         config.plocal_epochs)
    return ClientOutput(state=AhClient(model=params, weights=weights), upload=params,
                        train=stats)

  def aggregate(server, clients, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(global_params, clients: AhClient):
    return jax.vmap(aggregate_locally, in_axes=(0, None, 0))(clients.model, global_params,
                                                             clients.weights)

  return Algorithm(name="fedah", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, uploads_unordered=True)
