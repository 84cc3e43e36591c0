"""IDX reader, rotated-MNIST partition (FEDORA Appendix B) and size buckets."""

import gzip
import os
import struct

import numpy as np
import pytest

from conftest import SHARED_DATA, needs_shared
from fedora_jax.data import client_data, datasets, idx, partitions, sources
from fedora_jax.errors import DataError


def _write_idx(path, array, magic_type=0x08):
  header = bytes([0, 0, magic_type, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def test_real_mnist_matches_the_official_counts(mnist):
  assert mnist.x_train.shape == (60000, 28, 28) and mnist.x_train.dtype == np.uint8
  assert mnist.x_test.shape == (10000, 28, 28)
  # Class counts and pixel mean from the official files (shared/data/SOURCES.md).
  np.testing.assert_array_equal(
      np.bincount(mnist.y_train), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949])
  np.testing.assert_array_equal(
      np.bincount(mnist.y_test), [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009])
  assert abs(mnist.x_train.mean() - 33.318) < 1e-3


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_DATA, "fashion-mnist")),
                    reason=needs_shared("fashion-mnist"))
def test_idx_loader_reads_real_fashion_mnist_from_a_data_dir():
  fashion = sources.load_idx_dataset("fashion-mnist", os.path.join(SHARED_DATA, "fashion-mnist"))
  assert fashion.x_train.shape == (60000, 28, 28)
  np.testing.assert_array_equal(np.bincount(fashion.y_test), [1000] * 10)


def test_idx_round_trip(tmp_path):
  array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
  _write_idx(tmp_path / "a.gz", array)
  np.testing.assert_array_equal(idx.read_idx(str(tmp_path / "a.gz")), array)


@pytest.mark.parametrize("damage,message", [
    (lambda raw: raw[:-5], "truncated or corrupt"),
    (lambda raw: b"\x01" + raw[1:], "bad magic"),
    (lambda raw: raw[:2] + b"\x0d" + raw[3:], "unsupported IDX element type"),
    (lambda raw: raw[:6], "truncated IDX header"),
])
def test_idx_rejects_damaged_bytes(damage, message):
  raw = bytes([0, 0, 8, 2]) + struct.pack(">2I", 3, 4) + bytes(12)
  with pytest.raises(DataError, match=message):
    idx.parse_idx(damage(raw))


