"""MOON: FedAvg whose clients add a model-contrastive loss on representations.

Li, He, Song. "Model-Contrastive Federated Learning." CVPR 2021.
https://arxiv.org/abs/2103.16257  (code: github.com/QinbinLi/MOON)

Each round a sampled client trains the global model on cross-entropy + mu * l_con, l_con
contrasting its representation with the global model's (positive) and its previous local
model's (negative) at temperature tau; the server averages the models as FedAvg. Defaults:
mu 5 (CIFAR-10's), tau 0.5; evaluate "global" scores the global model, "local" each
client's latest local model.

Departures: z is the body's output (the classifier's input), not a projection head's.

Details (every option, the departures, measurements): docs/algorithms/moon.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer)
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of, traced

Params = Any

EVALUATIONS = ("global", "local")


class MoonConfig(NamedTuple):
  mu: float = 5.0          # weight of the model-contrastive loss (CIFAR-10's)
  tau: float = 0.5         # temperature
  evaluate: str = "global"  # "global": the global model (paper); "local": local models


FLAG_HELP = {
    "mu": "MOON: weight mu of the model-contrastive loss; 5 is the paper's on CIFAR-10,"
          " 1 on CIFAR-100 and Tiny-ImageNet",
    "tau": "MOON: temperature tau of the model-contrastive loss",
    "evaluate": "MOON: evaluate the global model (global, the paper) or each client's"
                " latest local model (local)",
}


class MoonClients(NamedTuple):
  previous: Params           # [K, ...] each client's latest local model w_i^{t-1}
  has_previous: jax.Array    # [K] bool: False before the first round (no negative pair)


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
  """[B] row-wise cosine of a, b [B, d], with PyTorch's eps on the norm product."""
  norms = jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1)
  return jnp.sum(a * b, axis=-1) / jnp.maximum(norms, 1e-8)


def contrastive_loss(z: jax.Array, z_glob: jax.Array, z_prev: jax.Array, tau: float,
                     has_previous: jax.Array) -> jax.Array:
  """[B] l_con per sample: softplus((sim(z, z_prev) - sim(z, z_glob)) / tau); 0 without
  a previous model (one positive logit and no negative)."""
  gap = (cosine_similarity(z, z_prev) - cosine_similarity(z, z_glob)) / tau
  return jnp.where(has_previous, jax.nn.softplus(gap), 0.0)


def moon_loss(apply_fn, head: str, global_params: Params, previous: Params,
              has_previous: jax.Array, config: MoonConfig):
  """loss_fn(params, x, y, weights): cross-entropy + mu * l_con, means over the batch."""
  def loss(params, x, y, weights):
    logits, z = apply_with_representation(apply_fn, params, x, head)
    # The fixed models on their running averages (BatchNorm's inference mode), as the
    # authors' code runs them (eval()); the trained model in train mode.
    with batch_stats.inference():
      z_glob = apply_with_representation(apply_fn, global_params, x, head)[1]
      z_prev = apply_with_representation(apply_fn, previous, x, head)[1]
    per_sample = (optax.softmax_cross_entropy_with_integer_labels(logits, y)
                  + config.mu * contrastive_loss(z, jax.lax.stop_gradient(z_glob),
                                                 jax.lax.stop_gradient(z_prev), config.tau,
                                                 has_previous))
    return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  return loss


def validate(config: MoonConfig, trainer: ClientTrainer) -> MoonConfig:
  if not traced(config.mu) and config.mu < 0:
    raise FieldError("moon", "mu", f"must be >= 0, got {config.mu}")
  if not traced(config.tau) and not config.tau > 0:
    raise FieldError("moon", "tau", f"must be > 0, got {config.tau}")
  check_one_of("moon", config, "evaluate", EVALUATIONS)
  check_representation_trainer("moon", trainer)
  return config


def moon(config: MoonConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    return AlgorithmState(server=tree.first(context.params),
                          clients=MoonClients(previous=context.params,
                                              has_previous=jnp.zeros((num_clients,), bool)))

  def broadcast(global_params, clients: MoonClients):
    return tree.broadcast_to_clients(global_params, tree.leading_size(clients.has_previous))

  def client_update(client: MoonClients, global_params, data, key):
    loss_fn = moon_loss(trainer.apply, head_layer(global_params), global_params,
                        client.previous, client.has_previous, config)
    params, stats = trainer.train(global_params, data.train, key, loss_fn=loss_fn)
    return ClientOutput(state=client._replace(previous=params), upload=params, train=stats)

  def aggregate(server, clients: MoonClients, uploads, weights):
    del server
    # From now on every client has a previous model (the authors' pool, see above).
    clients = clients._replace(has_previous=jnp.ones_like(clients.has_previous))
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(global_params, clients: MoonClients):
    if config.evaluate == "local":
      return clients.previous
    return broadcast(global_params, clients)

  return Algorithm(name="moon", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, upload_mean=SERVER_MODEL)
