"""FedEM: federated EM over a mixture of M shared component models, each client its own
mixture weights.

Marfoq, Neglia, Bellet, Kameni, Vidal. "Federated Multi-Task Learning under a Mixture of
Distributions." NeurIPS 2021. https://arxiv.org/abs/2108.10252
(code followed: the authors' github.com/omarfoq/FedEM, its client.step and
learners_ensemble; FL-bench's src/client/fedem.py and src/server/fedem.py,
KarhouTam/FL-bench, GPL: read, not run or copied. PFLlib has no FedEM, so there is no
verification row: the unit tests check the E-step, the weighted loss, pi's M-step, the
server's average and the mixture's prediction by hand.)

Each round a client takes the M = num_components (3) components, weighs each sample by its
responsibilities (E-step), updates its weights pi_k and trains every component on its weighted
loss; the server averages each component. Scored: sum_m pi_km softmax(h_m(x)) ("mixture").

Departures: the components start as re-draws of the run's initial model (the authors: M
independent models); q is recomputed per batch (the same numbers).

Details (every option, the departures, measurements): docs/algorithms/fedem.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError

Params = Any
PREDICTIONS = ("mixture", "logits")
LOG_FLOOR = 1e-12  # the mixture's probability is clamped before its log (the authors' clamp)


class FedEmConfig(NamedTuple):
  num_components: int = 3     # M: the paper's and the authors' n_learners
  prediction: str = "mixture"  # "mixture": sum_m pi_m softmax(h_m) (paper); "logits": FL-bench's


FLAG_HELP = {
    "num_components": "FedEM: number of shared component models M (the paper's 3)",
    "prediction": "FedEM: a client's prediction, mixture: sum_m pi_m softmax(h_m(x)) (the"
                  " paper's and the authors'); logits: sum_m pi_m h_m(x) (FL-bench's)",
}


class FedEmServer(NamedTuple):
  components: Params  # leaves [M, ...]: theta_1..theta_M


class FedEmClients(NamedTuple):
  mixture: jax.Array  # [K, M] pi_k, each row on the simplex


def validate(config: FedEmConfig, trainer: ClientTrainer) -> FedEmConfig:
  if config.num_components < 1:
    raise FieldError("fedem", "num_components", f"must be >= 1, got {config.num_components}")
  if config.prediction not in PREDICTIONS:
    raise FieldError("fedem", "prediction", f"must be mixture or logits, got"
                     f" {config.prediction!r}")
  if trainer.task != "classification" or trainer.apply is None:
    raise ConfigError("fedem needs a classification task and the model's forward")
  return config


def component_outputs(apply_fn, components: Params, x: jax.Array) -> jax.Array:
  """[M, B, classes]: every component's logits (a loop over the few components, so each
  forward pass is a plain one of the run's model)."""
  num = tree.leading_size(components)
  return jnp.stack([apply_fn(tree.take(components, m), x) for m in range(num)])


def per_sample_losses(apply_fn, components: Params, x: jax.Array, y: jax.Array) -> jax.Array:
  """[B, M] cross-entropy of each sample under each component."""
  logits = component_outputs(apply_fn, components, x)
  return jax.vmap(optax.softmax_cross_entropy_with_integer_labels, (0, None))(logits, y).T


def responsibilities(log_mixture: jax.Array, losses: jax.Array) -> jax.Array:
  """E-step [B, M]: q_m = softmax_m(log pi_m - loss_m) of per-sample losses [B, M]."""
  return jax.nn.softmax(log_mixture[None, :] - losses, axis=-1)


def weighted_loss(losses: jax.Array, q: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_m sum_i w_i q_im loss_im / sum_i w_i: the M components' weighted losses, summed."""
  return jnp.sum(weights[:, None] * q * losses) / jnp.maximum(jnp.sum(weights), 1.0)


def mixture_log_probs(logits: jax.Array, mixture: jax.Array, prediction: str) -> jax.Array:
  """[B, classes] a client's prediction from its components' logits [M, B, classes] and
  pi [M]: log sum_m pi_m softmax(logits_m) (mixture), or sum_m pi_m logits_m (logits)."""
  if prediction == "logits":
    return jnp.einsum("m,mbc->bc", mixture, logits)
  probs = jnp.einsum("m,mbc->bc", mixture, jax.nn.softmax(logits, axis=-1))
  return jnp.log(jnp.clip(probs, LOG_FLOOR, 1.0))


def fedem(config: FedEmConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None and trainer.evaluate_with is not None  # validate checked

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    components = tree.initial_centers(context.params, context.key, config.num_components)
    mixture = jnp.full((num_clients, config.num_components), 1.0 / config.num_components,
                       jnp.float32)
    return AlgorithmState(server=FedEmServer(components=components),
                          clients=FedEmClients(mixture=mixture))

  def broadcast(server: FedEmServer, clients: FedEmClients):
    return tree.broadcast_to_clients(server.components, clients.mixture.shape[0])

  def client_update(client: FedEmClients, components: Params, data, key):
    log_mixture = jnp.log(client.mixture)

    def loss_fn(params, seen, x, y, w):
      # The E-step's models are fixed: BatchNorm on their running averages (the authors'
      # and FL-bench's eval() while computing the sample weights).
      with batch_stats.inference():
        received = per_sample_losses(apply_fn, components, x, y)
      q = jax.lax.stop_gradient(responsibilities(log_mixture, received))
      loss = weighted_loss(per_sample_losses(apply_fn, params, x, y), q, w)
      return loss, (seen[0] + jnp.sum(w[:, None] * q, axis=0), seen[1] + jnp.sum(w))

    start = (jnp.zeros((config.num_components,), jnp.float32), jnp.zeros((), jnp.float32))
    params, stats, (q_sum, count) = trainer.train(components, data.train, key,
                                                  loss_fn=loss_fn, carry=start)
    mixture = jnp.where(count > 0, q_sum / jnp.maximum(count, 1.0), client.mixture)
    return ClientOutput(state=FedEmClients(mixture=mixture), upload=params, train=stats)

  def aggregate(server: FedEmServer, clients: FedEmClients, uploads: Params, weights):
    del server
    return AlgorithmState(server=FedEmServer(components=tree.weighted_mean(uploads, weights)),
                          clients=clients)

  def personalized_params(server: FedEmServer, clients: FedEmClients):
    return (broadcast(server, clients), clients.mixture)

  def forward(personal, x):
    components, mixture = personal
    return mixture_log_probs(component_outputs(apply_fn, components, x), mixture,
                             config.prediction)

  return Algorithm(name="fedem", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   evaluate=trainer.evaluate_with(forward), uploads_unordered=True)
