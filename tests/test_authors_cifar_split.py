"""--split=authors on pathological clients (CIFAR-10): the FEDORA code's pFedHN loader.

The reference below restates their loader (github.com/junwu6/FEDORA, utils/data_loader.py:
get_datasets, gen_classes_per_node, gen_data_split) step by step on the global RNGs their
set_seed seeds (NumPy's legacy np.random and Python's random); torch's random_split is
`partitions.torch_randperm`, whose values are pinned against torch below.
"""

import os
import random

import numpy as np
import pytest

from conftest import SHARED_DATA, needs_shared
from fedora_jax.data import cifar, partitions
from fedora_jax.data.partitions import PartitionConfig, make_partition
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import DataError, FieldError


def test_torch_randperm_is_torchs():
  # torch.randperm(n) right after torch.manual_seed(seed), CPU, torch 2.13 (random_split
  # draws its permutation so): the values printed by torch itself.
  np.testing.assert_array_equal(partitions.torch_randperm(10, 0),
                                [4, 1, 7, 5, 3, 9, 0, 8, 6, 2])
  np.testing.assert_array_equal(partitions.torch_randperm(12, 42),
                                [6, 8, 1, 7, 0, 2, 10, 11, 4, 3, 5, 9])


def _their_loader(y_train, y_test, num_users, seed, val_size, classes_per_user=2):
  """Their draws in their order, on the global RNGs (saved and restored)."""
  numpy_state, python_state = np.random.get_state(), random.getstate()
  try:
    np.random.seed(seed)
    random.seed(seed)
    perm = partitions.torch_randperm(len(y_train), seed)
    subsets = [perm[:len(y_train) - val_size], perm[len(y_train) - val_size:], None]
    num_classes = 10
    count = classes_per_user * num_users // num_classes
    probs = {c: list(p / p.sum()) for c in range(num_classes)
             for p in [np.random.uniform(0.4, 0.6, size=count)]}
    classes, shares, c_idx = [], [], 0
    for _ in range(num_users):
      held = []
      for _ in range(classes_per_user):
        held.append(c_idx)
        c_idx = (c_idx + 1) % num_classes
      classes.append(held)
      shares.append([probs[c].pop() for c in held])
    splits = []
    for mode, subset in zip(("train", "val", "test"), subsets):
      labels = y_test if subset is None else y_train[subset]
      totals = np.unique(labels, return_counts=True)[1]
      class_idx = {c: np.where(labels == c)[0] for c in range(num_classes)}
      for idx in class_idx.values():
        random.shuffle(idx)
      users = []
      for held, share in zip(classes, shares):
        mine = []
        for c, p in zip(held, share):
          end = 10 if mode == "train" else int(totals[c] * p)
          mine.extend(class_idx[c][:end])
          class_idx[c] = class_idx[c][end:]
        mine = np.asarray(mine, int)
        users.append(mine if subset is None else subset[mine])
      splits.append(users)
    return list(zip(*splits))
  finally:
    np.random.set_state(numpy_state)
    random.setstate(python_state)


@pytest.mark.parametrize("seed", [42, 3])
def test_indices_are_the_ones_their_loader_draws(seed):
  rng = np.random.default_rng(seed)
  y_train, y_test = rng.integers(0, 10, 2000), rng.integers(0, 10, 600)
  want = _their_loader(y_train, y_test, 10, seed, val_size=500)
  got = partitions.authors_pathological_indices(y_train, y_test, 10, seed, val_pool=500)
  for k, (ours, theirs) in enumerate(zip(got, want)):
    for split, a, b in zip(("train", "val", "test"), ours, theirs):
      np.testing.assert_array_equal(a, b, err_msg=f"client {k} {split}")
  for k, (train_idx, val_idx, test_idx) in enumerate(got):
    held = {(2 * k) % 10, (2 * k + 1) % 10}  # fixed cyclic pairs, no permutation
    assert set(y_train[train_idx]) == held and len(train_idx) == 20
    assert set(y_train[val_idx]) <= held and set(y_test[test_idx]) <= held
  every = [np.concatenate([c[i] for c in got]) for i in range(3)]
  assert len(set(every[0])) == len(every[0]) and len(set(every[1])) == len(every[1])
  assert not set(every[0]) & set(every[1])  # training and validation pools are disjoint
  assert set(every[1]) <= set(partitions.torch_randperm(2000, seed)[-500:])


def test_client_zero_sizes_by_hand():
  # 10 clients, 1000 test images per class: class 0's two proportions are NumPy's first
  # two uniform(0.4, 0.6) draws, normalised; client 0 takes the last one (their .pop()).
  y_train = np.repeat(np.arange(10), 200)
  y_test = np.repeat(np.arange(10), 1000)
  u = np.random.RandomState(42).uniform(0.4, 0.6, 2)
  test_idx = partitions.authors_pathological_indices(y_train, y_test, 10, 42,
                                                     val_pool=500)[0][2]
  class1 = np.random.RandomState(42).uniform(0.4, 0.6, 4)[2:]
  assert len(test_idx) == int(1000 * u[1] / u.sum()) + int(1000 * class1[1] / class1.sum())


def test_impossible_requests_are_one_line_errors():
  y = np.repeat(np.arange(10), 30)
  with pytest.raises(DataError, match="every class held equally often"):
    partitions.authors_pathological_indices(y, y, 7, 0, val_pool=50)
  with pytest.raises(DataError, match="class 0 has"):  # 10 clients x 10 images of class 0
    partitions.authors_pathological_indices(y, y, 10, 0, val_pool=290)
  labels = np.repeat(np.arange(10), 1100)  # 11,000: their 10,000 validation pool and more
  images = np.zeros((len(labels), 2, 2, 3), np.uint8)
  dataset = ImageDataset(name="tiny", x_train=images, y_train=labels, x_test=images,
                         y_test=labels, num_classes=10)
  with pytest.raises(FieldError, match="their own"):
    make_partition(dataset, 10, PartitionConfig("pathological", split="authors",
                                                data_fraction=0.5))
  with pytest.raises(FieldError, match="multiple of the 2 classes"):
    make_partition(dataset, 10, PartitionConfig("pathological", split="authors",
                                                train_per_client=5))
  # 4 training images a client (2 a class) where the loader takes 10 a class.
  part = make_partition(dataset, 10, PartitionConfig("pathological", split="authors",
                                                     train_per_client=4), seed=1)
  assert all(np.bincount(c.y_train).max() == 2 and len(c.y_train) == 4
             for c in part.clients)
  with pytest.raises(FieldError, match="cuts rotated or pathological clients"):
    make_partition(dataset, 10, PartitionConfig("dirichlet", split="authors"))


SHARED_CIFAR = os.path.join(SHARED_DATA, "cifar10")


@pytest.mark.skipif(not os.path.isdir(SHARED_CIFAR),
                    reason=needs_shared("cifar10"))
def test_ten_clients_of_the_real_jpeg_copy():
  data = cifar.load_cifar10(SHARED_CIFAR)
  part = make_partition(data, 10, PartitionConfig("pathological", split="authors"), seed=42)
  # Test sizes depend only on the seed's proportions (1,000 test images a class).
  assert [len(c.y_test) for c in part.clients] == [1041, 1081, 1105, 938, 1007, 957, 917,
                                                   893, 1060, 991]
  for k, client in enumerate(part.clients):
    assert sorted(np.unique(client.y_train)) == [(2 * k) % 10, (2 * k + 1) % 10]
    assert len(client.y_train) == 20 and 800 < len(client.y_val) < 1200
