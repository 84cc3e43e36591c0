"""IFCA: the Iterative Federated Clustering Algorithm (model-averaging variant).

Ghosh, Chung, Yin, Ramchandran. "An Efficient Framework for Clustered Federated
Learning." NeurIPS 2020. https://arxiv.org/abs/2006.04088
(code: github.com/jichan3751/ifca, HEAD 61e44b8)

The server keeps C cluster models and sends all C to every client ([K, C, ...] messages);
client k picks the one of lowest training loss, trains it by its local SGD and sends it
back; the server sets each cluster model to the plain mean of those that chose it (one
nobody chose keeps its model). A client is scored with its chosen cluster's model.
IfcaConfig: num_clusters 12, init_draws 10 (restarts kept when every cluster is chosen by
max(1, min_share K) clients), min_share 0.0.

Departures: C = 12 chosen on validation for FEDORA's 36 angles (the paper's 4:
--ifca_num_clusters=4); clusters other than 0 are the initial model's entries shuffled
within each layer; no re-picking of a test cluster by test loss (that reads test labels).

Details (every option, the departures, measurements): docs/algorithms/ifca.md.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.data.client_data import FederatedData
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class IfcaConfig(NamedTuple):
  num_clusters: int = 12  # C; chosen on validation (docs/algorithms/ifca.md); the IFCA paper's 4
  init_draws: int = 10    # random initialisations to choose from (1: a single draw)
  min_share: float = 0.0  # a draw passes if every cluster is chosen by max(1, share K)


FLAG_HELP = {
    "num_clusters": "Number of cluster models C (the IFCA paper's rotated MNIST: 4)",
    "init_draws": "Random initialisations of the C models drawn at the start; the first"
                  " whose first assignment gives every cluster max(1, min_share * K)"
                  " clients is kept (the authors' find_good_initializer); 1: one draw",
    "min_share": "Share of the clients every cluster must win in the first assignment"
                 " for a draw to pass (the authors' CIFAR code: 0.1 with 4 clusters)"}


class IfcaServer(NamedTuple):
  clusters: object  # leaves [C, ...]: the cluster models


class IfcaClients(NamedTuple):
  cluster: jax.Array  # [K] int32: the cluster each client chose in the last round


def validate(config: IfcaConfig) -> IfcaConfig:
  if config.num_clusters < 1:
    raise FieldError("ifca", "num_clusters", f"must be >= 1, got {config.num_clusters}")
  if config.init_draws < 1:
    raise FieldError("ifca", "init_draws", f"must be >= 1, got {config.init_draws}")
  if not 0.0 <= config.min_share <= 1.0 / config.num_clusters:
    raise FieldError("ifca", "min_share", f"must be in [0, 1 / num_clusters], got"
                     f" {config.min_share}")
  return config


def choose_cluster(trainer: ClientTrainer, clusters, train_data) -> tuple[jax.Array, jax.Array]:
  """(argmin_j of the training loss of cluster model j [] int32, the C losses [C])."""
  losses = jax.vmap(lambda params: trainer.evaluate(params, train_data).loss)(clusters)
  return jnp.argmin(losses).astype(jnp.int32), losses


def first_choices(trainer: ClientTrainer, draws, data: FederatedData) -> jax.Array:
  """[K, D] int32: the cluster each client would choose from each draw [D, C, ...]."""
  num_draws = tree.leading_size(draws)
  choices = jnp.zeros((data.num_clients, num_draws), jnp.int32)
  for ids, bucket in zip(data.client_ids, data.buckets):  # a few size buckets
    train = jax.tree.map(lambda a, n=len(ids): a[:n], bucket.train)  # drop device padding
    # lax.map over the draws keeps one draw's [clients, C] evaluations in memory.
    chosen = jax.lax.map(lambda clusters, train=train: jax.vmap(
        lambda d: choose_cluster(trainer, clusters, d)[0])(train), draws)  # [D, n]
    choices = choices.at[ids].set(chosen.T)
  return choices


def pick_draw(choices: jax.Array, num_clusters: int, min_clients: int) -> jax.Array:
  """[] int32: the first draw whose every cluster has >= min_clients of the [K, D]
  `choices`; none passing, the draw whose least-chosen cluster has the most."""
  counts = jnp.sum(jax.nn.one_hot(choices, num_clusters, dtype=jnp.int32), axis=0)  # [D, C]
  smallest = jnp.min(counts, axis=1)
  passes = smallest >= min_clients
  return jnp.where(jnp.any(passes), jnp.argmax(passes), jnp.argmax(smallest)).astype(
      jnp.int32)


def ifca(config: IfcaConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    # Draw 0 is the single draw from context.key; the others from keys folded from it.
    keys = jnp.concatenate([context.key[None], jax.vmap(jax.random.fold_in, (None, 0))(
        context.key, jnp.arange(1, config.init_draws))])
    draws = jax.vmap(lambda key: tree.initial_centers(context.params, key,
                                                      config.num_clusters))(keys)  # [D, C, ...]
    if config.init_draws == 1 or config.num_clusters == 1:
      clusters = tree.first(draws)
    else:
      min_clients = max(1, math.ceil(config.min_share * num_clients - 1e-9))
      choices = first_choices(trainer, draws, context.data)
      clusters = tree.take(draws, pick_draw(choices, config.num_clusters, min_clients))
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
