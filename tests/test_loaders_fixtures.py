"""GTSRB, Yearbook and leaf-spectra loaders on tiny files written in the published formats."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from fedora_jax.data import datasets, gtsrb, leaf, yearbook
from fedora_jax.errors import ConfigError, DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RED, BLUE = (200, 10, 10), (10, 10, 200)
GT_HEADER = ["Filename", "Width", "Height", "Roi.X1", "Roi.Y1", "Roi.X2", "Roi.Y2", "ClassId"]


def _sign(path, width, height, roi):
  """A blue image with a red sign filling the (inclusive) box `roi`, saved as PPM."""
  pixels = np.full((height, width, 3), BLUE, np.uint8)
  x1, y1, x2, y2 = roi
  pixels[y1:y2 + 1, x1:x2 + 1] = RED
  Image.fromarray(pixels).save(path)


def _write_gt(path, rows):
  with open(path, "w", newline="") as f:
    writer = csv.writer(f, delimiter=";")
    writer.writerow(GT_HEADER)
    writer.writerows(rows)


def _gtsrb_tree(root, test_labels_at="root"):
  """GTSRB/Final_Training/Images/<class>/, GTSRB/Final_Test/Images/, GT-final_test.csv."""
  train = root / "GTSRB" / "Final_Training" / "Images"
  for class_id, count in ((0, 4), (1, 3), (42, 1)):
    folder = train / f"{class_id:05d}"
    folder.mkdir(parents=True)
    rows = []
    for i in range(count):
      name = f"00000_{i:05d}.ppm"
      width, height = 30 + 7 * i, 34 + 3 * i
      roi = (5, 6, width - 6, height - 5)
      _sign(folder / name, width, height, roi)
      rows.append([name, width, height, *roi, class_id])
    _write_gt(folder / f"GT-{class_id:05d}.csv", rows)
  test = root / "GTSRB" / "Final_Test" / "Images"
  test.mkdir(parents=True)
  rows = []
  for i, class_id in enumerate((1, 0, 42)):
    name = f"{i:05d}.ppm"
    _sign(test / name, 40, 45, (5, 5, 34, 39))
    rows.append([name, 40, 45, 5, 5, 34, 39, class_id])
  labels_dir = {"root": root, "images": test}[test_labels_at]
  _write_gt(labels_dir / "GT-final_test.csv", rows)


@pytest.mark.parametrize("labels_at", ["root", "images"])
def test_gtsrb_reads_the_published_layout(tmp_path, labels_at):
  _gtsrb_tree(tmp_path, labels_at)
  data = gtsrb.load_gtsrb(str(tmp_path))
  assert data.num_classes == 43
  assert data.x_train.shape == (8, 32, 32, 3) and data.x_train.dtype == np.uint8
  np.testing.assert_array_equal(data.y_train, [0, 0, 0, 0, 1, 1, 1, 42])
  np.testing.assert_array_equal(data.y_test, [1, 0, 42])
  # Cropped to the Roi: only the red sign is left, at every size.
  np.testing.assert_array_equal(data.x_train.reshape(-1, 3).min(0), RED)
  np.testing.assert_array_equal(data.x_test.reshape(-1, 3).max(0), RED)


def test_gtsrb_rotated_clients_and_missing_files(tmp_path):
  _gtsrb_tree(tmp_path)
  federated = datasets.build_federated_dataset(
      "gtsrb", str(tmp_path), num_clients=2, setting="balanced", seed=0,
      train_per_client=2, val_per_client=1)
  assert federated.data.buckets[0].train.x.shape == (2, 2, 32, 32, 3)
  assert federated.data.num_classes == 43
  np.testing.assert_allclose(federated.partition.angles, [0.0, 180.0])
  os.remove(tmp_path / "GT-final_test.csv")
  with pytest.raises(DataError, match="GT-final_test.csv"):
    gtsrb.load_gtsrb(str(tmp_path))
  with pytest.raises(DataError, match=r"Final_Training/Images.*GTSRB_Final_Training_Images"):
    gtsrb.load_gtsrb(str(tmp_path / "GTSRB" / "Final_Test"))
  with pytest.raises(DataError, match="gtsrb: no data in .*gtsrb/ and no public source"):
    datasets.build_federated_dataset("gtsrb", None, 10, "balanced", 0)


def _portrait(path, value, mode="RGB"):
  Image.new(mode, (171, 186), (value,) * 3 if mode == "RGB" else value).save(path)


def _yearbook_tree(root):
  base = root / yearbook.FOLDER
  for gender in ("F", "M"):
    (base / gender).mkdir(parents=True)
  # 1929 is before Wild-Time's first year and dropped; a stray file is ignored.
  _portrait(base / "F" / "1929_Ohio_Cleveland_Central_1-1.png", 50)
  for i in range(3):
    _portrait(base / "F" / f"1930_Ohio_Cleveland_Central_{i}-1.png", 100 + i)
  _portrait(base / "M" / "1930_Texas_Austin_High_0-2.png", 90, mode="L")
  for i in range(2):
    _portrait(base / "M" / f"1931_Iowa_Ames_High_{i}.png", 20 + i)
    _portrait(base / "F" / f"1931_Iowa_Ames_High_{i + 5}.png", 30 + i)
  (base / "M" / "README.txt").write_text("not a portrait")


def test_yearbook_groups_portraits_by_year(tmp_path):
  _yearbook_tree(tmp_path)
  grouped = yearbook.load_yearbook(str(tmp_path))
  np.testing.assert_array_equal(grouped.groups, [1930, 1931])
  assert grouped.task == "classification" and grouped.num_classes == 2
  assert grouped.x[0].shape == (4, 32, 32) and grouped.x[0].dtype == np.uint8
  # M = 0, F = 1; uniform portraits keep their grey level.
  assert sorted(grouped.y[0].tolist()) == [0, 1, 1, 1]
  assert sorted(grouped.y[1].tolist()) == [0, 0, 1, 1]
  assert sorted(int(x.mean()) for x in grouped.x[0]) == [90, 100, 101, 102]
  # The folder itself (holding F/ and M/) works as --data_dir too.
  again = yearbook.load_yearbook(str(tmp_path / yearbook.FOLDER))
  np.testing.assert_array_equal(again.x[1], grouped.x[1])


def test_yearbook_clients_are_years(tmp_path):
  _yearbook_tree(tmp_path)
  federated = datasets.build_federated_dataset("yearbook", str(tmp_path), 2, "balanced", 0)
  np.testing.assert_array_equal(federated.groups, [1930, 1931])
  data = federated.data
  assert data.task == "classification" and data.num_classes == 2
  # 4 portraits a year: 1 test, 1 validation, 2 training.
  np.testing.assert_array_equal(data.split_sizes("train"), [2, 2])
  np.testing.assert_array_equal(data.split_sizes("val"), [1, 1])
  with pytest.raises(DataError, match="has 2 clients"):
    datasets.build_federated_dataset("yearbook", str(tmp_path), 84, "balanced", 0)
  with pytest.raises(ConfigError, match="balanced"):
    datasets.build_federated_dataset("yearbook", str(tmp_path), 2, "imbalanced", 0)
  with pytest.raises(DataError, match=r"yearbook: no data in .*F/yearbook/.*M/\*\.png"):
    yearbook.load_yearbook(str(tmp_path / yearbook.FOLDER / "F"))
  # The data root's yearbook/ folder.
  os.rename(tmp_path / yearbook.FOLDER, tmp_path / "yearbook")
  np.testing.assert_array_equal(
      yearbook.load_yearbook(str(tmp_path)).groups, [1930, 1931])


def _leaf_csv(path, years, seed, bands=("400", "550.5", "700", "1000")):
  rng = np.random.default_rng(seed)
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["sample_id", "year", "trait", *bands])
    for i, year in enumerate(years):
      spectrum = rng.uniform(0.05, 0.6, len(bands))
      writer.writerow([f"leaf{i}", year, round(10 + 100 * spectrum[0], 3),
                       *np.round(spectrum, 4)])
    writer.writerow(["leaf-bad", years[0], "NA", *["0.1"] * len(bands)])  # skipped


def test_leaf_csv_loader(tmp_path):
  _leaf_csv(tmp_path / "campaign_a.csv", [2019] * 10 + [2020] * 5, seed=0)
  _leaf_csv(tmp_path / "campaign_b.csv", [2021] * 5 + [2020] * 5, seed=1)
  grouped = leaf.load_leaf(str(tmp_path))
  assert grouped.task == "regression" and grouped.num_classes == 1
  np.testing.assert_array_equal(grouped.groups, [2019, 2020, 2021])
  assert [len(y) for y in grouped.y] == [10, 10, 5]
  assert grouped.x[0].shape == (10, 4) and grouped.x[0].dtype == np.float32
  assert grouped.y[0].dtype == np.float32
  # The trait column is the first band scaled; the file's values are kept.
  np.testing.assert_allclose(grouped.y[0], 10 + 100 * grouped.x[0][:, 0], atol=1e-2)

  (tmp_path / "other.csv").write_text("year,nitrogen,400\n2019,1.0,0.2\n")
  with pytest.raises(DataError, match="lacks trait"):
    leaf.load_leaf(str(tmp_path))
  os.remove(tmp_path / "other.csv")
  _leaf_csv(tmp_path / "campaign_c.csv", [2022] * 4, seed=2, bands=("400", "500"))
  with pytest.raises(DataError, match="other wavelength columns"):
    leaf.load_leaf(str(tmp_path))
  (tmp_path / "empty").mkdir()
  with pytest.raises(DataError, match=r"leaf: no data in .*empty/leaf/.*\*\.csv files"):
    leaf.load_leaf(str(tmp_path / "empty"))


def test_leaf_federation_is_standardized_regression(tmp_path):
  _leaf_csv(tmp_path / "leaves.csv", [2019] * 10 + [2020] * 10 + [2021] * 5, seed=0)
  assert datasets.default_num_clients("leaf", str(tmp_path)) == 3
  federated = datasets.build_federated_dataset("leaf", str(tmp_path), 3, "balanced", 0)
  data = federated.data
  assert data.task == "regression" and data.num_classes == 1
  # 60/20/20 per year: 10 leaves -> 6/2/2, 5 leaves -> 3/1/1.
  np.testing.assert_array_equal(data.split_sizes("train"), [6, 6, 3])
  # Standardized with the training leaves' statistics: mean 0, std 1 over them.
  train_y = np.concatenate([c.y_train for c in federated.partition.clients])
  train_x = np.concatenate([c.x_train for c in federated.partition.clients])
  assert abs(train_y.mean()) < 1e-5 and abs(train_y.std() - 1) < 1e-4
  np.testing.assert_allclose(train_x.mean(0), 0, atol=1e-5)


def test_leaf_run_reports_mae_end_to_end(tmp_path):
  """experiments.main on the leaf fixture: results.json speaks MAE, R-MAE and PTR."""
  data_dir = tmp_path / "leaf"
  data_dir.mkdir()
  _leaf_csv(data_dir / "leaves.csv", [2019] * 10 + [2020] * 10, seed=0)
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--dataset=leaf", f"--data_dir={data_dir}",
       "--algorithm=local", "--rounds=2", "--local_epochs=1", "--hidden=8", "--log_every=0",
       "--checkpoint_every=0", f"--workdir={workdir}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["task"] == "regression" and results["num_clients"] == 2
  assert {"mae", "r_mae", "ptr", "local_mae"} <= set(results) and "acc" not in results
  assert [c["group"] for c in results["clients"]] == [2019, 2020]
  assert all(np.isfinite(c["mae"]) and c["mae"] >= 0 for c in results["clients"])
  assert "mean_test_mae" in (workdir / "rounds.csv").read_text().splitlines()[0]
  assert "R-MAE" in proc.stdout
