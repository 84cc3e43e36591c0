"""CIFAR-10 and CIFAR-100 from the official python versions, or CIFAR-10 from an npz.

The official python versions (https://www.cs.toronto.edu/~kriz/cifar.html) are
`cifar-10-python.tar.gz` (cifar-10-batches-py/data_batch_1 .. data_batch_5, test_batch)
and `cifar-100-python.tar.gz` (cifar-100-python/train, test). Each batch file is a
pickled dict whose b"data" is [n, 3072] uint8 (1024 red, 1024 green, 1024 blue values,
rows first), with b"labels" (CIFAR-10) or b"fine_labels" (CIFAR-100's 100 classes; its
b"coarse_labels" holds the 20 superclasses) a list of ints. Pickle runs code from the
file: read only files you trust (a downloaded archive is checked against the official
checksums, fedora_jax/data/download.py).

`load_cifar10(data_dir)` / `load_cifar100(data_dir)` take the data root (its cifar10/ or
cifar100/ folder, downloaded there when missing; fedora_jax/data/root.py) or the
dataset's own folder or file, holding any of
  - the archive itself (read from the tar, nothing extracted);
  - the archive extracted: cifar-10-batches-py/ (cifar-100-python/), or its files;
  - CIFAR-10 only: an npz with x_train [50000, 32, 32, 3] uint8, y_train, x_test, y_test,
    named `cifar10_jpeg.npz` or `cifar10.npz` (or given as the file).
    `cifar10_jpeg.npz` is the JPEG-re-encoded copy described in shared/data/SOURCES.md:
    its pixels are not the original ones, and its dataset name says so,
    "CIFAR-10 (JPEG copy)"; quote that name beside any number measured on it.
Read in that order of preference. Images come back HWC uint8 (the model normalises
them), labels int32.
"""

import os
import pickle
import tarfile
import zipfile
import zlib
from typing import NamedTuple

import numpy as np

from fedora_jax.data import download, root
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import DataError

JPEG_COPY_NAME = "CIFAR-10 (JPEG copy)"
_NPZ_NAMES = ("cifar10_jpeg.npz", "cifar10.npz")


class _Format(NamedTuple):
  name: str           # the dataset's name and its folder in the data root
  archive: str        # the official archive's file name
  batch_dir: str      # the folder it extracts to
  train: tuple[str, ...]
  test: str
  label_key: bytes
  num_classes: int


CIFAR10 = _Format("cifar10", "cifar-10-python.tar.gz", "cifar-10-batches-py",
                  tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", b"labels", 10)
CIFAR100 = _Format("cifar100", "cifar-100-python.tar.gz", "cifar-100-python", ("train",),
                   "test", b"fine_labels", 100)


def _batch_folder(fmt: _Format, folder: str) -> str | None:
  for candidate in (os.path.join(folder, fmt.batch_dir), folder):
    if os.path.isfile(os.path.join(candidate, fmt.test)):
      return candidate
  return None


def _holds(fmt: _Format, folder: str) -> bool:
  names = (fmt.archive, *(_NPZ_NAMES if fmt is CIFAR10 else ()))
  return (_batch_folder(fmt, folder) is not None
          or any(os.path.isfile(os.path.join(folder, n)) for n in names))


def _expected(fmt: _Format) -> str:
  return (f"{fmt.archive} (from {download.REMOTE[fmt.name].homepage}) or it"
          f" extracted ({fmt.batch_dir}/)"
          + (f", or {' or '.join(_NPZ_NAMES)}" if fmt is CIFAR10 else ""))


def _load(fmt: _Format, data_dir: str | None) -> ImageDataset:
  where = root.locate(fmt.name, data_dir, lambda f: _holds(fmt, f), _expected(fmt))
  if os.path.isfile(where):
    return (_load_archive(fmt, where) if where.endswith((".tar.gz", ".tgz", ".tar"))
            else load_cifar10_npz(where))
  folder = _batch_folder(fmt, where)
  if folder is not None:
    return _load_batches(fmt, folder)
  if os.path.isfile(os.path.join(where, fmt.archive)):
    return _load_archive(fmt, os.path.join(where, fmt.archive))
  for name in _NPZ_NAMES if fmt is CIFAR10 else ():
    if os.path.isfile(os.path.join(where, name)):
      return load_cifar10_npz(os.path.join(where, name))
  raise DataError(f"{fmt.name}: {where} holds no {_expected(fmt)}")


def load_cifar10(data_dir: str | None = None) -> ImageDataset:
  return _load(CIFAR10, data_dir)


def load_cifar100(data_dir: str | None = None) -> ImageDataset:
  """CIFAR-100 with its 100 fine labels."""
  return _load(CIFAR100, data_dir)


def _parse_batch(fmt: _Format, f, where: str) -> tuple[np.ndarray, np.ndarray]:
  try:
    batch = pickle.load(f, encoding="bytes")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(fmt.label_key, batch.get(fmt.label_key.decode()))
  except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError,
          zlib.error, tarfile.TarError) as e:
    raise DataError(f"{fmt.name}: cannot read {where}: truncated or not a CIFAR batch"
                    f" ({e})") from None
  if data is None or labels is None:
    raise DataError(f"{fmt.name}: {where} has no data / {fmt.label_key.decode()} entries")
  data = np.asarray(data)
  if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
    raise DataError(f"{fmt.name}: {where}: data is {data.dtype} {data.shape}, expected"
                    " uint8 [n, 3072]")
  labels = np.asarray(labels, np.int32)
  if len(labels) != len(data):
    raise DataError(f"{fmt.name}: {where}: {len(data)} images but {len(labels)} labels")
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CHW rows -> HWC
  return np.ascontiguousarray(images), labels


