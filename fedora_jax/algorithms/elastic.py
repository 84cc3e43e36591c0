"""Elastic aggregation: the server scales each parameter's averaged update by how little
the clients' losses depend on it, so sensitive parameters move less.

Chen, Hu, Tan, Wei, Wu. "Elastic Aggregation for Federated Optimization." CVPR 2023.
https://openaccess.thecvf.com/content/CVPR2023/html/Chen_Elastic_Aggregation_for_Federated_Optimization_CVPR_2023_paper.html
(code followed: FL-bench's src/client/elastic.py / src/server/elastic.py,
KarhouTam/FL-bench, GPL: read, not run or copied. The paper's full text is not on disk,
so this module names no equation numbers; its per-parameter sensitivity is our reading
of the paper's "parameter sensitivity", FL-bench's per-tensor one an option. PFLlib has
no Elastic aggregation, so there is no verification row: the unit tests check the core
step by hand.)

A sampled client tracks a sensitivity Omega_k (a mu 0.95 moving average of |grad| over a
sample_ratio 0.3 share of its data), trains as FedAvg and uploads its update and Omega_k; the
server scales the mean update element-wise by zeta in [tau, 1 + tau] (tau 0.5), less where the
mean sensitivity is near its max. Scored: the global model. granularity "parameter" or "layer".

Departures: the sensitivity's samples are trained on too; "layer" uses the whole tensor's norm.
Details (every option, the departures, measurements): docs/algorithms/elastic.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer, epoch_batches
from fedora_jax.errors import FieldError, check_one_of, traced

Params = Any
GRANULARITIES = ("parameter", "layer")
ZERO_MAX = 1e-7  # a zero max sensitivity is replaced by this (the codes')


class ElasticConfig(NamedTuple):
  tau: float = 0.5             # zeta in [tau, 1 + tau]
  mu: float = 0.95             # the sensitivity's moving-average decay per batch
  sample_ratio: float = 0.3    # share of the client's training data the sensitivity reads
  granularity: str = "parameter"  # parameter: element-wise (the paper); layer: FL-bench's


FLAG_HELP = {
    "tau": "Elastic: zeta = 1 + tau - mean sensitivity / max sensitivity scales the update",
    "mu": "Elastic: decay of the sensitivity's moving average over the batches",
    "sample_ratio": "Elastic: share of a client's training data its sensitivity is read on",
    "granularity": "Elastic: a sensitivity per parameter (parameter, the paper) or per"
                   " tensor, its squared gradient norm (layer, FL-bench)",
}


class ElasticUpload(NamedTuple):
  delta: Params        # theta - w_k
  sensitivity: Params  # Omega_k


def validate(config: ElasticConfig) -> ElasticConfig:
  if not traced(config.tau) and config.tau < 0:
    raise FieldError("elastic", "tau", f"must be >= 0, got {config.tau}")
  if not traced(config.mu) and not 0 <= config.mu < 1:
    raise FieldError("elastic", "mu", f"must be in [0, 1), got {config.mu}")
  if not traced(config.sample_ratio) and not 0 < config.sample_ratio <= 1:
    raise FieldError("elastic", "sample_ratio",
                     f"must be in (0, 1], got {config.sample_ratio}")
  check_one_of("elastic", config, "granularity", GRANULARITIES)
  return config


def zero_sensitivity(params: Params, granularity: str) -> Params:
  if granularity == "layer":
    return jax.tree.map(lambda p: jnp.zeros((), p.dtype), params)
  return jax.tree.map(jnp.zeros_like, params)


def gradient_sensitivity(grads: Params, granularity: str) -> Params:
  """|g| element-wise, or ||g||^2 of each tensor."""
  if granularity == "layer":
    return jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)
  return jax.tree.map(jnp.abs, grads)


def elastic_coefficients(sensitivities: Params, weights: jax.Array, tau) -> Params:
  """zeta = 1 + tau - sum_k p_k Omega_k / max_k Omega_k over the clients of weight > 0,
  from stacked sensitivities [S, ...] and weights [S]."""
  p = weights / jnp.sum(weights)
  taking_part = weights > 0

  def one(omega):
    mask = taking_part.reshape((-1,) + (1,) * (omega.ndim - 1))
    largest = jnp.max(jnp.where(mask, omega, 0.0), axis=0)
    largest = jnp.where(largest == 0, ZERO_MAX, largest)
    return 1.0 + tau - jnp.tensordot(p, omega, axes=(0, 0)) / largest
  return jax.tree.map(one, sensitivities)


def elastic(config: ElasticConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def sensitivity_pass(omega: Params, params: Params, data, key) -> Params:
    """The moving average over the batches of the first int(ratio n) shuffled samples."""
    num_batches = trainer.steps_per_epoch(data.mask.shape[0])
    indices, _ = epoch_batches(key, data.mask, data.n, trainer.batch_size, num_batches)
    read = jnp.floor(config.sample_ratio * data.n)
    weights = (jnp.arange(indices.size).reshape(indices.shape) < read).astype(jnp.float32)
    gradient = jax.grad(trainer.loss)

    def step(omega, batch):
      idx, w = batch
      g = gradient_sensitivity(gradient(params, data.x[idx], data.y[idx], w),
                               config.granularity)
      moved = jax.tree.map(lambda o, s: config.mu * o + (1 - config.mu) * s, omega, g)
      return jax.tree.map(lambda m, o: jnp.where(jnp.sum(w) > 0, m, o), moved, omega), None
    omega, _ = jax.lax.scan(step, omega, (indices, weights))
    return omega

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=tree.first(context.params),
                          clients=zero_sensitivity(context.params, config.granularity))

  def broadcast(server, clients):
    return tree.broadcast_to_clients(server, tree.leading_size(clients))

  def client_update(omega, theta, data, key):
    sense_key, key = jax.random.split(key)
    omega = sensitivity_pass(omega, theta, jax.tree.map(jnp.asarray, data.train), sense_key)
    params, stats = trainer.train(theta, data.train, key)
    delta = jax.tree.map(jnp.subtract, theta, params)
    return ClientOutput(state=omega, upload=ElasticUpload(delta, omega), train=stats)

  def aggregate(server, clients, uploads: ElasticUpload, weights):
    zeta = elastic_coefficients(uploads.sensitivity, weights, config.tau)
    step = tree.weighted_mean(uploads.delta, weights)
    new = jax.tree_util.tree_map_with_path(
        lambda path, t, z, d: t - d if batch_stats.is_statistic(path) else t - z * d,
        server, zeta, step)
    return AlgorithmState(server=new, clients=clients)

  def personalized_params(server, clients):
    return tree.broadcast_to_clients(server, tree.leading_size(clients))

  return Algorithm(name="elastic", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server, uploads_unordered=True)
