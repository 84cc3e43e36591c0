"""FeSEM: Federated Stochastic Expectation Maximization (multi-center federated learning).

Long, Xie, Shen, Zhou, Wang, Jiang. "Multi-center federated learning: clients clustering
for better personalization." World Wide Web 26, 2023 (arXiv 2020).
https://arxiv.org/abs/2005.01026  https://doi.org/10.1007/s11280-022-01046-x

FeSEM minimises sum_k min_c ||theta_k - theta~_c||^2 (plus the clients' losses) over the
client models theta_k and C centers theta~_c by alternating, every round:
  E-step  assign each client to its nearest center by the L2 distance between its local
          model and the centers, r_k = argmin_c ||theta_k - theta~_c||^2;
  M-step  set each center to the mean of its clients' models (a center with no client
          keeps its value);
  local   send each client its center; the client trains from it on its own data.
In this engine's round the local step comes first and E/M close the round (the same
cycle): broadcast sends theta~_{r_k}, the client trains from it, and aggregate runs
the E-step on the freshly trained models and the M-step. A client's personalized model
is its center.

Initialisation. The paper draws the centers at random. Cluster 0 is the run's shared
initial model and the others are random re-draws of it (tree.random_models).
The first assignment is uniformly random: every client starts from the same model, so
an E-step on it would put all clients in one cluster.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class FesemConfig(NamedTuple):
  # C, the number of centers. The paper reports several values; 4 matches IFCA's rotated
  # MNIST (4 rotations) so the two clustering baselines compare at the same C.
  num_clusters: int = 4


class FesemServer(NamedTuple):
  centers: object  # leaves [C, ...]: the cluster centers theta~


class FesemClients(NamedTuple):
  params: object      # leaves [K, ...]: each client's local model theta_k
  cluster: jax.Array  # [K] int32: r_k, the center each client is assigned to


def validate(config: FesemConfig) -> FesemConfig:
  if config.num_clusters < 1:
    raise FieldError("fesem", "num_clusters", f"must be >= 1, got {config.num_clusters}")
  return config


def e_step(client_params, centers) -> jax.Array:
  """[K] int32: each client's nearest center by L2 distance (ties to the lowest index)."""
  return jnp.argmin(tree.squared_distances(client_params, centers), axis=1).astype(
      jnp.int32)


def m_step(client_params, assignment: jax.Array, centers):
  """Each center becomes the mean of its assigned clients' models."""
  return tree.group_means(client_params, assignment, centers)


def fesem(config: FesemConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    center_key, assign_key = jax.random.split(context.key)
    centers = tree.initial_centers(context.params, center_key, config.num_clusters)
    assignment = jax.random.randint(assign_key, (num_clients,), 0, config.num_clusters,
                                    jnp.int32)
    return AlgorithmState(server=FesemServer(centers=centers),
                          clients=FesemClients(params=context.params, cluster=assignment))

  def broadcast(server: FesemServer, clients: FesemClients):
    return tree.take(server.centers, clients.cluster)

  def client_update(client_state: FesemClients, center, data, key):
    params, stats = trainer.train(center, data.train, key)
    return ClientOutput(state=client_state._replace(params=params), upload=(), train=stats)

  def aggregate(server: FesemServer, clients: FesemClients, uploads, weights):
    del uploads, weights  # the models are read from the client state; the mean is plain
    assignment = e_step(clients.params, server.centers)
    centers = m_step(clients.params, assignment, server.centers)
    return AlgorithmState(server=FesemServer(centers=centers),
                          clients=clients._replace(cluster=assignment))

  def personalized_params(server: FesemServer, clients: FesemClients):
    return tree.take(server.centers, clients.cluster)

  return Algorithm(name="fesem", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
