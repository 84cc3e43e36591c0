"""--split=authors: rotated clients sampled as the FEDORA authors' loader samples them.

The reference is a transcription of their loop (github.com/junwu6/FEDORA,
utils/load_rotate_mnist.py, BaseNodes_RotateMNIST._init_dataloaders) on NumPy's global
legacy RNG, seeded the way their main_*.py seed it (utils/helper.py: set_seed).
"""

import dataclasses
import json

import numpy as np
import pytest

from experiments import flags as run_flags
from fedora_jax import config as config_lib
from fedora_jax import results as results_lib
from fedora_jax import train
from fedora_jax.data import partitions
from fedora_jax.data.partitions import PartitionConfig, make_partition
from fedora_jax.errors import ConfigError, DataError, FieldError


def _their_loop(n_train, n_test, n_nodes, seed, num_train_samples, num_val_samples,
                val_size):
  """Their index draws, statement for statement, on the global np.random."""
  saved = np.random.get_state()
  try:
    np.random.seed(seed)  # set_seed(args.seed); nothing draws from np.random until here
    ridx = np.arange(n_train)
    np.random.shuffle(ridx)
    train_ridx = ridx[:-val_size]
    val_ridx = ridx[-val_size:]
    test_size = n_test
    test_ridx = np.arange(test_size)
    np.random.shuffle(test_ridx)
    num_test = test_size // n_nodes
    start_train, start_val, clients = 0, 0, []
    for i in range(n_nodes):
      end_train = start_train + num_train_samples
      train_idx = train_ridx[start_train: end_train]
      start_train = end_train
      end_val = start_val + num_val_samples
      val_idx = val_ridx[start_val: end_val]
      start_val = end_val
      test_idx = test_ridx[num_test * i:num_test * (i + 1)]
      clients.append((train_idx, val_idx, test_idx))
    return clients
  finally:
    np.random.set_state(saved)


@pytest.mark.parametrize("seed", [42, 0, 7])
def test_indices_are_the_ones_their_loop_draws(seed):
  sizes = dict(n_train=90, n_test=40, n_nodes=6, num_train_samples=8, num_val_samples=4,
               val_size=30)
  want = _their_loop(seed=seed, **sizes)
  got = partitions.authors_rotation_indices(90, 40, 6, seed, train_per_client=8,
                                            val_per_client=4, val_pool=30)
  assert len(got) == 6
  for k, (ours, theirs) in enumerate(zip(got, want)):
    for split, a, b in zip(("train", "val", "test"), ours, theirs):
      np.testing.assert_array_equal(a, b, err_msg=f"client {k} {split}")
  # Shapes: 8 / 4 / 40 // 6 = 6 per client, 40 mod 6 = 4 test images unused.
  assert [tuple(map(len, c)) for c in got] == [(8, 4, 6)] * 6
  # Disjoint as they have it: training and validation come from two disjoint pools of
  # the training set (the last 30 of its shuffle are validation), tests from the test set.
  train_idx = np.concatenate([c[0] for c in got])
  val_idx = np.concatenate([c[1] for c in got])
  test_idx = np.concatenate([c[2] for c in got])
  assert len(set(train_idx)) == 48 and len(set(val_idx)) == 24
  assert not set(train_idx) & set(val_idx)
  assert len(set(test_idx)) == 36 and test_idx.max() < 40


def test_36_rotated_clients_of_real_mnist(mnist):
  part = make_partition(mnist, 36, PartitionConfig(split="authors"), seed=42)
  indices = _their_loop(60000, 10000, 36, 42, 128, 64, 10000)
  np.testing.assert_allclose(part.angles, 10.0 * np.arange(36))
  assert part.large_client is None and part.kind == "rotation"
  assert part.class_counts.shape == (36, 10) and (part.class_counts.sum(1) == 128).all()
  for c, (train_idx, val_idx, test_idx) in zip(part.clients, indices):
    assert (len(c.x_train), len(c.x_val), len(c.x_test)) == (128, 64, 277)
    assert c.x_train.dtype == np.uint8 and c.x_train.shape[1:] == (28, 28)
    np.testing.assert_array_equal(c.y_train, mnist.y_train[train_idx])
    np.testing.assert_array_equal(c.y_val, mnist.y_train[val_idx])
    np.testing.assert_array_equal(c.y_test, mnist.y_test[test_idx])
  # Rotations by multiples of 90 degrees are exact: client 9 (90 degrees, counter-
  # clockwise like torchvision's rotate) holds rot90 of the drawn images.
  train_idx, val_idx, test_idx = indices[9]
  np.testing.assert_array_equal(part.clients[9].x_train,
                                np.rot90(mnist.x_train[train_idx], axes=(1, 2)))
  np.testing.assert_array_equal(part.clients[0].x_test, mnist.x_test[indices[0][2]])
  # 36 * 128 training and 36 * 64 validation images, all distinct.
  drawn = np.concatenate([np.concatenate(i[:2]) for i in indices])
  assert len(np.unique(drawn)) == 36 * 192
  # Our default split draws other clients from the same data seed.
  ours = make_partition(mnist, 36, PartitionConfig(), seed=42)
  assert not np.array_equal(ours.clients[0].y_train, part.clients[0].y_train)


