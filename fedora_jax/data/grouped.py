"""Datasets whose clients are given by the data itself (one client per collection year).

Yearbook portraits and the leaf spectra come grouped by year; each group is one client.
`group_clients` splits every group, on its own and with a seeded shuffle, into training,
validation and test samples.
"""

from typing import Any, NamedTuple, Sequence

import numpy as np

from fedora_jax.data.client_data import Client
from fedora_jax.errors import DataError

TASKS = ("classification", "regression")


class GroupedDataset(NamedTuple):
  """Samples grouped into clients; targets are class ids or real values (regression)."""
  name: str
  groups: np.ndarray            # [G] the group of each client (e.g. its year), sorted
  x: tuple[np.ndarray, ...]     # G arrays [n_g, ...]: uint8 images or float32 features
  y: tuple[np.ndarray, ...]     # G arrays [n_g]: int32 class ids or float32 targets
  num_classes: int              # model outputs: the class count, 1 for regression
  task: str                     # "classification" or "regression"
  val_fraction: float = 0.1     # of each group's samples, for validation
  test_fraction: float = 0.1    # of each group's samples, for testing


def group_clients(dataset: GroupedDataset, num_clients: int, seed: int) -> list[Client]:
  """The first `num_clients` groups as clients, each split train / val / test at random.

  Each group's samples are shuffled with a seed derived from (seed, group index); a
  group of n samples gives round(n * dataset.test_fraction) test and
  round(n * dataset.val_fraction) validation samples, at least one of each, and keeps
  the rest (at least one) to train.
  """
  available = len(dataset.groups)
  if not 1 <= num_clients <= available:
    raise DataError(f"{dataset.name}: has {available} clients (groups"
                    f" {dataset.groups[0]}..{dataset.groups[-1]}), cannot make"
                    f" {num_clients}")
  clients = []
  for g in range(num_clients):
    x, y = dataset.x[g], dataset.y[g]
    n = len(y)
    if n < 3:
      raise DataError(f"{dataset.name}: group {dataset.groups[g]} has {n} samples; each"
                      " client needs at least 3 (train, validation, test)")
    n_test = max(1, int(round(n * dataset.test_fraction)))
    n_val = max(1, int(round(n * dataset.val_fraction)))
    if n_test + n_val >= n:
      n_test, n_val = 1, 1
    order = np.random.default_rng([seed, g]).permutation(n)
    test, val, train = order[:n_test], order[n_test:n_test + n_val], order[n_test + n_val:]
    clients.append(Client(x_train=x[train], y_train=y[train], x_val=x[val], y_val=y[val],
                          x_test=x[test], y_test=y[test]))
  return clients


def make_grouped(name: str, keys: np.ndarray, x: np.ndarray, y: np.ndarray,
                 num_classes: int, task: str, val_fraction: float = 0.1,
                 test_fraction: float = 0.1) -> GroupedDataset:
  """Groups samples by `keys` [N] (ascending), keeping each group's samples in order."""
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}")
  groups = np.unique(keys)
  members = [np.flatnonzero(keys == k) for k in groups]
  return GroupedDataset(name=name, groups=groups, x=tuple(x[m] for m in members),
                        y=tuple(y[m] for m in members), num_classes=num_classes, task=task,
                        val_fraction=val_fraction, test_fraction=test_fraction)


def standardize(clients: Sequence[Client]) -> tuple[list[Client], dict[str, np.ndarray]]:
  """Z-scores float features and float (regression) targets with the mean and standard
  deviation of all clients' training samples; uint8 images and class ids pass unchanged.

  Training-split statistics only, so nothing of the validation or test samples leaks
  into the preprocessing. Returns the clients and the statistics used.
  """
  stats = {}
  fields: dict[str, tuple[Any, Any]] = {}  # field: (mean, std)
  if np.issubdtype(clients[0].x_train.dtype, np.floating):
    x = np.concatenate([c.x_train for c in clients]).astype(np.float64)
    stats["x_mean"], stats["x_std"] = x.mean(axis=0), x.std(axis=0)
    fields["x"] = (stats["x_mean"], np.where(stats["x_std"] > 0, stats["x_std"], 1.0))
  if np.issubdtype(clients[0].y_train.dtype, np.floating):
    y = np.concatenate([c.y_train for c in clients]).astype(np.float64)
    stats["y_mean"], stats["y_std"] = y.mean(), y.std()
    fields["y"] = (stats["y_mean"], stats["y_std"] if stats["y_std"] > 0 else 1.0)
  if not fields:
    return list(clients), stats

  def scaled(array, field):
    if field not in fields:
      return array
    mean, std = fields[field]
    return ((array - mean) / std).astype(np.float32)
  return [Client(*(scaled(getattr(c, name), name.split("_")[0]) for name in Client._fields))
          for c in clients], stats
