"""GTSRB (German Traffic Sign Recognition Benchmark, Stallkamp et al., IJCNN 2011).

Reads the published archives as they unzip (https://benchmark.ini.rub.de, mirrored at
https://sid.erda.dk/public/archives/daaeac0d7ce1152aea9b61d9f1e19370/published-archive.html):

  GTSRB_Final_Training_Images.zip -> GTSRB/Final_Training/Images/<00000..00042>/
                                       GT-<class>.csv and <track>_<image>.ppm
  GTSRB_Final_Test_Images.zip     -> GTSRB/Final_Test/Images/<nnnnn>.ppm
  GTSRB_Final_Test_GT.zip         -> GT-final_test.csv (the test labels)

`data_dir` may be the data root holding `gtsrb/` (fedora_jax/data/root.py), the folder
holding `GTSRB/` or `GTSRB/` itself; GT-final_test.csv may
lie in `data_dir`, in `GTSRB/` or beside the test images. The CSVs are semicolon
separated: Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId. Each image is
cropped to its sign's bounding box (the Roi, corners inclusive) and resized to 32 x 32
RGB (bilinear), the usual input size; 39209 training and 12630 test images, 43 classes.
Reading the ~52k PPM files takes a minute or so.
"""

import csv
import os

import numpy as np

from fedora_jax.data import root as data_root
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import DataError

NUM_CLASSES = 43
IMAGE_SIZE = 32
TEST_LABELS = "GT-final_test.csv"
EXPECTED_FILES = ("GTSRB/Final_Training/Images/<00000..00042>/GT-<class>.csv + *.ppm,"
                  " GTSRB/Final_Test/Images/*.ppm and GT-final_test.csv (from"
                  " GTSRB_Final_Training_Images.zip, GTSRB_Final_Test_Images.zip and"
                  " GTSRB_Final_Test_GT.zip)")


def _holds(folder: str) -> bool:
  return any(os.path.isdir(os.path.join(root, "Final_Training", "Images"))
             for root in (os.path.join(folder, "GTSRB"), folder))


def _root(data_dir: str) -> str:
  for root in (os.path.join(data_dir, "GTSRB"), data_dir):
    if os.path.isdir(os.path.join(root, "Final_Training", "Images")):
      return root
  raise DataError(f"gtsrb: no Final_Training/Images under {data_dir}; expected"
                  f" {EXPECTED_FILES}")


def _read_rows(path: str) -> list[dict[str, str]]:
  try:
    with open(path, newline="") as f:
      rows = list(csv.DictReader(f, delimiter=";"))
  except OSError as e:
    raise DataError(f"gtsrb: cannot read {path} ({e})") from None
  needed = {"Filename", "Roi.X1", "Roi.Y1", "Roi.X2", "Roi.Y2", "ClassId"}
  if rows and not needed <= set(rows[0]):
    raise DataError(f"gtsrb: {path} lacks columns {sorted(needed - set(rows[0]))}"
                    " (want the semicolon-separated GTSRB annotation format)")
  return rows


def _load_image(folder: str, row: dict[str, str]) -> np.ndarray:
  from PIL import Image  # pylint: disable=g-import-not-at-top
  path = os.path.join(folder, row["Filename"])
  try:
    with Image.open(path) as image:
      box = (int(row["Roi.X1"]), int(row["Roi.Y1"]), int(row["Roi.X2"]) + 1,
             int(row["Roi.Y2"]) + 1)
      sign = image.convert("RGB").crop(box).resize((IMAGE_SIZE, IMAGE_SIZE),
                                                    Image.Resampling.BILINEAR)
      return np.asarray(sign, np.uint8)
  except (OSError, ValueError) as e:
    raise DataError(f"gtsrb: cannot read image {path} ({e})") from None


def _load(folder: str, rows: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
  images = np.stack([_load_image(folder, r) for r in rows])
  try:
    labels = np.array([int(r["ClassId"]) for r in rows], np.int32)
  except ValueError as e:
    raise DataError(f"gtsrb: bad ClassId in {folder} ({e})") from None
  if labels.min() < 0 or labels.max() >= NUM_CLASSES:
    raise DataError(f"gtsrb: ClassId outside 0..{NUM_CLASSES - 1} in {folder}")
  return images, labels


def load_gtsrb(data_dir: str | None) -> ImageDataset:
  """The official GTSRB training and test sets as 32 x 32 RGB uint8 images."""
  data_dir = data_root.locate("gtsrb", data_dir, _holds, EXPECTED_FILES)
  root = _root(data_dir)
  train_dir = os.path.join(root, "Final_Training", "Images")
  xs, ys = [], []
  class_dirs = sorted(d for d in os.listdir(train_dir)
                      if os.path.isdir(os.path.join(train_dir, d)))
  for class_dir in class_dirs:
    folder = os.path.join(train_dir, class_dir)
    rows = _read_rows(os.path.join(folder, f"GT-{class_dir}.csv"))
    if rows:
      x, y = _load(folder, rows)
      xs.append(x)
      ys.append(y)
  if not xs:
    raise DataError(f"gtsrb: no training images under {train_dir}; expected"
                    f" {EXPECTED_FILES}")

  test_dir = os.path.join(root, "Final_Test", "Images")
  candidates = [os.path.join(d, TEST_LABELS) for d in (data_dir, root, test_dir)]
  labels_path = next((p for p in candidates if os.path.isfile(p)), None)
  if labels_path is None or not os.path.isdir(test_dir):
    raise DataError(f"gtsrb: test set incomplete: need {test_dir}/*.ppm and {TEST_LABELS}"
                    f" (from GTSRB_Final_Test_GT.zip) in one of"
                    f" {', '.join(sorted(set(os.path.dirname(p) for p in candidates)))}")
  test_rows = _read_rows(labels_path)
  if not test_rows:
    raise DataError(f"gtsrb: {labels_path} lists no test images")
  x_test, y_test = _load(test_dir, test_rows)
  return ImageDataset(name="gtsrb", x_train=np.concatenate(xs),
                      y_train=np.concatenate(ys), x_test=x_test, y_test=y_test,
                      num_classes=NUM_CLASSES)
