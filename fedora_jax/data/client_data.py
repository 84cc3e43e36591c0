"""Client datasets stacked over a leading client axis, padded and masked.

Clients are grouped into size buckets so that no client is padded to a far larger
client's size (FEDORA's imbalanced setting has one client with ~280x the data of the
others). Inside a bucket every split is padded to the bucket's largest client and a mask
marks the real samples. Images stay uint8 on the device; models normalise on the fly.
"""

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from fedora_jax.errors import DataError

if TYPE_CHECKING:  # annotations only: the data modules do not import jax
  import jax

  from fedora_jax.data.public import PublicData


class ClientData(NamedTuple):
  """One split of the clients of one bucket: numpy arrays as built, jax arrays on the
  device and in jitted code."""
  x: "np.ndarray | jax.Array"     # [K_b, N, ...] uint8 (or float for non-image data)
  y: "np.ndarray | jax.Array"     # [K_b, N] int32 class ids (float32 for regression)
  mask: "np.ndarray | jax.Array"  # [K_b, N] bool: True for real samples
  n: "np.ndarray | jax.Array"     # [K_b] int32: real samples per client


class ClientSplits(NamedTuple):
  """Train, validation and test splits of the clients of one bucket."""
  train: ClientData
  val: ClientData
  test: ClientData


class Client(NamedTuple):
  """One client's unpadded splits, as a partition produces them."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_val: np.ndarray
  y_val: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


class FederatedData(NamedTuple):
  """All clients, in size buckets.

  `buckets` holds only arrays, so it is what jitted code takes; `client_ids` is the
  static layout: bucket b holds clients `client_ids[b]` in that order.
  """
  buckets: tuple[ClientSplits, ...]
  client_ids: tuple[np.ndarray, ...]
  num_clients: int
  num_classes: int
  # The public set no client holds (data/public.py), for algorithms that declare one.
  public: "PublicData | None" = None

  @property
  def input_shape(self) -> tuple[int, ...]:
    return self.buckets[0].train.x.shape[2:]

  @property
  def input_dtype(self) -> np.dtype:
    return self.buckets[0].train.x.dtype

  @property
  def task(self) -> str:
    """"regression" when the targets are real numbers (then num_classes is the model's
    single output), else "classification"."""
    floating = np.issubdtype(self.buckets[0].train.y.dtype, np.floating)
    return "regression" if floating else "classification"

  def split_sizes(self, split: str) -> np.ndarray:
    """[K] real sample counts of `split`, in client order."""
    sizes = np.zeros(self.num_clients, np.int32)
    for ids, bucket in zip(self.client_ids, self.buckets):
      sizes[ids] = np.asarray(getattr(bucket, split).n)
    return sizes


def pad_and_stack(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> ClientData:
  """Stacks per-client arrays into one ClientData padded to the largest client."""
  n = np.array([len(x) for x in xs], np.int32)
  size = max(int(n.max()), 1)
  x = np.zeros((len(xs), size) + xs[0].shape[1:], xs[0].dtype)
  # Class ids stay int32; real-valued (regression) targets become float32.
  y_dtype = np.float32 if np.issubdtype(ys[0].dtype, np.floating) else np.int32
  y = np.zeros((len(xs), size), y_dtype)
  mask = np.zeros((len(xs), size), bool)
  for k, (xk, yk) in enumerate(zip(xs, ys)):
    x[k, :len(xk)] = xk
    y[k, :len(yk)] = yk
    mask[k, :len(xk)] = True
  return ClientData(x=x, y=y, mask=mask, n=n)


def size_buckets(sizes: Sequence[int], max_pad_ratio: float) -> list[np.ndarray]:
  """Groups clients so that inside a group the largest is <= max_pad_ratio x the smallest.

  Greedy over clients sorted by size; returns client indices per bucket, each sorted.
  """
  if max_pad_ratio < 1:
    raise ValueError(f"max_pad_ratio must be >= 1, got {max_pad_ratio}")
  order = np.argsort(np.asarray(sizes), kind="stable")
  buckets, current = [], [order[0]]
  for k in order[1:]:
    if sizes[k] > max_pad_ratio * max(sizes[current[0]], 1):
      buckets.append(current)
      current = []
    current.append(k)
  buckets.append(current)
  return [np.sort(np.array(b, np.int64)) for b in buckets]


def stack_clients(clients: Sequence[Client], num_classes: int,
                  max_pad_ratio: float = 2.0) -> FederatedData:
  """Buckets clients by training-set size and stacks each bucket's splits."""
  if not clients:
    raise DataError("no clients to stack")
  for k, c in enumerate(clients):
    if len(c.x_train) == 0:
      raise DataError(f"client {k} has no training samples")
  groups = size_buckets([len(c.x_train) for c in clients], max_pad_ratio)
  buckets = []
  for ids in groups:
    members = [clients[k] for k in ids]
    buckets.append(ClientSplits(
        train=pad_and_stack([c.x_train for c in members], [c.y_train for c in members]),
        val=pad_and_stack([c.x_val for c in members], [c.y_val for c in members]),
        test=pad_and_stack([c.x_test for c in members], [c.y_test for c in members])))
  return FederatedData(buckets=tuple(buckets), client_ids=tuple(groups),
                       num_clients=len(clients), num_classes=num_classes)
