"""CFL: clustered federated learning, FedAvg within clusters that split in two when their
clients' updates stop agreeing.

Sattler, Mueller, Samek. "Clustered Federated Learning: Model-Agnostic Distributed
Multitask Optimization Under Privacy Constraints." IEEE TNNLS 32(8), 2021 (arXiv 2019).
https://arxiv.org/abs/1910.01991
(code followed: the authors' github.com/felisat/clustered-federated-learning, its
clustered_federated_learning.ipynb and fl_devices.py; FL-bench's src/server/cfl.py,
KarhouTam/FL-bench, GPL: read, not run or copied. PFLlib has no CFL, so there is no
verification row: the unit tests check the update norms, the cosine similarities, both
bipartitions and a split round by hand.)

Clients train from their cluster's model (the one they are scored with) and upload updates;
the server averages them per cluster and splits one in two (`bipartition`) when the mean update's
norm < eps1 (0.4), the largest > eps2 (1.6), after warmup_rounds (20), above min_cluster_size (2).

Departures: at most `max_clusters` (10) clusters; a pair's similarity is kept from its last round.

Details (every option, the departures, measurements): docs/algorithms/cfl.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

Params = Any
BIPARTITIONS = ("optimal", "complete")
COSINE_EPS = 1e-12  # the authors' pairwise_angles: + 1e-12 under the norms' product


class CflConfig(NamedTuple):
  eps1: float = 0.4          # split when the cluster's mean update norm is below this
  eps2: float = 1.6          # ... and its clients' largest update norm above this
  min_cluster_size: int = 2  # a cluster splits only with more clients than this
  warmup_rounds: int = 20    # no split in the first rounds (the authors' c_round > 20)
  max_clusters: int = 10     # slots for clusters (static shapes; not the paper's)
  bipartition: str = "optimal"  # "optimal": the paper's Algorithm 1; "complete": the code's


FLAG_HELP = {
    "eps1": "CFL: a cluster splits when the norm of its mean update is below eps1 (the"
            " authors' 0.4)",
    "eps2": "CFL: ... and the largest update norm of its clients is above eps2 (1.6)",
    "min_cluster_size": "CFL: a cluster splits only with more clients than this (2)",
    "warmup_rounds": "CFL: rounds before the first split (the authors' 20)",
    "max_clusters": "CFL: the most clusters (a split with no free slot is not made)",
    "bipartition": "CFL: optimal: the paper's Algorithm 1 (single linkage of the cosine"
                   " similarities); complete: the authors' and FL-bench's complete linkage",
}


class CflServer(NamedTuple):
  clusters: Params        # leaves [C, ...]: the cluster models (slots >= used unused)
  assignment: jax.Array   # [K] int32: each client's cluster
  used: jax.Array         # [] int32: clusters in use (slots 0..used-1)
  similarity: jax.Array   # [K, K] the last measured cosine similarity of the updates
  round: jax.Array        # [] int32: rounds aggregated so far


def validate(config: CflConfig) -> CflConfig:
  if not config.eps1 >= 0:
    raise FieldError("cfl", "eps1", f"must be >= 0, got {config.eps1}")
  if not config.eps2 >= 0:
    raise FieldError("cfl", "eps2", f"must be >= 0, got {config.eps2}")
  if config.min_cluster_size < 2:
    raise FieldError("cfl", "min_cluster_size", f"must be >= 2, got"
                     f" {config.min_cluster_size}")
  if config.warmup_rounds < 0:
    raise FieldError("cfl", "warmup_rounds", f"must be >= 0, got {config.warmup_rounds}")
  if config.max_clusters < 1:
    raise FieldError("cfl", "max_clusters", f"must be >= 1, got {config.max_clusters}")
  if config.bipartition not in BIPARTITIONS:
    raise FieldError("cfl", "bipartition", f"must be optimal or complete, got"
                     f" {config.bipartition!r}")
  return config


def flat(stacked) -> jax.Array:
  """[K, P]: each client's leaves raveled into one vector."""
  return jnp.concatenate([leaf.reshape(leaf.shape[0], -1).astype(jnp.float32)
                          for leaf in jax.tree.leaves(stacked)], axis=1)


def cosine_similarity(updates: jax.Array) -> jax.Array:
  """[K, K] <u_i, u_j> / (||u_i|| ||u_j|| + 1e-12) of the rows of `updates` [K, P]."""
  norms = jnp.linalg.norm(updates, axis=1)
  return (updates @ updates.T) / (norms[:, None] * norms[None, :] + COSINE_EPS)


def cluster_norms(updates: jax.Array, assignment: jax.Array, weights: jax.Array,
                  num_clusters: int) -> tuple[jax.Array, jax.Array]:
  """([C] ||weighted mean update||, [C] max update norm) over each cluster's clients of
  weight > 0 (0 for a cluster with none)."""
  member = jax.nn.one_hot(assignment, num_clusters, dtype=jnp.float32) * (weights > 0)[:, None]
  weighted = member * weights[:, None]                                       # [K, C]
  means = (weighted.T @ updates) / jnp.maximum(jnp.sum(weighted, axis=0), 1e-30)[:, None]
  norms = jnp.linalg.norm(updates, axis=1)
  return jnp.linalg.norm(means, axis=1), jnp.max(member * norms[:, None], axis=0)


