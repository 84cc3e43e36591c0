"""PeFLL: an embedding network maps a client's data to a descriptor, a hypernetwork maps the
descriptor to the client's model; the server trains both from the clients' updates.

Scott, Zakerinia, Lampert. "PeFLL: Personalized Federated Learning by Learning to Learn."
ICLR 2024. https://arxiv.org/abs/2306.05515
(code followed: the authors' pefllauthors/PeFLL, train.py and models.py; FL-bench's
src/server/pefll.py and src/client/pefll.py, KarhouTam/FL-bench, GPL: both read, not run
or copied. The paper's full text is not on disk, so this module names no equation
numbers. PFLlib has no PeFLL, so there is no verification row: the unit tests check the
descriptor, its normalisation and the server's gradients by hand and against jax.grad.)

The server holds an embedding network E and a hypernetwork h; client k's descriptor v_k (E's
mean over embed_batches 1 batches, normalize "first") gives theta_k = h(v_k), which it trains
and uploads delta_k with v_k and psi's gradient; the server takes one Adam step (server_lr
2e-4, grad_clip 50). Scored: h(v_k) of its whole split, absent classes masked (mask_absent).

Departures: the run's local training (the authors': 50 clipped SGD steps); a client receives
both networks.
Details (every option, the departures, measurements): docs/algorithms/pefll.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.algorithms.pfedhn import (Hypernetwork, hypernetwork_apply, init_hypernetwork,
                                          torch_linear)
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.engine.local_training import ClientTrainer, EvalStats
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
EMBED_MODELS = ("xy", "labels")
NORMALIZATIONS = ("first", "each")


class PefllConfig(NamedTuple):
  embed_dim: int = 0           # descriptor size e; 0: the authors' 1 + K / 4
  embed_model: str = "xy"      # E over (x, y) (authors' models.py MLP) or y alone
  embed_hidden: int = 20       # the authors' --embed-hid
  embed_layers: int = 3        # the authors' --embed-nlayers (Linear layers)
  embed_batches: int = 1       # batches of a round's descriptor (0: the whole split)
  normalize: str = "first"     # authors': the first descriptor's m, s; FL-bench: each
  hidden_dim: int = 100        # hypernetwork width
  n_hidden: int = 3            # hypernetwork hidden layers after the first
  server_lr: float = 2e-4      # Adam's (the authors' --lr, --optim adam)
  grad_clip: float = 50.0      # the server gradient's max global norm; 0: off
  mask_absent: bool = True     # scoring: absent classes' logits x 0 (authors' default)


FLAG_HELP = {
    "embed_dim": "PeFLL: descriptor size (0: 1 + clients / 4, the authors')",
    "embed_model": "PeFLL: embedding network over the flattened x and one-hot y (xy, the"
                   " authors' models.py MLP) or one-hot y alone (labels, their"
                   " --embed-model=mlp)",
    "embed_hidden": "PeFLL: the embedding network's hidden width",
    "embed_layers": "PeFLL: the embedding network's Linear layers",
    "embed_batches": "PeFLL: training batches averaged into a round's descriptor (0: the"
                     " whole training split)",
    "normalize": "PeFLL: descriptors normalised by the first one's mean and std (first,"
                 " the authors') or each by its own (each, FL-bench)",
    "hidden_dim": "PeFLL: hypernetwork hidden width",
    "n_hidden": "PeFLL: hypernetwork hidden layers after the first",
    "server_lr": "PeFLL: the server's Adam learning rate for both networks",
    "grad_clip": "PeFLL: max global norm of the server's averaged gradient (0: off)",
    "mask_absent": "PeFLL: score with the logits of classes absent from the client's"
                   " training split multiplied by 0 (the authors' default)",
}


class Networks(NamedTuple):
  embed: tuple            # ((w, b), ...) the embedding network's Linear layers
  hyper: Hypernetwork


class Scale(NamedTuple):
  mean: jax.Array         # [] m
  std: jax.Array          # [] s
  ready: jax.Array        # [] bool: m, s taken from a first descriptor


class PefllServer(NamedTuple):
  networks: Networks
  opt_state: Any
  scale: Scale


class PefllUpload(NamedTuple):
  delta: Params           # theta_k - theta~_k
  descriptor: jax.Array   # [e] v_k
  embed_grad: tuple       # g_psi
  own_scale: Scale        # the client's own m, s (the server keeps the first's)


def validate(config: PefllConfig, trainer: ClientTrainer) -> PefllConfig:
  check_one_of("pefll", config, "embed_model", EMBED_MODELS)
  check_one_of("pefll", config, "normalize", NORMALIZATIONS)
  for field, low in (("embed_dim", 0), ("embed_hidden", 1), ("embed_layers", 1),
                     ("embed_batches", 0), ("hidden_dim", 1), ("n_hidden", 0)):
    if getattr(config, field) < low:
      raise FieldError("pefll", field, f"must be >= {low}, got {getattr(config, field)}")
  if not config.server_lr > 0:
    raise FieldError("pefll", "server_lr", f"must be > 0, got {config.server_lr}")
  if config.grad_clip < 0:
    raise FieldError("pefll", "grad_clip", f"must be >= 0, got {config.grad_clip}")
  if trainer.task != "classification":
    raise ConfigError(f"pefll needs a classification task (its descriptor reads one-hot"
                      f" labels), not {trainer.task}")
  if trainer.apply is None or trainer.evaluate_with is None:
    raise ConfigError("pefll needs the model's apply function in the client trainer")
  return config


def embed_inputs(x: jax.Array, y: jax.Array, num_classes: int, embed_model: str):
  """[N, F] the embedding network's input: flattened x beside one-hot y, or one-hot y."""
  labels = jax.nn.one_hot(y, num_classes)
  if embed_model == "labels":
    return labels
  return jnp.concatenate([x.reshape(x.shape[0], -1).astype(labels.dtype), labels], -1)


