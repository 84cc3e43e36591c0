"""pFedLA: each client's model is a layer-wise weighted aggregate of all clients' models,
its weights produced by a hypernetwork of its own on the server.

Ma, Zhang, Guo, Xu. "Layer-wised Model Aggregation for Personalized Federated Learning."
CVPR 2022. https://arxiv.org/abs/2205.03993
(no official code; the public implementations are github.com/KarhouTam/pFedLA and its
successor in KarhouTam/FL-bench, src/server/pfedla.py)

Client i receives theta_bar_i, each layer a mix of all clients' stored layers with weights from
its hypernetwork on the server, trains it and uploads it; the server stores it and steps the
hypernetwork and embedding by the chain rule on delta = theta_bar_i - theta_i' (server_lr
5e-3, embed_dim = hidden_dim = 100). Scored: theta_bar_i (evaluate "aggregate").

Departures: delta_sign "before_minus_after" is descent (the public codes ascend:
"after_minus_before"); buffers "mix" mixes BatchNorm averages (the codes keep them: "own");
the models start from one shared initial model (KarhouTam/pFedLA: one per client).

Details (every option, the departures, measurements): docs/algorithms/pfedla.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import layer_names
from fedora_jax.algorithms.pfedhn import torch_linear
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

Params = Any

DELTA_SIGNS = ("before_minus_after", "after_minus_before")
EVALUATIONS = ("aggregate", "local")
BUFFERS = ("mix", "own")


class PfedlaConfig(NamedTuple):
  embed_dim: int = 100       # embedding size e of each client
  hidden_dim: int = 100      # hypernetwork width H
  server_lr: float = 5e-3    # SGD step of the hypernetworks and embeddings
  delta_sign: str = "before_minus_after"  # or "after_minus_before" (public code)
  evaluate: str = "aggregate"  # score theta_bar_i (public code) or "local": theta_i'
  buffers: str = "mix"       # own: BatchNorm's running averages stay the client's (codes)


FLAG_HELP = {
    "embed_dim": "pFedLA: client embedding size",
    "hidden_dim": "pFedLA: hypernetwork width (three Linear + ReLU layers)",
    "server_lr": "pFedLA: SGD learning rate of each client's hypernetwork and embedding",
    "delta_sign": "pFedLA: update fed to the chain rule: before_minus_after (descent, as"
                  " pFedHN) or after_minus_before (the public pFedLA code)",
    "evaluate": "pFedLA: score each client's aggregate theta_bar_i (aggregate, the public"
                " code) or the model it last trained (local)",
    "buffers": "pFedLA: BatchNorm's running averages mixed with their layer (mix) or each"
               " client's own (own, the public codes: only trainable tensors mixed)",
}


class LayerHypernetworks(NamedTuple):
  """N clients' hypernetworks, stacked: every leaf has a leading client axis [N, ...]."""
  embeddings: jax.Array  # [N, e]
  hidden: tuple          # ((w [N, in, H], b [N, H]), ...) three Linear layers
  heads_w: jax.Array     # [N, L, H, N] one Linear(H, N) per model layer
  heads_b: jax.Array     # [N, L, N]


class PfedlaServer(NamedTuple):
  hypernetworks: LayerHypernetworks
  models: Params         # [N, ...] theta_j: every client's latest local model


def validate(config: PfedlaConfig) -> PfedlaConfig:
  for field in ("embed_dim", "hidden_dim"):
    if getattr(config, field) < 1:
      raise FieldError("pfedla", field, f"must be >= 1, got {getattr(config, field)}")
  if not config.server_lr > 0:
    raise FieldError("pfedla", "server_lr", f"must be > 0, got {config.server_lr}")
  check_one_of("pfedla", config, "delta_sign", DELTA_SIGNS)
  check_one_of("pfedla", config, "evaluate", EVALUATIONS)
  check_one_of("pfedla", config, "buffers", BUFFERS)
  return config


def init_hypernetworks(key: jax.Array, num_clients: int, num_layers: int, embed_dim: int,
                       hidden_dim: int) -> LayerHypernetworks:
  embed_key, hidden_key, head_key = jax.random.split(key, 3)
  widths = [embed_dim, hidden_dim, hidden_dim, hidden_dim]

  def one_client(k):
    keys = jax.random.split(k, len(widths) - 1)
    return tuple(torch_linear(kk, fan_in, fan_out)
                 for kk, fan_in, fan_out in zip(keys, widths[:-1], widths[1:]))
  return LayerHypernetworks(
      embeddings=jax.random.normal(embed_key, (num_clients, embed_dim), jnp.float32),
      hidden=jax.vmap(one_client)(jax.random.split(hidden_key, num_clients)),
      heads_w=jax.random.uniform(head_key, (num_clients, num_layers, hidden_dim, num_clients),
                                 jnp.float32),
      heads_b=jnp.zeros((num_clients, num_layers, num_clients), jnp.float32))


