"""FedRep: a shared representation (body) averaged by the server, a personal head on each
client, trained in alternation.

Collins, Hassani, Mokhtari, Shakkottai. "Exploiting Shared Representations for
Personalized Federated Learning." ICML 2021. https://arxiv.org/abs/2102.07078
(code: github.com/lgcollins/FedRep)

Each round a sampled client takes the server's body, trains its own head (the top
head_layers = 1) for head_epochs = 4 epochs, the body frozen, then the body for the rest of
--local_epochs, the head frozen, and uploads the body; the server averages the bodies
(weighted by training-set size). A client is scored with the global body under its head.

Departures: both phases share one optimizer state, whose momentum gathers the frozen body's
weight decay (phase_optimizer="separate" restarts it for the body, as the authors' code in
effect does); head_epochs 4 of 5 keeps the authors' split (9 of 10 epochs on the head).

Details (every option, the departures, measurements): docs/algorithms/fedrep.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, WHOLE_SERVER, model_message
from fedora_jax.algorithms.layers import merge_layers, split_body_head, take_layers
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError

Params = Any


class FedRepConfig(NamedTuple):
  head_epochs: int = 4  # epochs of head training (body frozen) before the body's epochs
  head_layers: int = 1  # top layers that form the personal head
  phase_optimizer: str = "shared"  # separate: the optimizer state restarts with the body


FLAG_HELP = {
    "head_epochs": "FedRep: local epochs training the head (body frozen) before the body"
                   " trains for the remaining epochs (head frozen)",
    "head_layers": "FedRep: number of top layers in the personal head",
    "phase_optimizer": "FedRep: shared (one optimizer state over both phases: the frozen"
                       " part's momentum gathers its weight decay) or separate (a fresh"
                       " state when the body's phase begins, the authors' codes)",
}
PHASE_OPTIMIZERS = ("shared", "separate")


def check_phase_optimizer(algorithm: str, value: str) -> None:
  if value not in PHASE_OPTIMIZERS:
    raise FieldError(algorithm, "phase_optimizer",
                     f"must be one of {', '.join(PHASE_OPTIMIZERS)}, got {value!r}")


def batch_size_of(trainer: ClientTrainer) -> int:
  """The trainer's batch size B, read off steps_per_epoch(n) = max(1, ceil(n / B))."""
  high = 1
  while trainer.steps_per_epoch(high * 2) == 1:
    high *= 2
    if high > 1 << 30:
      raise ConfigError("cannot determine the local batch size")
  low, high = high, high * 2  # steps(low) == 1 < steps(high)
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if trainer.steps_per_epoch(middle) == 1 else (low, middle)
  return low


class PhasedParams(NamedTuple):
  params: Params
  step: jax.Array  # [] float: real local steps taken so far this round


def alternating_train(trainer: ClientTrainer, params: Params, first: list[str],
                      first_steps: jax.Array, data, key: jax.Array, loss_fn=None,
                      phase_optimizer: str = "shared"):
  """Trains only the layers `first` for `first_steps` steps, then only the others, on
  `loss_fn(params, x, y, weights)` (default: the model's own loss); with
  phase_optimizer "separate" the optimizer state starts afresh at the second phase.

  Returns (params, stats). One pass of the trainer's local SGD.
  """
  model_loss = trainer.loss if loss_fn is None else loss_fn

  def trains_first(step):
    return step < first_steps

  def phase_params(p: PhasedParams):
    in_first = trains_first(p.step)

    def freeze(name, layer):
      frozen = in_first != (name in first)  # this layer sits out the current phase
      return jax.tree.map(lambda a: jnp.where(frozen, jax.lax.stop_gradient(a), a), layer)
    return {"params": {n: freeze(n, layer) for n, layer in p.params["params"].items()}}

  def phased_loss(p: PhasedParams, x, y, weights):
    return model_loss(phase_params(p), x, y, weights)

  def post_step(new: PhasedParams, old: PhasedParams) -> PhasedParams:
    in_first = trains_first(old.step)

    def keep(name, new_layer, old_layer):
      frozen = in_first != (name in first)
      return jax.tree.map(lambda a, b: jnp.where(frozen, b, a), new_layer, old_layer)
    params = {"params": {n: keep(n, new.params["params"][n], old.params["params"][n])
                         for n in new.params["params"]}}
    return PhasedParams(params=params, step=old.step + 1.0)

  def second_phase_starts(p: PhasedParams) -> jax.Array:
    return p.step == first_steps

  start = PhasedParams(params=params, step=jnp.zeros((), jnp.float32))
  restart = second_phase_starts if phase_optimizer == "separate" else None
  trained, stats = trainer.train(start, data, key, post_step=post_step, loss_fn=phased_loss,
                                 restart_optimizer=restart)
  return trained.params, stats


def fedrep(config: FedRepConfig, trainer: ClientTrainer) -> Algorithm:
  if config.head_epochs < 1:
    raise FieldError("fedrep", "head_epochs", f"must be >= 1, got {config.head_epochs}")
  if config.head_epochs >= trainer.epochs:
    raise FieldError("fedrep", "head_epochs",
                     f"({config.head_epochs}) must be smaller than the local epochs"
                     f" ({trainer.epochs}), or the body never trains")
  if config.head_layers < 1:
    raise FieldError("fedrep", "head_layers", f"must be >= 1, got {config.head_layers}")
  check_phase_optimizer("fedrep", config.phase_optimizer)
  batch_size = batch_size_of(trainer)

  def body_of(params: Params) -> Params:
    return take_layers(params, split_body_head(params, config.head_layers, "fedrep_head_layers")[0])

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    return AlgorithmState(server=body_of(first), clients=context.params)

  def broadcast(body, client_params):
    return tree.broadcast_to_clients(body, tree.leading_size(client_params))

  def client_update(params, body, data, key):
    params = merge_layers(params, body)
    head = split_body_head(params, config.head_layers, "fedrep_head_layers")[1]
    steps_per_epoch = (data.train.n + batch_size - 1) // batch_size
    head_steps = (config.head_epochs * steps_per_epoch).astype(jnp.float32)
    params, stats = alternating_train(trainer, params, head, head_steps, data.train, key,
                                      phase_optimizer=config.phase_optimizer)
    return ClientOutput(state=params, upload=body_of(params), train=stats)

  def aggregate(server, client_params, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=client_params)

  def personalized_params(body, client_params):
    return merge_layers(client_params, broadcast(body, client_params))

  # ALA (PFLlib's clientrep.py: the server sends the body, copied into model.base) in
  # place of that copy works on the body: W covers the body's top p layers, the head is
  # the client's own, W learns on the whole model's loss; theta_i is the whole trained
  # model, the client's state.
  return Algorithm(name="fedrep", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   ala_hooks=model_message(personal_is_local=True)._replace(
                       trained=lambda out: out.state),
                   shared_part=WHOLE_SERVER, upload_mean=SERVER_MODEL)
