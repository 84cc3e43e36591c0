"""FLUTE: a shared representation averaged by the server under personal heads, with
regularisers inspired by neural collapse on the heads and the features.

Liu, Shen, Yang. "Federated Representation Learning in the Under-Parameterized Regime."
ICML 2024. https://arxiv.org/abs/2406.04596 (code: github.com/RenpuLiu/flute, built on
FedRep's; FL-bench's src/server/flute.py and src/client/flute.py read, not copied).

A sampled client trains its own head W_i under the server's frozen body B, then both for
the last rep_epochs (1), on CE + lambda1 NC(W_i, u_i) (Gram towards a simplex ETF over its
classes u_i) + lambda2 ||W_i||^2 [+ lambda3 ||B x||^2 when B trains], lambdas 0.25, 0.0025,
0.0005; it uploads B, W_i, u_i; the server averages the bodies and steps the heads' NC loss
once (server_lr 0.5). A client is scored with the global body under its (stepped) head.

Departures: the authors' head epochs take no step (--flute_rep_epochs equal to
--local_epochs is that form); the authors score before the server's NC step, here after.

Details (every option, the departures, measurements): docs/algorithms/flute.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedrep import PhasedParams, batch_size_of
from fedora_jax.algorithms.layers import (apply_with_representation, head_layer,
                                          merge_layers, split_body_head, take_layers)
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

Params = Any


class FluteConfig(NamedTuple):
  rep_epochs: int = 1         # last local epochs training body and head together
  lambda1: float = 0.25       # weight of the heads' NC term
  lambda2: float = 0.0025     # weight of ||W_i||_F^2
  lambda3: float = 0.0005     # weight of the batch's ||B x||_F^2 (rep epochs only)
  server_lr: float = 0.5      # the server's one SGD step on the heads' NC term (0: none)


FLAG_HELP = {
    "rep_epochs": "FLUTE: last local epochs training body and head together (the ones"
                  " before train the head alone); equal to --local_epochs: the authors'"
                  " code as run (its head epochs take no step)",
    "lambda1": "FLUTE: weight of the heads' neural-collapse term NC(W_i, u_i)",
    "lambda2": "FLUTE: weight of the head's squared Frobenius norm",
    "lambda3": "FLUTE: weight of the batch's summed squared feature norms (rep epochs)",
    "server_lr": "FLUTE: learning rate of the server's SGD step on the round's heads'"
                 " mean NC term (0: no step)",
}


class FluteUpload(NamedTuple):
  body: Params
  kernel: jax.Array   # [d, C] the head's kernel (W_i transposed)
  labels: jax.Array   # [C] u_i: 1 for the classes in the client's training split


def nc_target(labels: jax.Array) -> jax.Array:
  """[C, C] (I - 11^T / C) * (u u^T) / sqrt(C - 1): a simplex ETF's Gram over u's classes."""
  num = labels.shape[0]
  centred = jnp.eye(num) - jnp.full((num, num), 1.0 / num)
  return centred * jnp.outer(labels, labels) / math.sqrt(num - 1)


def frobenius(a: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.sum(jnp.square(a)))


def nc_penalty(kernel: jax.Array, labels: jax.Array) -> jax.Array:
  """NC(W, u) of a head kernel [d, C] (W = kernel^T, so W W^T = kernel^T kernel)."""
  gram = kernel.T @ kernel
  return frobenius(gram / frobenius(gram) - nc_target(labels))


def present_classes(y: jax.Array, mask: jax.Array, num_classes: int) -> jax.Array:
  """[C] 1.0 for each class with a real sample in (y, mask), else 0.0."""
  hits = jax.nn.one_hot(y, num_classes) * mask[:, None].astype(jnp.float32)
  return jnp.max(hits, axis=0)


def flute_loss(apply_fn, head: str, config: FluteConfig, labels: jax.Array,
               features_on: jax.Array):
  """The client's loss(params, x, y, weights): mean CE + lambda1 NC + lambda2 ||W||^2,
  + lambda3 sum_b ||z_b||^2 over the real samples where `features_on`."""
  def loss(params, x, y, weights):
    logits, z = apply_with_representation(apply_fn, params, x, head)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    mean_ce = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    kernel = params["params"][head]["kernel"]
    features = jnp.sum(weights * jnp.sum(jnp.square(z), axis=-1))
    return (mean_ce + config.lambda1 * nc_penalty(kernel, labels)
            + config.lambda2 * jnp.sum(jnp.square(kernel))
            + jnp.where(features_on, config.lambda3, 0.0) * features)
  return loss


def head_then_joint_train(trainer: ClientTrainer, params: Params, head: str,
                          head_steps: jax.Array, loss_at, data, key: jax.Array):
  """Trains only `head` for `head_steps` steps, then every layer; `loss_at(joint)` gives
  the loss of a phase (joint: [] bool). One pass of the trainer's local SGD."""
  def frozen_body(step):
    return step < head_steps

  def phase_params(p: PhasedParams):
    freeze = frozen_body(p.step)
    return {"params": {n: layer if n == head else jax.tree.map(
        lambda a: jnp.where(freeze, jax.lax.stop_gradient(a), a), layer)
        for n, layer in p.params["params"].items()}}

  def phased_loss(p: PhasedParams, x, y, weights):
    return loss_at(~frozen_body(p.step))(phase_params(p), x, y, weights)

  def post_step(new: PhasedParams, old: PhasedParams) -> PhasedParams:
    freeze = frozen_body(old.step)  # the body's momentum and decay never move it here
    layers = {n: new.params["params"][n] if n == head else jax.tree.map(
        lambda a, b: jnp.where(freeze, b, a), new.params["params"][n], old.params["params"][n])
        for n in new.params["params"]}
    return PhasedParams(params={"params": layers}, step=old.step + 1.0)

  start = PhasedParams(params=params, step=jnp.zeros((), jnp.float32))
  trained, stats = trainer.train(start, data, key, post_step=post_step, loss_fn=phased_loss)
  return trained.params, stats