def raw_layer_weights(net: LayerHypernetworks) -> jax.Array:
  """One client's hypernetwork (leaves without the client axis) -> alpha [L, N] >= 0."""
  feature = net.embeddings
  for w, b in net.hidden:
    feature = jax.nn.relu(feature @ w + b)
  return jax.nn.relu(jnp.einsum("h,lhn->ln", feature, net.heads_w) + net.heads_b)


def normalized_weights(alpha: jax.Array, client: jax.Array) -> jax.Array:
  """alpha [L, N] normalised per layer; an all-zero layer falls back to the client alone."""
  total = jnp.sum(alpha, axis=-1, keepdims=True)
  own = jax.nn.one_hot(client, alpha.shape[-1], dtype=alpha.dtype)
  return jnp.where(total > 0, alpha / jnp.where(total > 0, total, 1.0), own)


def aggregate_layers(weights: jax.Array, models: Params) -> Params:
  """theta_bar [N, ...]: layer l of client i is sum_j weights[i, l, j] theta_j^l."""
  names = layer_names(models)
  return {"params": {name: tree.mix(weights[:, l], models["params"][name])
                     for l, name in enumerate(names)}}


def personalized_models(hypernetworks: LayerHypernetworks, models: Params,
                        own_buffers: bool = False) -> Params:
  """theta_bar_i for every client i from its hypernetwork and all clients' models; with
  `own_buffers`, its BatchNorm running averages client i's own."""
  num_clients = tree.leading_size(models)
  alpha = jax.vmap(raw_layer_weights)(hypernetworks)                       # [N, L, N]
  weights = jax.vmap(normalized_weights)(alpha, jnp.arange(num_clients))
  mixed = aggregate_layers(weights, models)
  if not own_buffers:
    return mixed
  return jax.tree_util.tree_map_with_path(
      lambda path, mix, own: own if batch_stats.is_statistic(path) else mix, mixed, models)


def server_step(server: PfedlaServer, uploads: Params, weights: jax.Array,
                config: PfedlaConfig) -> PfedlaServer:
  """The chain-rule update of the sampled clients' hypernetworks, then their new models."""
  active = weights > 0
  own_buffers = config.buffers == "own"
  received, pullback = jax.vjp(
      lambda nets: personalized_models(nets, server.models, own_buffers),
      server.hypernetworks)

  def masked(a, b):
    return jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a - b, 0.0)
  if config.delta_sign == "before_minus_after":
    deltas = jax.tree.map(masked, received, uploads)
  else:
    deltas = jax.tree.map(masked, uploads, received)
  grads = pullback(deltas)[0]
  hypernetworks = jax.tree.map(lambda p, g: p - config.server_lr * g,
                               server.hypernetworks, grads)
  models = jax.tree.map(
      lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (old.ndim - 1)), new, old),
      uploads, server.models)
  return PfedlaServer(hypernetworks=hypernetworks, models=models)


def pfedla(config: PfedlaConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    num_layers = len(layer_names(tree.first(context.params)))
    nets = init_hypernetworks(context.key, num_clients, num_layers, config.embed_dim,
                              config.hidden_dim)
    return AlgorithmState(server=PfedlaServer(hypernetworks=nets, models=context.params),
                          clients=jnp.zeros((num_clients,), jnp.float32))

  def broadcast(server: PfedlaServer, clients):
    del clients
    return personalized_models(server.hypernetworks, server.models, config.buffers == "own")

  def client_update(client_state, params, data, key):
    trained, stats = trainer.train(params, data.train, key)
    return ClientOutput(state=client_state, upload=trained, train=stats)

  def aggregate(server: PfedlaServer, clients, uploads, weights):
    return AlgorithmState(server=server_step(server, uploads, weights, config),
                          clients=clients)

  def personalized_params(server: PfedlaServer, clients):
    if config.evaluate == "local":
      return server.models
    return broadcast(server, clients)

  return Algorithm(name="pfedla", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
