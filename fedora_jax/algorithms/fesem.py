"""FeSEM: Federated Stochastic Expectation Maximization (multi-center federated learning).

Long, Xie, Shen, Zhou, Wang, Jiang. "Multi-center federated learning: clients clustering
for better personalization." World Wide Web 26, 2023 (arXiv 2020).
https://arxiv.org/abs/2005.01026  https://doi.org/10.1007/s11280-022-01046-x

Each round a client trains from its center; the server reassigns every client to the nearest
of num_clusters (4) centers by L2 (E-step) and sets each center to its clients' mean
(M-step); a client is scored with its center. init "kmeans" (default): warmup_rounds 10 of
local training, then k-means (kmeans_iterations 10) sets the centers; "random": the paper's.
m_step "mean" (default) or "uploaders" (the authors' code's).

Departures: the k-means start (the paper draws the centers at random); the M-step's plain
mean over every client's current model, stale ones included (the code: that round's trainers,
sample-weighted); the code's per-cluster sampling and periodic re-clustering are not offered.
Details (every option, the departures, measurements): docs/algorithms/fesem.md.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

INITS = ("kmeans", "random")
M_STEPS = ("mean", "uploaders")


class FesemConfig(NamedTuple):
  # C, the number of centers. The paper reports several values; 4 matches IFCA's rotated
  # MNIST (4 rotations) so the two clustering baselines compare at the same C.
  num_clusters: int = 4
  init: str = "kmeans"         # "kmeans": k-means on round 1's local models; "random": the paper's
  warmup_rounds: int = 10      # rounds of local training before the k-means (init="kmeans")
  kmeans_iterations: int = 10  # Lloyd steps of that k-means (init="kmeans")
  m_step: str = "mean"         # "mean": every client, unweighted; "uploaders": the code's


class FesemServer(NamedTuple):
  centers: object        # leaves [C, ...]: the cluster centers theta~
  warmup_left: jax.Array  # [] int32: local-training rounds left before k-means; 0 after


class FesemClients(NamedTuple):
  params: object      # leaves [K, ...]: each client's local model theta_k
  cluster: jax.Array  # [K] int32: r_k, the center each client is assigned to


def validate(config: FesemConfig) -> FesemConfig:
  if config.num_clusters < 1:
    raise FieldError("fesem", "num_clusters", f"must be >= 1, got {config.num_clusters}")
  if config.init not in INITS:
    raise FieldError("fesem", "init", f"must be kmeans or random, got {config.init!r}")
  if config.warmup_rounds < 1:
    raise FieldError("fesem", "warmup_rounds", f"must be >= 1, got {config.warmup_rounds}")
  if config.kmeans_iterations < 0:
    raise FieldError("fesem", "kmeans_iterations",
                     f"must be >= 0, got {config.kmeans_iterations}")
  if config.m_step not in M_STEPS:
    raise FieldError("fesem", "m_step", f"must be mean or uploaders, got {config.m_step!r}")
  return config


def e_step(client_params, centers) -> jax.Array:
  """[K] int32: each client's nearest center by L2 distance (ties to the lowest index)."""
  return jnp.argmin(tree.squared_distances(client_params, centers), axis=1).astype(
      jnp.int32)


def m_step(client_params, assignment: jax.Array, centers, weights: jax.Array | None = None):
  """Each center becomes the mean of its assigned clients' models, weighted by [K]
  `weights` where given (a center whose clients all weigh 0 keeps its value)."""
  return tree.group_means(client_params, assignment, centers, weights)


def farthest_first_seeds(pairwise: jax.Array, num: int) -> jax.Array:
  """[num] int32 model indices: the model farthest from all others, then each next seed
  the model farthest from the seeds so far (by squared L2, [K, K] `pairwise`)."""
  seeds = [jnp.argmax(jnp.sum(pairwise, axis=1))]
  nearest_seed = pairwise[seeds[0]]
  for _ in range(1, num):  # C is small and static
    seeds.append(jnp.argmax(nearest_seed))
    nearest_seed = jnp.minimum(nearest_seed, pairwise[seeds[-1]])
  return jnp.stack(seeds).astype(jnp.int32)


def kmeans(client_params, num_clusters: int, iterations: int):
  """(centers [C, ...], assignment [K]): Lloyd's k-means from farthest-first seeds."""
  seeds = farthest_first_seeds(tree.pairwise_squared_distances(client_params),
                               num_clusters)
  centers = tree.take(client_params, seeds)
  centers = jax.lax.fori_loop(
      0, iterations,
      lambda _, c: m_step(client_params, e_step(client_params, c), c), centers)
  return centers, e_step(client_params, centers)


def fesem(config: FesemConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    if config.init == "kmeans":
      # Every client trains its own model from the shared one first; k-means follows.
      centers = tree.take(context.params, jnp.zeros((config.num_clusters,), jnp.int32))
      server = FesemServer(centers=centers,
                           warmup_left=jnp.asarray(config.warmup_rounds, jnp.int32))
      assignment = jnp.zeros((num_clients,), jnp.int32)
    else:
      center_key, assign_key = jax.random.split(context.key)
      centers = tree.initial_centers(context.params, center_key, config.num_clusters)
      server = FesemServer(centers=centers, warmup_left=jnp.asarray(0, jnp.int32))
      assignment = jax.random.randint(assign_key, (num_clients,), 0, config.num_clusters,
                                      jnp.int32)
    return AlgorithmState(server=server,
                          clients=FesemClients(params=context.params, cluster=assignment))

  def own_or_center(server: FesemServer, clients: FesemClients):
    """The client's own model while warming up, its center afterwards."""
    centers = tree.take(server.centers, clients.cluster)
    return jax.tree.map(lambda own, center: jnp.where(server.warmup_left > 0, own, center),
                        clients.params, centers)

  def client_update(client_state: FesemClients, center, data, key):
    params, stats = trainer.train(center, data.train, key)
    return ClientOutput(state=client_state._replace(params=params), upload=(), train=stats)

  def aggregate(server: FesemServer, clients: FesemClients, uploads, weights):
    del uploads  # the models are read from the client state
    # "mean": plain, over every client; "uploaders": the round's, by their weights.
    center_weights = weights if config.m_step == "uploaders" else None

    def em(params):
      assignment = e_step(params, server.centers)
      return m_step(params, assignment, server.centers, center_weights), assignment

    def cluster(params):
      return kmeans(params, config.num_clusters, config.kmeans_iterations)

    def keep(params):
      del params
      return server.centers, clients.cluster

    # warmup_left 0: E/M; 1: this round's models are the last local ones, k-means; >1: wait.
    centers, assignment = jax.lax.switch(jnp.minimum(server.warmup_left, 2),
                                         [em, cluster, keep], clients.params)
    warmup_left = jnp.maximum(server.warmup_left - 1, 0)
    return AlgorithmState(server=FesemServer(centers=centers, warmup_left=warmup_left),
                          clients=clients._replace(cluster=assignment))

  return Algorithm(name="fesem", init=init, broadcast=own_or_center,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=own_or_center,
                   # The E/M steps read the uploaded models.
                   state_upload=lambda clients: clients.params)
