"""FedFomo: personalized federated learning with first-order model optimization.

Zhang, Sapra, Fidler, Yeung, Alvarez. "Personalized Federated Learning with First Order
Model Optimization." ICLR 2021. https://arxiv.org/abs/2012.08565

Each round the server sends client i the models of num_models (M = 5) other clients, chosen
epsilon-greedily by its affinity row P[i] (epsilon 0.3, less epsilon_decay 0.05 a round);
client i weighs each by its first-order benefit on its validation data, moves its model by the
weighted differences, trains locally and returns the weights, which the server adds to P[i].
A client is scored with its own model.

Departures: the epsilon schedule is our reading of the paper; validation on the client's own
split; PFLlib's form (candidates, baseline, validation, affinity_update, distance_eps) and the
official code's (sampling, pool) are options.
Details (every option, the departures, measurements): docs/algorithms/fedfomo.md.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError


class FedFomoConfig(NamedTuple):
  num_models: int = 5          # M, models downloaded per client per round
  epsilon: float = 0.3         # initial probability of downloading M random models
  epsilon_decay: float = 0.05  # subtracted from epsilon after every round
  candidates: str = "others"   # self: P starts as the identity, own model a candidate
  baseline: str = "current"    # previous: weights against the model last round started from
  validation: str = "split"    # train_tail: the last 20 % of the training data validates
  affinity_update: str = "normalized"  # raw: P adds the signed, unnormalised weights
  distance_eps: float = 0.0    # added to ||theta_n - theta_i|| (PFLlib: 1e-5)
  sampling: str = "client"     # slot: explore or exploit drawn per download slot
  pool: str = "all"            # uploaders / uploader_count: last round's uploaders


CHOICES = {"candidates": ("others", "self"), "baseline": ("current", "previous"),
           "validation": ("split", "train_tail"), "affinity_update": ("normalized", "raw"),
           "sampling": ("client", "slot"), "pool": ("all", "uploaders", "uploader_count")}


class FedFomoServer(NamedTuple):
  affinity: jax.Array  # [K, K] float32: P[i, n], sum of the weights client i gave n
  round: jax.Array     # [] int32: rounds aggregated so far (epsilon schedule, sampling)
  key: jax.Array       # [2] uint32: raw PRNG key of the server's sampling
  uploaded: jax.Array | None = None  # [K] bool: last round's uploaders (set by init)


class FomoClient(NamedTuple):
  """A client's state under baseline=previous."""
  params: object    # its model
  previous: object  # the model its last training started from (after the federated update)


class FomoMessage(NamedTuple):
  models: object   # leaves [K, M, ...]: the models sent to each client
  ids: jax.Array   # [K, M] int32: whose models they are (-1: an empty slot)


class FomoUpload(NamedTuple):
  ids: jax.Array      # [K, M] int32
  weights: jax.Array  # [K, M] float32: what P adds (normalised w_n, or raw ones)


def validate(config: FedFomoConfig) -> FedFomoConfig:
  if config.num_models < 1:
    raise FieldError("fedfomo", "num_models", f"must be >= 1, got {config.num_models}")
  if not 0.0 <= config.epsilon <= 1.0:
    raise FieldError("fedfomo", "epsilon", f"must be in [0, 1], got {config.epsilon}")
  if config.epsilon_decay < 0:
    raise FieldError("fedfomo", "epsilon_decay", f"must be >= 0, got {config.epsilon_decay}")
  for field, allowed in CHOICES.items():
    if getattr(config, field) not in allowed:
      raise FieldError("fedfomo", field,
                       f"must be one of {', '.join(allowed)}, got {getattr(config, field)!r}")
  if config.distance_eps < 0:
    raise FieldError("fedfomo", "distance_eps", f"must be >= 0, got {config.distance_eps}")
  return config


