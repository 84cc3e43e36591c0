"""One round over a round's sampled clients only, their data handed in as slots.

With the clients held on the host (fedora_jax/data/host_clients.py) the device sees only
the M clients a round samples, as one bucket of M slots, and the algorithm's client
state only for those slots. That serves algorithms whose clients keep no state and whose
server keeps one model (FedAvg-like: `shared_model`, `uploads_unordered`, a client state
that is the [K] placeholder of fedavg.py); the others stop with one line naming why.
The round is the one rounds.py builds, restricted to the slots: the same client keys
(fold_in(round_key, k)), the same sampled clients, the same weights, so on the same
clients it gives the device-held round's numbers.
"""

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax import availability, communication, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, InitContext
from fedora_jax.data.client_data import ClientSplits, FederatedData
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.engine.local_training import ClientTrainer, step_budget
from fedora_jax.errors import ConfigError
from fedora_jax.rounds import RoundState, evaluate_personalized, sampled_clients

WHY = "--client_data=host"


class SlotMetrics(NamedTuple):
  """One round's per-slot metrics [M]: NaN train loss and metrics, 0 steps and bytes up
  for a slot whose client did not arrive (0 bytes down: it was offline)."""
  train_loss: jax.Array
  local_steps: jax.Array
  extra: dict[str, jax.Array]
  bytes_up: jax.Array      # int32
  bytes_down: jax.Array    # int32


class _NoClientData:
  """InitContext.data for an init that must not read every client's data."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, field: str):
    raise ConfigError(f"{WHY}: {self._name} reads every client's data when it starts"
                      f" (InitContext.data.{field}), which host-held clients never stack")


def check_algorithm(algorithm: Algorithm) -> None:
  """One line where the algorithm needs what host-held clients do not keep."""
  name = algorithm.name
  if algorithm.shared_model is None:
    raise ConfigError(f"{WHY}: {name} scores a model per client, which host-held clients"
                      " do not keep; it serves algorithms with one global model (FedAvg)")
  if not algorithm.uploads_unordered or algorithm.state_upload is not None:
    raise ConfigError(f"{WHY}: {name}'s server reads every client's upload or state in"
                      " client order; it serves servers that average the sampled uploads")
  if algorithm.sampled_broadcast is not None:
    raise ConfigError(f"{WHY}: {name}'s broadcast deals among the sampled clients of all"
                      " K, which host-held clients do not hold")


def check_stateless(name: str, clients: Any, num_slots: int) -> None:
  """The client state must be the [slots] placeholder: anything more is per-client
  state that a client sampled again would need back."""
  shapes = [leaf.shape for leaf in jax.tree.leaves(clients)]
  if any(shape != (num_slots,) for shape in shapes):
    raise ConfigError(f"{WHY}: {name} keeps state per client ({len(shapes)} array(s)),"
                      " which host-held clients do not hold yet")


def init_slots(algorithm: Algorithm, trainer: ClientTrainer, params: Any, num_slots: int,
               key: jax.Array) -> AlgorithmState:
  """algorithm.init over `num_slots` clients, given no client data, checked stateless."""
  check_algorithm(algorithm)
  def init(params, key):
    return algorithm.init(InitContext(
        params=tree.broadcast_to_clients(params, num_slots),
        data=cast(FederatedData, _NoClientData(algorithm.name)), trainer=trainer, key=key))
  state = jax.jit(init)(params, key)
  check_stateless(algorithm.name, state.clients, num_slots)
  return state


def sampled_ids(round_key: jax.Array, num_clients: int, num_sampled: int) -> jax.Array:
  """[M] the clients rounds.sampled_clients samples, ascending (all K when M = K)."""
  if num_sampled == num_clients:
    return jnp.arange(num_clients)
  return jnp.nonzero(sampled_clients(round_key, num_clients, num_sampled),
                     size=num_sampled)[0]


def _one_bucket(num_slots: int) -> tuple[np.ndarray, ...]:
  return (np.arange(num_slots),)


def build_slot_round(algorithm: Algorithm, client_chunk: int | None = None,
                     num_clients: int = 0,
                     conditions: availability.ClientConditions | None = None):
  """`slot_round(state, data, ids, weights, key) -> (state, SlotMetrics)`: the round for
  the sampled clients `ids` [M], whose data `data` is one bucket of M slots and whose
  weights in the server's mean are `weights` [M]. With `conditions` (availability.py),
  the fates rounds.py draws for all `num_clients` clients, read at the slots: a client
  that does not arrive weighs 0, a straggler stops at its step budget, and a round
  nobody arrives at changes no state."""
  def step(client_state, message, key, splits: ClientSplits):
    return algorithm.client_update(client_state, message, splits, key)

  def budgeted_step(client_state, message, key, speed, splits: ClientSplits):
    with step_budget(speed):
      return algorithm.client_update(client_state, message, splits, key)

  def slot_round(state: RoundState, data: ClientSplits, ids: jax.Array, weights: jax.Array,
                 key: jax.Array):
    round_key = jax.random.fold_in(key, state.round)
    server, clients = state.algorithm
    num_slots = ids.shape[0]
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key, ids)
    messages = algorithm.broadcast(server, clients)
    per_slot: tuple = (clients, messages, keys)
    online = arrived = jnp.ones(num_slots, bool)
    if conditions is not None:
      fate = availability.draw(conditions, round_key, state.round, num_clients)
      online, arrived = fate.online[ids], fate.arrives[ids]
      if conditions.partial_work:
        per_slot += (fate.speed[ids],)
    budgeted = conditions is not None and conditions.partial_work
    out = map_over_buckets(budgeted_step if budgeted else step, per_slot, (data,),
                           _one_bucket(num_slots), num_slots, client_chunk)
    new_state = algorithm.aggregate(server, out.state, out.upload,
                                    jnp.where(arrived, weights, 0.0))
    if conditions is not None:  # nobody arrived: the server waits, nothing changes
      new_state = jax.tree.map(lambda new, old: jnp.where(jnp.any(arrived), new, old),
                               new_state, state.algorithm)
    def kept(values):  # a client that did not arrive reports as one not sampled
      return jax.tree.map(lambda v: jnp.where(
          arrived, v, jnp.nan if jnp.issubdtype(v.dtype, jnp.inexact) else 0), values)
    up, down = (communication.per_client_bytes(t) for t in (out.upload, messages))
    metrics = SlotMetrics(
        train_loss=kept(out.train.loss), local_steps=kept(out.train.steps),
        extra=kept(out.metrics), bytes_up=jnp.where(arrived, up, 0).astype(jnp.int32),
        bytes_down=jnp.where(online, down, 0).astype(jnp.int32))
    return RoundState(round=state.round + 1, algorithm=new_state), metrics
  return slot_round


def build_slot_evaluation(algorithm: Algorithm, trainer: ClientTrainer,
                          client_chunk: int | None, split_names: tuple[str, ...]):
  """`evaluate(state, data) -> tuple of EvalStats [E]`, one per split of `split_names`:
  the state's shared model scored on the E clients of `data` (one bucket)."""
  def evaluate(state: RoundState, data: ClientSplits):
    num = tree.leading_size(data)
    layout = FederatedData(buckets=(data,), client_ids=_one_bucket(num), num_clients=num,
                           num_classes=0)
    return evaluate_personalized(algorithm, trainer, state.algorithm, layout, (data,),
                                 client_chunk, split_names)
  return evaluate
