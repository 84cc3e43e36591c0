"""kNN-Per: a FedAvg-trained global model whose softmax each client interpolates with a
k-nearest-neighbours classifier over its own training set's representations.

Marfoq, Neglia, Kameni, Vidal. "Personalized Federated Learning through Local
Memorization." ICML 2022. https://arxiv.org/abs/2111.09360
(code followed: the authors' omarfoq/knn-per, client.py's KNNPerClient, datastore.py and
eval_knnper.py, Apache-2.0; and FL-bench's src/client/knnper.py, KarhouTam/FL-bench, GPL:
both read, not run or copied. The paper's full text is not on disk, so this module
names no equation numbers. PFLlib has no kNN-Per, so there is no verification row: the
unit tests check the kNN step and the interpolation by hand.)

Training is FedAvg's. A client is scored with lambda p_kNN + (1 - lambda) softmax(global
logits), p_kNN from the k (7) training samples nearest in the global model's representation
(kernel scale 1); interpolation "validation" (default) picks lambda on its validation split
from grid 101 values, "fixed" uses weight 0.5. mix "probabilities" (default) or "logits".

Departures: the kernel weights are a softmax over the k neighbours; an empty datastore falls
back to the global model; the features are the head's input.
Details (every option, the departures, measurements): docs/algorithms/knnper.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm
from fedora_jax.algorithms.layers import (affine_head, check_representation_trainer,
                                          head_layer, in_chunks, representations)
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.engine.local_training import ClientTrainer, EvalStats
from fedora_jax.errors import FieldError, check_one_of, traced

Params = Any
INTERPOLATIONS = ("validation", "fixed")
MIXES = ("probabilities", "logits")
QUERY_CHUNK = 256     # queries whose distances to the datastore are held at once
PROB_FLOOR = 1e-12    # -log p's floor where p(y | x) is 0 (lambda 1, no neighbour of y)
SUBSET_SEED = 0       # the datastore's random subset (capacity > 0): the same every time


class KnnPerConfig(NamedTuple):
  k: int = 7                          # neighbours
  scale: float = 1.0                  # s_i = exp(-d^2 / (F * scale))
  interpolation: str = "validation"   # lambda per client on validation, or `weight`
  weight: float = 0.5                 # lambda with interpolation=fixed (FL-bench's 0.5)
  grid: int = 101                     # lambdas tried on validation: 0, 1/(grid-1), ..., 1
  mix: str = "probabilities"          # the paper's; logits: both codes' form
  capacity: int = 0                   # datastore size; 0: the whole training set


FLAG_HELP = {
    "k": "kNN-Per: neighbours in the client's datastore of training representations",
    "scale": "kNN-Per: kernel scale, neighbour weight exp(-d^2 / (F * scale))",
    "interpolation": "kNN-Per: lambda chosen per client on its validation split"
                     " (validation, the paper's) or --knnper_weight for all (fixed)",
    "weight": "kNN-Per: lambda with --knnper_interpolation=fixed (FL-bench's 0.5)",
    "grid": "kNN-Per: lambdas tried on validation, evenly spaced over [0, 1]",
    "mix": "kNN-Per: p_kNN mixed with the model's softmax (probabilities, the paper's) or"
           " its raw logits (logits, the authors' and FL-bench's code)",
    "capacity": "kNN-Per: training samples in the datastore, a fixed random subset (0: all)",
}


def validate(config: KnnPerConfig) -> KnnPerConfig:
  check_one_of("knnper", config, "interpolation", INTERPOLATIONS)
  check_one_of("knnper", config, "mix", MIXES)
  if config.k < 1:
    raise FieldError("knnper", "k", f"must be >= 1, got {config.k}")
  if not traced(config.scale) and not config.scale > 0:
    raise FieldError("knnper", "scale", f"must be > 0, got {config.scale}")
  if not traced(config.weight) and not 0.0 <= config.weight <= 1.0:
    raise FieldError("knnper", "weight", f"must be in [0, 1], got {config.weight}")
  if config.grid < 2:
    raise FieldError("knnper", "grid", f"must be >= 2, got {config.grid}")
  if config.capacity < 0:
    raise FieldError("knnper", "capacity", f"must be >= 0, got {config.capacity}")
  return config


def lambdas(config: KnnPerConfig) -> jax.Array:
  """The lambdas a client may use: the validation grid, or the one fixed weight."""
  if config.interpolation == "fixed":
    return jnp.reshape(jnp.asarray(config.weight, jnp.float32), (1,))
  return jnp.linspace(0.0, 1.0, config.grid, dtype=jnp.float32)


def knn_probabilities(queries: jax.Array, keys: jax.Array, labels: jax.Array,
                      valid: jax.Array, k: int, scale, num_classes: int) -> jax.Array:
  """[Q, C] p_kNN of queries [Q, F] over the datastore keys [N, F], labels [N] (its
  entries with valid [N] False left out); all zeros where no entry is valid."""
  dim = queries.shape[-1]
  squared = (jnp.sum(queries ** 2, -1)[:, None] + jnp.sum(keys ** 2, -1)[None, :]
             - 2.0 * queries @ keys.T)
  distances = jnp.where(valid[None, :], jnp.maximum(squared, 0.0), jnp.inf)
  neg_nearest, index = jax.lax.top_k(-distances, min(k, keys.shape[0]))
  present = jnp.isfinite(neg_nearest)
  logits = jnp.where(present, neg_nearest / (dim * scale), -jnp.inf)
  weights = jnp.where(present, jax.nn.softmax(jnp.where(present, logits, -1e30), -1), 0.0)
  one_hot = jax.nn.one_hot(labels[index], num_classes)           # [Q, k, C]
  return jnp.einsum("qk,qkc->qc", weights, one_hot)


def mixed_outputs(p_knn: jax.Array, logits: jax.Array, lam: jax.Array, mix: str) -> jax.Array:
  """[..., C] lambda p_kNN + (1 - lambda) model: its softmax, or its raw logits."""
  model = jax.nn.softmax(logits, -1) if mix == "probabilities" else logits
  return lam * p_knn + (1.0 - lam) * model


def mixed_loss(outputs: jax.Array, y: jax.Array, mix: str) -> jax.Array:
  """Per-sample loss of the mixture: -log p(y) (probabilities) or the cross-entropy of
  its softmax (logits)."""
  if mix == "probabilities":
    picked = jnp.take_along_axis(outputs, y[..., None], -1)[..., 0]
    return -jnp.log(jnp.maximum(picked, PROB_FLOOR))
  return optax.softmax_cross_entropy_with_integer_labels(outputs, y)


class Datastore(NamedTuple):
  keys: jax.Array     # [N, F] training representations
  labels: jax.Array   # [N]
  valid: jax.Array    # [N] bool: a real sample kept in the datastore


def datastore_entries(mask: jax.Array, capacity: int) -> jax.Array:
  """[N] bool: the real samples kept, all of them (capacity 0) or a fixed random
  `capacity` of them."""
  if capacity == 0:
    return mask
  ranks = jnp.where(mask, jax.random.uniform(jax.random.key(SUBSET_SEED), mask.shape), 2.0)
  return mask & (jnp.argsort(jnp.argsort(ranks)) < capacity)


def split_sums(config: KnnPerConfig, apply_fn, params: Params, head: str,
               store: Datastore, data: ClientData, grid: jax.Array):
  """(loss sums [G], correct counts [G]) of the mixture at each lambda of `grid` over
  the real samples of `data`."""
  num_classes = params["params"][head]["kernel"].shape[-1]
  chunk = min(data.mask.shape[0], QUERY_CHUNK)

  def one_chunk(batch):
    xb, yb, mb = batch
    features = representations(apply_fn, params, xb, head)
    logits = affine_head(params["params"][head], features)
    p_knn = knn_probabilities(features, store.keys, store.labels, store.valid, config.k,
                              config.scale, num_classes)
    # A client with no datastore is scored on the model alone (lambda 0).
    lam = jnp.where(jnp.any(store.valid), grid, 0.0)[:, None, None]
    outputs = mixed_outputs(p_knn[None], logits[None], lam, config.mix)   # [G, B, C]
    weight = mb.astype(jnp.float32)
    losses = mixed_loss(outputs, jnp.broadcast_to(yb, outputs.shape[:2]), config.mix)
    correct = (jnp.argmax(outputs, -1) == yb[None]).astype(jnp.float32)
    return jnp.sum(losses * weight, -1), jnp.sum(correct * weight, -1)

  losses, correct = jax.lax.map(one_chunk, (
      in_chunks(data.x, chunk), in_chunks(data.y, chunk), in_chunks(data.mask, chunk)))
  return jnp.sum(losses, 0), jnp.sum(correct, 0)


def knnper(config: KnnPerConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  check_representation_trainer("knnper", trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None

  def evaluate_splits(params: Params, splits: ClientSplits,
                      names: tuple[str, ...]) -> tuple[EvalStats, ...]:
    head = head_layer(params, "knnper")
    train = jax.tree.map(jnp.asarray, splits.train)
    store = Datastore(keys=representations(apply_fn, params, train.x, head),
                      labels=train.y, valid=datastore_entries(train.mask, config.capacity))
    grid = lambdas(config)
    chosen = jnp.zeros((), jnp.int32)
    if config.interpolation == "validation":
      _, val_correct = split_sums(config, apply_fn, params, head, store, splits.val, grid)
      chosen = jnp.argmax(val_correct)   # the first maximum: the smallest lambda
    results = []
    for name in names:
      data = getattr(splits, name)
      losses, correct = split_sums(config, apply_fn, params, head, store, data, grid)
      count = jnp.maximum(data.n.astype(jnp.float32), 1.0)
      results.append(EvalStats(loss=losses[chosen] / count, score=correct[chosen] / count))
    return tuple(results)

  host = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  return host._replace(name="knnper", evaluate_splits=evaluate_splits, ala_hooks=None,
                       shared_part=None, upload_mean=None)
