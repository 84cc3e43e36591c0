"""FedCross: the server keeps as many middleware models as a round samples clients, deals
them out among the sampled clients, and cross-aggregates each trained one with one
collaborator; the global model is generated from them.

Hu, Zhou, Zhang, Yu, Chen, Wei. "FedCross: Towards Accurate Federated Learning via
Multi-Model Cross-Aggregation." ICDE 2024. https://arxiv.org/abs/2210.08285
(code: PFLlib's servercross.py / clientcross.py, which the verification runs beside
this module. The paper's full text is not on disk: its Algorithm 1 as this module reads
it.)

Each round the M sampled clients each train one middleware model w_i; each trained v_i is
mixed with a collaborator's, w_i = alpha v_i + (1 - alpha) v_co(i) (alpha 0.99; collaborator
"lowest" similarity by default, "highest" or "in_order"; similarity "model" or "layers"). Every
client is scored with the global model, the mean of the w_i (global_model "middleware";
"uploads": PFLlib's); in the first first_stage_bound (0) rounds the w_i restart from it.

Departures: similarity ties go to the lower slot; "highest" never picks the slot itself.
Details (every option, the departures, measurements): docs/algorithms/fedcross.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.layers import layer_names, take_layers
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of, traced

Params = Any
COLLABORATORS = ("lowest", "highest", "in_order")
SIMILARITIES = ("model", "layers")
GLOBAL_MODELS = ("middleware", "uploads")
COSINE_EPSILON = 1e-8  # torch.nn.functional.cosine_similarity's


class FedCrossConfig(NamedTuple):
  alpha: float = 0.99                # the trained model's share in its cross-aggregation
  collaborator: str = "lowest"       # lowest | highest similarity, or in_order
  similarity: str = "model"          # cosine of whole models, or PFLlib's per-layer sum
  global_model: str = "middleware"   # mean of the middleware models, or PFLlib's uploads
  first_stage_bound: int = 0         # rounds in which the middleware models restart


FLAG_HELP = {
    "alpha": "FedCross: weight alpha of the trained middleware model in its"
             " cross-aggregation with its collaborator (1 - alpha)",
    "collaborator": "FedCross: the collaborator of each middleware model: the trained"
                    " model least (lowest) or most (highest) similar to it, or the next"
                    " in a rotating order (in_order)",
    "similarity": "FedCross: cosine of the models' parameters (model) or PFLlib's sum of"
                  " per-layer cosines, the last layer twice (layers)",
    "global_model": "FedCross: the global model as the mean of the cross-aggregated"
                    " middleware models (middleware) or as PFLlib's sample-weighted mean"
                    " of the round's trained models (uploads)",
    "first_stage_bound": "FedCross: rounds at the start in which every middleware model"
                         " restarts from the global model",
}


class CrossServer(NamedTuple):
  models: Params        # [K, ...] middleware slots; a round deals out the first M
  global_model: Params
  key: jax.Array        # raw key data of the deals
  round: jax.Array      # [] int32


class CrossMessage(NamedTuple):
  model: Params         # the middleware model dealt to the client
  slot: jax.Array       # [] int32 its slot
  dealt: jax.Array      # [] int32 M, the slots dealt this round


def validate(config: FedCrossConfig) -> FedCrossConfig:
  if not traced(config.alpha) and not 0.0 <= config.alpha <= 1.0:
    raise FieldError("fedcross", "alpha", f"must be in [0, 1], got {config.alpha}")
  if config.first_stage_bound < 0:
    raise FieldError("fedcross", "first_stage_bound",
                     f"must be >= 0, got {config.first_stage_bound}")
  check_one_of("fedcross", config, "collaborator", COLLABORATORS)
  check_one_of("fedcross", config, "similarity", SIMILARITIES)
  check_one_of("fedcross", config, "global_model", GLOBAL_MODELS)
  return config


def deal_slots(key: jax.Array, sampled: jax.Array) -> jax.Array:
  """[K] int32 slot of each client: the M sampled clients a random order of 0..M-1, the
  others M..K-1."""
  ranks = jax.random.uniform(key, sampled.shape)
  order = jnp.argsort(jnp.where(sampled, ranks, 2.0 + ranks))
  return jnp.argsort(order).astype(jnp.int32)


def round_slots(server_key: jax.Array, round_index, sampled: jax.Array) -> jax.Array:
  """The slots of round `round_index` from the server's raw key (the verification reads
  them too)."""
  return deal_slots(jax.random.fold_in(jax.random.wrap_key_data(server_key), round_index),
                    sampled)


def cosines(models: Params) -> jax.Array:
  """[N, N] cosine similarity of the models' parameters."""
  inner = tree.gram(models)
  norms = jnp.sqrt(jnp.maximum(jnp.diag(inner), 0.0))
  return inner / jnp.maximum(norms[:, None] * norms[None, :], COSINE_EPSILON)


