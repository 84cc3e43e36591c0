"""The client axis over devices: a `Mesh` with one axis, `clients`.

Client data lives on the devices split along the client axis (`NamedSharding(mesh,
P("clients"))`), each size bucket padded up to a multiple of the device count with copies
of its last client. Inside the round, `map_over_buckets` constrains every per-client
argument to the same sharding, so each device trains and evaluates its own clients; the
padded copies are trained too and then dropped (they carry no weight anywhere: they are
never part of the [K, ...] client state, the uploads or the metrics). The server step
works on the [K, ...] stacked state, which XLA keeps replicated or shards as it sees fit.

The same code runs on one CPU, on several (fake, via
XLA_FLAGS=--xla_force_host_platform_device_count=N) devices, on GPUs and across hosts
after `jax.distributed.initialize()` (`initialize_distributed`): the mesh spans
`jax.devices()`, every process's devices (on one process's CPU devices, see
`default_mesh`). Client k's randomness is fold_in(round key, k)
whatever device it lands on, so per-client results do not depend on the device count.
"""

import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedora_jax.tree import leading_size

CLIENT_AXIS = "clients"


def client_mesh(devices=None) -> Mesh:
  """A 1-D mesh over `devices` (default: all devices of all processes)."""
  devices = jax.devices() if devices is None else devices
  return Mesh(np.asarray(devices), (CLIENT_AXIS,))


def default_mesh(bucket_sizes: Sequence[int]) -> Mesh:
  """The mesh a run uses unless told: every device, except on one process's CPU devices
  (one per core, `cpu_device_count`), where it spans at most as many devices as the
  smallest size bucket has clients. A bucket padded to the device count trains copies of
  its last client on the spare devices: free on accelerators, but on a CPU each copy
  takes a core from the real client (the imbalanced setting's one large client ran slower
  split over 2 CPU devices than on 1 device using both cores:
  docs/measurements/2026-11-26-cpu-kernels.md)."""
  devices = jax.devices()
  if jax.default_backend() == "cpu" and jax.process_count() == 1:
    devices = devices[:max(1, min(len(devices), min(bucket_sizes)))]
  return client_mesh(devices)


def cpu_device_count() -> int:
  """Cores this process may run on: the CPU device count the commands ask JAX for."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def padded_size(num_clients: int, num_devices: int) -> int:
  """num_clients rounded up to a multiple of num_devices."""
  return -(-num_clients // num_devices) * num_devices


def pad_clients(tree: Any, size: int) -> Any:
  """Pads the leading (client) axis of host arrays to `size` with copies of the last client."""
  def pad(a):
    a = np.asarray(a)
    extra = size - a.shape[0]
    return a if extra == 0 else np.concatenate([a, np.repeat(a[-1:], extra, axis=0)])
  return jax.tree.map(pad, tree)


def client_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(CLIENT_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def put_global(tree: Any, sharding: NamedSharding) -> Any:
  """Host arrays -> global jax.Arrays with `sharding`; each process supplies the shards of
  its own devices from its (identical) host copy, so this also works across hosts."""
  def put(a):
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
  return jax.tree.map(put, tree)


def place_buckets(buckets: tuple, mesh: Mesh) -> tuple:
  """Each size bucket padded to a multiple of the mesh size, split over its devices."""
  sharding = client_sharding(mesh)
  return tuple(put_global(pad_clients(b, padded_size(leading_size(b), mesh.size)), sharding)
               for b in buckets)


def constrain_to_clients(tree: Any) -> Any:
  """Splits the leading axis of every leaf over the `clients` mesh axis, when tracing
  under a mesh that has one (`jax.set_mesh`); otherwise returns `tree` unchanged."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CLIENT_AXIS not in mesh.axis_names:
    return tree
  return jax.lax.with_sharding_constraint(tree, PartitionSpec(CLIENT_AXIS))


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> None:
  """jax.distributed.initialize with explicit settings, or its environment auto-detection
  (SLURM, Open MPI, TPU pods, ...) when all three are None."""
  if coordinator_address is None and num_processes is None and process_id is None:
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
