"""Clients held on the host (issue 51): for K beyond what the device holds.

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

from fedora_jax.data import synthetic
from fedora_jax.data.client_data import Client, ClientSplits, pad_and_stack
from fedora_jax.errors import DataError

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
  return tuple(padded_length(max(len(getattr(c, f"y_{s}")) for c in clients))  # type: ignore[return-value]
               for s in SPLITS)


def _pad_to(data, length: int):
  extra = length - data.mask.shape[1]
  if extra < 0:
    raise DataError(f"a client of {data.mask.shape[1]} samples in a slot of {length}")
  def pad(a):
    return np.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))
  return data._replace(x=pad(data.x), y=pad(data.y), mask=pad(data.mask))


def stack_slots(clients: Sequence[Client], lengths: tuple[int, int, int]) -> ClientSplits:
  """`clients` stacked as one bucket [S, ...], each split padded to `lengths`."""
  if any(len(c.y_train) == 0 for c in clients):
    raise DataError("a client has no training samples")
  return ClientSplits(*(
      _pad_to(pad_and_stack([getattr(c, f"x_{s}") for c in clients],
                            [getattr(c, f"y_{s}") for c in clients]), n)
      for s, n in zip(SPLITS, lengths)))