def bipartition(similarity: jax.Array, members: jax.Array, linkage: str) -> jax.Array:
  """[K] bool: the side of the split the `members` [K] bool fall on (True: the second
  group, the one without the lowest-index member). Agglomerative clustering of the
  distances -similarity down to two groups: single linkage ("optimal", the paper's
  Algorithm 1) or complete linkage ("complete"), by Lance-Williams updates of the group
  distances (min or max of the merged rows)."""
  size = members.shape[0]
  combine = jnp.minimum if linkage == "optimal" else jnp.maximum
  pair = members[:, None] & members[None, :] & ~jnp.eye(size, dtype=bool)
  start = (jnp.where(pair, -similarity, jnp.inf), members, jnp.arange(size))

  def merge(_, carry):
    dist, active, labels = carry
    flat_index = jnp.argmin(dist)
    i, j = flat_index // size, flat_index % size
    keep, gone = jnp.minimum(i, j), jnp.maximum(i, j)
    row = combine(dist[keep], dist[gone]).at[keep].set(jnp.inf).at[gone].set(jnp.inf)
    merged = (dist.at[keep].set(row).at[:, keep].set(row)
              .at[gone].set(jnp.inf).at[:, gone].set(jnp.inf),
              active.at[gone].set(False), jnp.where(labels == gone, keep, labels))
    more = jnp.sum(active) > 2
    return jax.tree.map(lambda new, old: jnp.where(more, new, old), merged, carry)

  _, active, labels = jax.lax.fori_loop(0, max(size - 2, 0), merge, start)
  first = jnp.argmax(active)   # the lowest index of the two groups left
  return members & (labels != first)


def cfl(config: CflConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  num_slots = config.max_clusters

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    model = tree.first(context.params)
    server = CflServer(
        clusters=jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_slots,) + leaf.shape),
                              model),
        assignment=jnp.zeros((num_clients,), jnp.int32), used=jnp.ones((), jnp.int32),
        similarity=jnp.zeros((num_clients, num_clients), jnp.float32),
        round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=jnp.zeros((num_clients,)))

  def broadcast(server: CflServer, clients):
    del clients
    return tree.take(server.clusters, server.assignment)

  def client_update(client_state, start: Params, data, key):
    params, stats = trainer.train(start, data.train, key)
    return ClientOutput(state=client_state, upload=params, train=stats)

  def split(server: CflServer, updates: jax.Array, weights: jax.Array) -> CflServer:
    """The round's splits: every cluster in use that meets the criteria is divided, its
    second group moved to the next free slot, which starts from the cluster's model."""
    sampled = weights > 0
    pairs = sampled[:, None] & sampled[None, :]
    similarity = jnp.where(pairs, cosine_similarity(updates), server.similarity)
    mean_norm, max_norm = cluster_norms(updates, server.assignment, weights, num_slots)
    sizes = jnp.sum(jax.nn.one_hot(server.assignment, num_slots, dtype=jnp.int32), axis=0)
    due = ((jnp.arange(num_slots) < server.used) & (mean_norm < config.eps1)
           & (max_norm > config.eps2) & (sizes > config.min_cluster_size)
           & (server.round >= config.warmup_rounds))

    def one(c, state):
      clusters, assignment, count = state

      def divide(state):
        clusters, assignment, count = state
        second = bipartition(similarity, assignment == c, config.bipartition)
        clusters = jax.tree.map(lambda leaf: leaf.at[count].set(leaf[c]), clusters)
        return clusters, jnp.where(second, count, assignment), count + 1
      return jax.lax.cond(due[c] & (count < num_slots), divide, lambda s: s, state)

    clusters, assignment, count = jax.lax.fori_loop(
        0, num_slots, one, (server.clusters, server.assignment, server.used))
    return server._replace(clusters=clusters, assignment=assignment, used=count,
                           similarity=similarity)

  def aggregate(server: CflServer, clients, uploads: Params, weights: jax.Array):
    starts = tree.take(server.clusters, server.assignment)
    updates = flat(jax.tree.map(jnp.subtract, uploads, starts))
    updates = jnp.where((weights > 0)[:, None], updates, 0.0)
    server = split(server, updates, weights)
    return AlgorithmState(server=server._replace(
        clusters=weighted_group_means(uploads, server.assignment, server.clusters, weights),
        round=server.round + 1), clients=clients)

  def personalized_params(server: CflServer, clients):
    del clients
    return tree.take(server.clusters, server.assignment)

  return Algorithm(name="cfl", init=init, broadcast=broadcast, client_update=client_update,
                   aggregate=aggregate, personalized_params=personalized_params,
                   artifacts=lambda server: {"cluster": server.assignment})


def weighted_group_means(stacked, assignment: jax.Array, previous, weights: jax.Array):
  """Each group's weights-weighted mean of the models assigned to it; a group with no
  weight keeps `previous` [C, ...]."""
  one_hot = jax.nn.one_hot(assignment, tree.leading_size(previous), dtype=jnp.float32)
  one_hot = one_hot * weights[:, None]
  totals = jnp.sum(one_hot, axis=0)
  sums = tree.mix(one_hot.T, stacked)

  def mean_or_keep(total, old):
    count = totals.reshape((-1,) + (1,) * (old.ndim - 1))
    return jnp.where(count > 0, total / jnp.maximum(count, 1e-30), old).astype(old.dtype)
  return jax.tree.map(mean_or_keep, sums, previous)
