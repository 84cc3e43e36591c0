"""ADCOL: clients learn representations a server-side discriminator cannot tell apart.

Li, Li, He, Song. "Adversarial Collaborative Learning on Non-IID Features." ICML 2023.
https://proceedings.mlr.press/v202/li23j.html
(code read, not run or copied: FL-bench's src/server/adcol.py and src/client/adcol.py,
KarhouTam/FL-bench, GPL; the authors' code was not found in the stored sources. The
paper's full text is not on disk: this module follows its abstract and FL-bench's code,
and names no equation numbers. PFLlib has no ADCOL, so there is no verification row: the
unit tests check the client's KL term, the discriminator's step and the server's round
by hand.)

Client k trains and is scored with its own model (`model` "personal"; "fedavg" averages them)
on CE + mu KL(U || softmax(D(z))), D the server's discriminator, trained on the z of 256 samples
a client (`representations`). Defaults: mu 0.5, discriminator_lr 0.01, discriminator_epochs 3.

Departures: a fixed number of z a client, after training (FL-bench: all of the last epoch's);
z is after the body's last activation (FL-bench's: before the ReLU its classifier applies).

Details (every option, the departures, measurements): docs/algorithms/adcol.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer,
                                          representations)
from fedora_jax.engine.local_training import ClientTrainer, epoch_batches
from fedora_jax.errors import FieldError, check_one_of

Params = Any
MODELS = ("personal", "fedavg")
HIDDEN = 512        # FL-bench's discriminator width
BN_MOMENTUM = 0.1   # PyTorch's BatchNorm1d defaults
BN_EPS = 1e-5


class AdcolConfig(NamedTuple):
  mu: float = 0.5                   # weight of the KL term (FL-bench's --mu)
  discriminator_lr: float = 0.01    # FL-bench's --dis_lr
  discriminator_epochs: int = 3     # FL-bench's --dis_epoch
  representations: int = 256        # representations a client uploads a round
  model: str = "personal"           # "personal" (the paper) or "fedavg" (FL-bench)


FLAG_HELP = {
    "mu": "ADCOL: weight of KL(uniform || the discriminator's client distribution) on a"
          " client's representations",
    "discriminator_lr": "ADCOL: the server's SGD learning rate for the discriminator",
    "discriminator_epochs": "ADCOL: the discriminator's passes over a round's"
                            " representations",
    "representations": "ADCOL: representations of its training samples a client uploads"
                       " a round (a random subset)",
    "model": "ADCOL: personal, each client its own model (the paper's); fedavg, the"
             " clients' models averaged as well (FL-bench's)",
}


class Discriminator(NamedTuple):
  params: Params   # kernels w0 [F, H], w1 [H, H], w2 [H, K]; BatchNorm gamma / beta g0..b1
  stats: Params    # running means m0, m1 and variances v0, v1 [H]


class AdcolServer(NamedTuple):
  discriminator: Discriminator
  model: Params    # the global model ("fedavg"), else ()
  key: jax.Array   # raw key: the discriminator's batches and the uploaded subsets
  round: jax.Array


class AdcolUpload(NamedTuple):
  features: jax.Array  # [R, F]
  mask: jax.Array      # [R] bool: a real sample
  model: Params        # the trained model ("fedavg"), else ()


def validate(config: AdcolConfig, trainer: ClientTrainer) -> AdcolConfig:
  if config.mu < 0:
    raise FieldError("adcol", "mu", f"must be >= 0, got {config.mu}")
  if config.discriminator_lr <= 0:
    raise FieldError("adcol", "discriminator_lr",
                     f"must be > 0, got {config.discriminator_lr}")
  for field in ("discriminator_epochs", "representations"):
    if getattr(config, field) < 1:
      raise FieldError("adcol", field, f"must be >= 1, got {getattr(config, field)}")
  check_one_of("adcol", config, "model", MODELS)
  check_representation_trainer("adcol", trainer)
  return config


def init_discriminator(key: jax.Array, features: int, num_clients: int) -> Discriminator:
  """PyTorch's Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)); BatchNorm's 1, 0."""
  keys = jax.random.split(key, 3)
  shapes = ((features, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, num_clients))
  params = {f"w{i}": jax.random.uniform(k, s, jnp.float32, -1.0, 1.0) / math.sqrt(s[0])
            for i, (k, s) in enumerate(zip(keys, shapes))}
  for i in range(2):
    params[f"g{i}"], params[f"b{i}"] = jnp.ones(HIDDEN), jnp.zeros(HIDDEN)
  stats = {name: jnp.full(HIDDEN, value) for i in range(2)
           for name, value in ((f"m{i}", 0.0), (f"v{i}", 1.0))}
  return Discriminator(params=params, stats=stats)


def discriminate(d: Discriminator, z: jax.Array,
                 weights: jax.Array | None = None) -> tuple[jax.Array, Params]:
  """(logits [B, K], running averages): `weights` None, on the running averages (eval);
  else train mode, on the batch statistics of its real samples, the averages updated."""
  h, stats = z, dict(d.stats)
  for i in range(2):
    h = h @ d.params[f"w{i}"]
    if weights is None:
      mean, var = d.stats[f"m{i}"], d.stats[f"v{i}"]
    else:
      count = jnp.maximum(jnp.sum(weights), 1.0)
      mean = jnp.sum(weights[:, None] * h, 0) / count
      var = jnp.sum(weights[:, None] * jnp.square(h - mean), 0) / count
      unbiased = var * count / jnp.maximum(count - 1.0, 1.0)
      stats[f"m{i}"] = (1 - BN_MOMENTUM) * d.stats[f"m{i}"] + BN_MOMENTUM * mean
      stats[f"v{i}"] = (1 - BN_MOMENTUM) * d.stats[f"v{i}"] + BN_MOMENTUM * unbiased
    h = (h - mean) / jnp.sqrt(var + BN_EPS) * d.params[f"g{i}"] + d.params[f"b{i}"]
    h = jax.nn.relu(h)
  return h @ d.params["w2"], stats


def uniform_kl(logits: jax.Array, weights: jax.Array) -> jax.Array:
  """KL(U || softmax(logits)) averaged over the real samples: sum_k (log(1/K) - log p_k)/K."""
  num = logits.shape[-1]
  per_sample = -math.log(num) - jnp.mean(jax.nn.log_softmax(logits), axis=-1)
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def client_loss(apply_fn, head: str, d: Discriminator, mu: float):
  def loss(params, x, y, weights):
    outputs, z = apply_with_representation(apply_fn, params, x, head)
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, y)
    mean_ce = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return mean_ce + mu * uniform_kl(discriminate(d, z)[0], weights)
  return loss


def train_discriminator(d: Discriminator, features: jax.Array, owners: jax.Array,
                        real: jax.Array, key: jax.Array, lr: float, epochs: int,
                        batch_size: int) -> Discriminator:
  """`epochs` shuffled passes of plain SGD on the cross-entropy of each real feature's
  owner (features [M, F], owners [M], real [M] bool)."""
  num_batches = max(1, math.ceil(features.shape[0] / batch_size))
  keys = jax.random.split(key, epochs)
  count = jnp.sum(real).astype(jnp.int32)
  indices, weights = jax.vmap(
      lambda k: epoch_batches(k, real, count, batch_size, num_batches))(keys)
  optimizer = optax.sgd(lr)

  def batch_loss(params, stats, idx, w):
    logits, new_stats = discriminate(Discriminator(params, stats), features[idx], w)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, owners[idx])
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0), new_stats

  def step(carry, batch):
    params, stats, opt_state = carry
    idx, w = batch
    (_, new_stats), grads = jax.value_and_grad(batch_loss, has_aux=True)(params, stats,
                                                                         idx, w)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    active = jnp.sum(w) > 0  # a batch of padding only changes nothing
    params = jax.tree.map(lambda new, old: jnp.where(active, new, old),
                          optax.apply_updates(params, updates), params)
    stats = jax.tree.map(lambda new, old: jnp.where(active, new, old), new_stats, stats)
    return (params, stats, opt_state), None

  flat = (indices.reshape(-1, batch_size), weights.reshape(-1, batch_size))
  (params, stats, _), _ = jax.lax.scan(step, (d.params, d.stats, optimizer.init(d.params)),
                                       flat)
  return Discriminator(params=params, stats=stats)


def upload_subset(key: jax.Array, mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """([size] indices, [size] real): a random `size` of the real samples (all of them,
  padded, where there are fewer)."""
  order = jnp.argsort(jnp.where(mask, jax.random.uniform(key, mask.shape), 2.0))
  order = jnp.resize(order, (size,)) if size > order.shape[0] else order[:size]
  real = (jnp.arange(size) < jnp.sum(mask)) & mask[order]
  return order, real


def adcol(config: AdcolConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None  # validate checked it
  shared = config.model == "fedavg"

  def init(context: InitContext) -> AlgorithmState:
    one = tree.take(context.params, 0)
    head = head_layer(one)
    features = one["params"][head]["kernel"].shape[0]
    key = raw_key(context.key)
    d = init_discriminator(jax.random.fold_in(context.key, 0), features,
                           context.data.num_clients)
    server = AdcolServer(discriminator=d, model=one if shared else (), key=key,
                         round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=context.params)

  def broadcast(server: AdcolServer, models):
    return tree.broadcast_to_clients((server.discriminator, server.model),
                                     tree.leading_size(models))

  def client_update(model, message, data, key):
    d, global_model = message
    start = global_model if shared else model
    head = head_layer(start)
    train_key, subset_key = jax.random.split(key)
    params, stats = trainer.train(start, data.train, train_key,
                                  loss_fn=client_loss(apply_fn, head, d, config.mu))
    idx, real = upload_subset(subset_key, data.train.mask, config.representations)
    features = representations(apply_fn, params, data.train.x[idx], head)
    upload = AdcolUpload(features=features, mask=real, model=params if shared else ())
    return ClientOutput(state=params, upload=upload, train=stats)

  def aggregate(server: AdcolServer, models, uploads: AdcolUpload, weights):
    num, size = uploads.mask.shape
    owners = jnp.repeat(jnp.arange(num), size)
    real = (uploads.mask & (weights > 0)[:, None]).reshape(-1)
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
    d = train_discriminator(server.discriminator, uploads.features.reshape(num * size, -1),
                            owners, real, key, config.discriminator_lr,
                            config.discriminator_epochs, trainer.batch_size)
    model = tree.weighted_mean(uploads.model, weights) if shared else ()
    server = AdcolServer(discriminator=d, model=model, key=server.key,
                         round=server.round + 1)
    return AlgorithmState(server=server, clients=models)

  def personalized_params(server: AdcolServer, models):
    return tree.broadcast_to_clients(server.model, tree.leading_size(models)) if shared \
        else models

  return Algorithm(name="adcol", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=(lambda server: server.model) if shared else None)