def selection_keys(server_key: jax.Array, round_index: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(explore key, tie-break noise key) of a round's selection, from the server's raw
  key (the verification harness breaks PFLlib's ties with the same noise)."""
  key = jax.random.fold_in(jax.random.wrap_key_data(server_key), round_index)
  explore_key, noise_key = jax.random.split(key)
  return explore_key, noise_key


def pick_slots(greedy_order: jax.Array, random_order: jax.Array, explore: jax.Array,
               allowed: jax.Array, count: jax.Array) -> jax.Array:
  """One client's [M] ids: slot s takes the first client not chosen yet of the random
  order where explore[s], else of the greedy order (the official get_federating_clients'
  pops); -1 where that client is not `allowed` ([K] bool) or s >= count."""
  def slot(chosen, inputs):
    index, exploring = inputs
    order = jnp.where(exploring, random_order, greedy_order)
    pick = order[jnp.argmax(~chosen[order])]
    ok = allowed[pick] & (index < count)
    return chosen.at[pick].set(True), jnp.where(ok, pick, -1)
  num_slots = explore.shape[0]
  _, ids = jax.lax.scan(slot, jnp.zeros(greedy_order.shape, bool),
                        (jnp.arange(num_slots), explore))
  return ids.astype(jnp.int32)


def select_models(affinity: jax.Array, key: jax.Array | tuple[jax.Array, jax.Array],
                  num_models: int,
                  epsilon: jax.Array, include_self: bool = False, per_slot: bool = False,
                  allowed: jax.Array | None = None,
                  count: jax.Array | None = None) -> jax.Array:
  """[K, M] ids of other clients (and the client itself with `include_self`): top
  affinity, or random with probability epsilon, drawn once a client (all M slots) or
  once a slot (`per_slot`); only `allowed` ones ([K, K] bool; -1 in the slots left over),
  at most `count` ([] int) a client.

  Ties in affinity (all of them before any weight is known) are broken at random, so
  the greedy choice does not always fall on the lowest ids. `key`: selection_keys'.
  """
  num_clients = affinity.shape[0]
  explore_key, noise_key = key if isinstance(key, tuple) else jax.random.split(key)
  noise = jax.random.uniform(noise_key, affinity.shape)
  candidate = ~jnp.eye(num_clients, dtype=bool) | include_self
  if allowed is not None:
    candidate = candidate & allowed
  # Greedy: sort by affinity (descending), then by noise; non-candidates sort last.
  greedy_rank = jax.vmap(lambda a, n, ok: jnp.lexsort((n, jnp.where(ok, -a, jnp.inf))))(
      affinity, noise, candidate)
  # The official code shuffles apart from its tie-break; one noise serves both per client.
  shuffle = (jax.random.uniform(jax.random.fold_in(noise_key, 1), affinity.shape)
             if per_slot else noise)
  random_rank = jnp.argsort(jnp.where(candidate, shuffle, 2.0), axis=1)
  if not per_slot and allowed is None and count is None:
    explore = jax.random.uniform(explore_key, (num_clients, 1)) < epsilon
    return jnp.where(explore, random_rank, greedy_rank)[:, :num_models].astype(jnp.int32)
  draws = (num_clients, num_models) if per_slot else (num_clients, 1)
  explore = jnp.broadcast_to(jax.random.uniform(explore_key, draws) < epsilon,
                             (num_clients, num_models))
  count = jnp.asarray(num_models if count is None else count)
  return jax.vmap(pick_slots, in_axes=(0, 0, 0, 0, None))(
      greedy_rank, random_rank, explore, candidate, count)


def signed_weights(val_loss_own: jax.Array, val_loss_others: jax.Array,
                   distances: jax.Array, distance_eps: float = 0.0) -> jax.Array:
  """[M] (L_i - L_n) / (||theta_n - theta_i|| + eps), signed; 0 where that is 0/0."""
  denominator = distances + distance_eps
  safe = jnp.where(denominator > 0, denominator, 1.0)
  return jnp.where(denominator > 0, (val_loss_own - val_loss_others) / safe, 0.0)


def normalized_weights(raw: jax.Array) -> jax.Array:
  """[M] max(0, raw) normalised to sum to 1; zeros if none helps."""
  positive = jnp.maximum(0.0, raw)
  total = jnp.sum(positive)
  return jnp.where(total > 0, positive / jnp.where(total > 0, total, 1.0), 0.0)


def first_order_weights(val_loss_own: jax.Array, val_loss_others: jax.Array,
                        distances: jax.Array, distance_eps: float = 0.0) -> jax.Array:
  """[M] normalised w_n = max(0, (L_i - L_n) / ||theta_n - theta_i||); zeros if none helps."""
  return normalized_weights(signed_weights(val_loss_own, val_loss_others, distances,
                                           distance_eps))


def train_tail(data: ClientData) -> tuple[ClientData, ClientData]:
  """(training, validation): PFLlib's split of one client's training data, its last
  int(0.2 n) = n // 5 real samples validating (padding sits after them)."""
  held = data.n // 5
  kept = data.n - held
  position = jnp.arange(data.mask.shape[0])
  return (data._replace(mask=data.mask & (position < kept), n=kept),
          data._replace(mask=data.mask & (position >= kept), n=held))


def federated_update(params, models, weights: jax.Array):
  """theta_i + sum_n w_n (theta_n - theta_i), models with leaves [M, ...]."""
  return jax.tree.map(
      lambda own, others: own + jnp.tensordot(weights, others - own[None], axes=(0, 0)),
      params, models)


def raw_key(key: jax.Array) -> jax.Array:
  """The uint32 data of a PRNG key (typed or legacy), storable in a checkpoint."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  return key


def fedfomo(config: FedFomoConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  with_self = config.candidates == "self"
  keeps_previous = config.baseline == "previous"

  def models_of(clients):
    return clients.params if keeps_previous else clients

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    if num_clients < 2:
      raise ConfigError("fedfomo needs at least 2 clients")
    # PFLlib's P starts as the identity: a client ranks its own model first.
    affinity = (jnp.eye(num_clients, dtype=jnp.float32) if with_self
                else jnp.zeros((num_clients, num_clients), jnp.float32))
    server = FedFomoServer(affinity=affinity, round=jnp.zeros((), jnp.int32),
                           key=raw_key(context.key),
                           uploaded=jnp.zeros((num_clients,), bool))
    clients = (FomoClient(params=context.params, previous=context.params)
               if keeps_previous else context.params)
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: FedFomoServer, client_params):
    num_clients = server.affinity.shape[0]
    epsilon = jnp.maximum(0.0, config.epsilon - config.epsilon_decay * server.round)
    keys = selection_keys(server.key, server.round)
    candidates = num_clients if with_self else num_clients - 1
    allowed, count = None, None
    if config.pool != "all":
      uploaded = (jnp.ones((num_clients,), bool) if server.uploaded is None
                  else server.uploaded)
      count = jnp.sum(uploaded)
      if config.pool == "uploaders":  # the client's own model stays a candidate (self)
        allowed = uploaded[None, :] | jnp.eye(num_clients, dtype=bool)
    ids = select_models(server.affinity, keys, min(config.num_models, candidates), epsilon,
                        include_self=with_self, per_slot=config.sampling == "slot",
                        allowed=allowed, count=None if config.pool == "uploaders" else count)
    return FomoMessage(models=tree.take(models_of(client_params), jnp.maximum(ids, 0)),
                       ids=ids)

  def client_update(state, message: FomoMessage, data, key):
    params = models_of(state)
    baseline = state.previous if keeps_previous else params
    train_data, val_data = (train_tail(data.train) if config.validation == "train_tail"
                            else (data.train, data.val))
    val_loss_own = trainer.evaluate(baseline, val_data).loss
    val_loss_others = jax.vmap(lambda p: trainer.evaluate(p, val_data).loss)(message.models)
    single = jax.tree.map(lambda leaf: leaf[None], baseline)
    distances = jnp.sqrt(tree.squared_distances(single, message.models)[0])
    raw = signed_weights(val_loss_own, val_loss_others, distances, config.distance_eps)
    raw = jnp.where(message.ids >= 0, raw, 0.0)  # an empty slot weighs nothing
    weights = normalized_weights(raw)
    params = federated_update(params, message.models, weights)
    trained, stats = trainer.train(params, train_data, key)
    new_state = FomoClient(params=trained, previous=params) if keeps_previous else trained
    added = raw if config.affinity_update == "raw" else weights
    return ClientOutput(state=new_state, upload=FomoUpload(ids=message.ids, weights=added),
                        train=stats, metrics={"models_used": jnp.sum(weights > 0).astype(
                            jnp.float32)})

  def aggregate(server: FedFomoServer, client_params, uploads: FomoUpload, weights):
    rows = jnp.arange(uploads.ids.shape[0])[:, None]
    # Empty slots (-1) add their weight 0 to column 0.
    affinity = server.affinity.at[rows, jnp.maximum(uploads.ids, 0)].add(uploads.weights)
    return AlgorithmState(server=server._replace(affinity=affinity, round=server.round + 1,
                                                 uploaded=weights > 0),
                          clients=client_params)

  return Algorithm(name="fedfomo", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: models_of(clients),
                   artifacts=lambda server: {"affinity": server.affinity},
                   # The models the server sends others are the clients' own, uploaded.
                   state_upload=models_of)
