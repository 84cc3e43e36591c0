"""One pure communication round over all clients, and the state it carries.

`build_train_round` returns `train_round(state, data, key) -> (state, metrics)`: the
server's broadcast, every client's update (vmapped per size bucket), the server's
aggregation and a per-client evaluation of the personalized models on the validation
and test splits. The runner jits it once per run. Built with `evaluate_test=False`, the
round scores validation only, and `build_test_evaluation` scores test on demand (the
runner's `--eval_every`). With `conditions` (fedora_jax/availability.py) sampled clients
may drop out or straggle; each round also counts the bytes each client received and sent
(fedora_jax/communication.py).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import availability, communication
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput
from fedora_jax.data.client_data import ClientSplits, FederatedData
from fedora_jax.engine.buckets import map_over_buckets, map_over_sampled, scatter_to_clients
from fedora_jax.engine.local_training import ClientTrainer, step_budget
from fedora_jax.errors import ConfigError


class RoundState(NamedTuple):
  round: jax.Array          # [] int32, rounds completed so far
  algorithm: AlgorithmState


class RoundMetrics(NamedTuple):
  """Per-client metrics of one round, each [K]; `extra` holds the algorithm's own."""
  train_loss: jax.Array
  local_steps: jax.Array
  val_loss: jax.Array
  val_score: jax.Array    # accuracy (classification) or MAE (regression)
  test_loss: jax.Array
  test_score: jax.Array
  extra: dict[str, jax.Array]
  # Bytes each client sent and received this round, int32 (communication.py); None only
  # in metrics built by hand.
  bytes_up: jax.Array | None = None
  bytes_down: jax.Array | None = None


