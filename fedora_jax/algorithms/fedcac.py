"""FedCAC: each client marks its critical parameters after training; it takes its
non-critical ones from the global model and its critical ones from a customised model,
the mean of the clients whose critical parameters overlap with its own.

Wu, Liu, Niu, Zhu, Tang. "Bold but Cautious: Unlocking the Potential of Personalized
Federated Learning through Cautiously Aggressive Collaboration." ICCV 2023.
https://arxiv.org/abs/2309.11103
(code: the authors' FLAIR-Community/Fling, fedcac_client.py / fedcac_group.py and
argzoo's fedcac configs; PFLlib's clientcac.py / servercac.py, which the verification
runs beside this module. The paper's full text is not on disk: this module follows that
code, and names no equation numbers.)

Each round a sampled client trains, marks the top tau 0.5 of each tensor's sensitivities as
critical and uploads; the server averages the models into w and, per client, those whose masks
overlap above a threshold rising over beta 100 rounds into u_i. Scored: c_i u_i + (1 - c_i) w.

Departure: a partial last batch trains; first_round "initial" is PFLlib's round 0.

Details (every option, the departures, measurements): docs/algorithms/fedcac.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

Params = Any
FIRST_ROUNDS = ("customized", "initial")
ZERO_THRESHOLD = 1e-10   # a threshold at or below this is replaced (the code's)
NONZERO = 1e-20          # by the smallest sensitivity above this


class FedCacConfig(NamedTuple):
  tau: float = 0.5              # fraction of each tensor's parameters marked critical
  beta: float = 100.0           # rounds over which the threshold rises to the max overlap
  first_round: str = "customized"  # "customized" (authors' code) or "initial" (PFLlib)


FLAG_HELP = {
    "tau": "FedCAC: fraction tau of each parameter tensor marked critical after training",
    "beta": "FedCAC: the collaboration threshold rises from the mean to the max overlap"
            " over beta rounds",
    "first_round": "FedCAC: customised models from the first round on (customized, the"
                   " authors' code) or the initial model's critical parameters after it"
                   " (initial, PFLlib)",
}


class CacServer(NamedTuple):
  model: Params          # the global model w
  round: jax.Array       # [] int32 t, rounds aggregated so far


class CacClient(NamedTuple):
  critical: Params       # [K, ...] bool masks c_i, the model's shapes
  customized: Params     # [K, ...] u_i


class CacUpload(NamedTuple):
  model: Params          # theta_i after training
  critical: Params       # its critical mask


def validate(config: FedCacConfig) -> FedCacConfig:
  if not 0 <= config.tau <= 1:
    raise FieldError("fedcac", "tau", f"must be in [0, 1], got {config.tau}")
  if not config.beta > 0:
    raise FieldError("fedcac", "beta", f"must be > 0, got {config.beta}")
  check_one_of("fedcac", config, "first_round", FIRST_ROUNDS)
  return config


def critical_mask(before: jax.Array, after: jax.Array, tau: float) -> jax.Array:
  """One tensor's critical parameters: sensitivity |(after - before) * after| at or above
  its int(tau n)-th largest value (none where that count is 0)."""
  sensitivity = jnp.abs((after - before) * after)
  flat = sensitivity.reshape(-1)
  count = int(tau * flat.size)
  if count == 0:
    return jnp.zeros(after.shape, bool)
  threshold = jnp.sort(flat)[flat.size - count]
  smallest_nonzero = jnp.min(jnp.where(flat > NONZERO, flat, jnp.inf))
  threshold = jnp.where((threshold <= ZERO_THRESHOLD) & jnp.isfinite(smallest_nonzero),
                        smallest_nonzero, threshold)
  return sensitivity >= threshold


def overlaps(critical: jax.Array) -> jax.Array:
  """[K, K] o_ij = 1 - |c_i - c_j|_1 / (2 |c_i|_1) of 0/1 masks [K, P]."""
  gram = critical @ critical.T
  counts = jnp.diag(gram)
  differences = counts[:, None] + counts[None, :] - 2.0 * gram
  return 1.0 - differences / (2.0 * jnp.maximum(counts[:, None], 1.0))


def collaborators(critical: jax.Array, sampled: jax.Array, round_index: jax.Array,
                  beta: float) -> jax.Array:
  """[K, K] bool: j is in client i's customised model (i itself always)."""
  num_clients = sampled.shape[0]
  overlap = overlaps(critical)
  pairs = sampled[:, None] & sampled[None, :] & ~jnp.eye(num_clients, dtype=bool)
  mean = jnp.sum(jnp.where(pairs, overlap, 0.0)) / jnp.maximum(jnp.sum(pairs), 1)
  largest = jnp.max(jnp.where(pairs, overlap, -jnp.inf))
  threshold = mean + (round_index + 1.0) / beta * (largest - mean)
  return (pairs & (overlap >= threshold)) | jnp.eye(num_clients, dtype=bool)


def combined(critical: Params, customized: Params, global_model: Params) -> Params:
  """c * u + (1 - c) * w, leaf by leaf (global_model without the client axis)."""
  return jax.tree.map(lambda c, u, w: jnp.where(c, u, w), critical, customized, global_model)


def _flat_masks(critical: Params) -> jax.Array:
  return jnp.concatenate([leaf.reshape(leaf.shape[0], -1).astype(jnp.float32)
                          for leaf in jax.tree.leaves(critical)], axis=1)


def fedcac(config: FedCacConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    server = CacServer(model=tree.first(context.params), round=jnp.zeros((), jnp.int32))
    clients = CacClient(critical=jax.tree.map(lambda p: jnp.zeros(p.shape, bool),
                                              context.params),
                        customized=context.params)
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: CacServer, clients: CacClient):
    return jax.vmap(combined, in_axes=(0, 0, None))(clients.critical, clients.customized,
                                                     server.model)

  def client_update(client: CacClient, start: Params, data, key):
    params, stats = trainer.train(start, data.train, key)
    critical = jax.tree.map(lambda b, a: critical_mask(b, a, config.tau), start, params)
    return ClientOutput(state=client._replace(critical=critical),
                        upload=CacUpload(model=params, critical=critical), train=stats)

  def aggregate(server: CacServer, clients: CacClient, uploads: CacUpload, weights):
    sampled = weights > 0
    together = collaborators(_flat_masks(uploads.critical), sampled, server.round,
                             config.beta).astype(jnp.float32)
    mixing = together / jnp.sum(together, axis=1, keepdims=True)
    customized = jax.tree.map(lambda m: jnp.tensordot(mixing, m, axes=(1, 0)), uploads.model)
    keep = ~sampled
    if config.first_round == "initial":   # PFLlib: none built in round 0
      keep = keep | (server.round == 0)
    customized = jax.tree.map(
        lambda new, old: jnp.where(keep.reshape((-1,) + (1,) * (old.ndim - 1)), old, new),
        customized, clients.customized)
    new_server = CacServer(model=tree.weighted_mean(uploads.model, weights),
                           round=server.round + 1)
    return AlgorithmState(server=new_server,
                          clients=clients._replace(customized=customized))

  def personalized_params(server: CacServer, clients: CacClient):
    return broadcast(server, clients)

  return Algorithm(name="fedcac", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
