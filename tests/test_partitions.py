"""Label-skew partitions (iid, pathological, Dirichlet), their sizes and their errors."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SHARED_DATA, needs_shared
from fedora_jax.data import datasets, sources
from fedora_jax.data.partitions import PartitionConfig, make_partition
from fedora_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FASHION = os.path.join(SHARED_DATA, "fashion-mnist")


def synthetic(num_train=3000, num_test=600, num_classes=10, seed=0):
  """A dataset whose every image spells its own index, so samples can be traced."""
  rng = np.random.default_rng(seed)

  def images(n, offset):
    index = np.arange(offset, offset + n)
    return np.stack([index // 256, index % 256, np.zeros(n), np.zeros(n)],
                    axis=1).astype(np.uint8).reshape(n, 2, 2)
  return sources.ImageDataset(
      name="synthetic", x_train=images(num_train, 0),
      y_train=rng.integers(0, num_classes, num_train).astype(np.int32),
      x_test=images(num_test, 30000),
      y_test=rng.integers(0, num_classes, num_test).astype(np.int32),
      num_classes=num_classes)


def sample_ids(x):
  return (x[:, 0, 0].astype(int) * 256 + x[:, 0, 1]).tolist()


DATA = synthetic()
CONFIGS = [PartitionConfig("iid"), PartitionConfig("iid", setting="imbalanced"),
           PartitionConfig("pathological"),
           PartitionConfig("pathological", setting="imbalanced", classes_per_client=3),
           PartitionConfig("dirichlet", dirichlet_alpha=0.1, min_client_size=10),
           PartitionConfig("dirichlet", setting="imbalanced"),
           PartitionConfig("pathological", train_per_client=20, val_per_client=10)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.kind}-{c.setting}")
def test_no_sample_goes_to_two_clients_and_labels_follow_images(config):
  part = make_partition(DATA, 10, config, seed=1)
  assert len(part.clients) == 10 and part.angles is None and part.kind == config.kind
  seen_train, seen_test = [], []
  for c in part.clients:
    for x, y in ((c.x_train, c.y_train), (c.x_val, c.y_val)):
      ids = sample_ids(x)
      np.testing.assert_array_equal(DATA.y_train[ids], y)
      seen_train += ids
    ids = [i - 30000 for i in sample_ids(c.x_test)]
    np.testing.assert_array_equal(DATA.y_test[ids], c.y_test)
    seen_test += ids
    assert len(c.x_val) >= 1 and len(c.x_test) >= 1
    assert len(c.x_train) >= max(config.min_client_size, 1)
  assert len(seen_train) == len(set(seen_train))
  assert len(seen_test) == len(set(seen_test))
  counts = np.stack([np.bincount(c.y_train, minlength=10) for c in part.clients])
  np.testing.assert_array_equal(part.class_counts, counts)


def test_without_fixed_sizes_the_whole_training_set_is_used_one_third_for_validation():
  part = make_partition(DATA, 7, PartitionConfig("iid"), seed=0)
  total = sum(len(c.x_train) + len(c.x_val) for c in part.clients)
  assert total >= len(DATA.x_train) - 7 * 10  # at most one sample per client and class lost
  for c in part.clients:
    pool = len(c.x_train) + len(c.x_val)
    assert len(c.x_val) == pool // 3
  assert sum(len(c.x_test) for c in part.clients) >= len(DATA.x_test) - 7 * 10


def test_pathological_gives_each_client_its_classes_and_shares_each_class():
  part = make_partition(DATA, 10, PartitionConfig("pathological", classes_per_client=2),
                        seed=4)
  holders = part.class_counts > 0
  assert (holders.sum(axis=1) == 2).all()
  assert (holders.sum(axis=0) == 2).all()  # 10 clients x 2 classes over 10 classes
  for k, c in enumerate(part.clients):
    classes = set(np.flatnonzero(holders[k]))
    assert set(c.y_val) <= classes and set(c.y_test) <= classes
  # Two holders of a class split it evenly (balanced), before the train / val split.
  pools = np.stack([np.bincount(np.concatenate([c.y_train, c.y_val]), minlength=10)
                    for c in part.clients])
  for cls in range(10):
    a, b = pools[holders[:, cls], cls]
    assert abs(int(a) - int(b)) <= 1


def test_imbalanced_makes_client_k_over_2_large():
  part = make_partition(DATA, 10, PartitionConfig("iid", setting="imbalanced"), seed=0)
  sizes = np.array([len(c.x_train) for c in part.clients])
  assert part.large_client == 5 and sizes.argmax() == 5
  assert abs(sizes[5] - sizes.sum() / 2) < 20  # weight K - 1: half of the data


def test_fixed_sizes_follow_appendix_b_and_the_large_client_takes_its_share():
  config = PartitionConfig("pathological", train_per_client=20, val_per_client=10)
  part = make_partition(DATA, 10, config, seed=0)
  assert all((len(c.x_train), len(c.x_val)) == (20, 10) for c in part.clients)
  large = make_partition(DATA, 10, config._replace(setting="imbalanced"), seed=0)
  sizes = [len(c.x_train) for c in large.clients]
  assert sizes[5] > 20 and all(s == 20 for k, s in enumerate(sizes) if k != 5)


def test_partitions_are_deterministic_per_seed():
  for config in CONFIGS:
    a = make_partition(DATA, 10, config, seed=3)
    b = make_partition(DATA, 10, config, seed=3)
    c = make_partition(DATA, 10, config, seed=4)
    for ca, cb in zip(a.clients, b.clients):
      np.testing.assert_array_equal(ca.x_train, cb.x_train)
      np.testing.assert_array_equal(ca.x_test, cb.x_test)
    assert any(len(ca.x_train) != len(cc.x_train) or not np.array_equal(ca.x_train, cc.x_train)
               for ca, cc in zip(a.clients, c.clients))


def test_dirichlet_honours_the_minimum_and_skews_labels():
  part = make_partition(DATA, 20, PartitionConfig("dirichlet", dirichlet_alpha=0.1,
                                                  min_client_size=30), seed=0)
  assert min(len(c.x_train) for c in part.clients) >= 30
  # alpha 0.1: most of a client's data comes from few classes.
  top_two = np.sort(part.class_counts, axis=1)[:, -2:].sum(1) / part.class_counts.sum(1)
  assert np.median(top_two) > 0.6


def test_data_fraction_partitions_a_random_tenth_of_train_and_test():
  # Parameter coaching's 10 clients: "10% training data and test data is selected
  # randomly from the dataset", then cut by Dirichlet label skew.
  config = PartitionConfig("dirichlet", dirichlet_alpha=0.3, data_fraction=0.1)
  part = make_partition(DATA, 10, config, seed=3)
  train = sorted(i for c in part.clients for x in (c.x_train, c.x_val) for i in sample_ids(x))
  test = sorted(i - 30000 for c in part.clients for i in sample_ids(c.x_test))
  assert len(set(train)) == len(train) and len(set(test)) == len(test)
  # A tenth of each split (a sample per client and class may fall to rounding).
  assert 300 - 10 * 10 <= len(train) <= 300 and 60 - 10 * 10 <= len(test) <= 60
  assert len(train) > 250 and len(test) > 40
  # Spread over the whole set, not its first tenth; the same draw for the same seed.
  assert max(train) > 1500 and max(test) > 300
  again = make_partition(DATA, 10, config, seed=3)
  assert [sample_ids(c.x_train) for c in again.clients] == [
      sample_ids(c.x_train) for c in part.clients]
  # At 1.0 nothing is drawn: the partition is the one without the field.
  whole = make_partition(DATA, 10, config._replace(data_fraction=1.0), seed=3)
  plain = make_partition(DATA, 10, PartitionConfig("dirichlet", dirichlet_alpha=0.3), seed=3)
  assert [sample_ids(c.x_train) for c in whole.clients] == [
      sample_ids(c.x_train) for c in plain.clients]


@pytest.mark.parametrize("num_clients,config,message", [
    (4000, PartitionConfig("iid"), "only 3000 training samples"),
    (10, PartitionConfig("pathological", classes_per_client=11), "must be between 1 and 10"),
    (10, PartitionConfig("pathological", classes_per_client=0), "must be between 1 and 10"),
    (1000, PartitionConfig("iid"), "fewer than"),
    (10, PartitionConfig("iid", min_client_size=500), "fewer than 500"),
    (10, PartitionConfig("iid", train_per_client=400), "fewer than the 600"),
    (50, PartitionConfig("dirichlet", dirichlet_alpha=0.05, min_client_size=59),
     "no draw of 100"),
    (10, PartitionConfig("dirichlet", dirichlet_alpha=0.0), "must be > 0"),
    (10, PartitionConfig("shards"), "unknown partition"),
    (10, PartitionConfig("iid", setting="lopsided"), "unknown setting"),
    (10, PartitionConfig("rotation", min_client_size=200), "more than the 128"),
    (10, PartitionConfig("iid", data_fraction=0.0), "data_fraction must be in"),
    (10, PartitionConfig("iid", val_fraction=1.0), "val_fraction must be in"),
    (40, PartitionConfig("iid", data_fraction=0.01), "leaves 30 training samples"),
])
def test_impossible_requests_fail_fast_with_one_line(num_clients, config, message):
  start = time.perf_counter()
  with pytest.raises(ConfigError, match=message) as error:
    make_partition(DATA, num_clients, config, seed=0)
  assert "\n" not in str(error.value)
  assert time.perf_counter() - start < 5


def test_registry_defaults_and_mnist_dirichlet(mnist):
  assert datasets.get_spec("cifar10").partition == "pathological"
  assert datasets.get_spec("rfmnist").num_clients == 72
  federated = datasets.build_federated_dataset(
      "mnist", None, 100, "balanced", 0,
      partition_config=PartitionConfig("dirichlet", dirichlet_alpha=0.1))
  assert federated.partition.kind == "dirichlet" and federated.data.num_clients == 100
  assert datasets.build_federated_dataset("mnist", None, 20, "balanced", 0).partition.kind == "iid"
  dataset = datasets.build_federated_dataset("rmnist", None, 4, "balanced", 0)
  assert dataset.partition.kind == "rotation"


def test_rfmnist_without_data_dir_says_where_to_get_the_files():
  with pytest.raises(ConfigError, match="--data_dir") as error:
    datasets.build_federated_dataset("rfmnist", None, 72, "balanced", 0)
  assert "fashion-mnist" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(not os.path.isdir(FASHION), reason=needs_shared("fashion-mnist"))
def test_rfmnist_follows_appendix_b_on_the_real_files():
  federated = datasets.build_federated_dataset("rfmnist", FASHION, 72, "balanced", 0)
  np.testing.assert_allclose(federated.partition.angles, 5.0 * np.arange(72))
  assert (federated.data.split_sizes("train") == 128).all()
  assert (federated.data.split_sizes("val") == 64).all()
  assert (federated.data.split_sizes("test") == 10000 // 72).all()
  assert federated.source.name == "fashion-mnist"


@pytest.mark.slow  # the command end to end
def test_main_runs_a_dirichlet_partition_and_records_class_counts(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--dataset=mnist", "--partition=dirichlet",
       "--dirichlet_alpha=0.5", "--num_clients=5", "--algorithm=local", "--rounds=1",
       "--local_epochs=1", "--hidden=8", "--checkpoint_every=0", f"--workdir={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["partition"]["kind"] == "dirichlet" and results["data"] == "mnist"
  for c in results["clients"]:
    assert "angle" not in c and sum(c["class_counts"]) == c["n_train"]
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--dataset=mnist", "--partition=pathological",
       "--classes_per_client=11", f"--workdir={tmp_path / 'bad'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1
  assert "must be between 1 and 10 (mnist's classes), got 11" in proc.stderr
  assert len([l for l in proc.stderr.splitlines() if l.startswith("error:")]) == 1
