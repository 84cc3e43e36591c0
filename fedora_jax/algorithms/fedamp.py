"""FedAMP: federated attentive message passing.

Huang, Chu, Zhou, Wang, Liu, Pei, Zhang. "Personalized Cross-Silo Federated Learning on
Non-IID Data." AAAI 2021. https://arxiv.org/abs/2007.03797

The server sends client i its cloud model u_i = sum_j xi_ij w_j, with attention weights from
the distances between the clients' models (`attention` "distance"; "cosine": HeurFedAMP);
client i trains w_i on its loss plus lambda / (2 alpha_k) ||w - u_i||^2 and is scored with
w_i. Defaults `alpha_k` = `lam` = `sigma` = 1 (PFLlib's).

Departures: the message-passing step is clipped to sigma / (K - 1) so that xi_ii >= 0
(`clip_step` True; False is PFLlib's); under partial participation, which the paper leaves
open, the attention reads every client's stored model (`attention_from` "all";
"uploaders" is PFLlib's).

Details (every option, the departures, measurements): docs/algorithms/fedamp.md.
"""

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import AlaHooks
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError

ATTENTION_FROM = ("all", "uploaders")


class FedAmpConfig(NamedTuple):
  attention: str = "distance"  # "distance": the paper's FedAMP; "cosine": HeurFedAMP
  alpha_k: float = 1.0         # message-passing step size alpha_k
  lam: float = 1.0             # lambda, weight of the attentive regulariser
  sigma: float = 1.0           # scale of A(x) = 1 - exp(-x / sigma)
  self_weight: float = 0.5     # HeurFedAMP's xi_ii (cosine attention only)
  cosine_scale: float = 1.0    # HeurFedAMP's sigma in softmax(sigma * cos) (cosine only)
  clip_step: bool = True       # xi with min(alpha_k, sigma / (K - 1)): xi_ii >= 0 (paper's bound)
  attention_from: str = "all"  # "all": every stored model; "uploaders": the round's (PFLlib)


class FedAmpServer(NamedTuple):
  attention: jax.Array  # [K, K] xi, rows sum to 1; xi[i] builds client i's cloud model


class FedAmpMessage(NamedTuple):
  cloud_model: object     # leaves [K, ...]: u_i = sum_j xi_ij w_j
  self_weight: jax.Array  # [K]: xi_ii
  prox_weight: jax.Array  # [K]: lambda / (2 alpha_k) of the configured values


def validate(config: FedAmpConfig) -> FedAmpConfig:
  if config.attention not in ("distance", "cosine"):
    raise FieldError("fedamp", "attention", f"must be distance or cosine, got {config.attention!r}")
  if not config.alpha_k > 0:
    raise FieldError("fedamp", "alpha_k", f"must be > 0, got {config.alpha_k}")
  if config.lam < 0:
    raise FieldError("fedamp", "lam", f"must be >= 0, got {config.lam}")
  if not config.sigma > 0:
    raise FieldError("fedamp", "sigma", f"must be > 0, got {config.sigma}")
  if not 0.0 <= config.self_weight <= 1.0:
    raise FieldError("fedamp", "self_weight", f"must be in [0, 1], got {config.self_weight}")
  if config.attention_from not in ATTENTION_FROM:
    raise FieldError("fedamp", "attention_from",
                     f"must be all or uploaders, got {config.attention_from!r}")
  return config


def _others(candidates: jax.Array | None, num_clients: int) -> jax.Array:
  """[K, K] bool: j != i and j a candidate (every client where candidates is None)."""
  off_diagonal = ~jnp.eye(num_clients, dtype=bool)
  return off_diagonal if candidates is None else off_diagonal & candidates[None, :]


def distance_attention(squared_distances: jax.Array, alpha_k: float, sigma: float,
                       candidates: jax.Array | None = None) -> jax.Array:
  """xi from ||w_i - w_j||^2 [K, K]: alpha_k A'(d) off the diagonal (for the candidate
  j's [K] bool only, where given), 1 - row sum on it."""
  others = _others(candidates, squared_distances.shape[0])
  xi = jnp.where(others, alpha_k * jnp.exp(-squared_distances / sigma) / sigma, 0.0)
  return xi + jnp.diag(1.0 - jnp.sum(xi, axis=1))


