"""Raw image datasets: train and test arrays as stored on disk (uint8, HW or HWC).

MNIST and Fashion-MNIST come from <data root>/mnist/ and <data root>/fashion-mnist/
(fedora_jax/data/root.py); Fashion-MNIST is downloaded there when missing, MNIST falls
back to the official files shipped in the package.
"""

import importlib.resources
import os
from typing import NamedTuple

import numpy as np

from fedora_jax.data import root
from fedora_jax.data.idx import read_idx
from fedora_jax.errors import DataError

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


class ImageDataset(NamedTuple):
  """A labelled image dataset with its official train/test split."""
  name: str
  x_train: np.ndarray  # [N_train, H, W(, C)] uint8
  y_train: np.ndarray  # [N_train] int32
  x_test: np.ndarray   # [N_test, H, W(, C)] uint8
  y_test: np.ndarray   # [N_test] int32
  num_classes: int


def embedded_mnist_dir() -> str:
  """The folder of the official MNIST files shipped inside the package."""
  return str(importlib.resources.files("fedora_jax.data") / "mnist")


def load_idx_dataset(name: str, directory: str, num_classes: int = 10) -> ImageDataset:
  """Loads MNIST-format IDX files (MNIST, Fashion-MNIST) from `directory`."""
  if not os.path.isdir(directory):
    raise DataError(f"{name}: data directory not found: {directory}")
  arrays = {k: read_idx(os.path.join(directory, f)) for k, f in _IDX_FILES.items()}
  for split in ("train", "test"):
    x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
      raise DataError(
          f"{name} in {directory}: {split} images {x.shape} and labels {y.shape} do not"
          " match")
    if y.max() >= num_classes:
      raise DataError(f"{name} in {directory}: label {y.max()} >= {num_classes} classes")
  return ImageDataset(
      name=name, x_train=arrays["x_train"], y_train=arrays["y_train"].astype(np.int32),
      x_test=arrays["x_test"], y_test=arrays["y_test"].astype(np.int32),
      num_classes=num_classes)


def holds_idx_files(folder: str) -> bool:
  return all(os.path.isfile(os.path.join(folder, f)) for f in _IDX_FILES.values())


_EXPECTED = f"the four IDX files ({', '.join(_IDX_FILES.values())})"


def load_mnist(data_dir: str | None = None) -> ImageDataset:
  """MNIST from the data root's mnist/ (or `data_dir` holding the four IDX files), else
  the copy shipped in the package."""
  folder = root.locate("mnist", data_dir, holds_idx_files, _EXPECTED,
                       fallback=embedded_mnist_dir())
  return load_idx_dataset("mnist", folder)


def load_fashion_mnist(data_dir: str | None = None) -> ImageDataset:
  """Fashion-MNIST from the data root's fashion-mnist/ (downloaded when missing), or
  `data_dir` holding its four IDX files."""
  folder = root.locate("fashion-mnist", data_dir, holds_idx_files, _EXPECTED)
  return load_idx_dataset("fashion-mnist", folder)
