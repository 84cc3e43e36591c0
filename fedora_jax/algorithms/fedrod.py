"""FedRoD: a shared body and generic head trained for the balanced (generic) task, plus a
personal head on each client that learns the residual for its own distribution.

Chen, Chao. "On Bridging Generic and Personalized Federated Learning for Image
Classification." ICLR 2022. https://arxiv.org/abs/2107.00778
(code: github.com/hongyouc/Fed-RoD; also TsingZ0/PFLlib clientrod.py)

Client i's model: body f (all but the top layer), generic head g (the top layer), both
shared and averaged by the server (FedAvg, weighted by training-set size), and a
personal head p_i of the same shape as g, kept on the client. Its personalised logits
are g(f(x)) + p_i(f(x)). Every local step, on one minibatch:
  * body and generic head descend the balanced softmax loss (BSM, Ren et al. 2020, the
    paper's Eq. for the generic objective):
        L_BSM = CE(g(f(x)) + log pi_i, y),   pi_i[c] = the client's count of class c,
    i.e. cross-entropy with the client's log class prior added to the logits;
  * the personal head descends CE(sg(g(f(x))) + p_i(sg(f(x))), y): the body and the
    generic head are fixed for it (the residual).
The two use the same optimizer settings (PFLlib: two SGDs of one learning rate); here
one optimizer step does both, the loss being their sum with the stop-gradients above.

Because the head is an affine layer, logits add exactly when parameters add:
g(z) + p(z) = (W_g + W_p) z + (b_g + b_p), and adding log pi to the logits is adding it
to b_g. So both losses are the model's own cross-entropy (ClientTrainer.loss) on a model
whose head parameters are summed / shifted; the head must be a layer with a "bias".
A class the client has never seen gets log(1e-8) instead of -inf.

personal_init: PFLlib starts p_i as a copy of the initial head ("copy", the default);
"zeros" starts the personalised model as the generic one.
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
