"""The data root: one folder per dataset, as TFDS's data_dir or torchvision's root.

`--data_dir` names a root holding one folder per dataset, named as the loaders name
their datasets:

  <root>/mnist/          the four MNIST IDX files (else the copy shipped in the package)
  <root>/fashion-mnist/  the four Fashion-MNIST IDX files
  <root>/cifar10/        cifar-10-python.tar.gz (or it extracted, or an npz)
  <root>/cifar100/       cifar-100-python.tar.gz (or it extracted)
  <root>/gtsrb/ <root>/yearbook/ <root>/leaf/   see their loaders
  <root>/ag_news/        train.csv, test.csv (--dataset=agnews)
  <root>/tinyimagenet/ <root>/flowers102/   see their loaders (no download)

Without `--data_dir` the root is $FEDORA_JAX_DATA, else $XDG_CACHE_HOME/fedora_jax, else
~/.cache/fedora_jax. A dataset with a public official source (fedora_jax/data/
download.py) that is missing from the root is downloaded into it. A folder holding one
dataset's files directly is accepted as `--data_dir` too, as before. The same root is
TFDS's data_dir for `--data_source=tfds` (TFDS keeps <root>/<tfds name>/<version>/, e.g.
fashion_mnist/3.0.1/, beside the folders above).
"""

import glob
import os
from typing import Callable

from fedora_jax.data import download
from fedora_jax.errors import DataError

ENV_ROOT = "FEDORA_JAX_DATA"


def default_root() -> str:
  """$FEDORA_JAX_DATA, else the per-user cache folder ($XDG_CACHE_HOME or ~/.cache)."""
  if os.environ.get(ENV_ROOT):
    return os.path.expanduser(os.environ[ENV_ROOT])
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.join(os.path.expanduser(cache), "fedora_jax")


def _holds_a_remote_file(name: str, folder: str) -> bool:
  remote = download.REMOTE.get(name)
  return remote is not None and any(os.path.isfile(os.path.join(folder, f.name))
                                    for f in remote.files)


def locate(name: str, data_dir: str | None, holds: Callable[[str], bool],
           expected: str, fallback: str | None = None) -> str:
  """The folder (or file) to read dataset `name` from, downloading it if need be.

  `data_dir`: the root, or the dataset's own folder or file; None: default_root().
  `holds(folder)`: whether `folder` holds the dataset in a form its loader reads.
  `expected`: the files it wants, for the error message. `fallback`: a folder to read
  when the root lacks the dataset (the MNIST shipped in the package), before any download.
  """
  if data_dir:
    data_dir = os.path.expanduser(data_dir)
    if not os.path.exists(data_dir):
      raise DataError(f"{name}: data directory not found: {data_dir}")
    # The dataset's own folder (or file), as --data_dir always accepted.
    if (os.path.isfile(data_dir) or holds(data_dir)
        or _holds_a_remote_file(name, data_dir)):
      return data_dir
    root = data_dir
  else:
    root = default_root()
  folder = os.path.join(root, name)
  if os.path.isdir(folder) and holds(folder):
    return folder
  if fallback is not None:
    return fallback
  if name in download.REMOTE:
    return download.fetch(name, root)  # a one-line error if it cannot
  raise DataError(f"{name}: no data in {folder}/ and no public source to download it"
                  f" from: put {expected} there, or pass --data_dir=<a root holding"
                  f" {name}/, or that folder itself>")

def tfds_data_dir(tfds_name: str, data_dir: str | None) -> str | None:
  """TFDS's data_dir for `tfds_name`: the data root (None: TFDS's own default).

  A dataset's own TFDS folder (<root>/<tfds_name>, holding <version>/) given as
  `data_dir` stands for its root. Without `data_dir` the default root serves when it
  holds a prepared `tfds_name` or $FEDORA_JAX_DATA is set; else TFDS's default
  (~/tensorflow_datasets), so data prepared there keeps working.
  """
  prepared = lambda d, n: bool(glob.glob(os.path.join(d, n, "*", "dataset_info.json")))
  if data_dir:
    data_dir = os.path.expanduser(data_dir)
    parent = os.path.dirname(os.path.normpath(data_dir))
    if os.path.basename(os.path.normpath(data_dir)) == tfds_name and prepared(parent, tfds_name):
      return parent
    return data_dir
  root = default_root()
  return root if os.environ.get(ENV_ROOT) or prepared(root, tfds_name) else None
