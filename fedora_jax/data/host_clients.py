"""Clients held on the host: for K beyond what the device holds.

Nothing is stacked for all K clients. A `HostClients` hands out any client's unpadded
splits on demand: from a list kept in host memory (a partition's clients), or generated
from its seed (Synthetic(alpha, beta): client k from (seed, k) alone, so the same client
always gets the same data and a round only generates the clients it samples).
`stack_slots` pads a round's clients to one bucket of static lengths for the device.
"""

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from fedora_jax.data import datasets, synthetic
from fedora_jax.data.client_data import Client, ClientData, ClientSplits
from fedora_jax.data.partitions import PartitionConfig
from fedora_jax.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")


@dataclasses.dataclass(frozen=True)
class HostClients:
  """K clients on the host; `client(k)` is client k's unpadded splits."""
  num_clients: int
  num_classes: int
  client: Callable[[int], Client]
  task: str = "classification"

  def take(self, ids: Sequence[int] | np.ndarray) -> list[Client]:
    return [self.client(int(k)) for k in ids]


def stored(clients: Sequence[Client], num_classes: int,
           task: str = "classification") -> HostClients:
  """Clients already in host memory (a partition's), served as they are."""
  if not clients:
    raise DataError("no clients to hold")
  return HostClients(num_clients=len(clients), num_classes=num_classes,
                     client=clients.__getitem__, task=task)


def generated_synthetic(config: synthetic.SyntheticConfig, num_clients: int,
                        seed: int) -> HostClients:
  """Synthetic(alpha, beta)'s clients 0..K-1, each generated when asked for (the same
  data as synthetic.make_clients gives it)."""
  synthetic.check(config)
  return HostClients(num_clients=num_clients, num_classes=synthetic.NUM_CLASSES,
                     client=lambda k: synthetic.make_client(config, seed, k))


def padded_length(n: int) -> int:
  """A split's static length for n real samples: the next power of two, so that the
  round compiles for a few lengths only, whatever sizes the sampled clients have."""
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def slot_lengths(clients: Sequence[Client]) -> tuple[int, int, int]:
  """(train, val, test) static lengths that hold every one of `clients`."""
  train, val, test = (padded_length(max(len(getattr(c, f"y_{s}")) for c in clients))
                      for s in SPLITS)
  return train, val, test


def _stack(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], length: int) -> ClientData:
  """Like client_data.pad_and_stack, written straight into arrays of `length` samples."""
  n = np.array([len(y) for y in ys], np.int32)
  if n.max() > length:
    raise DataError(f"a client of {n.max()} samples in a slot of {length}")
  x = np.zeros((len(xs), length) + xs[0].shape[1:], xs[0].dtype)
  y = np.zeros((len(ys), length), np.float32 if np.issubdtype(ys[0].dtype, np.floating)
               else np.int32)
  for k, (xk, yk) in enumerate(zip(xs, ys)):
    x[k, :len(yk)], y[k, :len(yk)] = xk, yk
  return ClientData(x=x, y=y, mask=np.arange(length) < n[:, None], n=n)


def stack_slots(clients: Sequence[Client], lengths: tuple[int, int, int]) -> ClientSplits:
  """`clients` stacked as one bucket [S, ...], each split padded to `lengths`."""
  if any(len(c.y_train) == 0 for c in clients):
    raise DataError("a client has no training samples")
  return ClientSplits(*(_stack([getattr(c, f"x_{s}") for c in clients],
                               [getattr(c, f"y_{s}") for c in clients], n)
                        for s, n in zip(SPLITS, lengths)))


def from_dataset(name: str, data_dir: str | None, num_clients: int, setting: str, seed: int,
                 data_source: str = "files",
                 partition_config: PartitionConfig | None = None) -> HostClients:
  """`name`'s K clients held on the host: generated per client where the dataset is
  generated (synthetic), else its partition's clients as build_federated_dataset cuts
  them (its stacked copy let go)."""
  spec = datasets.get_spec(name)
  if spec.generated:
    if setting != "balanced" or data_source != "files":
      raise ConfigError(f"{name}: generated clients take the default --setting and"
                        " --data_source")
    return generated_synthetic(datasets.synthetic_config(partition_config), num_clients,
                               seed)
  built = datasets.build_federated_dataset(name, data_dir, num_clients, setting, seed,
                                           data_source=data_source,
                                           partition_config=partition_config)
  return stored([built.partition.clients[k] for k in built.client_ids],
                built.data.num_classes, spec.task)
