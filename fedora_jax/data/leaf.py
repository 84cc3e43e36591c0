"""Leaf spectra: hyperspectral leaf reflectance -> a leaf trait, one client per year.

FEDORA's agriculture task (Wu et al., KDD 2023; a regression scored by MAE) predicts a
leaf trait from the leaf's hyperspectral reflectance, with clients given by the
collection year. The data are not public in a fixed format and the authors' code does
not load them, so this project defines a plain CSV format:

  the data root's leaf/ folder (or --data_dir itself) holds one or more *.csv files
  (read in name order and concatenated, e.g. one file per field campaign), comma
  separated, with a header row:
    year   the collection year (integer): the client
    trait  the target value (float), e.g. Vcmax or leaf nitrogen
    <wavelength> columns: one per band, the header being the wavelength in nm as a
           number (e.g. 400, 401, ..., 2400), the cell the reflectance (fraction or
           percent)
  Other columns (a sample id, species, plot, ...) are ignored. Every file must have
  the same wavelength columns. Rows with an empty or non-numeric year, trait or
  reflectance (NA, nan, "") are skipped.

Each year's leaves are split at random (seeded) into 60% training, 20% validation and
20% test. Reflectance and trait are then standardized with the mean and standard
deviation of all clients' training leaves (fedora_jax.data.grouped.standardize), so
MAE is reported in units of the trait's training standard deviation; the run logs that
mean and deviation, to convert back (trait = mean + std * standardized value).
"""

import csv
import glob
import logging
import os

import numpy as np

from fedora_jax.data import root as data_root
from fedora_jax.data.grouped import GroupedDataset, make_grouped
from fedora_jax.errors import DataError

logger = logging.getLogger("fedora_jax")

YEAR, TRAIT = "year", "trait"
VAL_FRACTION, TEST_FRACTION = 0.2, 0.2
EXPECTED_FILES = ("*.csv files with a header row: year, trait and one column per"
                  " wavelength named by its wavelength in nm (e.g. 400,401,...,2400)")


def _is_wavelength(column: str) -> bool:
  try:
    return float(column) > 0
  except ValueError:
    return False


def _read_csv(path: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, int]:
  """(wavelength columns, years [n], traits [n], reflectance [n, B], rows skipped)."""
  try:
    with open(path, newline="") as f:
      reader = csv.reader(f)
      header = [h.strip() for h in next(reader, [])]
      rows = list(reader)
  except (OSError, UnicodeDecodeError, csv.Error) as e:
    raise DataError(f"leaf: cannot read {path} ({e})") from None
  missing = [c for c in (YEAR, TRAIT) if c not in header]
  bands = [h for h in header if _is_wavelength(h)]
  if missing or not bands:
    what = ", ".join(missing + ([] if bands else ["wavelength columns"]))
    raise DataError(f"leaf: {path} lacks {what}; expected {EXPECTED_FILES}")
  year_col, trait_col = header.index(YEAR), header.index(TRAIT)
  band_cols = [header.index(b) for b in bands]
  years, traits, spectra, skipped = [], [], [], 0
  for row in rows:
    if not row or all(not cell.strip() for cell in row):
      continue
    try:
      year = float(row[year_col])
      values = [float(row[i]) for i in [trait_col] + band_cols]
    except (ValueError, IndexError):
      skipped += 1
      continue
    if not (np.isfinite(year) and year == int(year) and np.all(np.isfinite(values))):
      skipped += 1
      continue
    years.append(int(year))
    traits.append(values[0])
    spectra.append(values[1:])
  return (bands, np.array(years, np.int64), np.array(traits, np.float32),
          np.array(spectra, np.float32).reshape(len(spectra), len(bands)), skipped)


def load_leaf(data_dir: str | None) -> GroupedDataset:
  """All leaves of the CSV files in `data_dir`, grouped by year: [n, B] float32 -> trait."""
  holds = lambda folder: bool(glob.glob(os.path.join(folder, "*.csv")))
  data_dir = data_root.locate("leaf", data_dir, holds, EXPECTED_FILES)
  paths = sorted(glob.glob(os.path.join(data_dir, "*.csv")))
  if not paths:
    raise DataError(f"leaf: no .csv file in {data_dir}; expected {EXPECTED_FILES}")
  parts, bands, skipped = [], None, 0
  for path in paths:
    file_bands, years, traits, spectra, file_skipped = _read_csv(path)
    if bands is None:
      bands = file_bands
    elif [float(b) for b in file_bands] != [float(b) for b in bands]:
      raise DataError(f"leaf: {path} has other wavelength columns than {paths[0]}")
    parts.append((years, traits, spectra))
    skipped += file_skipped
  years = np.concatenate([p[0] for p in parts])
  if not len(years):
    raise DataError(f"leaf: no complete row in {', '.join(paths)}")
  traits = np.concatenate([p[1] for p in parts])
  spectra = np.concatenate([p[2] for p in parts])
  assert bands is not None  # set by the first of the (non-empty) paths
  if skipped:
    logger.info("leaf: skipped %d row(s) with missing or non-numeric values", skipped)
  logger.info("leaf: %d leaves, %d bands (%s-%s nm), years %s", len(years), len(bands),
              bands[0], bands[-1], ",".join(map(str, np.unique(years))))
  return make_grouped("leaf", years, spectra, traits, num_classes=1, task="regression",
                      val_fraction=VAL_FRACTION, test_fraction=TEST_FRACTION)
