"""Yearbook portraits (Ginosar et al., "A Century of Portraits", ICCV Workshops 2015).

The published archive faces_aligned_small_mirrored_co_aligned_cropped_cleaned.tar (from
https://shiry.ttic.edu/projects/yearbooks/yearbooks.html, formerly
https://people.eecs.berkeley.edu/~shiry/projects/yearbooks/yearbooks.html) unpacks to

  faces_aligned_small_mirrored_co_aligned_cropped_cleaned/F/<year>_<state>_<city>_..png
  faces_aligned_small_mirrored_co_aligned_cropped_cleaned/M/<year>_<state>_<city>_..png

37,921 frontal 186 x 171 portraits of American high-school students, 1905-2013, in F/
(female) and M/ (male); each file name starts with the year of its yearbook. As in
Wild-Time's Yearbook benchmark (Yao et al., NeurIPS 2022), which the 84 clients of
FEDORA's Yearbook setting correspond to, the task is gender classification (M = 0,
F = 1), the years before 1930 are dropped (they hold few portraits) and the images are
resized to 32 x 32; here they are kept as one grey channel (the portraits are black
and white). Each year from 1930 to 2013 is one client: 84 clients. `data_dir`: the data
root holding yearbook/ (fedora_jax/data/root.py), the folder holding the unpacked
archive's folder, or that folder itself.
"""

import os

import numpy as np

from fedora_jax.data import root as data_root
from fedora_jax.data.grouped import GroupedDataset, make_grouped
from fedora_jax.errors import DataError

FOLDER = "faces_aligned_small_mirrored_co_aligned_cropped_cleaned"
LABELS = {"M": 0, "F": 1}
FIRST_YEAR = 1930
IMAGE_SIZE = 32
EXPECTED_FILES = (f"{FOLDER}/F/*.png and {FOLDER}/M/*.png, file names starting with the"
                  " year (unpacked from faces_aligned_small_mirrored_co_aligned_cropped"
                  "_cleaned.tar)")


def _holds(folder: str) -> bool:
  return any(all(os.path.isdir(os.path.join(root, g)) for g in LABELS)
             for root in (os.path.join(folder, FOLDER), folder))


def _root(data_dir: str) -> str:
  for root in (os.path.join(data_dir, FOLDER), data_dir):
    if all(os.path.isdir(os.path.join(root, g)) for g in LABELS):
      return root
  raise DataError(f"yearbook: no F/ and M/ folders in {data_dir}; expected"
                  f" {EXPECTED_FILES}")


def _year(filename: str) -> int | None:
  head = filename.split("_", 1)[0]
  return int(head) if head.isdigit() and len(head) == 4 else None


def _load_image(path: str) -> np.ndarray:
  from PIL import Image  # pylint: disable=g-import-not-at-top
  try:
    with Image.open(path) as image:
      return np.asarray(image.convert("L").resize((IMAGE_SIZE, IMAGE_SIZE),
                                                  Image.Resampling.LANCZOS), np.uint8)
  except (OSError, ValueError) as e:
    raise DataError(f"yearbook: cannot read image {path} ({e})") from None


def load_yearbook(data_dir: str | None, first_year: int = FIRST_YEAR) -> GroupedDataset:
  """Portraits of `first_year` and later, grouped by year: [n, 32, 32] uint8, gender."""
  data_dir = data_root.locate("yearbook", data_dir, _holds, EXPECTED_FILES)
  root = _root(data_dir)
  images, labels, years = [], [], []
  for gender, label in sorted(LABELS.items()):
    folder = os.path.join(root, gender)
    for filename in sorted(os.listdir(folder)):
      year = _year(filename)
      if year is None or year < first_year or not filename.lower().endswith(".png"):
        continue
      images.append(_load_image(os.path.join(folder, filename)))
      labels.append(label)
      years.append(year)
  if not images:
    raise DataError(f"yearbook: no portraits from {first_year} on in {root}; expected"
                    f" {EXPECTED_FILES}")
  return make_grouped("yearbook", np.array(years), np.stack(images),
                      np.array(labels, np.int32), num_classes=len(LABELS),
                      task="classification")
