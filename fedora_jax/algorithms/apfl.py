"""APFL: each client mixes its own local model with the global one, learning the mixing weight.

Deng, Kamani, Mahdavi. "Adaptive Personalized Federated Learning." arXiv 2020.
https://arxiv.org/abs/2003.13461  (authors' code: github.com/MLOPTPSU/FedTorch)

Client k trains its copy w_k of the global model, its local model v_k and its mixing weight
alpha_k in [0, 1] (one loss, the run's client optimizer); the server averages the w_k,
weighted by training-set size. Client k is scored with its mixture of v_k and w_k. Config:
`mixing` "output", `alpha_update` "round", `alpha` 0.5 (the start), `adapt_alpha` True.

Departures: the defaults follow the authors' code, not the paper: outputs mixed, not
parameters (mixing="parameters" is the paper's); alpha moved once a round, on the whole
training split (alpha_update="step", every step, is the paper's). mixing="pfllib" is
PFLlib's form, behind ConFREE's table.

Details (every option, the departures, measurements): docs/algorithms/apfl.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, WHOLE_SERVER, model_message
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError, traced

Params = Any


MIXINGS = ("output", "parameters", "pfllib")


class ApflConfig(NamedTuple):
  alpha: float = 0.5        # initial mixing weight of the local model (authors' code)
  adapt_alpha: bool = True  # learn alpha by its gradient (adaptive APFL; when: alpha_update)
  mixing: str = "output"    # "output": authors' code (mixed logits); "parameters": paper;
                            # "pfllib": PFLlib's clientapfl.py (own losses, mixed at the end)
  alpha_update: str = "round"  # "round": authors' code, once a round; "step": the paper's
  alpha_penalty: float = 0.02  # authors' code: alpha's gradient + penalty * alpha (round,
                               # and pfllib's every step)
  lr: float = 5e-3          # alpha's step (round; pfllib: its penalty's): the run's lr


FLAG_HELP = {
    "alpha": "APFL initial mixing weight: personalised model = alpha v + (1 - alpha) w",
    "adapt_alpha": "APFL: learn alpha by its gradient (when: alpha_update; else keep it fixed)",
    "alpha_update": "APFL: round (authors' code: one plain SGD step on alpha a round) or"
                    " step (the paper: every local step, with the client optimizer)",
    "alpha_penalty": "APFL: alpha's round step (pfllib: every step) uses grad +"
                     " alpha_penalty * alpha",
    "mixing": "APFL: output (authors' code: alpha v(x) + (1 - alpha) w_k(x) with the"
              " client's own w_k), parameters (the paper: alpha v + (1 - alpha) w) or"
              " pfllib (PFLlib's: v and w on their own losses, alpha every step, v <-"
              " (1 - alpha) w_k + alpha v at the round's end)",
}


class ApflClient(NamedTuple):
  local: Params      # [K, ...] each client's local model v_k
  alpha: jax.Array   # [K] each client's mixing weight alpha_k in [0, 1]
  own_global: Params  # [K, ...] w_k after the client's last local steps (output mixing)


class ApflPersonal(NamedTuple):
  """A client's personalised predictor under output mixing."""
  alpha: jax.Array
  local: Params
  global_: Params


class ApflTrained(NamedTuple):
  """What one client's local SGD updates jointly."""
  global_: Params    # w_k: its copy of the global model
  local: Params      # v_k
  alpha: jax.Array   # [] alpha_k


def validate(config: ApflConfig) -> ApflConfig:
  if not traced(config.alpha) and not 0.0 <= config.alpha <= 1.0:
    raise FieldError("apfl", "alpha", f"must be in [0, 1], got {config.alpha}")
  if config.alpha_update not in ("round", "step"):
    raise FieldError("apfl", "alpha_update",
                     f"must be round or step, got {config.alpha_update!r}")
  if config.mixing not in MIXINGS:
    raise FieldError("apfl", "mixing",
                     f"must be output, parameters or pfllib, got {config.mixing!r}")
  return config


def mix(alpha: jax.Array, local, global_params):
  """alpha v + (1 - alpha) w, leaf by leaf; alpha broadcasts over trailing axes."""
  def mix_leaf(v, w):
    a = jnp.reshape(alpha, jnp.shape(alpha) + (1,) * (v.ndim - jnp.ndim(alpha)))
    return a * v + (1.0 - a) * w
  return jax.tree.map(mix_leaf, local, global_params)


def mixed_outputs(apply, personal: ApflPersonal, x: jax.Array) -> jax.Array:
  """alpha v(x) + (1 - alpha) w(x): the authors' code's personalised prediction."""
  return (personal.alpha * apply(personal.local, x)
          + (1.0 - personal.alpha) * apply(personal.global_, x))


def personal_loss(trainer: ClientTrainer, mixing: str, alpha, local, global_params,
                  x, y, weights):
  """The loss of the personalised prediction: mixed outputs or the mixed parameters (PFLlib:
  v's own loss)."""
  if mixing == "pfllib":
    return trainer.loss(local, x, y, weights)
  if mixing == "output":
    outputs = mixed_outputs(trainer.apply, ApflPersonal(alpha, local, global_params), x)
    return masked_cross_entropy(outputs, y, weights)
  return trainer.loss(mix(alpha, local, global_params), x, y, weights)


