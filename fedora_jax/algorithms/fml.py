"""FML: Federated Mutual Learning. Each client trains its personal model and a copy of
the shared meme model together, each learning from the labels and from the other's
predictions (deep mutual learning); the server averages the memes.

Shen, Zhang, Zhao, Wu, Wu, Yang, Liang, Wu. "Federated Mutual Learning." arXiv 2020.
https://arxiv.org/abs/2006.16765
(code: PFLlib's clientfml.py / serverfml.py, which the verification runs beside this
module. The paper's full text is not on disk: the objectives (docs/algorithms/fml.md) are
deep mutual learning's as the paper's abstract and PFLlib state them; no equation numbers.)

Client i trains its personal model w_i and the received meme m together, each on CE and a KL
to the other's fixed prediction (`alpha` = `beta` = 0.5 on CE); the server's meme is the
mean of the trained memes (`server_mean` "weighted"). Client i is scored with w_i.

Departures: a partial last batch trains. PFLlib's form, as options: detach_peer=false,
kl_reduction="mean", clip_norm=10, server_mean="uniform".

Details (every option, the departures, measurements): docs/algorithms/fml.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
KL_REDUCTIONS = ("batchmean", "mean")


class FmlConfig(NamedTuple):
  alpha: float = 0.5            # the personal model's weight on its labels
  beta: float = 0.5             # the meme model's weight on its labels
  detach_peer: bool = True      # the other model's prediction a fixed target (PFLlib: no)
  kl_reduction: str = "batchmean"  # "batchmean" (the KL) or "mean" (PFLlib: the KL / C)
  clip_norm: float = 0.0        # each model's gradient clipped to this norm (0: none;
                                # PFLlib 10)
  server_mean: str = "weighted"  # "weighted" (the run's weights) or "uniform" (PFLlib)


FLAG_HELP = {
    "alpha": "FML: the personal model's loss alpha CE + (1 - alpha) KL(meme || personal)",
    "beta": "FML: the meme model's loss beta CE + (1 - beta) KL(personal || meme)",
    "detach_peer": "FML: each KL's target, the other model's prediction, held fixed (true)"
                   " or differentiated too (false, PFLlib)",
    "kl_reduction": "FML: the KL averaged over the batch (batchmean) or over the batch and"
                    " the classes (mean, PFLlib's nn.KLDivLoss default)",
    "clip_norm": "FML: each model's gradient clipped to this global norm before its step"
                 " (0: none; PFLlib 10)",
    "server_mean": "FML: mean of the trained memes with the run's client weights (weighted)"
                   " or uniform over the sampled clients (uniform, PFLlib)",
}


class FmlTrained(NamedTuple):
  personal: Params
  meme: Params


def validate(config: FmlConfig, trainer: ClientTrainer) -> FmlConfig:
  for field in ("alpha", "beta"):
    if not 0 <= getattr(config, field) <= 1:
      raise FieldError("fml", field, f"must be in [0, 1], got {getattr(config, field)}")
  if config.clip_norm < 0:
    raise FieldError("fml", "clip_norm", f"must be >= 0, got {config.clip_norm}")
  check_one_of("fml", config, "kl_reduction", KL_REDUCTIONS)
  check_one_of("fml", config, "server_mean", server_optimizer.SERVER_MEANS)
  if trainer.task != "classification" or trainer.apply is None:
    raise ConfigError("fml needs a classification task and the model's forward")
  return config


def kl_divergence(target_logits: jax.Array, logits: jax.Array, weights: jax.Array,
                  reduction: str) -> jax.Array:
  """KL(softmax(target) || softmax(logits)) per sample, averaged over the real samples
  (and over the classes too for "mean")."""
  target = jax.nn.log_softmax(target_logits)
  per_sample = jnp.sum(jnp.exp(target) * (target - jax.nn.log_softmax(logits)), axis=-1)
  mean = jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  return mean / logits.shape[-1] if reduction == "mean" else mean


def clipped_gradient_surrogate(loss_fn, clip_norm: float):
  """loss_fn(params, x, y, weights) with the value of loss_fn and, as its gradient, the
  gradient of loss_fn with each top-level part's (personal, meme) clipped to global norm
  clip_norm (torch.nn.utils.clip_grad_norm_ per model)."""
  def surrogate(params: FmlTrained, x, y, weights):
    value, grads = jax.value_and_grad(loss_fn)(params, x, y, weights)
    grads = jax.lax.stop_gradient(grads)
    clipped = [jax.tree.map(lambda g, s=_clip_scale(part, clip_norm): s * g, part)
               for part in grads]
    linear = sum(jnp.vdot(g, p - jax.lax.stop_gradient(p))
                 for part, model in zip(clipped, params)
                 for g, p in zip(jax.tree.leaves(part), jax.tree.leaves(model)))
    return jax.lax.stop_gradient(value) + linear
  return surrogate


def _clip_scale(grads: Params, clip_norm: float) -> jax.Array:
  norm = optax.tree.norm(grads)
  return jnp.minimum(1.0, clip_norm / (norm + 1e-6))   # torch's clip_grad_norm_ eps


def fml_loss(trainer: ClientTrainer, config: FmlConfig):
  apply = trainer.apply
  assert apply is not None  # validate() requires the model's forward

  def loss(params: FmlTrained, x, y, weights):
    personal = apply(params.personal, x)
    meme = apply(params.meme, x)
    peer_of_personal, peer_of_meme = meme, personal
    if config.detach_peer:
      peer_of_personal = jax.lax.stop_gradient(meme)
      peer_of_meme = jax.lax.stop_gradient(personal)
    ce = optax.softmax_cross_entropy_with_integer_labels
    mean = lambda v: jnp.sum(v * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return (config.alpha * mean(ce(personal, y))
            + (1 - config.alpha) * kl_divergence(peer_of_personal, personal, weights,
                                                 config.kl_reduction)
            + config.beta * mean(ce(meme, y))
            + (1 - config.beta) * kl_divergence(peer_of_meme, meme, weights,
                                                config.kl_reduction))
  if config.clip_norm > 0:
    return clipped_gradient_surrogate(loss, config.clip_norm)
  return loss


def fml(config: FmlConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  loss_fn = fml_loss(trainer, config)

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=tree.first(context.params), clients=context.params)

  def broadcast(meme, personal):
    return tree.broadcast_to_clients(meme, tree.leading_size(personal))

  def client_update(personal, meme, data, key):
    trained, stats = trainer.train(FmlTrained(personal=personal, meme=meme), data.train, key,
                                   loss_fn=loss_fn)
    return ClientOutput(state=trained.personal, upload=trained.meme, train=stats)

  def aggregate(meme, personal, uploads, weights):
    del meme
    return AlgorithmState(
        server=tree.weighted_mean(uploads, server_optimizer.sampled_weights(
            weights, config.server_mean)),
        clients=personal)

  def personalized_params(meme, personal):
    del meme
    return personal

  return Algorithm(name="fml", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, uploads_unordered=True)
