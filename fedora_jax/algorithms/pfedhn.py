"""pFedHN: personalized federated learning with a hypernetwork.

Shamsian, Navon, Fetaya, Chechik. "Personalized Federated Learning using Hypernetworks."
ICML 2021. https://arxiv.org/abs/2103.04628  (code: github.com/AvivSham/pFedHN)

The server's hypernetwork makes client k's model theta_k = h(v_k; phi) from its learned
embedding v_k; client k trains it locally and uploads delta_k = theta_k - theta~_k, which the
server back-propagates through h to step phi and the v_k. Client k is scored with
h(v_k; phi). Defaults, the official trainer's: `embed_dim` 0 (e = 1 + K / 4),
`hidden_dim` 100, `n_hidden` 3, `server_lr` 1e-2, momentum 0.9, weight decay 1e-3, clip 50.

Departures: one server step a round on the summed hypergradients (`server_steps` "summed");
"per_client" takes the official trainer's step per client.

Details (every option, the departures, measurements): docs/algorithms/pfedhn.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.batch_stats import is_statistic
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

SERVER_STEPS = ("summed", "per_client")


class PfedhnConfig(NamedTuple):
  embed_dim: int = 0               # embedding size e; 0: the paper's 1 + K / 4
  hidden_dim: int = 100            # hypernetwork width H
  n_hidden: int = 3                # hidden Linear(H, H) layers after the first
  server_lr: float = 1e-2          # hypernetwork and embedding learning rate
  server_momentum: float = 0.9
  server_weight_decay: float = 1e-3
  grad_clip: float = 50.0          # max global norm of the hypergradient; 0: off
  server_steps: str = "summed"     # or "per_client": the official trainer's one step each


class Hypernetwork(NamedTuple):
  layers: tuple    # ((w [in, H], b [H]), ...) 1 + n_hidden Linear layers
  head_w: Any      # the target model's pytree, each leaf [H, *leaf shape]
  head_b: Any      # the target model's pytree, each leaf [*leaf shape]


class PfedhnParams(NamedTuple):
  hypernetwork: Hypernetwork
  embeddings: jax.Array   # [K, e] one learned embedding per client


class PfedhnServer(NamedTuple):
  params: PfedhnParams
  opt_state: Any          # optax state of the server optimiser (momentum traces)


def validate(config: PfedhnConfig) -> PfedhnConfig:
  if config.embed_dim < 0:
    raise FieldError("pfedhn", "embed_dim", f"must be >= 0, got {config.embed_dim}")
  if config.hidden_dim < 1:
    raise FieldError("pfedhn", "hidden_dim", f"must be >= 1, got {config.hidden_dim}")
  if config.n_hidden < 0:
    raise FieldError("pfedhn", "n_hidden", f"must be >= 0, got {config.n_hidden}")
  if not config.server_lr > 0:
    raise FieldError("pfedhn", "server_lr", f"must be > 0, got {config.server_lr}")
  if config.grad_clip < 0:
    raise FieldError("pfedhn", "grad_clip", f"must be >= 0, got {config.grad_clip}")
  check_one_of("pfedhn", config, "server_steps", SERVER_STEPS)
  return config


def embedding_size(config: PfedhnConfig, num_clients: int) -> int:
  return config.embed_dim or int(1 + num_clients / 4)


def torch_linear(key: jax.Array, fan_in: int, fan_out: int) -> tuple[jax.Array, jax.Array]:
  bound = 1.0 / math.sqrt(fan_in)
  w_key, b_key = jax.random.split(key)
  return (jax.random.uniform(w_key, (fan_in, fan_out), jnp.float32, -bound, bound),
          jax.random.uniform(b_key, (fan_out,), jnp.float32, -bound, bound))


def init_hypernetwork(key: jax.Array, embed_dim: int, hidden_dim: int, n_hidden: int,
                      target) -> Hypernetwork:
  """`target`: one model (no client axis), whose structure and shapes the heads produce."""
  layer_key, head_key = jax.random.split(key)
  widths = [embed_dim] + [hidden_dim] * (n_hidden + 1)
  layers = tuple(torch_linear(k, fan_in, fan_out) for k, fan_in, fan_out in
                 zip(jax.random.split(layer_key, n_hidden + 1), widths[:-1], widths[1:]))
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  leaves = [leaf for _, leaf in paths_and_leaves]
  heads = [torch_linear(k, hidden_dim, leaf.size)
           for k, leaf in zip(jax.random.split(head_key, len(leaves)), leaves)]
  # BatchNorm's running averages (engine/batch_stats.py): generated too, from heads that
  # start at the initial model's values (a random variance could be negative).
  heads = [(jnp.zeros_like(w), leaf.reshape(-1)) if is_statistic(path) else (w, b)
           for (w, b), (path, leaf) in zip(heads, paths_and_leaves)]
  head_w = [w.reshape((hidden_dim,) + leaf.shape) for (w, _), leaf in zip(heads, leaves)]
  head_b = [b.reshape(leaf.shape) for (_, b), leaf in zip(heads, leaves)]
  return Hypernetwork(layers=layers, head_w=jax.tree.unflatten(treedef, head_w),
                      head_b=jax.tree.unflatten(treedef, head_b))


def hypernetwork_apply(net: Hypernetwork, embedding: jax.Array):
  """One embedding [e] -> one target model (no ReLU after the last hidden layer)."""
  x = embedding
  for index, (w, b) in enumerate(net.layers):
    if index > 0:
      x = jax.nn.relu(x)
    x = x @ w + b
  return jax.tree.map(lambda w, b: jnp.tensordot(x, w, axes=(0, 0)) + b,
                      net.head_w, net.head_b)


def client_models(params: PfedhnParams):
  """[K, ...] theta_k = h(v_k; phi) for every client embedding."""
  return jax.vmap(lambda v: hypernetwork_apply(params.hypernetwork, v))(params.embeddings)


def hypergradient(params: PfedhnParams, deltas) -> PfedhnParams:
  """sum_k (d theta_k / d(phi, v))^T delta_k: one vjp of the map (phi, v) -> Theta."""
  _, pullback = jax.vjp(client_models, params)
  return pullback(deltas)[0]


def client_hypergradient(params: PfedhnParams, client: jax.Array, delta) -> PfedhnParams:
  """(d theta_k / d(phi, v))^T delta_k for one client k: its embedding's row alone."""
  _, pullback = jax.vjp(
      lambda p: hypernetwork_apply(p.hypernetwork, p.embeddings[client]), params)
  return pullback(delta)[0]


