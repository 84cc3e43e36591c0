"""Runs a per-client function over all clients, or over a round's sampled ones, one vmap
per size bucket.

The round sees every per-client quantity stacked in client order [K, ...]. For each
bucket we gather its clients' slices, vmap the function over them together with the
bucket's data, then put the results back in client order. With one bucket holding every
client in order (the balanced setting) there is no gather or scatter at all.

`map_over_sampled` runs the function for the clients a round samples only: M static
slots for M sampled clients, each running in its own bucket or a larger one (its data
padded to that bucket's lengths), so a round at participation f costs about f of a full
one (the DESIGN's client sampling), however the sampled clients fall into buckets.
"""

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec

from fedora_jax.tree import leading_size
from fedora_jax.engine.sharding import CLIENT_AXIS, constrain_to_clients, padded_size


def _is_identity(client_ids: Sequence[np.ndarray], num_clients: int) -> bool:
  return len(client_ids) == 1 and np.array_equal(client_ids[0], np.arange(num_clients))


def gather(tree: Any, ids: np.ndarray | jax.Array) -> Any:
  return jax.tree.map(lambda a: a[ids], tree)


def over_clients(fn: Callable[..., Any], client_chunk: int | None = None) -> Callable[..., Any]:
  """`fn` mapped over a leading client axis of all its arguments.

  None: `jax.vmap` (every client at once). n > 0: `jax.lax.map` over chunks of n clients,
  each chunk vmapped (under a multi-device mesh, inside `shard_map`: each device loops
  over its own clients); the results are the same. Vmapped convolutions lower to grouped
  convolutions, which XLA's CPU backend may run slower than a loop over smaller groups:
  benchmarks/vmap_vs_map.py measures both.
  """
  if client_chunk is None:
    return jax.vmap(fn)
  if client_chunk < 1:
    raise ValueError(f"client_chunk must be >= 1 or None, got {client_chunk}")

  def chunked(*args):
    # One client at a time without a vmap of one: a vmap would turn the padded steps'
    # `lax.cond` (engine/local_training.py) into a select that still computes them.
    return jax.lax.map(lambda a: fn(*a), args,
                       batch_size=None if client_chunk == 1 else client_chunk)

  def mapped(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CLIENT_AXIS not in mesh.axis_names or mesh.size == 1:
      return chunked(*args)
    # Under a mesh each device loops over the chunks of its own clients; a lax.map over
    # the sharded axis itself would gather every client onto every device. No type
    # check of varying axes (check_vma): the body is per-client with no collective over
    # `clients`, and the check rejects every lax.scan / while_loop whose carry starts
    # from a constant (an optimizer's step count, ALA's weights) as soon as the body
    # mixes in a client's data.
    spec = PartitionSpec(CLIENT_AXIS)
    return jax.shard_map(chunked, in_specs=(spec,) * len(args), out_specs=spec,
                         check_vma=False)(*args)
  return mapped


def map_over_buckets(fn: Callable[..., Any], per_client_args: tuple, buckets: tuple,
                     client_ids: Sequence[np.ndarray], num_clients: int,
                     client_chunk: int | None = None) -> Any:
  """fn(*per_client_args_k, bucket_data_k) for every client k; outputs stacked [K, ...].

  `per_client_args` are pytrees with leaves [K, ...] (or None); `buckets[b]` is bucket b's
  data with leaves [K_b, ...], or [S_b >= K_b, ...] when padded for the device mesh
  (engine/sharding.py): the padded slots get copies of the bucket's last client and their
  outputs are dropped. Under a mesh the client axis of every argument is split over its
  `clients` axis. `client_chunk`: see `over_clients` (None: vmap).
  """
  mapped = over_clients(fn, client_chunk)
  slots = [leading_size(data) for data in buckets]
  if _is_identity(client_ids, num_clients) and slots[0] == num_clients:
    return mapped(*constrain_to_clients(per_client_args), buckets[0])
  outputs = []
  for ids, data, size in zip(client_ids, buckets, slots):
    padded_ids = np.concatenate([ids, np.repeat(ids[-1:], size - len(ids))])
    out = mapped(*constrain_to_clients(gather(per_client_args, padded_ids)), data)
    outputs.append(out if size == len(ids) else
                   jax.tree.map(lambda a, n=len(ids): a[:n], out))
  inverse = np.argsort(np.concatenate(client_ids))
  return jax.tree.map(lambda *parts: jnp.concatenate(parts)[inverse], *outputs)


def _mesh_size() -> int:
  """Devices along the `clients` axis of the mesh being traced under (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CLIENT_AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[CLIENT_AXIS]


def sampled_slots(bucket_sizes: Sequence[int], num_sampled: int) -> list[int]:
  """Slots of each bucket (buckets in ascending data size) for a round's M sampled
  clients: s_b = min(M, N_b) - min(M, N_{b+1}), N_b the clients of buckets b and above.

  A client fits the slot of any bucket at least as large as its own, so the sampled
  clients, taken largest bucket first, fill these slots exactly (the j-th of them comes
  from a bucket no larger than its slot's): M slots in all, whichever clients are sampled.
  """
  at_or_above = np.cumsum(np.asarray(bucket_sizes)[::-1])[::-1]
  capped = np.minimum(num_sampled, np.append(at_or_above, 0))
  return [int(s) for s in capped[:-1] - capped[1:]]


def _pad_split(data: Any, length: int) -> Any:
  """A ClientData [S, N, ...] padded with masked-out samples to [S, length, ...]."""
  extra = length - data.mask.shape[1]
  if extra == 0:
    return data
  def pad(a):
    return jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))
  return data._replace(x=pad(data.x), y=pad(data.y), mask=pad(data.mask))


def _gather_padded(buckets: tuple, sources: Sequence[int], lengths: Sequence[int],
                   bucket_of: jax.Array, position: jax.Array) -> Any:
  """The data of slot clients that come from any of the `sources` buckets, split i padded
  to lengths[i]: per source a gather of the slots' rows, kept where the slot's client is
  in that source."""
  def from_bucket(b):
    taken = gather(buckets[b], jnp.clip(position, 0, leading_size(buckets[b]) - 1))
    return type(taken)(*(_pad_split(split, n) for split, n in zip(taken, lengths)))
  result = from_bucket(sources[-1])
  for b in sources[:-1]:
    here = bucket_of == b
    result = jax.tree.map(
        lambda new, old, here=here: jnp.where(here.reshape((-1,) + (1,) * (old.ndim - 1)),
                                              new, old),
        from_bucket(b), result)
  return result


def map_over_sampled(fn: Callable[..., Any], per_client_args: tuple, buckets: tuple,
                     client_ids: Sequence[np.ndarray], num_clients: int,
                     sampled: jax.Array, num_sampled: int,
                     client_chunk: int | None = None) -> tuple[Any, jax.Array]:
  """fn(*per_client_args_k, data_k) for the sampled clients k only.

  `sampled` [K] bool marks `num_sampled` = M clients (a static count). The sampled
  clients, ordered by bucket from the largest data down and by client within one, fill
  `sampled_slots`: a client runs in its own bucket or a larger one, its data padded to
  that bucket's lengths (padding is masked out and shuffles last, so its update is the
  one its own bucket gives, up to summation order). Each bucket's slots are rounded up
  to the device count with fillers; the assignment itself does not depend on devices.
  Returns (outputs [S, ...], slot_clients [S]): slot s holds client slot_clients[s]'s
  output, or slot_clients[s] == K for a filler, whose output `scatter_to_clients` drops.
  """
  mapped = over_clients(fn, client_chunk)
  num_devices = _mesh_size()
  # Buckets from the least data to the most; a bucket's slots hold val and test padded to
  # the longest of it and the smaller buckets (their lengths need not grow with train's).
  order = sorted(range(len(buckets)), key=lambda b: buckets[b].train.mask.shape[1])
  longest = {}
  for rank, b in enumerate(order):
    longest[b] = [max(getattr(buckets[c], split).mask.shape[1] for c in order[:rank + 1])
                  for split in buckets[b]._fields]
  bucket_of, position = np.zeros(num_clients, np.int32), np.zeros(num_clients, np.int32)
  for b, ids in enumerate(client_ids):
    bucket_of[ids], position[ids] = b, np.arange(len(ids))
  rank_of_bucket = np.argsort(order)
  # Largest bucket first, then client order: the static rank of each client.
  priority = ((len(buckets) - 1 - rank_of_bucket[bucket_of]) * num_clients
              + np.arange(num_clients))
  chosen_all = jnp.argsort(jnp.where(sampled, jnp.asarray(priority), np.iinfo(np.int32).max),
                           stable=True)[:num_sampled]
  slots = sampled_slots([len(client_ids[b]) for b in order], num_sampled)
  outputs, slot_clients = [], []
  start = 0
  for rank in reversed(range(len(order))):
    b, count = order[rank], slots[rank]
    if count == 0:
      continue
    chosen = chosen_all[start:start + count]
    start += count
    filled = padded_size(count, num_devices)
    if filled > count:  # fillers: copies of the first client, dropped on the way back
      chosen = jnp.concatenate([chosen, jnp.repeat(chosen[:1], filled - count)])
    data = _gather_padded(buckets, order[:rank + 1], longest[b],
                          jnp.asarray(bucket_of)[chosen], jnp.asarray(position)[chosen])
    args = constrain_to_clients(gather(per_client_args, chosen))
    outputs.append(mapped(*args, constrain_to_clients(data)))
    slot_clients.append(jnp.where(jnp.arange(filled) < count, chosen, num_clients))
  return (jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs),
          jnp.concatenate(slot_clients))


def scatter_to_clients(stacked: Any, slot_clients: jax.Array, values: Any) -> Any:
  """`stacked` [K, ...] with client slot_clients[s]'s entry replaced by values[s]; slots
  whose client is K (fillers) change nothing."""
  return jax.tree.map(lambda a, v: a.at[slot_clients].set(v.astype(a.dtype), mode="drop"),
                      stacked, values)
