"""FedCP: a conditional policy network splits each sample's features into a global part, fed
to a global head, and a personalised part, fed to the client's own head.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy." KDD 2023.
https://arxiv.org/abs/2307.01217
(code: github.com/TsingZ0/FedCP, system/flcore/clients/clientcp.py and
servers/servercp.py; the same files in TsingZ0/PFLlib. The paper's full text is not on disk.)

A sampled client trains the global extractor f, its head h_p and the policy network (CPN)
on CE(h_p(z * r) + h_g(z * s), y) + lam MMD(f(x), f_g(x)), (r, s) the CPN's Gumbel-softmax
split of z = f(x), then uploads f, h_g <- (h_p + h_g) / 2 and its CPN; the server averages
each (weights n_i). Each client is scored with its own forward, noise-free (its own
`evaluate`). FedCpConfig: lam 5.0 (the authors' MNIST script), temperature 1.0.

Departures: evaluation without Gumbel noise (the authors draw it at test time too); the
last partial batch trains (the authors' loader drops it).

Details (every option, the departures, measurements): docs/algorithms/fedcp.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import BODY
from fedora_jax.algorithms.layers import (affine_head, apply_with_representation, head_layer,
                                          merge_layers, split_body_head, take_layers)
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError

Params = Any
MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)   # the code's 'rbf' bandwidth_range
LAYER_NORM_EPS = 1e-5                        # PyTorch's nn.LayerNorm default


class FedCpConfig(NamedTuple):
  lam: float = 5.0          # weight lambda of MMD(f(x), f_global(x)) (run_me.sh, MNIST)
  temperature: float = 1.0  # Gumbel-softmax temperature tau of the policy


FLAG_HELP = {
    "lam": "FedCP: weight lambda of the MMD between the features of the trained and of the"
           " received global feature extractor",
    "temperature": "FedCP: temperature tau of the policy's Gumbel-softmax",
}


class FedCpClient(NamedTuple):
  personal_head: Params   # [K, ...] {"params": {head: ...}} h_p
  global_head: Params     # [K, ...] the client's copy of h_g
  policy: Params          # [K, ...] the client's copy of the CPN
  context: jax.Array      # [K, d] c_i (unnormalised)


class FedCpServer(NamedTuple):
  body: Params            # the global feature extractor f
  global_head: Params     # h_g
  policy: Params          # the CPN


class FedCpModel(NamedTuple):
  """One client's personalised model (what `evaluate` scores)."""
  model: Params           # f under h_p: the run's model
  global_head: Params
  policy: Params
  context: jax.Array      # [d]


class FedCpTrained(NamedTuple):
  model: Params           # f and h_p
  policy: Params
  step: jax.Array         # [] float: steps taken, for each step's Gumbel noise


def validate(config: FedCpConfig, trainer: ClientTrainer) -> FedCpConfig:
  if config.lam < 0:
    raise FieldError("fedcp", "lam", f"must be >= 0, got {config.lam}")
  if not config.temperature > 0:
    raise FieldError("fedcp", "temperature", f"must be > 0, got {config.temperature}")
  if trainer.task != "classification":
    raise ConfigError("fedcp needs a classification task")
  if trainer.apply is None or trainer.evaluate_with is None:
    raise ConfigError("fedcp needs the trainer's model forward (make_client_trainer)")
  return config


def init_policy(key: jax.Array, dim: int) -> Params:
  """ConditionalSelection(d, d): Linear(d, 2d) with PyTorch's U(+-1/sqrt(d)), LayerNorm(2d)."""
  bound = 1.0 / jnp.sqrt(dim)
  kernel_key, bias_key = jax.random.split(key)
  return {"kernel": jax.random.uniform(kernel_key, (dim, 2 * dim), jnp.float32, -bound, bound),
          "bias": jax.random.uniform(bias_key, (2 * dim,), jnp.float32, -bound, bound),
          "scale": jnp.ones((2 * dim,), jnp.float32),
          "offset": jnp.zeros((2 * dim,), jnp.float32)}


def policy_logits(policy: Params, gate_input: jax.Array) -> jax.Array:
  """[B, 2, d]: ReLU(LayerNorm(gate_input @ W + b)), the first d for r, the next for s."""
  hidden = gate_input @ policy["kernel"] + policy["bias"]
  mean = jnp.mean(hidden, axis=-1, keepdims=True)
  variance = jnp.var(hidden, axis=-1, keepdims=True)
  hidden = (hidden - mean) / jnp.sqrt(variance + LAYER_NORM_EPS)
  hidden = jax.nn.relu(hidden * policy["scale"] + policy["offset"])
  return hidden.reshape(hidden.shape[0], 2, -1)


def gated_logits(model: FedCpModel, head: str, features: jax.Array, noise: jax.Array,
                 temperature: float) -> tuple[jax.Array, jax.Array]:
  """(outputs [B, C], r [B, d]): h_p(z r) + h_g(z s), (r, s) = softmax((a + noise) / tau)."""
  context = model.context / jnp.maximum(jnp.linalg.norm(model.context), 1e-12)
  logits = policy_logits(model.policy, features * context)
  gates = jax.nn.softmax((logits + noise) / temperature, axis=1)
  personal, shared = gates[:, 0], gates[:, 1]
  outputs = (affine_head(model.model["params"][head], features * personal)
             + affine_head(model.global_head["params"][head], features * shared))
  return outputs, personal


