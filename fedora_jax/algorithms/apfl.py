"""APFL: each client mixes its own local model with the global one, learning the mixing weight.

Deng, Kamani, Mahdavi. "Adaptive Personalized Federated Learning." arXiv 2020.
https://arxiv.org/abs/2003.13461  (authors' code: github.com/MLOPTPSU/FedTorch)

Client k keeps a local model v_k and a mixing weight alpha_k; its personalised model is
the mixture  v_bar_k = alpha_k v_k + (1 - alpha_k) w_k  of the parameters. Every local
step, on one minibatch xi (the paper's Algorithm 1 and its gradient step on alpha):
  w_k   <- w_k   - lr grad f_k(w_k; xi)                        (FedAvg's local step)
  v_k   <- v_k   - lr grad_v f_k(v_bar_k; xi) = v_k - lr alpha_k grad f_k(v_bar_k; xi)
  alpha <- alpha - lr grad_alpha f_k(v_bar_k; xi)
                 = alpha - lr <v_k - w_k, grad f_k(v_bar_k; xi)>,  projected onto [0, 1]
all three from the same iterates (w_k, v_k, alpha_k) before the step. After the local
steps the w_k are averaged into the global model (weighted by training-set size, full
participation), which every client starts the next round from; v_k and alpha_k stay in
the stacked client state. Evaluation uses v_bar_k with the latest global model.

One engine step does all three updates: the trained pytree is (w, v, alpha) and its loss
f(w) + f(alpha v + (1 - alpha) stop_gradient(w)), whose gradient is exactly the three
directions above (w gets no gradient from the mixture). They therefore share the run's
client optimizer: with --momentum=0 --weight_decay=0 this is the paper's plain SGD with
one step size; with momentum, alpha is a heavy-ball step like v and w. The round's
reported train loss is that sum, f(w) + f(v_bar).

Defaults: alpha starts at 0.5, the authors' code default (--fed_personal_alpha 0.5;
the paper also reports fixed alpha in {0.25, 0.5, 0.75}); adapting it is the paper's
method, and `adapt_alpha=False` keeps it fixed. Local models v_k start from the shared
initial model, as w does.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError

Params = Any


class ApflConfig(NamedTuple):
  alpha: float = 0.5        # initial mixing weight of the local model (authors' code)
  adapt_alpha: bool = True  # learn alpha by its gradient (the paper's adaptive APFL)


FLAG_HELP = {
    "alpha": "APFL initial mixing weight: personalised model = alpha v + (1 - alpha) w",
    "adapt_alpha": "APFL: update alpha by its gradient each local step (else keep it fixed)",
}


class ApflClient(NamedTuple):
  local: Params      # [K, ...] each client's local model v_k
  alpha: jax.Array   # [K] each client's mixing weight alpha_k in [0, 1]


class ApflTrained(NamedTuple):
  """What one client's local SGD updates jointly."""
  global_: Params    # w_k: its copy of the global model
  local: Params      # v_k
  alpha: jax.Array   # [] alpha_k


def validate(config: ApflConfig) -> ApflConfig:
  if not 0.0 <= config.alpha <= 1.0:
    raise FieldError("apfl", "alpha", f"must be in [0, 1], got {config.alpha}")
  return config


def mix(alpha: jax.Array, local, global_params):
  """alpha v + (1 - alpha) w, leaf by leaf; alpha broadcasts over trailing axes."""
  def mix_leaf(v, w):
    a = jnp.reshape(alpha, jnp.shape(alpha) + (1,) * (v.ndim - jnp.ndim(alpha)))
    return a * v + (1.0 - a) * w
  return jax.tree.map(mix_leaf, local, global_params)


def joint_loss(trainer: ClientTrainer, adapt_alpha: bool):
  """f(w) + f(alpha v + (1 - alpha) sg(w)): its gradient gives APFL's three directions."""
  def loss(p: ApflTrained, x, y, weights):
    alpha = p.alpha if adapt_alpha else jax.lax.stop_gradient(p.alpha)
    mixed = mix(alpha, p.local, jax.lax.stop_gradient(p.global_))
    return trainer.loss(p.global_, x, y, weights) + trainer.loss(mixed, x, y, weights)
  return loss


def project_alpha(new: ApflTrained, old: ApflTrained) -> ApflTrained:
  """Keeps alpha a convex weight after each step (the paper's alpha is in [0, 1])."""
  del old
  return new._replace(alpha=jnp.clip(new.alpha, 0.0, 1.0))


def apfl(config: ApflConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  loss = joint_loss(trainer, config.adapt_alpha)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    global_params = tree.first(context.params)
    clients = ApflClient(local=context.params,
                         alpha=jnp.full((num_clients,), config.alpha, jnp.float32))
    return AlgorithmState(server=global_params, clients=clients)

  def broadcast(global_params, clients: ApflClient):
    return tree.broadcast_to_clients(global_params, clients.alpha.shape[0])

  def client_update(client: ApflClient, global_params, data, key):
    start = ApflTrained(global_=global_params, local=client.local, alpha=client.alpha)
    trained, stats = trainer.train(start, data.train, key, loss_fn=loss,
                                   post_step=project_alpha)
    return ClientOutput(state=ApflClient(local=trained.local, alpha=trained.alpha),
                        upload=trained.global_, train=stats,
                        metrics={"alpha": trained.alpha})

  def aggregate(server, clients, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(global_params, clients: ApflClient):
    return mix(clients.alpha, clients.local,
               tree.broadcast_to_clients(global_params, clients.alpha.shape[0]))

  return Algorithm(name="apfl", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
