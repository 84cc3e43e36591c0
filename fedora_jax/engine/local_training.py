"""Training and evaluation of ONE client; the round vmaps these over the client axis.

Local training is a `lax.scan` over SGD steps. Each epoch shuffles the client's real
samples (padding goes last) and cuts them into batches; the last batch may be partial, as
with a PyTorch DataLoader without drop_last. Padded batch slots carry zero weight, and
steps beyond a client's own count (a smaller client in a bucket of larger ones) leave
its parameters and optimizer state unchanged: a `lax.cond` skips them when clients run
one at a time (`--client_chunk=1`), and selects the unchanged state under `vmap`. A
straggler (fedora_jax/availability.py) skips its steps past its budget the same way:
the round sets `step_budget` around its update, and every local-training loop reads it
through `within_budget`.

The task decides the loss and the score: classification trains on softmax cross-entropy
and scores accuracy (higher is better); regression (one model output, float targets)
trains on squared error and scores the mean absolute error (lower is better).

Models with BatchNorm carry their running averages folded into the parameters. Each step
of `train` runs its loss in train mode (flax's mutable `batch_stats`), and the step's
state takes the new averages the loss's forward passes return; everything else runs
inference mode (fedora_jax/engine/batch_stats.py).
"""

import contextlib
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import batch_stats