def test_truncated_gzip_and_missing_files_are_named(tmp_path):
  _write_idx(tmp_path / "a.gz", np.zeros((100, 28, 28), np.uint8))
  raw = (tmp_path / "a.gz").read_bytes()
  (tmp_path / "cut.gz").write_bytes(raw[: len(raw) // 2])
  with pytest.raises(DataError, match="cut.gz"):
    idx.read_idx(str(tmp_path / "cut.gz"))
  with pytest.raises(DataError, match="not found"):
    idx.read_idx(str(tmp_path / "missing.gz"))
  with pytest.raises(DataError, match="directory not found"):
    sources.load_mnist(str(tmp_path / "nowhere"))



def test_balanced_partition_follows_appendix_b(mnist):
  part = partitions.rotation_partition(mnist, num_clients=36, setting="balanced", seed=3)
  np.testing.assert_allclose(part.angles, 10.0 * np.arange(36))
  assert part.large_client is None
  for c in part.clients:
    assert (len(c.x_train), len(c.x_val), len(c.x_test)) == (128, 64, 10000 // 36)
    assert c.x_train.dtype == np.uint8
  # Client 0 is unrotated, so its images are exact training images; with no
  # replacement the 36 * 192 drawn indices are distinct.
  train_images = {a.tobytes() for a in mnist.x_train}
  assert all(a.tobytes() in train_images for a in part.clients[0].x_train)


def test_partition_draws_without_replacement_and_rotates(mnist):
  part = partitions.rotation_partition(mnist, num_clients=4, setting="balanced", seed=0)
  # Rotations by multiples of 90 degrees are exact, so every client's images can be
  # rotated back and located in the training set; no index repeats across clients.
  lookup = {a.tobytes(): i for i, a in enumerate(mnist.x_train)}
  seen = []
  for k, c in enumerate(part.clients):
    for images in (c.x_train, c.x_val):
      unrotated = np.rot90(images, k=-k, axes=(1, 2))
      seen += [lookup[a.tobytes()] for a in np.ascontiguousarray(unrotated)]
  assert len(seen) == len(set(seen)) == 4 * 192


def test_imbalanced_partition_gives_the_rest_to_client_k_over_2(mnist):
  part = partitions.rotation_partition(mnist, num_clients=36, setting="imbalanced", seed=0)
  assert part.large_client == 18
  rest = 60000 - 35 * 192
  large = part.clients[18]
  assert (len(large.x_train), len(large.x_val)) == (2 * rest // 3, rest - 2 * rest // 3)
  assert all(len(c.x_train) == 128 for k, c in enumerate(part.clients) if k != 18)


def test_partition_is_deterministic_per_seed(mnist):
  a = partitions.rotation_partition(mnist, 6, seed=5)
  b = partitions.rotation_partition(mnist, 6, seed=5)
  c = partitions.rotation_partition(mnist, 6, seed=6)
  np.testing.assert_array_equal(a.clients[2].x_train, b.clients[2].x_train)
  assert not np.array_equal(a.clients[2].x_train, c.clients[2].x_train)


def test_impossible_partitions_fail_fast(mnist):
  with pytest.raises(DataError, match="need"):
    partitions.rotation_partition(mnist, num_clients=400, setting="balanced")
  with pytest.raises(DataError, match="need"):
    partitions.rotation_partition(mnist, num_clients=320, setting="imbalanced")
  with pytest.raises(DataError, match="setting"):
    partitions.rotation_partition(mnist, num_clients=3, setting="lopsided")


def test_rotation_is_counter_clockwise_nearest_neighbour():
  image = np.arange(16, dtype=np.uint8).reshape(1, 4, 4)
  np.testing.assert_array_equal(partitions.rotate_images(image, 90)[0], np.rot90(image[0]))
  np.testing.assert_array_equal(partitions.rotate_images(image, 0), image)


def test_size_buckets_bound_the_padding():
  assert [b.tolist() for b in client_data.size_buckets([128, 128, 35520, 128], 2.0)] == [
      [0, 1, 3], [2]]
  assert [b.tolist() for b in client_data.size_buckets([10, 15, 21, 40], 2.0)] == [
      [0, 1], [2, 3]]
  assert len(client_data.size_buckets([1, 1000], float("inf"))) == 1


def test_stacked_clients_are_padded_and_masked():
  rng = np.random.default_rng(0)
  clients = [client_data.Client(
      x_train=rng.integers(0, 255, (n, 2, 2), np.uint8), y_train=np.full(n, k),
      x_val=np.zeros((1, 2, 2), np.uint8), y_val=np.zeros(1, int),
      x_test=np.zeros((2, 2, 2), np.uint8), y_test=np.zeros(2, int))
      for k, n in enumerate([3, 5, 40])]
  data = client_data.stack_clients(clients, num_classes=3, max_pad_ratio=2.0)
  assert len(data.buckets) == 2
  first = data.buckets[0].train
  assert first.x.shape == (2, 5, 2, 2) and first.x.dtype == np.uint8
  np.testing.assert_array_equal(first.mask.sum(axis=1), [3, 5])
  np.testing.assert_array_equal(first.n, [3, 5])
  np.testing.assert_array_equal(data.split_sizes("train"), [3, 5, 40])
  np.testing.assert_array_equal(first.x[0, 3:], 0)


def test_imbalanced_rmnist_uses_two_buckets():
  federated = datasets.build_federated_dataset("rmnist", None, 36, "imbalanced", 0)
  assert [len(ids) for ids in federated.data.client_ids] == [35, 1]
  # The 35 small clients are padded to 128, not to the large client's size.
  assert federated.data.buckets[0].train.x.shape[1] == 128
