"""FedMTL (MOCHA's objective): federated multi-task learning, each client a task with its
own model, the tasks tied by a regulariser over the matrix W of every client's model.

Smith, Chiang, Sanjabi, Talwalkar. "Federated Multi-Task Learning." NeurIPS 2017.
https://arxiv.org/abs/1705.10467
(code: PFLlib's clientmtl.py / servermtl.py, which the verification runs beside this
module. MOCHA itself solves the convex problem's dual with local SDCA steps; like
PFLlib, this module descends the primal with the run's optimiser, which any model
allows. The paper's full text is not on disk; no equation numbers.)

A sampled client t trains and is scored with its own w_t, on its loss plus R(W) = lambda_1
sum_t ||w_t - w_bar||^2 + lambda_2 ||W||_F^2 (`omega` "mean"), the other columns of W fixed; the
server sends the models' mean and norms. lambda_1, lambda_2 = lam_mean, lam_norm (1) times s,
lam_scale "digits": PFLlib's 10^-(digits of d + 1), d the parameter count; "one": s = 1.

Departures: every client is a column of W (PFLlib: the round's sampled ones); a partial last
batch trains. PFLlib's form: regulariser_gradient=false (R moves nothing), omega="pfllib".

Details (every option, the departures, measurements): docs/algorithms/fedmtl.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import (Algorithm, AlgorithmState, ClientOutput,
                                        InitContext, keep_states)
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
LAM_SCALES = ("digits", "one")
OMEGAS = ("mean", "pfllib")


class FedMtlConfig(NamedTuple):
  lam_mean: float = 1.0               # lambda_1 / s, on tr(W Omega W^T)
  lam_norm: float = 1.0               # lambda_2 / s, on ||W||_F^2
  lam_scale: str = "digits"           # s: "digits" (PFLlib's 10^-(digits of d + 1)) or "one"
  omega: str = "mean"                 # "mean" (mean-regularised MTL) or "pfllib"
  regulariser_gradient: bool = True   # R descended (true) or only reported (PFLlib: false)


FLAG_HELP = {
    "lam_mean": "FedMTL: lambda_1 / s, the weight of tr(W Omega W^T) = sum_t ||w_t -"
                " mean||^2",
    "lam_norm": "FedMTL: lambda_2 / s, the weight of ||W||_F^2",
    "lam_scale": "FedMTL: s, PFLlib's 10^-(digits of the parameter count + 1) (digits) or"
                 " 1 (one)",
    "omega": "FedMTL: the task relation, mean-regularised (I - 11^T/m)^2 (mean) or PFLlib's"
             " ones-matrix form, (1 - 1/m)^2 ||sum of the models||^2 (pfllib)",
    "regulariser_gradient": "FedMTL: descend the regulariser (true) or only add it to the"
                            " loss, as PFLlib's detached copies do (false: trains as LOCAL)",
}


class MtlMessage(NamedTuple):
  """What a client needs of W as the round starts."""
  mean: Params            # w_bar_0, the models' mean
  spread: jax.Array       # [] sum_s ||w_s - w_bar_0||^2
  squares: jax.Array      # [] sum_s ||w_s||^2
  clients: jax.Array      # [] m, the clients (the columns of W)


def validate(config: FedMtlConfig, trainer: ClientTrainer) -> FedMtlConfig:
  for field in ("lam_mean", "lam_norm"):
    if getattr(config, field) < 0:
      raise FieldError("fedmtl", field, f"must be >= 0, got {getattr(config, field)}")
  check_one_of("fedmtl", config, "lam_scale", LAM_SCALES)
  check_one_of("fedmtl", config, "omega", OMEGAS)
  if trainer.task != "classification" or trainer.apply is None:
    raise ConfigError("fedmtl needs a classification task and the model's forward")
  return config


def scale_of(params: Params, lam_scale: str) -> float:
  """s: 1, or PFLlib's 10^-f, f = the digits of d plus 1 (d the parameter count)."""
  if lam_scale == "one":
    return 1.0
  count = sum(leaf.size for leaf in jax.tree.leaves(params))
  return 10.0 ** -(int(math.log10(count) + 1) + 1)


def _dot(a: Params, b: Params) -> jax.Array:
  return jnp.asarray(sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a),
                                                          jax.tree.leaves(b))))


def regulariser(params: Params, start: Params, message: MtlMessage, config: FedMtlConfig,
                scale: float) -> jax.Array:
  """R(W) with this client's column at `params` (it was `start` when the round began), the
  others as they began. With delta = params - start and w_bar_0 their mean then:
    sum_s ||w_s - w_bar||^2 = spread + 2 <delta, start - w_bar_0> + (1 - 1/m) ||delta||^2
    ||W||_F^2 = squares + 2 <delta, start> + ||delta||^2
  (differences, not ||a||^2 - ||b||^2, where models are close)."""
  delta = jax.tree.map(jnp.subtract, params, start)
  m = message.clients
  moved = _dot(delta, delta)
  norm = message.squares + 2.0 * _dot(delta, start) + moved
  if config.omega == "mean":
    offset = jax.tree.map(jnp.subtract, start, message.mean)
    relation = message.spread + 2.0 * _dot(delta, offset) + (1 - 1 / m) * moved
  else:  # (1 - 1/m)^2 ||sum_s w_s||^2, the sum being m w_bar_0 + delta
    total = jax.tree.map(lambda w, d: m * w + d, message.mean, delta)
    relation = (1 - 1 / m) ** 2 * _dot(total, total)
  return scale * (config.lam_mean * relation + config.lam_norm * norm)


def fedmtl(config: FedMtlConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply = trainer.apply
  assert apply is not None  # validate() checked it

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=(), clients=context.params)

  def broadcast(server, clients):
    del server
    count = tree.leading_size(clients)
    mean = tree.weighted_mean(clients, jnp.ones(count))
    spread = jnp.sum(tree.squared_distances(clients, tree.broadcast_to_clients(mean, 1)))
    squares = jnp.asarray(sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(clients)))
    message = MtlMessage(mean=mean, spread=spread, squares=squares,
                         clients=jnp.asarray(count, jnp.float32))
    return tree.broadcast_to_clients(message, count)

  def client_update(start, message: MtlMessage, data, key):
    scale = scale_of(start, config.lam_scale)

    def loss_fn(params, x, y, weights):
      fixed = params if config.regulariser_gradient else jax.lax.stop_gradient(params)
      return (masked_cross_entropy(apply(params, x), y, weights)
              + regulariser(fixed, start, message, config, scale))
    params, stats = trainer.train(start, data.train, key, loss_fn=loss_fn)
    return ClientOutput(state=params, upload=(), train=stats)

  return Algorithm(name="fedmtl", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=keep_states,
                   personalized_params=lambda server, clients: clients)