def init_embed(key: jax.Array, in_dim: int, config: PefllConfig, embed_dim: int) -> tuple:
  widths = ([in_dim, embed_dim] if config.embed_model == "labels" else
            [in_dim] + [config.embed_hidden] * (config.embed_layers - 1) + [embed_dim])
  keys = jax.random.split(key, len(widths) - 1)
  return tuple(torch_linear(k, a, b) for k, a, b in zip(keys, widths[:-1], widths[1:]))


def embed_apply(layers: tuple, inputs: jax.Array) -> jax.Array:
  """[N, e]: Linear layers with ReLU between them."""
  h = inputs
  for index, (w, b) in enumerate(layers):
    if index > 0:
      h = jax.nn.relu(h)
    h = h @ w + b
  return h


def raw_descriptor(layers: tuple, inputs: jax.Array, weights: jax.Array) -> jax.Array:
  """[e] the weighted mean of E over the samples (weights [N], 0 for the ones left out)."""
  return weights @ embed_apply(layers, inputs) / jnp.maximum(jnp.sum(weights), 1.0)


def own_scale(raw: jax.Array) -> Scale:
  """The entries' mean and unbiased standard deviation (torch's std), no gradient."""
  raw = jax.lax.stop_gradient(raw)
  return Scale(jnp.mean(raw), jnp.std(raw, ddof=1), jnp.bool_(True))


def normalized(raw: jax.Array, scale: Scale, normalize: str) -> jax.Array:
  if normalize == "each":   # FL-bench: standardised by its own entries, gradient through
    return (raw - jnp.mean(raw)) / jnp.std(raw, ddof=1)
  mine = own_scale(raw)
  mean = jnp.where(scale.ready, scale.mean, mine.mean)
  std = jnp.where(scale.ready, scale.std, mine.std)
  return (raw - mean) / std


def first_scale(scale: Scale, uploads: Scale, sampled: jax.Array) -> Scale:
  """The server's m, s: kept once set, else the first sampled client's."""
  first = jnp.argmax(sampled)
  take = jnp.logical_not(scale.ready) & jnp.any(sampled)
  return Scale(mean=jnp.where(take, uploads.mean[first], scale.mean),
               std=jnp.where(take, uploads.std[first], scale.std),
               ready=scale.ready | take)


def descriptor_weights(mask: jax.Array, count: int, key: jax.Array) -> jax.Array:
  """[N] 1 on `count` real samples drawn at random (all of them if count is 0 or more
  than there are), else 0."""
  mask = jnp.asarray(mask)
  if count == 0 or count >= mask.shape[0]:
    return mask.astype(jnp.float32)
  ranks = jnp.argsort(jnp.argsort(jnp.where(mask, jax.random.uniform(key, mask.shape), 2.0)))
  return (mask & (ranks < count)).astype(jnp.float32)


def hyper_gradient(hyper: Hypernetwork, descriptors: jax.Array, deltas) -> Hypernetwork:
  """sum_k (d h(v_k; phi) / d phi)^T delta_k over the stacked descriptors [K, e]."""
  _, pullback = jax.vjp(
      lambda net: jax.vmap(lambda v: hypernetwork_apply(net, v))(descriptors), hyper)
  return pullback(deltas)[0]


