"""IFCA: the Iterative Federated Clustering Algorithm (model-averaging variant).

Ghosh, Chung, Yin, Ramchandran. "An Efficient Framework for Clustered Federated
Learning." NeurIPS 2020. https://arxiv.org/abs/2006.04088

The server keeps C cluster models theta_1..theta_C. Every round (Algorithm 1):
  1. it sends all C models to every client;
  2. client k evaluates each on its own training data and picks
     j_k = argmin_j F_k(theta_j) (ties go to the lowest index);
  3. it runs its local SGD starting from theta_{j_k} and sends back the result;
  4. the server sets each theta_j to the plain mean of the models of the clients that
     chose j (the paper's model averaging: unweighted by sample counts); a cluster nobody
     chose keeps its model.
A client's personalized model is the (updated) model of the cluster it chose.

The paper starts the C models from independent random initialisations. We keep the run's
shared initial model as cluster 0 and draw the others by shuffling its entries within
each layer (tree.random_models: same i.i.d. distribution, no initialiser needed).
Messages are [K, C, ...]: every client really downloads all C models.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class IfcaConfig(NamedTuple):
  num_clusters: int = 4  # the paper's rotated MNIST: k = 4 rotations (0, 90, 180, 270)


class IfcaServer(NamedTuple):
  clusters: object  # leaves [C, ...]: the cluster models


class IfcaClients(NamedTuple):
  cluster: jax.Array  # [K] int32: the cluster each client chose in the last round


def validate(config: IfcaConfig) -> IfcaConfig:
  if config.num_clusters < 1:
    raise FieldError("ifca", "num_clusters", f"must be >= 1, got {config.num_clusters}")
  return config


def choose_cluster(trainer: ClientTrainer, clusters, train_data) -> tuple[jax.Array, jax.Array]:
  """(argmin_j of the training loss of cluster model j [] int32, the C losses [C])."""
  losses = jax.vmap(lambda params: trainer.evaluate(params, train_data).loss)(clusters)
  return jnp.argmin(losses).astype(jnp.int32), losses


def ifca(config: IfcaConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    clusters = tree.initial_centers(context.params, context.key, config.num_clusters)
    return AlgorithmState(server=IfcaServer(clusters=clusters),
                          clients=IfcaClients(cluster=jnp.zeros((num_clients,), jnp.int32)))

  def broadcast(server: IfcaServer, clients: IfcaClients):
    num_clients = clients.cluster.shape[0]
    return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_clients,) + leaf.shape),
                        server.clusters)

  def client_update(client_state, clusters, data, key):
    del client_state
    chosen, losses = choose_cluster(trainer, clusters, data.train)
    params, stats = trainer.train(tree.take(clusters, chosen), data.train, key)
    return ClientOutput(state=IfcaClients(cluster=chosen), upload=params, train=stats,
                        metrics={"cluster": chosen.astype(jnp.float32),
                                 "cluster_loss": losses[chosen]})

  def aggregate(server: IfcaServer, clients: IfcaClients, uploads, weights):
    # The paper's cluster average is unweighted, over the clients that took part.
    clusters = tree.group_means(uploads, clients.cluster, server.clusters,
                                       members=weights > 0)
    return AlgorithmState(server=IfcaServer(clusters=clusters), clients=clients)

  def personalized_params(server: IfcaServer, clients: IfcaClients):
    return tree.take(server.clusters, clients.cluster)

  return Algorithm(name="ifca", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