Params = Any
# regularizer(params) -> scalar added to the data loss (e.g. a proximal term).
Regularizer = Callable[[Params], jax.Array]
# post_step(new_params, old_params) -> params, applied after each optimizer step.
PostStep = Callable[[Params, Params], Params]
# loss_fn(params, x, y, weights) -> scalar: a data loss replacing the model's cross-entropy,
# for algorithms that train more than one model's parameters at once (e.g. APFL).
LossFn = Callable[[Params, jax.Array, jax.Array, jax.Array], jax.Array]
# observe(params, x, y, weights) -> a pytree of arrays, read at each real step's params
# before the step, in the loss's mode, and summed over the steps (FedProto's prototypes
# as its authors' code collects them).
Observe = Callable[[Params, jax.Array, jax.Array, jax.Array], Any]
# With train(carry=c0): loss_fn(params, carry, x, y, weights) -> (scalar, new carry), a
# state the steps thread through, read and renewed by each real step's loss (FedDBE's
# running mean of the representations); padded steps keep it.
CarriedLossFn = Callable[[Params, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
# restart_optimizer(params) -> [] bool, read before each real step: when true the
# optimizer state starts afresh at that step (a phase with an optimizer of its own, as
# FedPAC's authors build one per phase of their alternating training).
RestartOptimizer = Callable[[Params], jax.Array]


class TrainStats(NamedTuple):
  loss: jax.Array   # [] mean data loss over this round's local steps
  steps: jax.Array  # [] int32 number of real (non-padded) SGD steps taken


TASKS = ("classification", "regression")


class EvalStats(NamedTuple):
  """Classification: mean cross-entropy and accuracy. Regression: mean squared error and
  the mean absolute error. `score` is the task's metric (lower is better for MAE)."""
  loss: jax.Array      # [] mean loss over the real samples
  score: jax.Array  # [] classification: fraction classified correctly; regression: MAE


class ClientTrainer(NamedTuple):
  """Pure per-client functions shared by all algorithms."""
  loss: Callable[[Params, jax.Array, jax.Array, jax.Array], jax.Array]
  # -> (params, TrainStats), then the observed sums with `observe`, the carry with `carry`.
  train: Callable[..., tuple[Any, ...]]
  evaluate: Callable[[Params, ClientData], EvalStats]
  steps_per_epoch: Callable[[int], int]
  task: str = "classification"
  epochs: int = 1  # local epochs per call of `train` (unless it is given `epochs`)
  batch_size: int = 1  # samples per local step (a pass of an algorithm's own over the data)
  # The model's forward `apply(params, x) -> outputs`, for algorithms that read inside it
  # (the features under the head: layers.forward_with_features).
  apply: Callable[[Params, jax.Array], jax.Array] | None = None
  # evaluate_with(forward) -> `evaluate` for another forward(model, x) -> outputs, with the
  # same batching and metrics (FedCP: a personalized model that is more than the run's model).
  evaluate_with: Callable[[Callable[[Any, jax.Array], jax.Array]],
                          Callable[[Any, ClientData], EvalStats]] | None = None


def _masked_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
  return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def masked_cross_entropy(logits: jax.Array, y: jax.Array, weights: jax.Array) -> jax.Array:
  """Softmax cross-entropy averaged over the real samples (weights 1; padding 0): the
  classification loss, for algorithms that compute their own logits."""
  return _masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weights)


def epoch_batches(key: jax.Array, mask: jax.Array | np.ndarray, n: jax.typing.ArrayLike,
                  batch_size: int, num_batches: int) -> tuple[jax.Array, jax.Array]:
  """One shuffled epoch: sample indices [num_batches, B] and their weights (1 real, 0 pad)."""
  size = mask.shape[0]
  # Real samples get a random rank in [0, 1); padding ranks 2 and so sorts last.
  order = jnp.argsort(jnp.where(mask, jax.random.uniform(key, (size,)), 2.0))
  slots = num_batches * batch_size
  if slots > size:
    order = jnp.concatenate([order, jnp.zeros((slots - size,), order.dtype)])
  weights = (jnp.arange(slots) < n).astype(jnp.float32)
  return (order[:slots].reshape(num_batches, batch_size),
          weights.reshape(num_batches, batch_size))


# The fraction of its real local steps the client being traced completes this round
# (a straggler's speed), set by the round around one client's update; empty: all steps.
# Nested budgets multiply (FedADMM's random epochs inside a straggler's speed).
_STEP_BUDGET: list[jax.Array] = []


@contextlib.contextmanager
def step_budget(fraction: jax.Array):
  """Local training traced inside completes only `fraction` ([] float) of its steps."""
  _STEP_BUDGET.append(fraction)
  try:
    yield
  finally:
    _STEP_BUDGET.pop()


def within_budget(weights: jax.Array, real: jax.Array | None = None) -> jax.Array:
  """A local training's batch weights [steps, ...] with the steps past the current
  `step_budget` zeroed: of its T real steps (`real` [steps] bool; default: a step with
  any weight) the client completes the first max(1, floor(fraction T))."""
  if not _STEP_BUDGET:
    return weights
  if real is None:
    real = jnp.any(weights.reshape(weights.shape[0], -1) > 0, axis=1)
  # The small slack keeps a float32 fraction such as 0.7 of 10 steps at 7, not 6.
  fraction = functools.reduce(jnp.multiply, _STEP_BUDGET)
  allowed = jnp.maximum(1, jnp.floor(fraction * jnp.sum(real) + 1e-3))
  kept = real & (jnp.cumsum(real) <= allowed)
  return jnp.where(kept.reshape((-1,) + (1,) * (weights.ndim - 1)), weights, 0)


def make_client_trainer(apply_fn: Callable[[Params, jax.Array], jax.Array],
                        optimizer: optax.GradientTransformation, epochs: int,
                        batch_size: int, eval_batch_size: int = 1024,
                        task: str = "classification") -> ClientTrainer:
  """Builds the per-client loss, local SGD and evaluation for a model.

  `apply_fn(params, x) -> logits` ([B, 1] predictions for regression): a flax
  `model.apply` (BatchNorm statistics folded into `params`, engine/batch_stats.py). The
  optimizer state is created afresh at every call of `train`, as FEDORA's authors
  re-create their SGD-with-momentum each round.
  """
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
  apply_fn = batch_stats.model_apply(apply_fn)
  regression = task == "regression"

  def per_sample_loss(outputs, y):
    if regression:
      return jnp.square(outputs[..., 0] - y)
    return optax.softmax_cross_entropy_with_integer_labels(outputs, y)

  def per_sample_score(outputs, y):
    if regression:
      return jnp.abs(outputs[..., 0] - y)
    return (jnp.argmax(outputs, -1) == y).astype(jnp.float32)

  def loss(params, x, y, weights):
    logits = apply_fn(params, x)
    per_sample = per_sample_loss(logits, y)
    return _masked_mean(per_sample, weights)

  def steps_per_epoch(num_samples: int) -> int:
    return max(1, math.ceil(num_samples / batch_size))

  default_epochs = epochs

  def train(params, data: ClientData, key: jax.Array,
            regularizer: Regularizer | None = None,
            post_step: PostStep | None = None,
            loss_fn: LossFn | None = None,
            epochs: int | None = None,
            observe: Observe | None = None,
            carry: Any = None,
            restart_optimizer: RestartOptimizer | None = None):
    """`epochs` (static): this call's epochs instead of the trainer's (fine-tuning).
    With `observe`, returns (params, stats, the sum of observe over the real steps).
    With `carry` (the loss then a CarriedLossFn), returns its last value after those."""
    epochs = default_epochs if epochs is None else epochs
    data = jax.tree.map(jnp.asarray, data)
    data_loss_fn = loss if loss_fn is None else loss_fn
    num_batches = steps_per_epoch(data.mask.shape[0])
    epoch_keys = jax.random.split(key, epochs)
    indices, weights = jax.vmap(
        lambda k: epoch_batches(k, data.mask, data.n, batch_size, num_batches))(epoch_keys)
    indices = indices.reshape(epochs * num_batches, batch_size)
    weights = within_budget(weights.reshape(epochs * num_batches, batch_size))

    def objective(p, c, x, y, w):
      if carry is None:
        data_loss = data_loss_fn(p, x, y, w)
      else:
        data_loss, c = data_loss_fn(p, c, x, y, w)
      total = data_loss if regularizer is None else data_loss + regularizer(p)
      return total, (data_loss, c)

    def observed(p, x, y, w):
      if not batch_stats.has_statistics(p):
        return observe(p, x, y, w)
      with batch_stats.training(w > 0):  # the loss's mode; its new averages unused
        return observe(p, x, y, w)

    def take_step(carry, idx, w):
      params, opt_state, seen, threaded = carry
      if restart_optimizer is not None:
        restart = restart_optimizer(params)
        opt_state = jax.tree.map(lambda fresh, old: jnp.where(restart, fresh, old),
                                 optimizer.init(params), opt_state)
      if observe is not None:
        seen = jax.tree.map(jnp.add, seen, observed(params, data.x[idx], data.y[idx], w))
      # BatchNorm (flax's imagenet example): the loss in train mode returns the new
      # running averages, set after the optimizer's step, which they take no part in.
      (_, (data_loss, threaded)), grads, trained = batch_stats.value_and_grad(
          objective, has_aux=True)(params, threaded, data.x[idx], data.y[idx], w,
                                   mask=w > 0)
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_params = batch_stats.take_statistics(optax.apply_updates(params, updates),
                                               trained)
      if post_step is not None:
        new_params = post_step(new_params, params)
      return (new_params, new_opt_state, seen, threaded), data_loss

    def step(carry, batch):
      idx, w = batch
      active = jnp.sum(w) > 0
      # A padded step is skipped, not computed and dropped: one client at a time (a
      # lax.map over single clients) pays only its own steps. Vmapped over clients the
      # cond becomes a select of both branches, the padded step's cost as before.
      skipped_loss = jnp.zeros((), jax.eval_shape(take_step, carry, idx, w)[1].dtype)
      carry, data_loss = jax.lax.cond(active, take_step,
                                      lambda c, *_: (c, skipped_loss), carry, idx, w)
      return carry, (data_loss, active)

    seen = () if observe is None else jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype),
        jax.eval_shape(observed, params, data.x[indices[0]], data.y[indices[0]], weights[0]))
    threaded = () if carry is None else carry
    (params, _, seen, threaded), (losses, active) = jax.lax.scan(
        step, (params, optimizer.init(params), seen, threaded), (indices, weights))
    stats = TrainStats(loss=_masked_mean(losses, active.astype(jnp.float32)),
                       steps=jnp.sum(active).astype(jnp.int32))
    return ((params, stats) + ((seen,) if observe is not None else ())
            + ((threaded,) if carry is not None else ()))

  def evaluate_with(forward):
    """`evaluate` of the models that `forward(model, x) -> outputs` runs."""
    return functools.partial(_evaluate, forward)

  def _evaluate(forward, params, data: ClientData) -> EvalStats:
    data = jax.tree.map(jnp.asarray, data)
    size = data.mask.shape[0]
    chunk = min(size, eval_batch_size)
    num_chunks = math.ceil(size / chunk)
    pad = num_chunks * chunk - size
    x, y, mask = jnp.asarray(data.x), jnp.asarray(data.y), jnp.asarray(data.mask)
    if pad:
      x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)])
      y = jnp.concatenate([y, jnp.zeros((pad,), y.dtype)])
      mask = jnp.concatenate([mask, jnp.zeros((pad,), bool)])

    def sums(xb, yb, mb):
      logits = forward(params, xb)
      ce = per_sample_loss(logits, yb)
      correct = per_sample_score(logits, yb)
      weight = mb.astype(jnp.float32)
      return jnp.sum(ce * weight), jnp.sum(correct * weight)

    def chunk_sums(_, batch):
      # A chunk of padding only (a small client in a large bucket) is skipped.
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(sums, *batch))
      return None, jax.lax.cond(jnp.any(batch[2]), sums, lambda *_: zeros, *batch)

    _, (ce_sums, correct_sums) = jax.lax.scan(
        chunk_sums, None,
        (x.reshape((num_chunks, chunk) + x.shape[1:]), y.reshape(num_chunks, chunk),
         mask.reshape(num_chunks, chunk)))
    count = jnp.maximum(data.n.astype(jnp.float32), 1.0)
    return EvalStats(loss=jnp.sum(ce_sums) / count, score=jnp.sum(correct_sums) / count)

  return ClientTrainer(loss=loss, train=train, evaluate=evaluate_with(apply_fn),
                       steps_per_epoch=steps_per_epoch, task=task, epochs=epochs,
                       batch_size=batch_size, apply=apply_fn, evaluate_with=evaluate_with)


def make_optimizer(lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
  """SGD with PyTorch's semantics: weight decay is added to the gradient before momentum."""
  return optax.chain(optax.add_decayed_weights(weight_decay),
                     optax.sgd(lr, momentum=momentum if momentum > 0 else None))