def mmd(x: jax.Array, y: jax.Array, weights: jax.Array) -> jax.Array:
  """Biased MMD^2 of the weighted samples x, y [B, d] under the sum of RBF kernels."""
  def kernel(a, b):
    distances = jnp.sum(jnp.square(a[:, None] - b[None]), axis=-1)
    return sum(jnp.exp(-0.5 * distances / bandwidth) for bandwidth in MMD_BANDWIDTHS)
  pair = weights[:, None] * weights[None, :]
  total = kernel(x, x) + kernel(y, y) - 2.0 * kernel(x, y)
  return jnp.sum(pair * total) / jnp.maximum(jnp.sum(pair), 1.0)


def context_of(personal_head: Params, head: str) -> jax.Array:
  """[d] c_i: the head's weight rows summed over the classes (set_head_g)."""
  return jnp.sum(personal_head["params"][head]["kernel"], axis=-1)


def step_noise(key: jax.Array, step: jax.Array, shape) -> jax.Array:
  """The Gumbel(0, 1) noise of local step `step`."""
  step = jax.lax.stop_gradient(step).astype(jnp.int32)
  return jax.random.gumbel(jax.random.fold_in(key, step), shape)


def fedcp(config: FedCpConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply, evaluate_with = trainer.apply, trainer.evaluate_with
  assert apply is not None and evaluate_with is not None  # validate() checked them

  def parts(params: Params) -> tuple[list[str], str]:
    head = head_layer(params, "fedcp")
    return split_body_head(params, 1, "fedcp")[0], head

  def features_of(params: Params, head: str, x: jax.Array) -> jax.Array:
    return apply_with_representation(apply, params, x, head)[1]

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    body_names, head = parts(first)
    dim = first["params"][head]["kernel"].shape[0]
    num_clients = tree.leading_size(context.params)
    policy_key, context_key = jax.random.split(context.key)
    policy = init_policy(policy_key, dim)
    heads = take_layers(context.params, [head])
    server = FedCpServer(body=take_layers(first, body_names),
                         global_head=take_layers(first, [head]), policy=policy)
    clients = FedCpClient(
        personal_head=heads, global_head=heads,
        policy=tree.broadcast_to_clients(policy, num_clients),
        context=jax.random.uniform(context_key, (num_clients, dim), jnp.float32))
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: FedCpServer, clients: FedCpClient):
    return tree.broadcast_to_clients(server.body, tree.leading_size(clients.context))

  def client_update(client: FedCpClient, body, data, key):
    model = merge_layers(body, client.personal_head)
    body_names, head = parts(model)
    received = model      # f_g: the received extractor, a constant of the loss (frozen)
    noise_key, train_key = jax.random.split(key)

    def loss(p: FedCpTrained, x, y, weights):
      features = features_of(p.model, head, x)
      noise = step_noise(noise_key, p.step, (x.shape[0], 2, features.shape[-1]))
      gated = FedCpModel(model=p.model, global_head=client.global_head, policy=p.policy,
                         context=client.context)
      outputs, _ = gated_logits(gated, head, features, noise, config.temperature)
      return (masked_cross_entropy(outputs, y, weights)
              + config.lam * mmd(features, features_of(received, head, x), weights))

    def count_step(new: FedCpTrained, old: FedCpTrained) -> FedCpTrained:
      return new._replace(step=old.step + 1.0)   # exact, whatever the optimizer did to it

    start = FedCpTrained(model=model, policy=client.policy, step=jnp.zeros((), jnp.float32))
    trained, stats = trainer.train(start, data.train, train_key, loss_fn=loss,
                                   post_step=count_step)
    personal_head = take_layers(trained.model, [head])
    upload_head = jax.tree.map(lambda p, g: 0.5 * p + 0.5 * g, personal_head,
                               client.global_head)   # generate_upload_head
    state = client._replace(personal_head=personal_head, policy=trained.policy)
    upload = FedCpServer(body=take_layers(trained.model, body_names),   # what it sends
                         global_head=upload_head, policy=trained.policy)
    return ClientOutput(state=state, upload=upload, train=stats)

  def aggregate(server: FedCpServer, clients: FedCpClient, uploads: FedCpServer, weights):
    new_server = FedCpServer(body=tree.weighted_mean(uploads.body, weights),
                             global_head=tree.weighted_mean(uploads.global_head, weights),
                             policy=tree.weighted_mean(uploads.policy, weights))
    head = list(server.global_head["params"])[0]
    sampled = weights > 0

    def to_sampled(new, old):   # the round's clients receive the new global part
      return jax.tree.map(
          lambda n, o: jnp.where(sampled.reshape((-1,) + (1,) * (o.ndim - 1)), n, o),
          tree.broadcast_to_clients(new, sampled.shape[0]), old)
    contexts = jax.vmap(context_of, in_axes=(0, None))(clients.personal_head, head)
    clients = clients._replace(
        global_head=to_sampled(new_server.global_head, clients.global_head),
        policy=to_sampled(new_server.policy, clients.policy),
        context=jnp.where(sampled[:, None], contexts, clients.context))
    return AlgorithmState(server=new_server, clients=clients)

  def personalized_params(server: FedCpServer, clients: FedCpClient) -> FedCpModel:
    bodies = tree.broadcast_to_clients(server.body, tree.leading_size(clients.context))
    return FedCpModel(model=merge_layers(bodies, clients.personal_head),
                      global_head=clients.global_head, policy=clients.policy,
                      context=clients.context)

  def forward(model: FedCpModel, x: jax.Array) -> jax.Array:
    """The personalised prediction, the policy without Gumbel noise."""
    head = head_layer(model.model, "fedcp")
    features = features_of(model.model, head, x)
    noise = jnp.zeros((x.shape[0], 2, features.shape[-1]), features.dtype)
    return gated_logits(model, head, features, noise, config.temperature)[0]

  return Algorithm(name="fedcp", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   evaluate=evaluate_with(forward),
                   shared_part=BODY)  # FedCpServer.body: the feature extractor f