def pefll(config: PefllConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  batch_size = batch_size_of(trainer)
  apply_fn, evaluate_with = trainer.apply, trainer.evaluate_with
  assert apply_fn is not None and evaluate_with is not None  # validate() checked them
  clip = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip > 0 else []
  optimizer = optax.chain(*clip, optax.adam(config.server_lr))

  def num_classes_of(hyper: Hypernetwork) -> int:
    return jax.tree.leaves(hyper.head_b)[-1].shape[-1]   # the top layer's bias

  def descriptor(networks: Networks, scale: Scale, data: ClientData, weights):
    inputs = embed_inputs(jnp.asarray(data.x), jnp.asarray(data.y),
                          num_classes_of(networks.hyper), config.embed_model)
    raw = raw_descriptor(networks.embed, inputs, weights)
    return normalized(raw, scale, config.normalize), own_scale(raw)

  def descriptor_vjp(networks: Networks, scale: Scale, train: ClientData, weights):
    """((v, own scale), pullback of v to the embedding network's parameters)."""
    def v_of(embed):
      return descriptor(networks._replace(embed=embed), scale, train, weights)
    v, pullback, mine = jax.vjp(v_of, networks.embed, has_aux=True)
    return (v, mine), lambda g: pullback(g)[0]

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    embed_dim = config.embed_dim or int(1 + num_clients / 4)
    target = tree.first(context.params)
    embed_key, hyper_key = jax.random.split(context.key)
    hyper = init_hypernetwork(hyper_key, embed_dim, config.hidden_dim, config.n_hidden,
                              target)
    in_dim = context.data.num_classes + (0 if config.embed_model == "labels" else
                                         math.prod(context.data.input_shape))
    networks = Networks(embed=init_embed(embed_key, in_dim, config, embed_dim), hyper=hyper)
    scale = Scale(jnp.zeros(()), jnp.ones(()), jnp.bool_(False))
    return AlgorithmState(
        server=PefllServer(networks=networks, opt_state=optimizer.init(networks),
                           scale=scale),
        clients=jnp.zeros((num_clients,), jnp.float32))

  def broadcast(server: PefllServer, clients):
    return tree.broadcast_to_clients((server.networks, server.scale),
                                     tree.leading_size(clients))

  def client_update(client_state, received, data: ClientSplits, key):
    networks, scale = received
    batch_key, train_key = jax.random.split(key)
    weights = descriptor_weights(jnp.asarray(data.train.mask), config.embed_batches * batch_size,
                                 batch_key)
    (v, mine), embed_pullback = descriptor_vjp(networks, scale, data.train, weights)
    theta, theta_pullback = jax.vjp(lambda u: hypernetwork_apply(networks.hyper, u), v)
    trained, stats = trainer.train(theta, data.train, train_key)
    delta = jax.tree.map(jnp.subtract, theta, trained)
    embed_grad = embed_pullback(theta_pullback(delta)[0])
    return ClientOutput(state=client_state,
                        upload=PefllUpload(delta=delta, descriptor=v, embed_grad=embed_grad,
                                           own_scale=mine),
                        train=stats)

  def aggregate(server: PefllServer, clients, uploads: PefllUpload, weights):
    sampled = weights > 0
    on = sampled.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(on), 1.0)
    deltas = jax.tree.map(lambda d: d * on.reshape((-1,) + (1,) * (d.ndim - 1)),
                          uploads.delta)
    grads = Networks(
        embed=jax.tree.map(lambda g: jnp.tensordot(on, g, axes=(0, 0)) / count,
                           uploads.embed_grad),
        hyper=jax.tree.map(lambda g: g / count,
                           hyper_gradient(server.networks.hyper, uploads.descriptor, deltas)))
    updates, opt_state = optimizer.update(grads, server.opt_state, server.networks)
    # A round no client took part in leaves the networks and the optimiser as they were.
    keep = jnp.any(sampled)
    networks = jax.tree.map(lambda new, old: jnp.where(keep, new, old),
                            optax.apply_updates(server.networks, updates), server.networks)
    opt_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), opt_state,
                             server.opt_state)
    return AlgorithmState(
        server=PefllServer(networks=networks, opt_state=opt_state,
                           scale=first_scale(server.scale, uploads.own_scale, sampled)),
        clients=clients)

  def evaluate_splits(scored, splits: ClientSplits,
                      names: tuple[str, ...]) -> tuple[EvalStats, ...]:
    networks, scale = scored
    train = jax.tree.map(jnp.asarray, splits.train)
    v, _ = descriptor(networks, scale, train, train.mask.astype(jnp.float32))
    theta = hypernetwork_apply(networks.hyper, v)
    present = jnp.ones((num_classes_of(networks.hyper),))
    if config.mask_absent:
      present = (jnp.sum(jax.nn.one_hot(train.y, present.shape[0])
                         * train.mask[:, None], axis=0) > 0).astype(jnp.float32)
    evaluate = evaluate_with(lambda params, x: apply_fn(params, x) * present)
    return tuple(evaluate(theta, getattr(splits, name)) for name in names)

  def shared_model(server: PefllServer):
    return (server.networks, server.scale)

  def personalized_params(server: PefllServer, clients):
    return tree.broadcast_to_clients(shared_model(server), tree.leading_size(clients))

  return Algorithm(name="pefll", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, evaluate_splits=evaluate_splits,
                   shared_model=shared_model)