def joint_loss(trainer: ClientTrainer, adapt_alpha: bool, mixing: str):
  """f(w) + f(mixture of v and sg(w)): its gradient gives APFL's three directions."""
  def loss(p: ApflTrained, x, y, weights):
    alpha = p.alpha if adapt_alpha else jax.lax.stop_gradient(p.alpha)
    frozen_global = jax.lax.stop_gradient(p.global_)
    return (trainer.loss(p.global_, x, y, weights)
            + personal_loss(trainer, mixing, alpha, p.local, frozen_global, x, y, weights))
  return loss


def round_alpha_step(trainer: ClientTrainer, config: ApflConfig, start: ApflTrained,
                     train_data) -> jax.Array:
  """The authors' once-a-round alpha: clip(alpha - lr (d f(mixture)/d alpha + c alpha))."""
  weights = train_data.mask.astype(jnp.float32)
  grad = jax.grad(lambda a: personal_loss(trainer, config.mixing, a, start.local,
                                          start.global_, train_data.x, train_data.y,
                                          weights))(start.alpha)
  return jnp.clip(start.alpha - config.lr * (grad + config.alpha_penalty * start.alpha),
                  0.0, 1.0)


def pfllib_alpha_step(config: ApflConfig):
  """PFLlib's alpha after each local step: clip(alpha - <v - w, alpha dv + (1 - alpha) dw>
  - lr 0.02 alpha), dv and dw the step v and w took (lr times their gradients)."""
  def post_step(new: ApflTrained, old: ApflTrained) -> ApflTrained:
    steps = mix(old.alpha, jax.tree.map(jnp.subtract, old.local, new.local),
                jax.tree.map(jnp.subtract, old.global_, new.global_))
    gap = jax.tree.map(jnp.subtract, new.local, new.global_)
    direction = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(gap),
                                                   jax.tree.leaves(steps)))
    alpha = old.alpha - direction - config.lr * config.alpha_penalty * old.alpha
    return new._replace(alpha=jnp.clip(alpha, 0.0, 1.0))
  return post_step


def project_alpha(new: ApflTrained, old: ApflTrained) -> ApflTrained:
  """Keeps alpha a convex weight after each step (the paper's alpha is in [0, 1])."""
  del old
  return new._replace(alpha=jnp.clip(new.alpha, 0.0, 1.0))


def apfl(config: ApflConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  if config.mixing == "output" and trainer.task != "classification":
    raise ConfigError(f"apfl with mixing=output needs a classification task, not "
                      f"{trainer.task} (use --apfl_mixing=parameters)")
  pfllib = config.mixing == "pfllib"
  per_round = config.adapt_alpha and config.alpha_update == "round" and not pfllib
  loss = joint_loss(trainer, config.adapt_alpha and not per_round and not pfllib,
                    config.mixing)
  post_step = project_alpha
  if pfllib:  # a fixed alpha stays put under weight decay too
    post_step = (pfllib_alpha_step(config) if config.adapt_alpha
                 else lambda new, old: new._replace(alpha=old.alpha))

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    global_params = tree.first(context.params)
    clients = ApflClient(local=context.params,
                         alpha=jnp.full((num_clients,), config.alpha, jnp.float32),
                         own_global=context.params)
    return AlgorithmState(server=global_params, clients=clients)

  def broadcast(global_params, clients: ApflClient):
    return tree.broadcast_to_clients(global_params, clients.alpha.shape[0])

  def client_update(client: ApflClient, global_params, data, key):
    start = ApflTrained(global_=global_params, local=client.local, alpha=client.alpha)
    if per_round:
      train_data = jax.tree.map(jnp.asarray, data.train)
      start = start._replace(alpha=round_alpha_step(trainer, config, start, train_data))
    trained, stats = trainer.train(start, data.train, key, loss_fn=loss,
                                   post_step=post_step)
    local = mix(trained.alpha, trained.local, trained.global_) if pfllib else trained.local
    return ClientOutput(state=ApflClient(local=local, alpha=trained.alpha,
                                         own_global=trained.global_),
                        upload=trained.global_, train=stats,
                        metrics={"alpha": trained.alpha})

  def aggregate(server, clients, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(global_params, clients: ApflClient):
    if pfllib:  # v_k, already the round's-end mixture
      return clients.local
    if config.mixing == "output":
      return ApflPersonal(alpha=clients.alpha, local=clients.local,
                          global_=clients.own_global)
    return mix(clients.alpha, clients.local,
               tree.broadcast_to_clients(global_params, clients.alpha.shape[0]))

  evaluate = None
  if config.mixing == "output":
    evaluate_with = trainer.evaluate_with
    if evaluate_with is None:
      raise ConfigError("apfl with mixing=output needs the trainer's evaluate_with"
                        " (make_client_trainer)")
    evaluate = evaluate_with(lambda personal, x: mixed_outputs(trainer.apply, personal, x))
  return Algorithm(name="apfl", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, evaluate=evaluate,
                   ala_hooks=model_message(personal_is_local=False),
                   shared_part=WHOLE_SERVER, upload_mean=SERVER_MODEL)
