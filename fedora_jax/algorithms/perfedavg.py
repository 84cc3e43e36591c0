"""Per-FedAvg: FedAvg on the MAML objective, so that the global model is a good start for
one step of local adaptation.

Fallah, Mokhtari, Ozdaglar. "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach." NeurIPS 2020. https://arxiv.org/abs/2002.07948
(implementations compared against: the pFedMe authors' github.com/CharlieDinh/pFedMe,
FLAlgorithms/users/userperavg.py, and TsingZ0/PFLlib, system/flcore/clients/clientperavg.py)

A sampled client takes the paper's local steps from the global model w on batches D, D' (D''):
w_tilde = w - alpha grad f_i(w; D), then w -= beta grad f_i(w_tilde; D') (`variant` "fo", the
default) or its Hessian-free form ("hf"); the server averages the models (FedAvg). A client is
scored with one step of size alpha from the global model it received on a training batch
(`evaluation` "received"; "latest": from the new one; "test": PFLlib a41f7ba's test steps).
Defaults: alpha 0.005, beta 0.001 (the pFedMe authors' Per-FedAvg runs).

Departures: HF's Hessian-vector product is exact (the paper: a finite difference); an epoch's
chunks of 2B (3B for HF) samples are dealt to D, D' (D'') (PFLlib halves batches of 2B).

Details (every option, the departures, measurements): docs/algorithms/perfedavg.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import model_message
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import (ClientTrainer, EvalStats, TrainStats,
                                               epoch_batches, within_budget)
from fedora_jax.errors import FieldError, check_one_of

Params = Any

VARIANTS = ("fo", "hf")
# The scored model: the adaptation of the model a client last received (ours), every
# client's adaptation of the latest global model (PFLlib's), or that on test batches
# (PFLlib a41f7ba's).
EVALUATIONS = ("received", "latest", "test")


class PerFedAvgConfig(NamedTuple):
  alpha: float = 0.005  # inner (personalisation) step size
  beta: float = 0.001   # outer (meta) step size
  variant: str = "fo"   # "fo": first-order MAML step; "hf": Hessian-free step
  evaluation: str = "received"  # scored: "received", "latest" or "test" (EVALUATIONS)


FLAG_HELP = {
    "alpha": "Per-FedAvg: inner step size alpha (local adaptation, also at evaluation)",
    "beta": "Per-FedAvg: outer step size beta of the meta update",
    "variant": "Per-FedAvg: fo (first-order MAML step, the compared codes') or hf"
               " (Hessian-free step with an exact Hessian-vector product)",
    "evaluation": "Per-FedAvg: scored model, received (each client's one-step adaptation"
                  " of the global model it last received, kept while it sits rounds"
                  " out), latest (every client adapts the latest global model each"
                  " round, PFLlib's) or test (PFLlib a41f7ba's: two steps, alpha then"
                  " beta, on two test batches, a test-data leak)",
}


def validate(config: PerFedAvgConfig) -> PerFedAvgConfig:
  if config.alpha < 0:
    raise FieldError("perfedavg", "alpha", f"must be >= 0, got {config.alpha}")
  if config.beta < 0:
    raise FieldError("perfedavg", "beta", f"must be >= 0, got {config.beta}")
  check_one_of("perfedavg", config, "variant", VARIANTS)
  check_one_of("perfedavg", config, "evaluation", EVALUATIONS)
  return config


def sgd_step(params: Params, grads: Params, lr: float) -> Params:
  return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def train_mode_value_and_grad(loss_fn):
  """(loss, grads, params with the running averages moved) of `loss_fn(params, x, y,
  weights)`, BatchNorm in train mode over the samples of nonzero weight."""
  value_and_grad = batch_stats.value_and_grad(loss_fn)
  return lambda params, x, y, weights: value_and_grad(params, x, y, weights,
                                                      mask=weights > 0)


def meta_step(loss_fn, params: Params, batches, config: PerFedAvgConfig):
  """One Per-FedAvg step from w; `batches` is ((x, y, w) of D, of D', [of D''])).
  Returns (new w, f(w_tilde; D')).

  BatchNorm runs in train mode in every pass and each pass moves the running averages,
  as PyTorch's train-mode forwards do: D under w, then D' under w_tilde (then D'' under
  w); only the other parameters take the meta step."""
  value_and_grad = train_mode_value_and_grad(loss_fn)
  _, inner_grad, moved = value_and_grad(params, *batches[0])
  adapted = batch_stats.take_statistics(sgd_step(params, inner_grad, config.alpha), moved)
  # A model whose running averages are the latest (D, then D'); its weights go unused.
  outer_loss, outer_grad, latest = value_and_grad(adapted, *batches[1])
  if config.variant == "hf":
    # (I - alpha H(w; D'')) v with v = grad f(w_tilde; D'). H is symmetric, so H v is
    # the pullback of v through the gradient (reverse over reverse). The running
    # averages do not enter a train-mode loss, so taking them from the passes so far
    # changes only the averages D'' moves.
    third = lambda p: value_and_grad(p, *batches[2])[1:]
    _, pullback, latest = jax.vjp(third, batch_stats.take_statistics(params, latest),
                                  has_aux=True)
    (hessian_vector,) = pullback(outer_grad)
    outer_grad = jax.tree.map(lambda v, hv: v - config.alpha * hv, outer_grad,
                              hessian_vector)
  new_params = sgd_step(params, outer_grad, config.beta)
  return batch_stats.take_statistics(new_params, latest), outer_loss


def meta_train(loss_fn, config: PerFedAvgConfig, params: Params, data: ClientData,
               key: jax.Array, epochs: int, batch_size: int):
  """E epochs of Per-FedAvg steps for ONE client; returns (w, TrainStats)."""
  per_step = 3 if config.variant == "hf" else 2
  chunk = per_step * batch_size
  num_chunks = max(1, -(-data.mask.shape[0] // chunk))

  def epoch(k):
    idx, weights = epoch_batches(k, data.mask, data.n, chunk, num_chunks)
    # Deal each chunk's samples in turn to D, D' (, D''): [chunks, per_step, B].
    deal = lambda a: jnp.swapaxes(a.reshape(num_chunks, batch_size, per_step), 1, 2)
    return deal(idx), deal(weights)

  idx, weights = jax.vmap(epoch)(jax.random.split(key, epochs))
  idx = idx.reshape((epochs * num_chunks, per_step, batch_size))
  weights = weights.reshape((epochs * num_chunks, per_step, batch_size))
  # A straggler's budget (availability.py) counts the steps that run: D and D' both real.
  weights = within_budget(weights, (jnp.sum(weights[:, 0], axis=1) > 0)
                          & (jnp.sum(weights[:, 1], axis=1) > 0))

  def step(w, batch):
    batch_idx, batch_weights = batch
    batches = tuple((data.x[batch_idx[j]], data.y[batch_idx[j]], batch_weights[j])
                    for j in range(per_step))
    new_w, loss = meta_step(loss_fn, w, batches, config)
    active = (jnp.sum(batch_weights[0]) > 0) & (jnp.sum(batch_weights[1]) > 0)
    return optax.tree_utils.tree_where(active, new_w, w), (loss, active)

  params, (losses, active) = jax.lax.scan(step, params, (idx, weights))
  real = active.astype(jnp.float32)
  return params, TrainStats(loss=jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1.0),
                            steps=jnp.sum(active).astype(jnp.int32))


def adapt(loss_fn, alpha: float, params: Params, data: ClientData, key: jax.Array,
          batch_size: int) -> Params:
  """The evaluated model: one SGD step of size alpha on one random training batch
  (BatchNorm in train mode, its running averages moved by that batch)."""
  idx, weights = epoch_batches(key, data.mask, data.n, batch_size, 1)
  _, grads, moved = train_mode_value_and_grad(loss_fn)(
      params, data.x[idx[0]], data.y[idx[0]], weights[0])
  return batch_stats.take_statistics(sgd_step(params, grads, alpha), moved)


def adapt_on_test(loss_fn, config: PerFedAvgConfig, params: Params, data: ClientData,
                  key: jax.Array, batch_size: int) -> Params:
  """PFLlib a41f7ba's scored model: a step of size alpha on one random test batch of B,
  then one of size beta on the next, from where the first left off (BatchNorm in train
  mode). A step whose batch holds no real sample changes nothing."""
  idx, weights = epoch_batches(key, data.mask, data.n, batch_size, 2)
  value_and_grad = train_mode_value_and_grad(loss_fn)
  for j, lr in enumerate((config.alpha, config.beta)):
    _, grads, moved = value_and_grad(params, data.x[idx[j]], data.y[idx[j]], weights[j])
    stepped = batch_stats.take_statistics(sgd_step(params, grads, lr), moved)
    params = optax.tree_utils.tree_where(jnp.sum(weights[j]) > 0, stepped, params)
  return params


class LatestServer(NamedTuple):
  """The server of the references' evaluation: the global model and what draws each
  round's adaptation batches."""
  model: Params
  key: jax.Array     # the algorithm's key, its uint32 data (a checkpoint stores it)
  round: jax.Array   # [] int32, rounds aggregated so far


class Adaptable(NamedTuple):
  """What a client scores under evaluation latest / test: the latest global model and
  the key of its adaptation batches."""
  model: Params
  key: jax.Array


def adaptation_keys(server: LatestServer, clients: jax.Array) -> jax.Array:
  """[K] keys of the clients' adaptation batches after `server.round` rounds:
  fold_in(fold_in(key, round), client)."""
  round_key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key, clients)


def perfedavg(config: PerFedAvgConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  batch_size = batch_size_of(trainer)
  if config.evaluation != "received":
    return _latest(config, trainer, batch_size)

  def init(context: InitContext) -> AlgorithmState:
    # Before any round each client holds the shared initial model, not yet adapted.
    return AlgorithmState(server=tree.first(context.params), clients=context.params)

  def broadcast(global_params, personal):
    return tree.broadcast_to_clients(global_params, tree.leading_size(personal))

  def client_update(personal, global_params, data, key):
    del personal
    train_key, adapt_key = jax.random.split(key)
    train = jax.tree.map(jnp.asarray, data.train)
    trained, stats = meta_train(trainer.loss, config, global_params, train, train_key,
                                trainer.epochs, batch_size)
    adapted = adapt(trainer.loss, config.alpha, global_params, train, adapt_key,
                    batch_size)
    return ClientOutput(state=adapted, upload=trained, train=stats)

  def aggregate(server, personal, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=personal)

  return Algorithm(name="perfedavg", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, personal: personal,
                   # ALA's theta_hat replaces the received global model before both the
                   # meta-training and the one-step adaptation; theta_i is the trained meta
                   # model (PFLlib's clientperavg.py).
                   ala_hooks=model_message(personal_is_local=False))


def _latest(config: PerFedAvgConfig, trainer: ClientTrainer, batch_size: int) -> Algorithm:
  """Per-FedAvg scored as the references score it: every client adapts the latest global
  model at every evaluation (evaluation "latest" or "test"). A client's state is its
  index, which keys its adaptation batches."""

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    return AlgorithmState(
        server=LatestServer(model=tree.first(context.params), key=raw_key(context.key),
                            round=jnp.zeros((), jnp.int32)),
        clients=jnp.arange(num_clients, dtype=jnp.int32))

  def broadcast(server: LatestServer, clients):
    return tree.broadcast_to_clients(server.model, tree.leading_size(clients))

  def client_update(index, global_params, data, key):
    trained, stats = meta_train(trainer.loss, config, global_params,
                                jax.tree.map(jnp.asarray, data.train), key,
                                trainer.epochs, batch_size)
    return ClientOutput(state=index, upload=trained, train=stats)

  def aggregate(server: LatestServer, clients, uploads, weights):
    return AlgorithmState(
        server=LatestServer(model=tree.weighted_mean(uploads, weights), key=server.key,
                            round=server.round + 1),
        clients=clients)

  def personalized_params(server: LatestServer, clients) -> Adaptable:
    return Adaptable(model=broadcast(server, clients),
                     key=adaptation_keys(server, clients))

  def evaluate_splits(scored: Adaptable, splits: ClientSplits,
                      names: tuple[str, ...]) -> tuple[EvalStats, ...]:
    if config.evaluation == "test":
      model = adapt_on_test(trainer.loss, config, scored.model,
                            jax.tree.map(jnp.asarray, splits.test), scored.key, batch_size)
    else:
      model = adapt(trainer.loss, config.alpha, scored.model,
                    jax.tree.map(jnp.asarray, splits.train), scored.key, batch_size)
    return tuple(trainer.evaluate(model, getattr(splits, name)) for name in names)

  # No ALA host: the scored model is the global model's adaptation, whatever ALA made of
  # it in training.
  return Algorithm(name="perfedavg", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   evaluate_splits=evaluate_splits)