def per_client_steps(optimizer: optax.GradientTransformation, params: PfedhnParams,
                     opt_state, deltas, active: jax.Array) -> tuple[PfedhnParams, Any]:
  """One optimiser step per active client ([K] bool), in client order (the official
  trainer's steps), each with its own hypergradient at `params` (the round's start)."""
  def step(carry, inputs):
    current, state = carry
    client, delta, on = inputs
    grads = client_hypergradient(params, client, delta)
    updates, new_state = optimizer.update(grads, state, current)
    keep = lambda new, old: jnp.where(on, new, old)
    return (jax.tree.map(keep, optax.apply_updates(current, updates), current),
            jax.tree.map(keep, new_state, state)), None
  (params_out, state_out), _ = jax.lax.scan(
      step, (params, opt_state), (jnp.arange(active.shape[0]), deltas, active))
  return params_out, state_out


def server_optimizer(config: PfedhnConfig) -> optax.GradientTransformation:
  """The official code's order: clip the gradient, add weight decay, SGD with momentum."""
  clip = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip > 0 else []
  return optax.chain(*clip, optax.add_decayed_weights(config.server_weight_decay),
                     optax.sgd(config.server_lr, momentum=config.server_momentum or None))


def pfedhn(config: PfedhnConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  optimizer = server_optimizer(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    embed_dim = embedding_size(config, num_clients)
    net_key, embed_key = jax.random.split(context.key)
    params = PfedhnParams(
        hypernetwork=init_hypernetwork(net_key, embed_dim, config.hidden_dim,
                                       config.n_hidden, tree.take(context.params, 0)),
        embeddings=jax.random.normal(embed_key, (num_clients, embed_dim), jnp.float32))
    return AlgorithmState(server=PfedhnServer(params=params, opt_state=optimizer.init(params)),
                          clients=jnp.zeros((num_clients,), jnp.float32))

  def broadcast(server: PfedhnServer, clients):
    del clients
    return client_models(server.params)

  def client_update(client_state, params, data, key):
    trained, stats = trainer.train(params, data.train, key)
    delta = jax.tree.map(lambda before, after: before - after, params, trained)
    return ClientOutput(state=client_state, upload=delta, train=stats)

  def aggregate(server: PfedhnServer, clients, deltas, weights):
    if config.server_steps == "per_client":  # a client that sat the round out: no step
      params, opt_state = per_client_steps(optimizer, server.params, server.opt_state,
                                           deltas, weights > 0)
      return AlgorithmState(server=PfedhnServer(params=params, opt_state=opt_state),
                            clients=clients)
    # A client that sat the round out uploads a zero delta: it adds nothing.
    grads = hypergradient(server.params, deltas)
    updates, opt_state = optimizer.update(grads, server.opt_state, server.params)
    return AlgorithmState(server=PfedhnServer(params=optax.apply_updates(server.params, updates),
                                              opt_state=opt_state),
                          clients=clients)

  def personalized_params(server: PfedhnServer, clients):
    del clients
    return client_models(server.params)

  return Algorithm(name="pfedhn", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
