"""A public dataset: a held-out slice of the training split that no client holds.

Algorithms that distil on data every party may read (FedMD's alignment set; the public
set of FedDistill-like methods) declare the size they need (the registry's
`public_size`, the run's --public_size); the data layer then draws that many samples of
the official training split, seeded by the data seed, before the clients are cut, so
no client holds them, and hands them over in `FederatedData.public`. The labels come
along for algorithms that read them; FedMD reads the images only. A run without one
(public size None or 0) cuts its clients from the whole training split, as before.
"""

from typing import NamedTuple

import numpy as np

from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import FieldError


class PublicData(NamedTuple):
  """The public samples (no client axis): numpy as built."""
  x: np.ndarray  # [P, ...] as the source's images (uint8)
  y: np.ndarray  # [P] int32 class ids


def hold_out_public(source: ImageDataset, size: int,
                    seed: int) -> tuple[ImageDataset, PublicData]:
  """`size` samples of `source`'s training split drawn without replacement (a seeded
  choice, in ascending index order) as the public set, and the source without them."""
  n = len(source.y_train)
  if size <= 0 or size >= n:
    raise FieldError("experiment", "public_size",
                     f"must be in [1, {n - 1}] (the training split holds {n}), got {size}")
  # A stream of the data seed that no partition draws from.
  chosen = np.sort(np.random.default_rng([seed, 2]).choice(n, size, replace=False))
  kept = np.setdiff1d(np.arange(n), chosen)
  public = PublicData(x=source.x_train[chosen], y=source.y_train[chosen].astype(np.int32))
  return source._replace(x_train=source.x_train[kept], y_train=source.y_train[kept]), public