def client_keys(round_key: jax.Array, num_clients: int) -> jax.Array:
  """[K] keys, client k's = fold_in(round_key, k): independent of bucketing and devices."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key, jnp.arange(num_clients))


def evaluate_clients(trainer: ClientTrainer, params: Any, data: FederatedData,
                     buckets: tuple[ClientSplits, ...], client_chunk: int | None = None,
                     evaluate=None, shared: bool = False,
                     split_names: tuple[str, ...] = ("val", "test"), evaluate_splits=None):
  """(loss, score) of each client's model on each split of `split_names` (a tuple in that
  order, each [K]); `evaluate` (an Algorithm's own, if it has one) in place of
  trainer.evaluate, `evaluate_splits` (one that reads the client's other splits) in
  place of both. shared: `params` is one model (no client axis) that every client
  scores on its own data."""
  evaluate = trainer.evaluate if evaluate is None else evaluate

  def evaluate_one(params_k, splits: ClientSplits):
    if evaluate_splits is not None:
      return tuple(evaluate_splits(params_k, splits, split_names))
    return tuple(evaluate(params_k, getattr(splits, name)) for name in split_names)
  if shared:
    return map_over_buckets(lambda splits: evaluate_one(params, splits), (), buckets,
                            data.client_ids, data.num_clients, client_chunk)
  return map_over_buckets(evaluate_one, (params,), buckets, data.client_ids,
                          data.num_clients, client_chunk)


def evaluate_personalized(algorithm: Algorithm, trainer: ClientTrainer,
                          state: AlgorithmState, layout: FederatedData,
                          data: tuple[ClientSplits, ...], client_chunk: int | None,
                          split_names: tuple[str, ...]):
  """evaluate_clients of the models the algorithm reports for `state`: its one
  `shared_model`, scored on every client's data without K copies of it, or each
  client's personalized model."""
  if algorithm.shared_model is not None:
    return evaluate_clients(trainer, algorithm.shared_model(state.server), layout, data,
                            client_chunk, algorithm.evaluate, shared=True,
                            split_names=split_names,
                            evaluate_splits=algorithm.evaluate_splits)
  return evaluate_clients(trainer, algorithm.personalized_params(state.server, state.clients),
                          layout, data, client_chunk, algorithm.evaluate,
                          split_names=split_names, evaluate_splits=algorithm.evaluate_splits)


def build_test_evaluation(algorithm: Algorithm, trainer: ClientTrainer, layout: FederatedData,
                          client_chunk: int | None = None):
  """`test(state, data) -> (loss, score)`, each [K]: every client's test scores of the
  models `state` holds, for a round whose `train_round` (built with evaluate_test=False)
  scored validation only."""
  def test(state: RoundState, data: tuple[ClientSplits, ...]):
    (scores,) = evaluate_personalized(algorithm, trainer, state.algorithm, layout, data,
                                      client_chunk, ("test",))
    return scores
  return test


def sampled_clients(round_key: jax.Array, num_clients: int, num_sampled: int) -> jax.Array:
  """[K] bool, True for the `num_sampled` clients that take part in this round.

  Drawn from fold_in(round_key, K), a stream no client key uses (theirs are 0..K-1), so
  for a seed the same clients take part in the same rounds whatever the algorithm."""
  order = jax.random.permutation(jax.random.fold_in(round_key, num_clients), num_clients)
  return jnp.zeros(num_clients, bool).at[order[:num_sampled]].set(True)


def num_sampled_clients(participation: float, num_clients: int) -> int:
  """Clients per round for a participation fraction in (0, 1]: round(f K), at least 1."""
  if not 0.0 < participation <= 1.0:
    raise ConfigError(f"--participation must be in (0, 1], got {participation}")
  return max(1, min(num_clients, round(participation * num_clients)))


def _filled(values: Any, num_clients: int, fill) -> Any:
  """[K, ...] arrays shaped like the per-slot `values` [S, ...], every entry `fill`
  (0 where the dtype has no NaN)."""
  def full(v):
    value = fill if jnp.issubdtype(v.dtype, jnp.inexact) else 0
    return jnp.full((num_clients,) + v.shape[1:], value, v.dtype)
  return jax.tree.map(full, values)


def _sampled_outputs(out: ClientOutput, slot_clients: jax.Array, clients: Any,
                     num_clients: int, upload_slots: bool = False) -> ClientOutput:
  """The sampled clients' outputs put back in client order [K, ...]: the others keep their
  state, upload zeros, report no steps and NaN train loss and metrics. upload_slots: the
  uploads stay as they are, one per slot [S, ...]."""
  def scatter(template, values):
    return scatter_to_clients(template, slot_clients, values)
  return ClientOutput(
      state=scatter(clients, out.state),
      upload=(out.upload if upload_slots else
              scatter(_filled(out.upload, num_clients, 0), out.upload)),
      train=scatter(_filled(out.train, num_clients, jnp.nan), out.train),
      metrics=scatter(_filled(out.metrics, num_clients, jnp.nan), out.metrics))


# Each client's weight in the server's averages: its training samples, or 1 (--client_weights).
CLIENT_WEIGHTS = ("samples", "uniform")


def build_train_round(algorithm: Algorithm, trainer: ClientTrainer, layout: FederatedData,
                      client_chunk: int | None = None, participation: float = 1.0,
                      evaluate_test: bool = True, client_weights: str = "samples",
                      conditions: availability.ClientConditions | None = None):
  """The round function for this algorithm and client layout (bucket membership is static).

  `layout` supplies the static bucket structure; the arrays themselves are passed to
  each call as `data` (a tuple of ClientSplits), so they are arguments, not constants.

  participation < 1: each round `sampled_clients` picks M = round(f K) clients, and only
  they are trained: their state, messages, keys and data are gathered into static slots
  (`map_over_sampled`), so the round costs about what M clients cost. The others keep
  their state, upload zeros, report zero local steps and NaN train loss and metrics, and
  carry zero weight into `aggregate` (so FedAvg-style averages are over the sampled
  clients; algorithms that read every client's state, like FEDORA's propagation, see the
  non-sampled clients' last state). Algorithms with `uploads_unordered` get the M slots'
  uploads and weights instead. Every client is still evaluated every round: a
  personalized model can change without its client training (FEDORA, pFedHN, FedAvg);
  one `shared_model` is scored on every client's data without K copies of it.
  evaluate_test=False: the round's test loss and score are NaN, not computed (the runner
  scores test with `build_test_evaluation` in the rounds it needs).
  client_weights: each client's weight in `aggregate`, "samples" (its n_k training
  samples) or "uniform" (1 for every client; 0 for those not sampled either way).
  An algorithm with `trains_unsampled` trains every client every round; the ones not
  sampled keep their new state, but upload zeros and weigh 0 in `aggregate`.
  conditions: dropout, availability and stragglers (availability.py). A sampled client
  that drops (or is offline, or late for the deadline) still fills its slot, but its
  output is thrown away as a filler's: to `aggregate` it is a client that was not
  sampled (state kept, zero upload, weight 0; 0 steps, NaN train loss). A round nobody
  arrives at changes no state. A straggler's local training stops at its step budget.
  """
  if client_weights not in CLIENT_WEIGHTS:
    raise ValueError(f"client_weights must be one of {CLIENT_WEIGHTS}, got {client_weights!r}")
  num_clients = layout.num_clients
  train_weights = jnp.asarray(layout.split_sizes("train"), jnp.float32)
  if client_weights == "uniform":
    train_weights = jnp.ones_like(train_weights)
  num_sampled = num_sampled_clients(participation, num_clients)
  if algorithm.trains_unsampled and algorithm.uploads_unordered:
    raise ValueError(f"{algorithm.name}: trains_unsampled reads uploads in client order")
  # Only the sampled clients train (in slots), unless every client does.
  in_slots = num_sampled < num_clients and not algorithm.trains_unsampled

  def train_round(state: RoundState, data: tuple[ClientSplits, ...], key: jax.Array):
    round_key = jax.random.fold_in(key, state.round)
    server, clients = state.algorithm
    active = jnp.ones(num_clients, bool)
    if num_sampled < num_clients:
      active = sampled_clients(round_key, num_clients, num_sampled)
    messages = (algorithm.broadcast(server, clients) if algorithm.sampled_broadcast is None
                else algorithm.sampled_broadcast(server, clients, active))
    per_client: tuple = (clients, messages, client_keys(round_key, num_clients))
    fate = (None if conditions is None else
            availability.draw(conditions, round_key, state.round, num_clients))
    budgeted = fate is not None and conditions is not None and conditions.partial_work
    if fate is not None and budgeted:
      per_client += (fate.speed,)
    step = _client_step(algorithm, budgeted)
    weights = train_weights
    slot_clients = None
    if in_slots:
      out, slot_clients = map_over_sampled(
          step, per_client, data, layout.client_ids, num_clients, active, num_sampled,
          client_chunk)
    else:
      out = map_over_buckets(step, per_client, data, layout.client_ids, num_clients,
                             client_chunk)
    uploaded = _upload_bytes(algorithm, out, clients)
    received = arrived = active
    if fate is not None:
      received, arrived = active & fate.online, active & fate.arrives
      # A client that did not arrive is thrown away as a filler slot (client K) is.
      slots = jnp.arange(num_clients) if slot_clients is None else slot_clients
      kept = arrived | ~active if algorithm.trains_unsampled else arrived
      slot_clients = jnp.where(jnp.append(kept, False)[slots], slots, num_clients)
    if algorithm.trains_unsampled and (fate is not None or num_sampled < num_clients):
      # Every client trained: those not sampled keep their state, upload nothing.
      received = received | ~active
      if slot_clients is not None:
        out = _sampled_outputs(out, slot_clients, clients, num_clients)
      out = out._replace(upload=jax.tree.map(
          lambda u: jnp.where(arrived.reshape((-1,) + (1,) * (u.ndim - 1)), u,
                              jnp.zeros_like(u)), out.upload))
      weights = jnp.where(arrived, train_weights, 0.0)
    elif slot_clients is not None:
      out = _sampled_outputs(out, slot_clients, clients, num_clients,
                             upload_slots=algorithm.uploads_unordered)
      weights = jnp.where(arrived, train_weights, 0.0)
      if algorithm.uploads_unordered:  # the slots' own weights; fillers (client K) weigh 0
        weights = jnp.append(weights, 0.0)[slot_clients]
    new_state = algorithm.aggregate(server, out.state, out.upload, weights)
    if fate is not None:  # nobody arrived: the server waits, nothing changes
      anyone = jnp.any(arrived)
      new_state = jax.tree.map(lambda new, old: jnp.where(anyone, new, old), new_state,
                               state.algorithm)
    if evaluate_test:
      val, test = evaluate_personalized(algorithm, trainer, new_state, layout, data,
                                        client_chunk, ("val", "test"))
    else:
      (val,) = evaluate_personalized(algorithm, trainer, new_state, layout, data,
                                     client_chunk, ("val",))
      test = jax.tree.map(lambda v: jnp.full_like(v, jnp.nan), val)
    metrics = RoundMetrics(
        train_loss=out.train.loss, local_steps=out.train.steps,
        val_loss=val.loss, val_score=val.score, test_loss=test.loss,
        test_score=test.score, extra=out.metrics,
        bytes_up=jnp.where(arrived, uploaded, 0).astype(jnp.int32),
        bytes_down=jnp.where(received, _download_bytes(algorithm, messages),
                             0).astype(jnp.int32))
    return RoundState(round=state.round + 1, algorithm=new_state), metrics

  return train_round


def _upload_bytes(algorithm: Algorithm, out: ClientOutput, clients: Any) -> int:
  """One client's upload in bytes (static): its ClientOutput's `upload`, [K or S, ...]
  here, and the part of its state the server reads (`state_upload`)."""
  read = () if algorithm.state_upload is None else jax.eval_shape(
      jax.vmap(algorithm.state_upload), clients)
  return communication.per_client_bytes((out.upload, read))


def _download_bytes(algorithm: Algorithm, messages: Any) -> int:
  """One client's message in bytes (static), less what it holds already (`preshared`)."""
  held = () if algorithm.preshared is None else algorithm.preshared(messages)
  return communication.per_client_bytes(messages) - communication.per_client_bytes(held)


def _client_step(algorithm: Algorithm, budgeted: bool = False):
  """Adapts `client_update` to map_over_buckets' argument order (data last); budgeted:
  with a per-client step budget (a straggler's speed) before the data."""
  def step(client_state, message, key, splits: ClientSplits):
    return algorithm.client_update(client_state, message, splits, key)

  def budgeted_step(client_state, message, key, speed, splits: ClientSplits):
    with step_budget(speed):
      return algorithm.client_update(client_state, message, splits, key)
  return budgeted_step if budgeted else step
