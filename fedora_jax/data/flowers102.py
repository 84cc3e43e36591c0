"""Oxford Flowers102 (Nilsback & Zisserman, ICVGIP 2008), from its official files.

https://www.robots.ox.ac.uk/~vgg/data/flowers/102/ distributes

  102flowers.tgz   jpg/image_00001.jpg .. jpg/image_08189.jpg (varying sizes, RGB)
  imagelabels.mat  `labels`: [1, 8189], the class (1..102) of image i at column i-1
  setid.mat        `trnid`, `valid`, `tstid`: 1-based image numbers of the official
                   training (1,020), validation (1,020) and test (6,149) splits

(the same three files torchvision's `Flowers102` downloads). The .mat files are MATLAB 5
files, read with scipy.io.loadmat. Training set: trnid and valid together (2,040 images;
our partitions cut each client's own validation split out of it); test set: tstid
(6,149). Labels become 0..101. Every image is resized to 64x64 RGB (PIL bilinear), as
PFLlib's generate_Flowers102.py does (`transforms.Resize((64, 64))`), the data ConFREE's
poster uses through PFLlib. PFLlib pools all 8,189 images before cutting clients; we keep
the official test split as the test pool, as for every other dataset here.

`load_flowers102(data_dir)` takes the data root (its `flowers102/` folder,
fedora_jax/data/root.py) or the dataset's own folder, holding the two .mat files and the
archive (read in place, nothing extracted) or it extracted (`jpg/`). Decoding the 8,189
JPEGs takes a minute or so.
"""

import os
import tarfile
import zlib

import numpy as np

from fedora_jax.data import root as data_root
from fedora_jax.data.sources import ImageDataset
from fedora_jax.data.tinyimagenet import decode_jpeg
from fedora_jax.errors import DataError

NAME = "flowers102"
ARCHIVE = "102flowers.tgz"
LABELS = "imagelabels.mat"
SPLITS = "setid.mat"
NUM_CLASSES = 102
IMAGE_SIZE = 64
EXPECTED = (f"{ARCHIVE} (or it extracted, jpg/), {LABELS} and {SPLITS} from"
            " https://www.robots.ox.ac.uk/~vgg/data/flowers/102/")


def _image_name(number: int) -> str:
  return f"jpg/image_{number:05d}.jpg"


def _holds(folder: str) -> bool:
  return (os.path.isfile(os.path.join(folder, LABELS))
          and os.path.isfile(os.path.join(folder, SPLITS))
          and (os.path.isfile(os.path.join(folder, ARCHIVE))
               or os.path.isdir(os.path.join(folder, "jpg"))))


def _mat(path: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
  import scipy.io  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise DataError(f"{NAME}: {path} not found; expected {EXPECTED}")
  try:
    mat = scipy.io.loadmat(path)
  except Exception as e:  # pylint: disable=broad-except
    # loadmat fails on damaged files with whatever its parser hits (IndexError on a
    # short header, ValueError, MatReadError, zlib.error, ...): all mean a bad file.
    raise DataError(f"{NAME}: cannot read {path}: truncated or not a MATLAB file"
                    f" ({e})") from None
  missing = [k for k in keys if k not in mat]
  if missing:
    raise DataError(f"{NAME}: {path} lacks {', '.join(missing)}")
  return {k: np.asarray(mat[k]).reshape(-1).astype(np.int64) for k in keys}


def _decode_all(folder: str, numbers: np.ndarray) -> dict[int, np.ndarray]:
  """Image number -> [64, 64, 3] uint8, from the archive or the extracted jpg/."""
  wanted = {_image_name(int(n)): int(n) for n in numbers}
  images = {}
  archive = os.path.join(folder, ARCHIVE)
  if os.path.isdir(os.path.join(folder, "jpg")):
    for name, number in wanted.items():
      path = os.path.join(folder, name)
      try:
        with open(path, "rb") as f:
          images[number] = decode_jpeg(f.read(), path, IMAGE_SIZE)
      except OSError as e:
        raise DataError(f"{NAME}: cannot read {path} ({e.strerror})") from None
    return images
  try:
    with tarfile.open(archive, "r:*") as tar:
      for member in tar:  # streaming: the gzip stream is read once, front to back
        found = wanted.get(member.name.removeprefix("./"))
        file = tar.extractfile(member) if found is not None and member.isfile() else None
        if found is not None and file is not None:  # a regular file: extractfile reads it
          images[found] = decode_jpeg(file.read(), f"{archive}:{member.name}", IMAGE_SIZE)
  except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
    raise DataError(f"{NAME}: cannot read {archive}: truncated or corrupt ({e})") from None
  missing = sorted(set(wanted.values()) - set(images))
  if missing:
    raise DataError(f"{NAME}: {archive} lacks {len(missing)} image(s) setid.mat names,"
                    f" e.g. {_image_name(missing[0])}")
  return images


def load_flowers102(data_dir: str | None = None) -> ImageDataset:
  """Flowers102: official train + val as the training set, the official test set."""
  folder = data_root.locate(NAME, data_dir, _holds, EXPECTED)
  if os.path.isfile(folder):
    folder = os.path.dirname(folder)  # one of its files given: read its folder
  labels = _mat(os.path.join(folder, LABELS), ("labels",))["labels"]
  splits = _mat(os.path.join(folder, SPLITS), ("trnid", "valid", "tstid"))
  if labels.size == 0 or labels.min() < 1 or labels.max() > NUM_CLASSES:
    raise DataError(f"{NAME}: {os.path.join(folder, LABELS)}: labels outside"
                    f" 1..{NUM_CLASSES}")
  train_ids = np.concatenate([splits["trnid"], splits["valid"]])
  test_ids = splits["tstid"]
  every = np.concatenate([train_ids, test_ids])
  if every.min() < 1 or every.max() > labels.size:
    raise DataError(f"{NAME}: {os.path.join(folder, SPLITS)} names images outside"
                    f" 1..{labels.size} ({LABELS} labels {labels.size})")
  images = _decode_all(folder, every)
  pick = lambda ids: (np.stack([images[int(i)] for i in ids]),
                      (labels[ids - 1] - 1).astype(np.int32))
  (x_train, y_train), (x_test, y_test) = pick(train_ids), pick(test_ids)
  return ImageDataset(name=NAME, x_train=x_train, y_train=y_train, x_test=x_test,
                      y_test=y_test, num_classes=NUM_CLASSES)