def server_nc_step(kernels: jax.Array, labels: jax.Array, took_part: jax.Array,
                   lr: float) -> jax.Array:
  """One SGD step of (1/S) sum_i NC(W_i, u_i) over the S clients that took part, on their
  kernels [K, d, C]; the others' kernels unchanged."""
  count = jnp.maximum(jnp.sum(took_part), 1).astype(kernels.dtype)
  grads = jax.vmap(jax.grad(nc_penalty))(kernels, labels) / count
  return jnp.where(took_part[:, None, None], kernels - lr * grads, kernels)


def validate(config: FluteConfig, trainer: ClientTrainer) -> None:
  if not 1 <= config.rep_epochs <= trainer.epochs:
    raise FieldError("flute", "rep_epochs", f"must be between 1 and the local epochs"
                     f" ({trainer.epochs}), got {config.rep_epochs}")
  for field in ("lambda1", "lambda2", "lambda3", "server_lr"):
    value = getattr(config, field)
    if not (math.isfinite(value) and value >= 0):
      raise FieldError("flute", field, f"must be a finite number >= 0, got {value}")


def flute(config: FluteConfig, trainer: ClientTrainer) -> Algorithm:
  validate(config, trainer)
  batch_size = batch_size_of(trainer)
  head_epochs = trainer.epochs - config.rep_epochs

  def body_of(params: Params) -> Params:
    return take_layers(params, split_body_head(params, 1, "flute")[0])

  def init(context: InitContext) -> AlgorithmState:
    head = head_layer(context.params, "flute")  # an affine classifier, or one line
    if context.params["params"][head]["kernel"].shape[-1] < 2:
      raise FieldError("flute", "lambda1", "the NC term needs at least 2 classes")
    return AlgorithmState(server=body_of(tree.first(context.params)), clients=context.params)

  def broadcast(body, client_params):
    return tree.broadcast_to_clients(body, tree.leading_size(client_params))

  def client_update(params, body, data, key):
    params = merge_layers(params, body)
    head = head_layer(params, "flute")
    labels = present_classes(data.train.y, data.train.mask,
                             params["params"][head]["kernel"].shape[-1])
    steps_per_epoch = (data.train.n + batch_size - 1) // batch_size
    head_steps = (head_epochs * steps_per_epoch).astype(jnp.float32)
    params, stats = head_then_joint_train(
        trainer, params, head, head_steps,
        lambda joint: flute_loss(trainer.apply, head, config, labels, joint),
        data.train, key)
    upload = FluteUpload(body=body_of(params), kernel=params["params"][head]["kernel"],
                         labels=labels)
    return ClientOutput(state=params, upload=upload, train=stats)

  def aggregate(server, client_params, uploads: FluteUpload, weights):
    del server
    head = head_layer(client_params, "flute")
    took_part = weights > 0
    layer = client_params["params"][head]
    # A client that sat the round out uploads zeros: its own head in their place.
    kernels = jnp.where(took_part[:, None, None], uploads.kernel, layer["kernel"])
    kernels = server_nc_step(kernels, uploads.labels, took_part, config.server_lr)
    clients = {"params": {**client_params["params"], head: {**layer, "kernel": kernels}}}
    return AlgorithmState(server=tree.weighted_mean(uploads.body, weights), clients=clients)

  def personalized_params(body, client_params):
    return merge_layers(client_params, broadcast(body, client_params))

  return Algorithm(name="flute", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
