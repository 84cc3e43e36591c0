"""pFedSim: FedAvg for a warm-up, then each client's feature extractor is a mixture of the
clients' extractors weighted by how alike their classifiers are; classifiers stay
personal.

Tan, Zhou, Liu, Wang, Yu. "pFedSim: Similarity-Aware Model Aggregation Towards
Personalized Federated Learning." arXiv 2023. https://arxiv.org/abs/2305.15706
(code followed: FL-bench's src/server/pfedsim.py, KarhouTam/FL-bench, GPL: read, not run
or copied. The paper's full text is not on disk, so this module follows that code and
names no equation numbers. PFLlib has no pFedSim, so there is no verification row: the
unit tests check the core step by hand.)

FedAvg for warmup (0.5 of the run's rounds); then client i receives the mean of every client's
stored body weighted by a_ij = -log(1 - s_ij), s_ij the classifiers' mean class-wise cosine,
with its own classifier, trains the whole model and is scored with it.

Departure: s_ij is capped at 0.9999 so identical classifiers weigh -log(1e-4), not infinity.
Details (every option, the departures, measurements): docs/algorithms/pfedsim.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import head_layer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

Params = Any
SELF_SIMILARITY = 0.9999  # the code's weight of a client's own model, before -log(1 - .)
COSINE_EPS = 1e-8         # torch.cosine_similarity's floor on a norm


class PfedSimConfig(NamedTuple):
  warmup: float = 0.5   # FedAvg rounds: a fraction of `rounds` in [0, 1], or a count > 1
  rounds: int = 100     # the run's rounds (a train field)


FLAG_HELP = {
    "warmup": "pFedSim: FedAvg warm-up before the similarity-weighted aggregation, a"
              " fraction of the rounds in [0, 1] or a number of rounds > 1",
}


class SimServer(NamedTuple):
  model: Params            # the global model (FedAvg's, frozen after the warm-up)
  round: jax.Array         # [] int32 t, rounds aggregated so far
  similarity: jax.Array    # [K, K] s_ij, 1 on the diagonal


def warmup_rounds(config: Any, owner: str = "pfedsim") -> int:
  """T_w: int(warmup * rounds) for a warmup in [0, 1], else int(warmup) (< rounds), from
  a config with `warmup` and `rounds` (pFedSim's; FedAP's f-FedAP warm-up takes it too)."""
  if config.rounds < 1:
    raise FieldError(owner, "rounds", f"must be >= 1, got {config.rounds}")
  if 0 <= config.warmup <= 1:
    return int(config.warmup * config.rounds)
  if 1 < config.warmup < config.rounds:
    return int(config.warmup)
  raise FieldError(owner, "warmup", f"must be in [0, 1] or in (1, rounds ="
                   f" {config.rounds}), got {config.warmup}")


def classifier_similarity(kernels: jax.Array) -> jax.Array:
  """[K, K] max(0, mean_c cos(W_i[:, c], W_j[:, c])) of classifier kernels [K, F, C]."""
  norms = jnp.maximum(jnp.linalg.norm(kernels, axis=1), COSINE_EPS)   # [K, C]
  units = kernels / norms[:, None, :]
  cosines = jnp.einsum("ifc,jfc->ijc", units, units)
  return jnp.maximum(jnp.mean(cosines, axis=-1), 0.0)


def aggregation_weights(similarity: jax.Array) -> jax.Array:
  """[K, K] rows a_ij / sum_j a_ij with a_ij = -log(1 - s_ij), s_ii = 0.9999."""
  capped = jnp.clip(similarity, 0.0, SELF_SIMILARITY)
  capped = jnp.where(jnp.eye(similarity.shape[0], dtype=bool), SELF_SIMILARITY, capped)
  weights = -jnp.log1p(-capped)
  return weights / jnp.sum(weights, axis=1, keepdims=True)


def update_similarity(similarity: jax.Array, kernels: jax.Array,
                      sampled: jax.Array) -> jax.Array:
  """s_ij measured anew for each pair i != j of the round's clients, kept for the rest."""
  pairs = sampled[:, None] & sampled[None, :] & ~jnp.eye(sampled.shape[0], dtype=bool)
  return jnp.where(pairs, classifier_similarity(kernels), similarity)


def personalized_models(models: Params, weights: jax.Array, head: str) -> Params:
  """Every client's body mixed by `weights` [K, K], its own classifier `head` kept."""
  mixed = tree.mix(weights, models)
  mixed["params"] = {**mixed["params"], head: models["params"][head]}
  return mixed


def pfedsim(config: PfedSimConfig, trainer: ClientTrainer) -> Algorithm:
  warmup = warmup_rounds(config)

  def init(context: InitContext) -> AlgorithmState:
    head_layer(context.params, "pfedsim")  # a Dense classifier on top, or a one-line error
    num_clients = tree.leading_size(context.params)
    server = SimServer(model=tree.first(context.params), round=jnp.zeros((), jnp.int32),
                       similarity=jnp.eye(num_clients, dtype=jnp.float32))
    return AlgorithmState(server=server, clients=context.params)

  def broadcast(server: SimServer, clients: Params):
    num_clients = tree.leading_size(clients)
    personal = personalized_models(dict(clients), aggregation_weights(server.similarity),
                                   head_layer(clients, "pfedsim"))
    warm = server.round < warmup
    return jax.tree.map(lambda p, g: jnp.where(warm, jnp.broadcast_to(g, p.shape), p),
                        personal, tree.broadcast_to_clients(server.model, num_clients))

  def client_update(client: Params, start: Params, data, key):
    del client
    params, stats = trainer.train(start, data.train, key)
    return ClientOutput(state=params, upload=params, train=stats)

  def aggregate(server: SimServer, clients: Params, uploads: Params, weights):
    warm = server.round < warmup
    num_clients = tree.leading_size(clients)
    model = jax.tree.map(lambda new, old: jnp.where(warm, new, old),
                         tree.weighted_mean(uploads, weights), server.model)
    kernels = uploads["params"][head_layer(uploads, "pfedsim")]["kernel"]
    similarity = jnp.where(warm, server.similarity,
                           update_similarity(server.similarity, kernels, weights > 0))
    # During the warm-up every client's stored model is the global one (the code's
    # personal models are set to it when the warm-up ends).
    clients = jax.tree.map(lambda c, g: jnp.where(warm, jnp.broadcast_to(g, c.shape), c),
                           clients, tree.broadcast_to_clients(model, num_clients))
    return AlgorithmState(server=SimServer(model, server.round + 1, similarity),
                          clients=clients)

  def personalized_params(server: SimServer, clients: Params):
    del server
    return clients

  return Algorithm(name="pfedsim", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
