"""Tiny-ImageNet (the CS231n release, http://cs231n.stanford.edu/tiny-imagenet-200.zip).

The official archive `tiny-imagenet-200.zip` unzips to

  tiny-imagenet-200/wnids.txt                      the 200 class ids (WordNet ids), one a line
  tiny-imagenet-200/train/<wnid>/images/<wnid>_<i>.JPEG   500 per class, 64x64 RGB
  tiny-imagenet-200/train/<wnid>/<wnid>_boxes.txt  (bounding boxes; not used)
  tiny-imagenet-200/val/images/val_<i>.JPEG        10,000 images
  tiny-imagenet-200/val/val_annotations.txt        filename, wnid, x0, y0, x1, y1 (tabs)
  tiny-imagenet-200/test/images/test_<i>.JPEG      10,000 images without labels

The official test set has no labels, so the validation set is our test set, as FedALA
(Zhang et al., AAAI 2023) does through PFLlib (dataset/generate_tiny_imagenet.py pools
train and val). Class c is the c-th line of wnids.txt. A few training images are
greyscale JPEGs; every image is converted to RGB. Images come back [N, 64, 64, 3] uint8
(models standardise them), labels int32: 100,000 training and 10,000 test images.

`load_tinyimagenet(data_dir)` takes the data root (its `tinyimagenet/` folder,
fedora_jax/data/root.py), or the dataset's own folder, holding the zip (read in place,
nothing extracted) or it extracted (`tiny-imagenet-200/`, or that folder itself), or the
zip given as a file. There is no download: fetch the zip yourself. Decoding the 110,000
JPEGs takes a minute or two.
"""

import io
import os
import zipfile
import zlib

import numpy as np

from fedora_jax.data import root as data_root
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import DataError

NAME = "tinyimagenet"
ARCHIVE = "tiny-imagenet-200.zip"
FOLDER = "tiny-imagenet-200"
NUM_CLASSES = 200
IMAGE_SIZE = 64
EXPECTED = (f"{ARCHIVE} (from http://cs231n.stanford.edu/{ARCHIVE}) or it extracted"
            f" ({FOLDER}/wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG,"
            " val/val_annotations.txt)")


def _extracted(folder: str) -> str | None:
  for candidate in (os.path.join(folder, FOLDER), folder):
    if os.path.isfile(os.path.join(candidate, "wnids.txt")):
      return candidate
  return None


def _holds(folder: str) -> bool:
  return _extracted(folder) is not None or os.path.isfile(os.path.join(folder, ARCHIVE))


class _Folder:
  """Reads files of the extracted release."""

  def __init__(self, top: str):
    self.top = top

  def where(self, rel: str) -> str:
    return os.path.join(self.top, rel)

  def read(self, rel: str) -> bytes:
    try:
      with open(self.where(rel), "rb") as f:
        return f.read()
    except OSError as e:
      raise DataError(f"{NAME}: cannot read {self.where(rel)} ({e.strerror})") from None

  def listdir(self, rel: str) -> list[str]:
    try:
      return sorted(os.listdir(self.where(rel)))
    except OSError as e:
      raise DataError(f"{NAME}: cannot list {self.where(rel)} ({e.strerror})") from None


class _Zip:
  """Reads files of the release straight from the zip (members under tiny-imagenet-200/)."""

  def __init__(self, path: str):
    self.path = path
    try:
      self.zip = zipfile.ZipFile(path)
      self.names = set(self.zip.namelist())
    except (OSError, zipfile.BadZipFile) as e:
      raise DataError(f"{NAME}: cannot read {path}: truncated or not a zip ({e})") from None

  def where(self, rel: str) -> str:
    return f"{self.path}:{FOLDER}/{rel}"

  def read(self, rel: str) -> bytes:
    name = f"{FOLDER}/{rel}"
    if name not in self.names:
      raise DataError(f"{NAME}: {self.path} lacks {name}")
    try:
      return self.zip.read(name)
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as e:
      raise DataError(f"{NAME}: cannot read {self.where(rel)}: corrupt ({e})") from None

  def listdir(self, rel: str) -> list[str]:
    prefix = f"{FOLDER}/{rel.rstrip('/')}/"
    return sorted({n[len(prefix):].split("/")[0] for n in self.names
                   if n.startswith(prefix) and len(n) > len(prefix)})


def decode_jpeg(data: bytes, where: str, size: int) -> np.ndarray:
  """JPEG bytes -> [size, size, 3] uint8 RGB (bilinear-resized when not that size)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  try:
    with Image.open(io.BytesIO(data)) as image:
      rgb = image.convert("RGB")
      if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
      return np.asarray(rgb, np.uint8)
  except (OSError, ValueError, SyntaxError) as e:
    raise DataError(f"{NAME}: cannot decode image {where} ({e})") from None


def _text(files, rel: str) -> list[str]:
  try:
    return files.read(rel).decode("utf-8").splitlines()
  except UnicodeDecodeError as e:
    raise DataError(f"{NAME}: {files.where(rel)} is not text ({e})") from None


def _read(files) -> ImageDataset:
  wnids = [w.strip() for w in _text(files, "wnids.txt") if w.strip()]
  if len(wnids) != NUM_CLASSES or len(set(wnids)) != NUM_CLASSES:
    raise DataError(f"{NAME}: {files.where('wnids.txt')} lists {len(set(wnids))} distinct"
                    f" class ids, expected {NUM_CLASSES}")
  label = {w: c for c, w in enumerate(wnids)}
  x_train, y_train = [], []
  for wnid in wnids:
    rel = f"train/{wnid}/images"
    for name in files.listdir(rel):
      if name.upper().endswith(".JPEG"):
        x_train.append(decode_jpeg(files.read(f"{rel}/{name}"), files.where(f"{rel}/{name}"),
                                   IMAGE_SIZE))
        y_train.append(label[wnid])
  if not x_train:
    raise DataError(f"{NAME}: no training images under {files.where('train')}/<wnid>/images/")
  x_test, y_test = [], []
  annotations = "val/val_annotations.txt"
  for line_no, line in enumerate(_text(files, annotations), 1):
    fields = line.split("\t")
    if not line.strip():
      continue
    if len(fields) < 2 or fields[1] not in label:
      raise DataError(f"{NAME}: {files.where(annotations)} line {line_no}: expected"
                      f" '<file>\\t<wnid in wnids.txt>\\t...', got {line[:60]!r}")
    rel = f"val/images/{fields[0]}"
    x_test.append(decode_jpeg(files.read(rel), files.where(rel), IMAGE_SIZE))
    y_test.append(label[fields[1]])
  if not x_test:
    raise DataError(f"{NAME}: {files.where(annotations)} lists no images")
  return ImageDataset(name=NAME, x_train=np.stack(x_train),
                      y_train=np.asarray(y_train, np.int32), x_test=np.stack(x_test),
                      y_test=np.asarray(y_test, np.int32), num_classes=NUM_CLASSES)


def load_tinyimagenet(data_dir: str | None = None) -> ImageDataset:
  """Tiny-ImageNet's 200 classes: the training set, and the validation set as test set."""
  where = data_root.locate(NAME, data_dir, _holds, EXPECTED)
  if os.path.isfile(where):
    return _read(_Zip(where))
  top = _extracted(where)
  if top is not None:
    return _read(_Folder(top))
  if os.path.isfile(os.path.join(where, ARCHIVE)):
    return _read(_Zip(os.path.join(where, ARCHIVE)))
  raise DataError(f"{NAME}: {where} holds no {EXPECTED}")
