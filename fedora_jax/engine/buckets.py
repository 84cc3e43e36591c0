"""Runs a per-client function over all clients, or over a round's sampled ones, one vmap
per size bucket.

The round sees every per-client quantity stacked in client order [K, ...]. For each
bucket we gather its clients' slices, vmap the function over them together with the
bucket's data, then put the results back in client order. With one bucket holding every
client in order (the balanced setting) there is no gather or scatter at all.

`map_over_sampled` runs the function for the clients a round samples only: a static
number of slots per bucket, filled with the sampled clients' arguments and data, so a
round at participation f costs about f of a full one (the DESIGN's client sampling).
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


def gather(tree: Any, ids: np.ndarray) -> Any:
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
    return jax.lax.map(lambda a: fn(*a), args, batch_size=client_chunk)

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


def sampled_slots(bucket_size: int, bucket_slots: int, num_sampled: int,
                  num_devices: int) -> int:
  """Static slots a bucket gets for a round's sampled clients: as many as can be sampled
  from it (min(M, K_b)), rounded up to the device count, never past its padded size."""
  return min(bucket_slots, padded_size(min(num_sampled, bucket_size), num_devices))


def map_over_sampled(fn: Callable[..., Any], per_client_args: tuple, buckets: tuple,
                     client_ids: Sequence[np.ndarray], num_clients: int,
                     sampled: jax.Array, num_sampled: int,
                     client_chunk: int | None = None) -> tuple[Any, jax.Array]:
  """fn(*per_client_args_k, bucket_data_k) for the sampled clients k only.

  `sampled` [K] bool marks `num_sampled` clients (a static count). Bucket b gets
  `sampled_slots` slots: its sampled clients first, in client order, then unsampled or
  padded ones that fill the static shape. Returns (outputs [S, ...], slot_clients [S]):
  slot s holds client slot_clients[s]'s output, or slot_clients[s] == K for a filler,
  whose output `scatter_to_clients` drops. Per-client results equal `map_over_buckets`'s.
  """
  mapped = over_clients(fn, client_chunk)
  num_devices = _mesh_size()
  outputs, slot_clients = [], []
  for ids, data in zip(client_ids, buckets):
    bucket_slots = leading_size(data)
    padded_ids = np.concatenate([ids, np.repeat(ids[-1:], bucket_slots - len(ids))])
    in_bucket = sampled[padded_ids] & (np.arange(bucket_slots) < len(ids))
    slots = sampled_slots(len(ids), bucket_slots, num_sampled, num_devices)
    # Stable: sampled positions first, each group in client order.
    positions = jnp.argsort(~in_bucket, stable=True)[:slots]
    chosen = jnp.asarray(padded_ids)[positions]
    args = constrain_to_clients(gather(per_client_args, chosen))
    outputs.append(mapped(*args, constrain_to_clients(gather(data, positions))))
    slot_clients.append(jnp.where(in_bucket[positions], chosen, num_clients))
  return (jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs),
          jnp.concatenate(slot_clients))


def scatter_to_clients(stacked: Any, slot_clients: jax.Array, values: Any) -> Any:
  """`stacked` [K, ...] with client slot_clients[s]'s entry replaced by values[s]; slots
  whose client is K (fillers) change nothing."""
  return jax.tree.map(lambda a, v: a.at[slot_clients].set(v.astype(a.dtype), mode="drop"),
                      stacked, values)
