"""pFedLA: each client's model is a layer-wise weighted aggregate of all clients' models,
its weights produced by a hypernetwork of its own on the server.

Ma, Zhang, Guo, Xu. "Layer-wised Model Aggregation for Personalized Federated Learning."
CVPR 2022. https://arxiv.org/abs/2205.03993
(no official code; the public implementations are github.com/KarhouTam/pFedLA and its
successor in KarhouTam/FL-bench, src/server/pfedla.py)

Notation: N clients, L layers (fedora_jax.algorithms.layers: flax top-level modules, a
Dense layer's kernel and bias together, input to output), theta_j^l client j's latest
local model's layer l, kept by the server. Client i has an embedding v_i and a hypernetwork
HN_i(.; phi_i) producing its aggregation weight matrix alpha_i = HN_i(v_i; phi_i) [L, N].
Every round:
  1. aggregation: theta_bar_i^l = sum_j alpha_ij^l theta_j^l / sum_j alpha_ij^l for every
     layer l (weights normalised per layer; a layer whose weights are all 0 keeps the
     client's own layer, as in both public implementations);
  2. client i trains theta_bar_i with the run's local SGD to theta_i' and uploads it;
  3. the server stores theta_i <- theta_i' and updates phi_i and v_i by the chain rule
     through the aggregation:  grad(phi_i, v_i) = (d theta_bar_i / d(phi_i, v_i))^T
     delta_i, delta_i = theta_bar_i - theta_i' standing for the gradient of client i's loss
     at theta_bar_i (as pFedHN: the local update is a descent step), then one SGD step of
     learning rate server_lr. One jax.vjp through the aggregation of all clients at once;
     phi_i only reaches theta_bar_i, so each hypernetwork gets its own client's term, and a
     client that sat the round out (weight 0) gets none and keeps its stored model.
A client's personalised model is theta_bar_i from the updated hypernetworks and models
(what the public code evaluates; `evaluate="aggregate"`, the default). `evaluate="local"`
scores instead the model theta_i' the client last trained (the shared initial model
before it first trains), the view under which the parameter-coaching paper's pFedLA row
(Zhi et al., AAAI 2024, Table 1: 97.80 on MNIST alpha 0.1, above its LOCAL's 95.91) can
be read, as its FedProx row is (fedprox.py).

Hypernetwork (both public implementations): v_i -> [Linear(e, H), ReLU] x 3 -> one
Linear(H, N) per layer, then ReLU: alpha_i^l = ReLU(W_l f + b_l), with W_l ~ U(0, 1) and
b_l = 0 so that the weights start positive; the other Linear layers take PyTorch's
default initialisation and the embeddings N(0, 1). Defaults are KarhouTam/pFedLA's: e =
H = 100, server learning rate 5e-3, plain SGD (local training there: SGD lr 1e-2, 10
local epochs, batch 32: the run's flags). Each client's models start from the run's shared
initial model (KarhouTam/pFedLA draws one per client; FL-bench shares one).

delta_sign, derived by hand: local SGD at rate eta takes theta_i' = theta_bar_i - eta
sum_s g_s, so delta = theta_bar_i - theta_i' is eta times the summed gradients of client
i's loss, to first order eta T grad L(theta_bar_i). With J = d theta_bar_i / d phi_i, the
loss's gradient in phi_i is J^T grad L, and the step phi_i -= lr J^T delta moves
theta_bar_i by -lr J J^T delta (J J^T positive semi-definite): towards theta_i', the loss
falls. Both public implementations (KarhouTam/pFedLA server/pFedLA.py
update_hypernetwork, FL-bench) feed theta_i' - theta_bar_i (their client's p1 - p0) as
grad_outputs and then subtract lr times the result: the same step reversed, theta_bar_i
moved away from the trained model (tests/test_pfedla.py checks both against the distance
to theta_i'). "before_minus_after" (the default) is the descent, the sign of pFedHN's
code; "after_minus_before" gives the public codes' (the verification row runs it). The
paper's text is not on disk to say which it writes.

buffers: both public codes mix only the trainable tensors; every buffer (BatchNorm's
running mean and variance) of theta_bar_i is client i's own stored one (their
generate_client_model_parameters: a one-hot weight for a tensor without requires_grad),
and none enters the chain rule: "own". "mix" (the default) mixes the running averages
with their layer's weights, as the rest of the layer (engine/batch_stats.py folds them
into it); the deltas of the mixed averages then enter the chain rule too.
Not implemented: HeurpFedLA (the paper's variant that keeps the top-k layers local).
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
