"""Server-side optimisers and server means, for algorithms whose server does more than
average the uploaded models (FedAvgM, FedOpt, SCAFFOLD, FedDyn, FedNova, ...).

A server optimiser treats the round's pseudo-gradient g = x - mean_k(y_k) (the global
model minus the mean of the uploaded models) as a gradient, and moves the global model
with an optax transformation: plain SGD with server lr 1 is FedAvg; SGD with momentum is
FedAvgM (Hsu et al. 2019); `adaptive` is FedOpt's FedAdagrad / FedAdam / FedYogi (Reddi
et al. ICLR 2021, Algorithm 2). The optimiser state lives in the algorithm's server state.

`sampled_weights` picks the weights of a server mean over a round's sampled clients:
those of the run (--client_weights, training-set sizes by default) or 1 each (the
1/|S| mean SCAFFOLD, FedDyn and FedOpt write). Clients that sat the round out, and the
engine's filler slots, carry weight 0 either way (rounds.py).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree

Params = Any

SERVER_MEANS = ("uniform", "weighted")
ADAPTIVE = ("adam", "yogi", "adagrad")


def sampled_weights(weights: jax.Array, server_mean: str) -> jax.Array:
  """The weights of a server mean over the sampled clients (weight > 0): "weighted", the
  run's own; "uniform", 1 for each."""
  if server_mean == "uniform":
    return (weights > 0).astype(weights.dtype)
  return weights


def pseudo_gradient(global_params: Params, uploads: Params, weights: jax.Array) -> Params:
  """x - sum_k w_k y_k / sum_k w_k: the step FedAvg takes, as a gradient to descend."""
  return jax.tree.map(jnp.subtract, global_params, tree.weighted_mean(uploads, weights))


def server_step(optimizer: optax.GradientTransformation, global_params: Params,
                opt_state: Any, gradient: Params) -> tuple[Params, Any]:
  """One step of the server optimiser on `gradient`: (new global model, its state)."""
  updates, opt_state = optimizer.update(gradient, opt_state, global_params)
  return optax.apply_updates(global_params, updates), opt_state


class AdaptiveState(NamedTuple):
  momentum: Params   # m_t
  velocity: Params   # v_t


def adaptive(kind: str, lr: float, beta1: float, beta2: float,
             tau: float) -> optax.GradientTransformation:
  """FedOpt's server update (Reddi et al., Algorithm 2) on the pseudo-gradient g = -Delta:

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = v_{t-1} + Delta_t^2                                       (adagrad)
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                     (adam)
    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2) (yogi)
    x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau)

  with m_{-1} = 0 and v_{-1} = tau^2 (the algorithm asks v_{-1} >= tau^2), and, as the
  paper writes it, no bias correction (optax.adam's and optax.yogi's differ there)."""
  if kind not in ADAPTIVE:
    raise ValueError(f"unknown adaptive server optimizer {kind!r}; known: {ADAPTIVE}")

  def init(params):
    return AdaptiveState(momentum=jax.tree.map(jnp.zeros_like, params),
                         velocity=jax.tree.map(lambda p: jnp.full_like(p, tau * tau), params))

  def velocity(v, delta):
    square = jnp.square(delta)
    if kind == "adagrad":
      return v + square
    if kind == "adam":
      return beta2 * v + (1.0 - beta2) * square
    return v - (1.0 - beta2) * square * jnp.sign(v - square)

  def update(gradient, state, params=None):
    del params
    delta = jax.tree.map(jnp.negative, gradient)
    momentum = jax.tree.map(lambda m, d: beta1 * m + (1.0 - beta1) * d, state.momentum, delta)
    velocities = jax.tree.map(velocity, state.velocity, delta)
    updates = jax.tree.map(lambda m, v: lr * m / (jnp.sqrt(v) + tau), momentum, velocities)
    return updates, AdaptiveState(momentum=momentum, velocity=velocities)

  return optax.GradientTransformation(init, update)
