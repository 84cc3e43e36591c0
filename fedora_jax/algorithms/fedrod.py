"""FedRoD: a shared body and generic head trained for the balanced (generic) task, plus a
personal head on each client that learns the residual for its own distribution.

Chen, Chao. "On Bridging Generic and Personalized Federated Learning for Image
Classification." ICLR 2022. https://arxiv.org/abs/2107.00778
(code: github.com/hongyouc/Fed-RoD; also TsingZ0/PFLlib clientrod.py)

Client i trains the shared body f and generic head g on the balanced softmax loss (its log
class prior added to the logits) and its personal head p_i on the residual; the server
averages body and generic head, weighted by training-set size. Client i is scored with
g(f(x)) + p_i(f(x)). `personal_init` "copy" (PFLlib's; "zeros": p_i starts at zero).

Departures: one optimizer step on the sum of the two losses (PFLlib: two SGDs of one
learning rate).

Details (every option, the departures, measurements): docs/algorithms/fedrod.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, WHOLE_SERVER
from fedora_jax.algorithms.layers import merge_layers, split_body_head, take_layers
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError

Params = Any


class FedRodConfig(NamedTuple):
  personal_init: str = "copy"  # "copy": the initial head (PFLlib); "zeros"


FLAG_HELP = {"personal_init": "FedRoD: personal head starts as a copy of the initial head"
                              " (copy, PFLlib) or at zero (zeros)"}


class FedRodTrained(NamedTuple):
  model: Params     # body + generic head (the shared model)
  personal: Params  # {"params": {head: ...}}: the personal head p_i


def _head_name(params: Params) -> str:
  head = split_body_head(params, 1, "fedrod's head")[1][0]
  if "bias" not in params["params"][head]:
    raise ConfigError(f"fedrod needs an affine head with a bias; {head} has"
                      f" {sorted(params['params'][head])}")
  return head


def with_head(model: Params, head: Params) -> Params:
  return merge_layers(model, head)


def summed_head(model: Params, personal: Params) -> Params:
  """The personalised model: generic head + personal head on the shared body."""
  return merge_layers(model, jax.tree.map(jnp.add, take_layers(model, list(personal["params"])),
                                          personal))


def class_log_prior(y: jax.Array, mask: jax.Array, num_classes: int) -> jax.Array:
  counts = jnp.sum(jax.nn.one_hot(y, num_classes) * mask[:, None], axis=0)
  return jnp.log(jnp.maximum(counts, 1e-8))


def fedrod_loss(trainer: ClientTrainer, head: str, log_prior: jax.Array):
  def loss(p: FedRodTrained, x, y, weights):
    shifted = {"params": {**p.model["params"], head: {
        **p.model["params"][head], "bias": p.model["params"][head]["bias"] + log_prior}}}
    balanced = trainer.loss(shifted, x, y, weights)
    residual = trainer.loss(summed_head(jax.lax.stop_gradient(p.model), p.personal), x, y,
                            weights)
    return balanced + residual
  return loss


def fedrod(config: FedRodConfig, trainer: ClientTrainer) -> Algorithm:
  if config.personal_init not in ("copy", "zeros"):
    raise FieldError("fedrod", "personal_init",
                     f"must be copy or zeros, got {config.personal_init!r}")

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    personal = take_layers(context.params, [_head_name(first)])
    if config.personal_init == "zeros":
      personal = jax.tree.map(jnp.zeros_like, personal)
    return AlgorithmState(server=first, clients=personal)

  def broadcast(model, personal):
    return tree.broadcast_to_clients(model, tree.leading_size(personal))

  def client_update(personal, model, data, key):
    head = _head_name(model)
    num_classes = model["params"][head]["bias"].shape[-1]
    log_prior = class_log_prior(data.train.y, data.train.mask, num_classes)
    trained, stats = trainer.train(FedRodTrained(model=model, personal=personal), data.train,
                                   key, loss_fn=fedrod_loss(trainer, head, log_prior))
    return ClientOutput(state=trained.personal, upload=trained.model, train=stats)

  def aggregate(server, personal, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=personal)

  def personalized_params(model, personal):
    return summed_head(broadcast(model, personal), personal)

  return Algorithm(name="fedrod", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, shared_part=WHOLE_SERVER,
                   upload_mean=SERVER_MODEL)
