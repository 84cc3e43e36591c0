"""APFL: each client mixes its own local model with the global one, learning the mixing weight.

Deng, Kamani, Mahdavi. "Adaptive Personalized Federated Learning." arXiv 2020.
https://arxiv.org/abs/2003.13461  (authors' code: github.com/MLOPTPSU/FedTorch)

Client k keeps a local model v_k and a mixing weight alpha_k; its personalised model is
the mixture  v_bar_k = alpha_k v_k + (1 - alpha_k) w_k  of the parameters (the paper's
`mixing="parameters"`; the authors' code mixes outputs instead, see "Mixing" below).
Every local step, on one minibatch xi (the paper's Algorithm 1 and its gradient step on
alpha):
  w_k   <- w_k   - lr grad f_k(w_k; xi)                        (FedAvg's local step)
  v_k   <- v_k   - lr grad_v f_k(v_bar_k; xi) = v_k - lr alpha_k grad f_k(v_bar_k; xi)
  alpha <- alpha - lr grad_alpha f_k(v_bar_k; xi)
                 = alpha - lr <v_k - w_k, grad f_k(v_bar_k; xi)>,  projected onto [0, 1]
all three from the same iterates (w_k, v_k, alpha_k) before the step. After the local
steps the w_k are averaged into the global model (weighted by training-set size, full
participation), which every client starts the next round from; v_k and alpha_k stay in
the stacked client state. With mixing="parameters" evaluation uses v_bar_k with the
latest global model.

One engine step does all three updates: the trained pytree is (w, v, alpha) and its loss
f(w) + f(alpha v + (1 - alpha) stop_gradient(w)), whose gradient is exactly the three
directions above (w gets no gradient from the mixture). They therefore share the run's
client optimizer: with --momentum=0 --weight_decay=0 this is the paper's plain SGD with
one step size; with momentum, alpha is a heavy-ball step like v and w. The round's
reported train loss is that sum, f(w) + f(v_bar).

Mixing (`mixing`). The authors' code (FedTorch, comms/trainings/federated/apfl.py with
comms/utils/eval.py:inference_personal) never forms v_bar: it mixes the two models'
outputs, alpha v_k(x) + (1 - alpha) w_k(x), both in the personal training loss and in
evaluation, and evaluates with the client's own w_k (its copy of the global model right
after its local steps, before the server averages). `mixing="output"` (the default) does
that: the loss is f(w) + CE(alpha v(x) + (1 - alpha) sg(w)(x)), whose gradient in alpha is
<v(x) - w(x), dCE/doutputs>, and the personalised model is (alpha_k, v_k, own w_k),
evaluated through that mixture. `mixing="parameters"` is the paper's v_bar with the
latest global model. Parameter mixing averages two MLPs whose hidden units need not line
up (v_k never restarts from w), so the mixture can be worse than either model; on
rotated MNIST it gave 0.755 at 500 rounds against the FEDORA paper's 0.787
(docs/measurements/). The FEDORA authors' repository holds no baseline code, so which form
their row used is not known; the default follows the APFL authors' code. 

Alpha's step (`alpha_update`). The paper's Algorithm 1 moves alpha every local step.
The authors' code (comms/utils/flow_utils.py:alpha_update) moves it once a round, on
the round's first batch, by one plain SGD step of the client learning rate on its
gradient plus 0.02 alpha (a small pull towards the global model). Here every local step
with the run's optimizer (heavy-ball momentum 0.9 by default) drives alpha to 1 within
~40 rounds on rotated MNIST (mean alpha 0.67 at round 21, 1.0 from round 41 on), after
which APFL is LOCAL: 0.7575 against LOCAL's 0.7563 at 500 rounds, the paper's APFL row
being 0.787 (docs/measurements/). `alpha_update="round"` (the default) is the authors'
step, taken at the round's starting iterates on the client's whole training split (one
full batch here, a first minibatch there; the exact d/d alpha of the personal loss,
where their code uses the parameter-space <v - w, alpha grad_v + (1 - alpha) grad_w>)
and used for the round's local steps;
`alpha_update="step"` is the paper's.

PFLlib's form (`mixing="pfllib"`), the APFL behind the tables of the PFLlib-based papers
(ConFREE's Table 2: StuZheng/ConFREE client/clientapfl.py, the same as PFLlib's). Every
local step trains w_k and v_k each on its own loss, f(w) and f(v) (v never sees the
mixture), then moves alpha by
  alpha <- clip(alpha - lr (<v - w, alpha grad f(v) + (1 - alpha) grad f(w)> + 0.02 alpha))
with v, w the iterates after the step and the gradients those of the step (its
alpha_update, after FedTorch's flow_utils); at the round's end v_k is replaced by the
parameter mixture (1 - alpha) w_k + alpha v_k with the client's own trained w_k, which is
its personalised model, evaluated and kept for the next round. lr g is taken as the step
each model took, equal under PFLlib's plain SGD (with momentum it is the momentum step);
`alpha_update` does not apply.

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
