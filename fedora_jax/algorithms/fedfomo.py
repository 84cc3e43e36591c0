"""FedFomo: personalized federated learning with first-order model optimization.

Zhang, Sapra, Fidler, Yeung, Alvarez. "Personalized Federated Learning with First Order
Model Optimization." ICLR 2021. https://arxiv.org/abs/2012.08565

Every round (paper Algorithm 1):
  1. the server sends client i the current models of M other clients, chosen
     epsilon-greedily: with probability epsilon_t M random others, otherwise the M with
     the largest affinity P[i, n] (the running sum of the weights i gave n);
     epsilon_t = max(0, epsilon - decay * t);
  2. client i weighs each downloaded model by its first-order benefit on i's validation
     data, w_n = max(0, (L_val(theta_i) - L_val(theta_n)) / ||theta_n - theta_i||),
     normalised to sum to 1 (all zero: no federated update);
  3. it sets theta_i <- theta_i + sum_n w_n (theta_n - theta_i) and trains locally;
  4. it returns the weights, which the server adds to row i of P.
A client's personalized model is its own theta_i.

Defaults: M = 5 as in PFLlib's FedFomo (github.com/TsingZ0/PFLlib); epsilon = 0.3
decayed by 0.05 per round is our reading of the paper's epsilon-greedy schedule (PFLlib
drops the exploration and always takes the top M).

PFLlib's form, each difference behind its own option (the paper's stays the default):
candidates=self (P starts as the identity and the client's own model, the server's copy
of its last upload, is a candidate), baseline=previous (losses and distances measured
against the model the client started its previous round's training from, PFLlib's
`old_model`, not its current one), validation=train_tail (the last 20 % of the training
data validates, int(0.2 n), and the rest trains), affinity_update=raw (P adds the
signed, unnormalised weights) and distance_eps=1e-5 (added to the distance). With
epsilon 0 and M >= K these give PFLlib's serverfomo/clientfomo (docs/verification.md);
its training loader is unshuffled, which ours is not.

Memory: the message holds M models per client, [K, M, ...], never the [K, K, ...] of all
pairs. A distance ||theta_n - theta_i|| of zero
(identical models, e.g. everyone in round 1) gives w_n = 0. Validation loss is the
split's full mean cross-entropy (the paper holds out part of the client's training
data; here the client's own validation split serves).
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


CHOICES = {"candidates": ("others", "self"), "baseline": ("current", "previous"),
           "validation": ("split", "train_tail"), "affinity_update": ("normalized", "raw")}


class FedFomoServer(NamedTuple):
  affinity: jax.Array  # [K, K] float32: P[i, n], sum of the weights client i gave n
  round: jax.Array     # [] int32: rounds aggregated so far (epsilon schedule, sampling)
  key: jax.Array       # [2] uint32: raw PRNG key of the server's sampling


class FomoClient(NamedTuple):
  """A client's state under baseline=previous."""
  params: object    # its model
  previous: object  # the model its last training started from (after the federated update)


class FomoMessage(NamedTuple):
  models: object   # leaves [K, M, ...]: the models sent to each client
  ids: jax.Array   # [K, M] int32: whose models they are


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


def select_models(affinity: jax.Array, key: jax.Array, num_models: int,
                  epsilon: jax.Array, include_self: bool = False) -> jax.Array:
  """[K, M] ids of other clients (and the client itself with `include_self`): top
  affinity, or random with probability epsilon.

  Ties in affinity (all of them before any weight is known) are broken at random, so
  the greedy choice does not always fall on the lowest ids.
  """
  num_clients = affinity.shape[0]
  explore_key, noise_key = jax.random.split(key)
  noise = jax.random.uniform(noise_key, affinity.shape)
  not_self = ~jnp.eye(num_clients, dtype=bool) | include_self
  # Greedy: sort by affinity (descending), then by noise; self sorts last.
  greedy_rank = jax.vmap(lambda a, n, ok: jnp.lexsort((n, jnp.where(ok, -a, jnp.inf))))(
      affinity, noise, not_self)
  random_rank = jnp.argsort(jnp.where(not_self, noise, 2.0), axis=1)
  explore = jax.random.uniform(explore_key, (num_clients, 1)) < epsilon
  return jnp.where(explore, random_rank, greedy_rank)[:, :num_models].astype(jnp.int32)


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
                           key=raw_key(context.key))
    clients = (FomoClient(params=context.params, previous=context.params)
               if keeps_previous else context.params)
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: FedFomoServer, client_params):
    num_clients = server.affinity.shape[0]
    epsilon = jnp.maximum(0.0, config.epsilon - config.epsilon_decay * server.round)
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
    candidates = num_clients if with_self else num_clients - 1
    ids = select_models(server.affinity, key, min(config.num_models, candidates), epsilon,
                        include_self=with_self)
    return FomoMessage(models=tree.take(models_of(client_params), ids), ids=ids)

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
    weights = normalized_weights(raw)
    params = federated_update(params, message.models, weights)
    trained, stats = trainer.train(params, train_data, key)
    new_state = FomoClient(params=trained, previous=params) if keeps_previous else trained
    added = raw if config.affinity_update == "raw" else weights
    return ClientOutput(state=new_state, upload=FomoUpload(ids=message.ids, weights=added),
                        train=stats, metrics={"models_used": jnp.sum(weights > 0).astype(
                            jnp.float32)})

  def aggregate(server: FedFomoServer, client_params, uploads: FomoUpload, weights):
    del weights
    rows = jnp.arange(uploads.ids.shape[0])[:, None]
    affinity = server.affinity.at[rows, uploads.ids].add(uploads.weights)
    return AlgorithmState(server=server._replace(affinity=affinity, round=server.round + 1),
                          clients=client_params)

  return Algorithm(name="fedfomo", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: models_of(clients),
                   artifacts=lambda server: {"affinity": server.affinity},
                   # The models the server sends others are the clients' own, uploaded.
                   state_upload=models_of)
