"""FedDBE: FedAvg whose clients keep a personal bias vector added to the representation
(PRBM) and pull the running mean of their representations towards a global one (MR).

Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan. "Eliminating Domain Bias for Federated
Learning in Representation Space." NeurIPS 2023. https://arxiv.org/abs/2311.14975
(code: github.com/TsingZ0/DBE, clientDBE.py / serverDBE.py / run_me.sh; the same code is
PFLlib's clientdbe.py / serverdbe.py, which the verification runs beside this module.
The paper's full text is not on disk: this module follows that code, and names no
equation numbers.)

Before round 1 every client trains once to set the global mean g of representations. A round is
FedAvg's; client i trains the model and its bias m_i (never sent) on CE(h(f(x) + m_i), y) +
kl_weight * mean_k (r_k - g_k)^2 / 2, r the running mean of f(x) (mean_momentum); it is scored
with the global model under its m_i. Defaults (run_me.sh): kl_weight 50, mean_momentum 1.

Departures: the run's optimiser trains m_i (the code: a plain SGD of the same learning rate);
a partial last batch trains (the code's loader drops it).

Details (every option, the departures, measurements): docs/algorithms/feddbe.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer)
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import FieldError

Params = Any


class FedDbeConfig(NamedTuple):
  kl_weight: float = 50.0     # weight of the mean regularisation (run_me.sh; PFLlib: 0)
  mean_momentum: float = 1.0  # running-mean momentum (run_me.sh; PFLlib's main.py: 0.1)


FLAG_HELP = {
    "kl_weight": "FedDBE: weight of the mean regularisation mean_k (r_k - g_k)^2 / 2 of"
                 " the representations' running mean r against the global mean g (the"
                 " authors' 50; PFLlib's default 0 turns it off)",
    "mean_momentum": "FedDBE: momentum of the representations' running mean, reset each"
                     " round (1, the authors': the batch's own mean; PFLlib's default 0.1)",
}


class DbeServer(NamedTuple):
  model: Params        # the global model (f and h)
  global_mean: jax.Array  # [d] g, fixed after the initialisation period


class DbeTrained(NamedTuple):
  model: Params
  bias: jax.Array      # [d] m_i


def validate(config: FedDbeConfig, trainer: ClientTrainer) -> FedDbeConfig:
  if config.kl_weight < 0:
    raise FieldError("feddbe", "kl_weight", f"must be >= 0, got {config.kl_weight}")
  if not 0 < config.mean_momentum <= 1:
    raise FieldError("feddbe", "mean_momentum",
                     f"must be in (0, 1], got {config.mean_momentum}")
  check_representation_trainer("feddbe", trainer)
  return config


def running_mean(previous: jax.Array, z: jax.Array, weights: jax.Array,
                 momentum: float) -> jax.Array:
  """(1 - momentum) r + momentum * the mean of the batch's real representations z [B, d]."""
  batch_mean = jnp.sum(z * weights[:, None], axis=0) / jnp.maximum(jnp.sum(weights), 1.0)
  return (1.0 - momentum) * previous + momentum * batch_mean


def mean_regulariser(mean: jax.Array, global_mean: jax.Array) -> jax.Array:
  """mean_k (r_k - g_k)^2 / 2 (the code's KL between unit-variance Gaussians)."""
  return jnp.mean(0.5 * jnp.square(mean - global_mean))


def shifted_head(model: Params, head: str, bias: jax.Array) -> Params:
  """The model whose prediction is h(f(x) + m): its head's bias b + m W."""
  layer = model["params"][head]
  return {"params": {**model["params"],
                     head: {**layer, "bias": layer["bias"] + bias @ layer["kernel"]}}}


def dbe_loss(apply_fn, head: str, global_mean: jax.Array, config: FedDbeConfig):
  """CarriedLossFn of a round's step: CE(h(f(x) + m), y) + kl_weight * MR, carrying r."""
  def loss(p: DbeTrained, mean, x, y, weights):
    outputs, z = apply_with_representation(apply_fn, p.model, x, head)
    outputs = outputs + p.bias @ p.model["params"][head]["kernel"]   # h(z + m), h affine
    mean = running_mean(mean, z, weights, config.mean_momentum)
    total = (masked_cross_entropy(outputs, y, weights)
             + config.kl_weight * mean_regulariser(mean, global_mean))
    return total, jax.lax.stop_gradient(mean)
  return loss


def plain_loss(apply_fn, head: str, config: FedDbeConfig):
  """The initialisation period's CarriedLossFn: CE(h(f(x)), y), carrying r."""
  def loss(model, mean, x, y, weights):
    outputs, z = apply_with_representation(apply_fn, model, x, head)
    mean = running_mean(mean, z, weights, config.mean_momentum)
    return masked_cross_entropy(outputs, y, weights), jax.lax.stop_gradient(mean)
  return loss


def feddbe(config: FedDbeConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)

  def init(context: InitContext) -> AlgorithmState:
    model = tree.first(context.params)
    head = head_layer(model, "feddbe")
    dim = model["params"][head]["kernel"].shape[0]
    num_clients = tree.leading_size(context.params)
    data = context.data
    keys = jax.vmap(jax.random.fold_in, (None, 0))(context.key, jnp.arange(num_clients))

    def initial_mean(key, splits):
      """One client's initialisation period: its running mean r_i and its size n_i."""
      *_, mean = trainer.train(model, splits.train, key, loss_fn=plain_loss(
          trainer.apply, head, config), carry=jnp.zeros((dim,), jnp.float32))
      return mean, splits.train.n.astype(jnp.float32)
    means, sizes = map_over_buckets(initial_mean, (keys,), data.buckets, data.client_ids,
                                    num_clients)
    global_mean = jnp.sum(sizes[:, None] * means, axis=0) / jnp.sum(sizes)
    return AlgorithmState(server=DbeServer(model=model, global_mean=global_mean),
                          clients=jnp.zeros((num_clients, dim), jnp.float32))

  def broadcast(server: DbeServer, biases):
    return tree.broadcast_to_clients(server, biases.shape[0])

  def client_update(bias, server: DbeServer, data, key):
    head = head_layer(server.model, "feddbe")
    dim = bias.shape[-1]
    trained, stats, _ = trainer.train(
        DbeTrained(model=server.model, bias=bias), data.train, key,
        loss_fn=dbe_loss(trainer.apply, head, server.global_mean, config),
        carry=jnp.zeros((dim,), jnp.float32))
    return ClientOutput(state=trained.bias, upload=trained.model, train=stats)

  def aggregate(server: DbeServer, biases, uploads, weights):
    return AlgorithmState(server=server._replace(model=tree.weighted_mean(uploads, weights)),
                          clients=biases)

  def personalized_params(server: DbeServer, biases):
    head = head_layer(server.model, "feddbe")
    models = tree.broadcast_to_clients(server.model, biases.shape[0])
    return jax.vmap(shifted_head, in_axes=(0, None, 0))(models, head, biases)

  return Algorithm(name="feddbe", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, uploads_unordered=True)
