"""FedAP: each client's model a mixture of the clients' models weighted by how alike
their data look to a pretrained model's BatchNorm layers; BatchNorm layers stay local.

Lu, Wang, Chen, Qin, Xie, Yu, Cui. "Personalized Federated Learning with Adaptive
Batchnorm for Healthcare." IEEE Transactions on Big Data, 2022.
https://arxiv.org/abs/2112.00734
(code followed: the authors' microsoft/PersonalizedFL, alg/fedap.py and alg/core/comm.py;
FL-bench's src/server/fedap.py, KarhouTam/FL-bench, GPL: read, not run or copied. PFLlib
has no FedAP, so there is no verification row: the unit tests check the core step by
hand.)

After warmup (0.5 of the rounds) of FedAvg, a client receives sum_j w_ij theta_j with its own
BatchNorm layers (batch_norm "all"), trains it, and the server stores it: w_ii = model_momentum
0.5, w_ij from 1/d_ij, d the distance of the clients' BatchNorm inputs; scored: the mixture.

Departures: FedAvg's warm-up pretrains the model (the authors: on pooled data); the variance
is exact over a client's samples; without BatchNorm every distance is zero (a warning).

Details (every option, the departures, measurements): docs/algorithms/fedap.md.
"""

import logging
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms import pfedsim
from fedora_jax.algorithms.layers import in_chunks
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.batch_stats import is_batch_norm, is_statistic
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
BATCH_NORMS = ("all", "statistics")
SCORES = ("mixed", "trained")
ZERO_DISTANCE_WEIGHT = 1e14  # the code's 1/d for two clients at distance 0
STATS_CHUNK = 256            # samples per forward pass when measuring the statistics


class FedApConfig(NamedTuple):
  model_momentum: float = 0.5  # m, a client's weight on its own model (authors, FL-bench)
  warmup: float = 0.5          # FedAvg rounds: a fraction of `rounds` in [0, 1] or a count
  batch_norm: str = "all"      # local: "all" (paper, authors), "statistics" (FL-bench)
  score: str = "mixed"         # scored: the mixture (authors), "trained" (FL-bench)
  rounds: int = 100            # the run's rounds (a train field)


FLAG_HELP = {
    "model_momentum": "FedAP: a client's weight on its own model in its mixture (m)",
    "warmup": "FedAP: FedAvg rounds that pretrain the model whose BatchNorm inputs give the"
              " similarities, a fraction of the rounds in [0, 1] or a number of rounds > 1",
    "batch_norm": "FedAP: BatchNorm kept on the client: all (scale, shift and running"
                  " averages: the paper's, the authors') or statistics (FL-bench's)",
    "score": "FedAP: score the client's mixture (mixed, the authors') or its trained model"
             " (trained, FL-bench's)",
}


class Moments(NamedTuple):
  mean: tuple[jax.Array, ...]  # per BatchNorm layer, [C_l] (stacked: [K, C_l])
  var: tuple[jax.Array, ...]


class ApServer(NamedTuple):
  model: Params         # FedAvg's model during the warm-up, the pretrained one after
  round: jax.Array      # [] int32 t, rounds aggregated so far
  moments: Moments      # [K, C_l] each client's statistics under the pretrained model
  measured: jax.Array   # [K] bool, whose moments are stored
  weights: jax.Array    # [K, K] w_ij


def warmup_rounds(config: FedApConfig) -> int:
  """T_w, as pFedSim reads its warm-up: a fraction of the rounds, or a count."""
  return pfedsim.warmup_rounds(config, owner="fedap")


def validate(config: FedApConfig) -> FedApConfig:
  check_one_of("fedap", config, "batch_norm", BATCH_NORMS)
  check_one_of("fedap", config, "score", SCORES)
  if not 0 <= config.model_momentum <= 1:
    raise FieldError("fedap", "model_momentum",
                     f"must be in [0, 1], got {config.model_momentum}")
  warmup_rounds(config)
  return config