@pytest.mark.parametrize("config,num_clients,error,message", [
    (PartitionConfig(split="authors", setting="imbalanced"), 36, FieldError,
     "no imbalanced clients"),
    (PartitionConfig("iid", split="authors"), 10, FieldError, "authors' sampling cuts"
     " rotated or pathological clients"),
    (PartitionConfig(split="theirs"), 10, FieldError, "must be one of ours, authors"),
    (PartitionConfig(split="authors"), 160, DataError, "need 10240 validation images,"
     " but their validation pool holds 10000"),
])
def test_impossible_requests_are_one_line_errors(mnist, config, num_clients, error,
                                                 message):
  with pytest.raises(error, match=message):
    make_partition(mnist, num_clients, config)


def _from_flags():
  """The configs of `main --split=authors --data_seed=42 --algorithm=local` and of
  `main --data_seed=42 --algorithm=local`."""
  flag_values = run_flags.FLAGS
  configs = []
  for split in (["--split=authors"], []):
    flag_values(["main", *split, "--data_seed=42", "--algorithm=local"])
    try:
      configs.append(run_flags.experiment_config())
    finally:
      flag_values.unparse_flags()
  assert configs[1].data.partition.split == "ours"
  return configs[0], configs[1]


def _run_infos(authors):
  """results.json's run description with the authors' split and with ours."""
  ours = dataclasses.replace(authors, data=dataclasses.replace(authors.data,
                                                               partition=PartitionConfig()))
  return (train._run_info(config_lib.resolve(authors), 36),
          train._run_info(config_lib.resolve(ours), 36))


def test_the_flag_reaches_the_partition_the_identity_and_results():
  authors, ours = _from_flags()
  assert authors.data.partition == PartitionConfig(kind="rotation", split="authors")
  assert config_lib.identity(authors)["data"]["partition"]["split"] == "authors"
  assert config_lib.identity(ours)["data"]["partition"]["split"] == "ours"
  info, default_info = _run_infos(authors)
  assert info["split"] == "authors" and "partition" not in info
  assert "split" not in default_info  # results.json of our split is as before


def test_a_run_of_one_split_is_neither_resumed_nor_referenced_by_the_other(tmp_path):
  authors, ours = _from_flags()
  info, default_info = _run_infos(authors)
  train.open_workdir(str(tmp_path), authors, str(tmp_path))
  (tmp_path / "results.json").write_text("{}")
  with pytest.raises(ConfigError, match="other settings: data.partition.split='authors'"
                     " \\(now 'ours'\\);"):
    train.check_workdir(str(tmp_path), ours)
  assert train.check_workdir(str(tmp_path), authors)
  # A LOCAL reference drawn with the authors' split does not score a run of ours.
  reference = {**info, "algorithm": "local", "best_val": {"round": 1},
               "clients": [{"id": 0, "acc": 0.5, "best_val_acc": 0.5}]}
  (tmp_path / "local.json").write_text(json.dumps(reference))
  with pytest.raises(ConfigError, match="split='authors' \\(run: None\\)"):
    results_lib.load_reference(str(tmp_path / "local.json"), default_info)
  assert results_lib.load_reference(str(tmp_path / "local.json"), info).final[0] == 0.5


def test_a_reference_older_than_a_partition_field_counts_it_at_its_default(tmp_path):
  # A LOCAL run recorded before a partition field existed (the synthetic dataset's) still
  # serves a run at that field's default, and not one that sets it otherwise.
  run = {"algorithm": "fedavg", "rounds": 1, "train": {k: 0 for k in (
             "local_epochs", "batch_size", "lr", "momentum", "weight_decay")},
         "partition": {"kind": "dirichlet", "synthetic_alpha": 1.0}}
  reference = {**run, "algorithm": "local", "partition": {"kind": "dirichlet"},
               "best_val": {"round": 1}, "clients": [{"id": 0, "acc": 0.5, "best_val_acc": 0.5}]}
  (tmp_path / "local.json").write_text(json.dumps(reference))
  assert results_lib.load_reference(str(tmp_path / "local.json"), run).final[0] == 0.5
  other = {**run, "partition": {"kind": "dirichlet", "synthetic_alpha": 2.0}}
  with pytest.raises(ConfigError, match="other settings: partition="):
    results_lib.load_reference(str(tmp_path / "local.json"), other)