def cosine_attention(gram: jax.Array, self_weight: float, scale: float,
                     candidates: jax.Array | None = None) -> jax.Array:
  """HeurFedAMP's xi from the Gram matrix <w_i, w_j> [K, K]; a row with no candidate
  other than itself keeps its own model (xi_ii = 1)."""
  norms = jnp.sqrt(jnp.maximum(jnp.diag(gram), 1e-30))
  cosine = gram / (norms[:, None] * norms[None, :])
  others = _others(candidates, gram.shape[0])
  # A row's max over its candidates (0 where it has none) keeps exp finite and no row NaN.
  logits = jnp.where(others, scale * cosine, -jnp.inf)
  shifted = jnp.exp(logits - jnp.max(jnp.where(others, logits, 0.0), axis=1, keepdims=True))
  total = jnp.sum(shifted, axis=1, keepdims=True)
  has_other = total > 0
  softmax = shifted / jnp.where(has_other, total, 1.0)
  own = jnp.where(has_other[:, 0], self_weight, 1.0)
  return (1.0 - own)[:, None] * softmax + jnp.diag(own)


def step_size(config: FedAmpConfig, num_clients: int) -> float:
  """alpha_k used: as given, or clipped to sigma / (K - 1) so that every xi_ii >= 0."""
  if config.clip_step and num_clients > 1:
    return min(config.alpha_k, config.sigma / (num_clients - 1))
  return config.alpha_k


def first_round_self_weight(num_clients: int, config: FedAmpConfig) -> float:
  """xi_ii of the first broadcast, when every client starts from the same model (d = 0)."""
  return 1.0 - (num_clients - 1) * step_size(config, num_clients) / config.sigma


def attention_matrix(client_params, config: FedAmpConfig,
                     uploaded: jax.Array | None = None) -> jax.Array:
  """xi [K, K] from the clients' models; with `uploaded` [K] bool and attention_from
  "uploaders", only the uploaders' models are attended to."""
  candidates = uploaded if config.attention_from == "uploaders" else None
  if config.attention == "distance":
    alpha_k = step_size(config, tree.leading_size(client_params))
    return distance_attention(tree.pairwise_squared_distances(client_params),
                              alpha_k, config.sigma, candidates)
  return cosine_attention(tree.gram(client_params), config.self_weight,
                          config.cosine_scale, candidates)


def fedamp(config: FedAmpConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    if num_clients < 2 and config.attention == "cosine":
      raise ConfigError("fedamp with cosine attention needs at least 2 clients")
    self_weight = first_round_self_weight(num_clients, config)
    if config.attention == "distance" and self_weight < 0:
      # A warning, not an error: PFLlib's defaults do this for any K > 2.
      logging.getLogger("fedora_jax").warning(
          "fedamp: with %d clients, alpha_k=%g and sigma=%g the first cloud models "
          "extrapolate (self weight xi_ii = %.3g < 0); the paper's analysis needs "
          "alpha_k <= sigma / (K - 1) = %.3g (clip_step=True)",
          num_clients, config.alpha_k, config.sigma, self_weight, config.sigma / (num_clients - 1))
    server = FedAmpServer(attention=attention_matrix(context.params, config))
    return AlgorithmState(server=server, clients=context.params)

  def broadcast(server: FedAmpServer, client_params):
    num_clients = tree.leading_size(client_params)
    prox_weight = config.lam / (2.0 * config.alpha_k)
    return FedAmpMessage(cloud_model=tree.mix(server.attention, client_params),
                         self_weight=jnp.diag(server.attention),
                         prox_weight=jnp.full((num_clients,), prox_weight, jnp.float32))

  def client_update(params, message: FedAmpMessage, data, key):
    cloud = message.cloud_model
    params, stats = trainer.train(
        params, data.train, key,
        regularizer=lambda p: message.prox_weight * tree.squared_distance(p, cloud))
    return ClientOutput(state=params, upload=(), train=stats,
                        metrics={"self_weight": message.self_weight})

  def aggregate(server, client_params, uploads, weights):
    del server, uploads
    # weights > 0: the clients whose models arrived this round (rounds.py).
    attention = attention_matrix(client_params, config, uploaded=weights > 0)
    return AlgorithmState(server=FedAmpServer(attention=attention), clients=client_params)

  return Algorithm(name="fedamp", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: clients,
                   # Attention and cloud models are computed from the uploaded models.
                   state_upload=lambda params: params,
                   artifacts=lambda server: {"attention": server.attention},
                   # Client i's "global model" is its cloud model u_i (the prox anchor):
                   # ALA replaces it, and training starts from theta_hat too.
                   ala_hooks=AlaHooks(
                       received=lambda message: message.cloud_model,
                       replace=lambda state, message, start: (
                           start, message._replace(cloud_model=start)),
                       trained=lambda out: out.state, personal_is_local=False))