def similarities(models: Params, kind: str) -> jax.Array:
  """[N, N] similarity of the middleware models: `kind` "model" or "layers"."""
  if kind == "model":
    return cosines(models)
  names = layer_names(models)
  per_layer = [cosines(take_layers(models, [name])) for name in names]
  return sum(per_layer) + per_layer[-1]


def collaborators(similarity: jax.Array, dealt: jax.Array, round_index: jax.Array,
                  kind: str) -> jax.Array:
  """[N] int32 the collaborator of each slot among the first `dealt`; a slot itself where
  it is the only one (and for the slots past `dealt`, which are not used)."""
  size = similarity.shape[0]
  slots = jnp.arange(size)
  if kind == "in_order":
    offset = round_index % jnp.maximum(dealt - 1, 1) + 1
    chosen = (slots + offset) % jnp.maximum(dealt, 1)
  else:
    candidate = (slots[None, :] < dealt) & (slots[None, :] != slots[:, None])
    if kind == "lowest":
      chosen = jnp.argmin(jnp.where(candidate, similarity, jnp.inf), axis=1)
    else:
      chosen = jnp.argmax(jnp.where(candidate, similarity, -jnp.inf), axis=1)
  alone = (dealt <= 1) | (slots >= dealt)
  return jnp.where(alone, slots, chosen).astype(jnp.int32)


def cross_aggregate(trained: Params, partners: jax.Array, alpha) -> Params:
  """w_i = alpha v_i + (1 - alpha) v_partners[i], for every slot."""
  return jax.tree.map(lambda v: alpha * v + (1.0 - alpha) * v[partners], trained)


def fedcross(config: FedCrossConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    server = CrossServer(models=context.params, global_model=tree.first(context.params),
                         key=raw_key(context.key), round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=jnp.zeros((num_clients,)))

  def sampled_broadcast(server: CrossServer, clients, sampled):
    slots = round_slots(server.key, server.round, sampled)
    dealt = jnp.sum(sampled).astype(jnp.int32)
    return CrossMessage(model=tree.take(server.models, slots), slot=slots,
                        dealt=jnp.broadcast_to(dealt, slots.shape))

  def broadcast(server: CrossServer, clients):
    return sampled_broadcast(server, clients, jnp.ones(tree.leading_size(clients), bool))

  def client_update(client_state, message: CrossMessage, data, key):
    params, stats = trainer.train(message.model, data.train, key)
    return ClientOutput(state=client_state, upload=message._replace(model=params),
                        train=stats)

  def aggregate(server: CrossServer, clients, uploads: CrossMessage, weights):
    arrived = weights > 0
    size = tree.leading_size(server.models)
    dealt = jnp.max(jnp.where(arrived, uploads.dealt, 0))
    index = jnp.where(arrived, uploads.slot, size)  # the others write nowhere
    trained = jax.tree.map(lambda old, new: old.at[index].set(new, mode="drop"),
                           server.models, uploads.model)
    valid = jnp.arange(size) < dealt
    partners = collaborators(similarities(trained, config.similarity), dealt, server.round,
                             config.collaborator)
    crossed = cross_aggregate(trained, partners, config.alpha)
    first_stage = server.round < config.first_stage_bound
    slot_weights = valid.astype(jnp.float32)
    if config.global_model == "uploads":
      generated = tree.weighted_mean(uploads.model, weights)
    else:
      generated = tree.weighted_mean(optax.tree_utils.tree_where(first_stage, trained, crossed), slot_weights)
    restarted = tree.broadcast_to_clients(generated, size)
    renewed = optax.tree_utils.tree_where(first_stage, restarted, crossed)
    models = jax.tree.map(
        lambda new, old: jnp.where(valid.reshape((-1,) + (1,) * (old.ndim - 1)), new, old),
        renewed, trained)
    server = CrossServer(models=models, global_model=generated, key=server.key,
                         round=server.round + 1)
    return AlgorithmState(server=server, clients=clients)

  def personalized_params(server: CrossServer, clients):
    return tree.broadcast_to_clients(server.global_model, tree.leading_size(clients))

  return Algorithm(name="fedcross", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.global_model,
                   uploads_unordered=True, sampled_broadcast=sampled_broadcast)