def _read_batch(fmt: _Format, path: str) -> tuple[np.ndarray, np.ndarray]:
  if not os.path.isfile(path):
    raise DataError(f"{fmt.name}: batch file not found: {path}")
  with open(path, "rb") as f:
    return _parse_batch(fmt, f, path)


def _assemble(fmt: _Format, batches: dict[str, tuple[np.ndarray, np.ndarray]]) -> ImageDataset:
  x_test, y_test = batches[fmt.test]
  return _checked(fmt.name, np.concatenate([batches[n][0] for n in fmt.train]),
                  np.concatenate([batches[n][1] for n in fmt.train]), x_test, y_test,
                  fmt.num_classes)


def _load_batches(fmt: _Format, folder: str) -> ImageDataset:
  """The extracted batch files in `folder`."""
  return _assemble(fmt, {n: _read_batch(fmt, os.path.join(folder, n))
                         for n in (*fmt.train, fmt.test)})


def _load_archive(fmt: _Format, path: str) -> ImageDataset:
  """The batch files read straight from the official archive, in one pass over it."""
  wanted = {f"{fmt.batch_dir}/{n}": n for n in (*fmt.train, fmt.test)}
  batches = {}
  try:
    with tarfile.open(path, "r:*") as tar:
      for member in tar:  # streaming: a gzip stream is read once, front to back
        name = wanted.get(member.name.removeprefix("./"))
        if name is not None and member.isfile():
          batches[name] = _parse_batch(fmt, tar.extractfile(member), f"{path}:{member.name}")
  except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
    raise DataError(f"{fmt.name}: cannot read {path}: truncated or corrupt ({e})") from None
  missing = [m for m, n in wanted.items() if n not in batches]
  if missing:
    raise DataError(f"{fmt.name}: {path} lacks {', '.join(missing)}")
  return _assemble(fmt, batches)


def load_cifar10_npz(path: str) -> ImageDataset:
  """An npz of x_train, y_train, x_test, y_test (e.g. shared/data's JPEG copy)."""
  name = JPEG_COPY_NAME if os.path.basename(path) == "cifar10_jpeg.npz" else "cifar10"
  try:
    with np.load(path) as arrays:
      missing = {"x_train", "y_train", "x_test", "y_test"} - set(arrays.files)
      if missing:
        raise DataError(f"cifar10: {path} lacks {', '.join(sorted(missing))}")
      x_train, y_train, x_test, y_test = (arrays[k] for k in
                                          ("x_train", "y_train", "x_test", "y_test"))
  except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
    raise DataError(f"cifar10: cannot read {path}: truncated or corrupt ({e})") from None
  return _checked(name, x_train, y_train, x_test, y_test, 10)


def _checked(name, x_train, y_train, x_test, y_test, num_classes) -> ImageDataset:
  for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (32, 32, 3):
      raise DataError(f"{name}: {split} images are {x.dtype} {x.shape}, expected uint8"
                      " [n, 32, 32, 3]")
    if y.ndim != 1 or len(y) != len(x):
      raise DataError(f"{name}: {len(x)} {split} images but labels of shape {y.shape}")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
      raise DataError(f"{name}: {split} labels outside [0, {num_classes})")
  return ImageDataset(name=name, x_train=x_train, y_train=y_train.astype(np.int32),
                      x_test=x_test, y_test=y_test.astype(np.int32), num_classes=num_classes)