def batch_norm_inputs(apply: Callable[[Params, jax.Array], Any], params: Params,
                      x: jax.Array) -> list[jax.Array]:
  """The input of every BatchNorm layer of one forward pass (inference mode), in call
  order: the features the authors' getallfea returns."""
  captured: list[jax.Array] = []

  def interceptor(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
      captured.append(args[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    apply(params, x)
  return captured


def client_moments(apply: Callable[[Params, jax.Array], Any], params: Params, x: jax.Array,
                   mask: jax.Array) -> Moments:
  """Per-channel mean and variance of each BatchNorm layer's input over the samples
  `mask` marks (and every position of a convolution's map), chunk by chunk."""
  chunk = min(mask.shape[0], STATS_CHUNK)

  def sums(_, batch):
    xb, mb = batch
    out = []
    for feature in batch_norm_inputs(apply, params, xb):
      weight = mb.reshape(mb.shape + (1,) * (feature.ndim - 1)).astype(feature.dtype)
      axes = tuple(range(feature.ndim - 1))
      positions = math.prod(feature.shape[1:-1])
      out.append((jnp.sum(feature * weight, axis=axes),
                  jnp.sum(feature ** 2 * weight, axis=axes),
                  jnp.sum(mb).astype(feature.dtype) * positions))
    return None, out

  _, per_chunk = jax.lax.scan(sums, None, (in_chunks(x, chunk), in_chunks(mask, chunk)))
  means, variances = [], []
  for first, second, count in per_chunk:
    total = jnp.maximum(jnp.sum(count), 1.0)
    mean = jnp.sum(first, axis=0) / total
    means.append(mean)
    variances.append(jnp.maximum(jnp.sum(second, axis=0) / total - mean ** 2, 0.0))
  return Moments(tuple(means), tuple(variances))


def wasserstein_distances(moments: Moments, num_clients: int) -> jax.Array:
  """[K, K] d_ij = sum_l sqrt(||mu_il - mu_jl||^2 + ||sigma_il - sigma_jl||^2)."""
  total = jnp.zeros((num_clients, num_clients))
  for mean, var in zip(moments.mean, moments.var):
    std = jnp.sqrt(var)
    squared = (jnp.sum((mean[:, None] - mean[None]) ** 2, axis=-1)
               + jnp.sum((std[:, None] - std[None]) ** 2, axis=-1))
    total = total + jnp.sqrt(squared)
  return total


def aggregation_weights(distances: jax.Array, measured: jax.Array,
                        momentum: float) -> jax.Array:
  """[K, K]: rows of measured clients (1 - m) (1/d_ij) / sum_k 1/d_ik over the other
  measured clients, m on the diagonal; other rows (and a client measured alone) identity."""
  num_clients = measured.shape[0]
  eye = jnp.eye(num_clients, dtype=bool)
  pairs = measured[:, None] & measured[None, :] & ~eye
  safe = jnp.where(distances > 0, distances, 1.0)
  inverse = jnp.where(distances > 0, 1.0 / safe, ZERO_DISTANCE_WEIGHT)
  inverse = jnp.where(pairs, inverse, 0.0)
  row_sums = jnp.sum(inverse, axis=1, keepdims=True)
  mixed = (1.0 - momentum) * inverse / jnp.where(row_sums > 0, row_sums, 1.0)
  mixed = jnp.where(eye, momentum, mixed)
  return jnp.where((row_sums > 0), mixed, eye.astype(mixed.dtype))


def personalized_models(models: Params, weights: jax.Array, batch_norm: str) -> Params:
  """Every client's mixture sum_j w_ij theta_j with its own BatchNorm leaves kept."""
  local = is_batch_norm if batch_norm == "all" else is_statistic
  return jax.tree_util.tree_map_with_path(
      lambda path, own, mix: own if local(path) else mix, models, tree.mix(weights, models))


def fedap(config: FedApConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  warmup = warmup_rounds(config)
  if trainer.apply is None:
    raise ConfigError("fedap needs the trainer's model forward (trainer.apply)")
  apply = trainer.apply

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    model = tree.first(context.params)
    train = context.data.buckets[0].train
    shapes = jax.eval_shape(lambda p, x: client_moments(apply, p, x, jnp.ones(1, bool)),
                            model, jax.ShapeDtypeStruct((1,) + train.x.shape[2:],
                                                        train.x.dtype))
    if not shapes.mean:
      logging.getLogger("fedora_jax").warning(
          "fedap: the model has no BatchNorm layers, so every client mixes its own model"
          " (model_momentum) with the others' mean")
    moments = jax.tree.map(lambda s: jnp.zeros((num_clients,) + s.shape, s.dtype), shapes)
    server = ApServer(model=model, round=jnp.zeros((), jnp.int32), moments=moments,
                      measured=jnp.zeros(num_clients, bool),
                      weights=jnp.eye(num_clients, dtype=jnp.float32))
    return AlgorithmState(server=server, clients=context.params)

  def broadcast(server: ApServer, clients: Params):
    personal = personalized_models(clients, server.weights, config.batch_norm)
    global_model = tree.broadcast_to_clients(server.model, tree.leading_size(clients))
    return jax.tree.map(lambda p, g: jnp.where(server.round < warmup, g, p),
                        personal, global_model)

  def client_update(client: Params, start: Params, data, key):
    del client
    moments = client_moments(apply, start, data.train.x, data.train.mask)
    params, stats = trainer.train(start, data.train, key)
    return ClientOutput(state=params, upload=(params, moments), train=stats)

  def aggregate(server: ApServer, clients: Params, uploads, weights):
    models, moments = uploads
    warm = server.round < warmup
    num_clients = tree.leading_size(clients)
    model = jax.tree.map(lambda new, old: jnp.where(warm, new, old),
                         tree.weighted_mean(models, weights), server.model)
    # From T_w on, a client's first round starts from the pretrained model (module doc).
    fresh = (weights > 0) & ~server.measured & ~warm
    moments = jax.tree.map(
        lambda new, old: jnp.where(fresh.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        moments, server.moments)
    measured = server.measured | fresh
    mixing = aggregation_weights(wasserstein_distances(moments, num_clients), measured,
                                 config.model_momentum)
    # During the warm-up every stored model is FedAvg's (the pretrained one at its end).
    clients = jax.tree.map(lambda c, g: jnp.where(warm, jnp.broadcast_to(g, c.shape), c),
                           clients, tree.broadcast_to_clients(model, num_clients))
    return AlgorithmState(server=ApServer(model, server.round + 1, moments, measured,
                                          mixing.astype(server.weights.dtype)),
                          clients=clients)

  def personalized_params(server: ApServer, clients: Params):
    if config.score == "trained":
      return clients
    return broadcast(server, clients)

  return Algorithm(name="fedap", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
