"""Naturally partitioned data: FEMNIST and Shakespeare from LEAF's JSON,
CIFAR-100 (Pachinko) from TFF's HDF5 and SQLite files, on tiny files the tests write in
the published formats (the SQLite examples serialized with the tf.train.Example copy
tensorflow_datasets ships, as TFF serializes them with TensorFlow's)."""

import json
import os
import sqlite3
import subprocess
import sys
from unittest import mock

import h5py
import jax
import numpy as np
import optax
import pytest
from tensorflow_datasets.proto import tf_example_pb2, tf_feature_pb2

from fedora_jax import config as config_lib, settings
from fedora_jax.algorithms import layers
from fedora_jax.data import datasets, natural, stackoverflow, tff_files
from fedora_jax.errors import ConfigError, DataError
from fedora_jax.models import build_model
from fedora_jax.models.char_lstm import CharLSTM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_leaf(folder, split, files):
  """LEAF's layout: <folder>/<split>/<name>.json, each {users, num_samples, user_data}."""
  os.makedirs(folder / split, exist_ok=True)
  for name, user_data in files.items():
    (folder / split / name).write_text(json.dumps({
        "users": list(user_data), "num_samples": [len(d["y"]) for d in user_data.values()],
        "user_data": user_data}))


def _femnist_user(n, label, seed):
  """n images of LEAF's floats: background 1.0, a stroke of darker pixels."""
  rng = np.random.default_rng(seed)
  x = np.ones((n, 784))
  x[:, rng.integers(0, 784, 20)] = rng.uniform(0, 0.5, (n, 20)).round(3)
  return {"x": x.tolist(), "y": [label + i % 2 for i in range(n)]}


@pytest.fixture
def femnist_dir(tmp_path):
  """Two train files (three writers, one of them too small), their test files."""
  folder = tmp_path / "femnist"
  _write_leaf(folder, "train", {
      "all_data_0_niid_0_keep_0_train_9.json": {"f0001_00": _femnist_user(12, 0, 0),
                                                 "f0002_01": _femnist_user(2, 10, 1)},
      "all_data_1_niid_0_keep_0_train_9.json": {"f0003_02": _femnist_user(9, 60, 2)}})
  _write_leaf(folder, "test", {
      "all_data_0_niid_0_keep_0_test_9.json": {"f0001_00": _femnist_user(3, 4, 3),
                                                "f0002_01": _femnist_user(1, 10, 4)},
      "all_data_1_niid_0_keep_0_test_9.json": {"f0003_02": _femnist_user(2, 60, 5)}})
  return folder


def test_femnist_one_client_per_writer_with_its_own_test_samples(femnist_dir):
  users = natural.load_femnist(str(femnist_dir), num_clients=2, seed=0)
  # f0002_01 has 2 training samples (< MIN_TRAIN): passed over for the next writer.
  assert list(users.user_ids) == ["f0001_00", "f0003_02"]
  assert users.source.num_classes == 62
  first, second = users.clients
  # 12 training images: 1 validates (10 %), 11 train; the test split is the writer's own.
  assert (len(first.y_train), len(first.y_val), len(first.y_test)) == (11, 1, 3)
  assert (len(second.y_train), len(second.y_val), len(second.y_test)) == (8, 1, 2)
  raw = json.loads((femnist_dir / "test" / "all_data_0_niid_0_keep_0_test_9.json")
                   .read_text())["user_data"]["f0001_00"]
  expected = np.round(255 * (1 - np.array(raw["x"]))).astype(np.uint8).reshape(3, 28, 28)
  np.testing.assert_array_equal(first.x_test, expected)  # ink bright, background 0
  np.testing.assert_array_equal(first.y_test, raw["y"])
  assert first.x_train.dtype == np.uint8 and first.x_train.shape[1:] == (28, 28)
  assert set(second.y_train) | set(second.y_val) <= {60, 61}
  # The same seed, the same split; another seed, another one.
  again = natural.load_femnist(str(femnist_dir), num_clients=2, seed=0).clients[0]
  np.testing.assert_array_equal(again.y_train, first.y_train)
  other = natural.load_femnist(str(femnist_dir), num_clients=2, seed=1).clients[0]
  assert not np.array_equal(other.x_val, first.x_val)


def test_femnist_registry_and_data_root(femnist_dir):
  """--dataset=femnist through the registry, from the data root's femnist/ folder."""
  federated = datasets.build_federated_dataset("femnist", str(femnist_dir.parent), 2,
                                               "balanced", 0)
  assert federated.data.num_clients == 2 and federated.data.num_classes == 62
  assert list(federated.groups) == ["f0001_00", "f0003_02"]
  np.testing.assert_array_equal(federated.data.split_sizes("test"), [3, 2])
  counts = federated.partition.class_counts  # [K, 62] training samples per class
  assert counts.shape == (2, 62) and counts[1, 60:].sum() == counts[1].sum() == 8
  resolved = config_lib.resolve(config_lib.ExperimentConfig(
      data=config_lib.DataConfig(dataset="femnist")))
  assert resolved.data.partition is None and resolved.model.name == "fedavg_cnn"
  with pytest.raises(DataError, match=r"femnist: 2 of its 3 users .* cannot make 3"):
    datasets.build_federated_dataset("femnist", str(femnist_dir), 3, "balanced", 0)
  with pytest.raises(ConfigError, match="clients are its users"):
    datasets.build_federated_dataset("femnist", str(femnist_dir), 2, "imbalanced", 0)
  with pytest.raises(ConfigError, match="published files only"):
    datasets.build_federated_dataset("femnist", str(femnist_dir), 2, "balanced", 0,
                                     data_source="tfds")
  # A partition flag would be ignored where the data gives the clients: refused, not dropped.
  with pytest.raises(ConfigError, match=r"femnist has one client per user .* --dirichlet_alpha"
                                        r", --partition would be ignored"):
    settings.from_settings({"dataset": "femnist", "partition": "dirichlet",
                            "dirichlet_alpha": 0.1})


def test_leaf_bad_input_is_one_line(tmp_path, femnist_dir):
  with pytest.raises(DataError, match=r"femnist: no data in .*preprocess\.sh"):
    natural.load_femnist(str(tmp_path / "femnist" / "train"), 1, 0)
  with pytest.raises(DataError, match="data directory not found"):
    natural.load_femnist(str(tmp_path / "absent"), 1, 0)
  broken = femnist_dir / "train" / "all_data_0_niid_0_keep_0_train_9.json"
  broken.write_text('{"users": ["a"], "user_data": ')
  with pytest.raises(DataError, match=r"LEAF: cannot read .*train_9\.json"):
    natural.load_femnist(str(femnist_dir), 1, 0)
  broken.write_text(json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 10],
                                                                      "y": [1]}}}))
  with pytest.raises(DataError, match="x must be lists of 784 numbers"):
    natural.load_femnist(str(femnist_dir), 1, 0)
  broken.write_text(json.dumps({"users": ["a"]}))
  with pytest.raises(DataError, match="lacks \"users\" or \"user_data\""):
    natural.load_femnist(str(femnist_dir), 1, 0)


def test_shakespeare_next_character(tmp_path):
  text = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer~"
  snippets = [text[i:i + 80] for i in range(5)]
  targets = [text[i + 80] for i in range(5)]  # the last one, "~", is not in LEAF's alphabet
  role = {"x": snippets, "y": targets}
  _write_leaf(tmp_path, "train", {"all_data_niid_0_keep_0_train_9.json":
                                  {"HAMLET_PRINCE_OF_DENMARK_HAMLET": role}})
  _write_leaf(tmp_path, "test", {"all_data_niid_0_keep_0_test_9.json": {
      "HAMLET_PRINCE_OF_DENMARK_HAMLET": {"x": [text[:80]], "y": [text[80]]}}})
  users = natural.load_shakespeare(str(tmp_path), num_clients=1, seed=0)
  client = users.clients[0]
  assert users.source.num_classes == 80 == len(natural.SHAKESPEARE_LETTERS)
  assert len(client.y_train) + len(client.y_val) == 4  # the "~" sample dropped
  assert client.x_test.shape == (1, 80) and client.x_test.dtype == np.int32
  letters = natural.SHAKESPEARE_LETTERS
  assert "".join(letters[i - 1] for i in client.x_test[0]) == text[:80]
  assert letters[client.y_test[0]] == text[80]
  assert natural.character_ids("a~") == [letters.index("a") + 1, 0]
  federated = datasets.build_federated_dataset("shakespeare", str(tmp_path), 1,
                                               "balanced", 0)
  assert federated.data.input_dtype == np.int32 and federated.data.num_classes == 80


def _cifar_clients(sizes, seed=0):
  rng = np.random.default_rng(seed)
  clients = {}
  for c, n in enumerate(sizes):
    labels = rng.integers(0, 100, n).astype(np.int64)
    clients[str(c)] = {"image": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                       "label": labels, "coarse_label": labels // 5}
  return clients


def _write_h5(path, clients):
  """TFF's HDF5 client data: examples/<client>/<feature>, [n, ...] each."""
  with h5py.File(path, "w") as f:
    for client, features in clients.items():
      for name, values in features.items():
        f[f"examples/{client}/{name}"] = values


def _feature(value) -> tf_feature_pb2.Feature:
  """One example's feature as TFF serializes it: bytes, floats or int64s, flattened."""
  if isinstance(value, (bytes, str)):
    text = value.encode() if isinstance(value, str) else value
    return tf_feature_pb2.Feature(bytes_list=tf_feature_pb2.BytesList(value=[text]))
  value = np.asarray(value)
  if np.issubdtype(value.dtype, np.floating):
    return tf_feature_pb2.Feature(
        float_list=tf_feature_pb2.FloatList(value=value.flatten().tolist()))
  return tf_feature_pb2.Feature(
      int64_list=tf_feature_pb2.Int64List(value=value.flatten().tolist()))


def _write_sqlite(path, splits):
  """TFF's SQLite client data (sql_client_data_utils' tables): splits ->
  {client: {feature: [n, ...] values}}, each example a serialized tf.train.Example."""
  with sqlite3.connect(path) as db:
    db.execute("CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,"
               " serialized_example_proto BLOB NOT NULL)")
    db.execute("CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT"
               " NOT NULL, num_examples INTEGER NOT NULL)")
    for split, clients in splits.items():
      for client, features in clients.items():
        n = len(next(iter(features.values())))
        for i in range(n):
          example = tf_example_pb2.Example(features=tf_feature_pb2.Features(
              feature={name: _feature(values[i]) for name, values in features.items()}))
          db.execute("INSERT INTO examples VALUES (?, ?, ?)",
                     (split, client, example.SerializeToString()))
        db.execute("INSERT INTO client_metadata VALUES (?, ?, ?)", (client, split, n))
  db.close()


@pytest.mark.parametrize("fmt", ["h5", "sqlite"])
def test_femnist_from_tffs_federated_emnist(tmp_path, fmt):
  """TFF's writers: pixels [28, 28] floats (background 1.0), labels; train and test."""
  rng = np.random.default_rng(0)

  def writers(sizes):
    return {w: {"label": rng.integers(0, 62, n).astype(np.int32),
                "pixels": rng.uniform(0, 1, (n, 28, 28)).astype(np.float32)}
            for w, n in sizes.items()}
  train = writers({"f0000_14": 2, "f0001_41": 10, "f0002_05": 6})
  test = writers({"f0001_41": 2})  # f0002_05 has no test examples: 20 % carved
  if fmt == "h5":
    _write_h5(tmp_path / "fed_emnist_train.h5", train)
    _write_h5(tmp_path / "fed_emnist_test.h5", test)
  else:
    _write_sqlite(tmp_path / "emnist_all.sqlite", {"train": train, "test": test})
  users = natural.load_femnist(str(tmp_path), num_clients=2, seed=0)
  assert list(users.user_ids) == ["f0001_41", "f0002_05"]  # f0000_14: 2 examples
  first, second = users.clients
  assert (len(first.y_train), len(first.y_val), len(first.y_test)) == (9, 1, 2)
  assert (len(second.y_train), len(second.y_val), len(second.y_test)) == (4, 1, 1)
  want = np.round(255 * (1 - test["f0001_41"]["pixels"])).astype(np.uint8)
  np.testing.assert_array_equal(first.x_test, want)
  np.testing.assert_array_equal(first.y_test, test["f0001_41"]["label"])


@pytest.mark.parametrize("fmt", ["h5", "sqlite"])
def test_cifar100_pachinko_from_tff_files(tmp_path, fmt):
  # 12 clients, so that ids sort as text ("10" before "2") but are taken as numbers.
  clients = _cifar_clients([10] * 12)
  if fmt == "h5":
    _write_h5(tmp_path / "fed_cifar100_train.h5", clients)
  else:
    _write_sqlite(tmp_path / "cifar100.sqlite",
                  {"train": clients, "test": _cifar_clients([4, 4], seed=1)})
  users = natural.load_cifar100_pachinko(str(tmp_path), num_clients=3, seed=0)
  assert list(users.user_ids) == ["0", "1", "2"]
  for user, client in zip(users.user_ids, users.clients):
    # No published test samples of a training client: 20 % test, 10 % of the rest val.
    assert (len(client.y_train), len(client.y_val), len(client.y_test)) == (7, 1, 2)
    images, labels = clients[user]["image"], clients[user]["label"]
    got = np.concatenate([client.x_train, client.x_val, client.x_test])
    got_y = np.concatenate([client.y_train, client.y_val, client.y_test])
    order = np.lexsort((got_y, got.reshape(10, -1)[:, 0]))
    want = np.lexsort((labels, images.reshape(10, -1)[:, 0]))
    np.testing.assert_array_equal(got[order], images[want])
    np.testing.assert_array_equal(got_y[order], labels[want])
  federated = datasets.build_federated_dataset("cifar100_pachinko", str(tmp_path), 3,
                                               "balanced", 0)
  assert federated.data.input_shape == (32, 32, 3) and federated.data.num_classes == 100


def test_tff_reader_bad_input_is_one_line(tmp_path):
  with pytest.raises(DataError, match=r"cifar100_pachinko: no data .*fed_cifar100\.tar"):
    natural.load_cifar100_pachinko(str(tmp_path), 1, 0)
  (tmp_path / "cifar100.sqlite").write_bytes(b"not a database at all" * 10)
  with pytest.raises(DataError, match="cannot read .* as SQLite"):
    natural.load_cifar100_pachinko(str(tmp_path), 1, 0)
  os.remove(tmp_path / "cifar100.sqlite")
  (tmp_path / "fed_cifar100_train.h5").write_bytes(b"not HDF5")
  with pytest.raises(DataError, match="cannot read .* as HDF5"):
    natural.load_cifar100_pachinko(str(tmp_path), 1, 0)
  _write_h5(tmp_path / "fed_cifar100_train.h5", {"0": {"label": np.zeros(5, np.int64)}})
  with pytest.raises(DataError, match="lacks the features image and label"):
    natural.load_cifar100_pachinko(str(tmp_path), 1, 0)
  with mock.patch.dict(sys.modules, {"h5py": None}):  # h5py not installed
    with pytest.raises(DataError, match="needs h5py: pip install h5py"):
      natural.load_cifar100_pachinko(str(tmp_path), 1, 0)
  with sqlite3.connect(tmp_path / "other.sqlite") as db:
    db.execute("CREATE TABLE examples (client_id TEXT)")
  db.close()
  with pytest.raises(DataError, match="lacks the tables"):
    tff_files.client_sizes(str(tmp_path / "other.sqlite"), "train")
  (tmp_path / "renamed").mkdir()
  _write_sqlite(tmp_path / "renamed" / "cifar100.sqlite", {"training": _cifar_clients([3])})
  with pytest.raises(DataError, match=r"no client in split 'train' \(its splits: training\)"):
    natural.load_cifar100_pachinko(str(tmp_path / "renamed"), 1, 0)


@pytest.mark.slow
def test_femnist_run_end_to_end(tmp_path, femnist_dir):
  """experiments.main --dataset=femnist: results.json names each client's writer."""
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--dataset=femnist",
       f"--data_dir={femnist_dir}", "--num_clients=2", "--model=mlp", "--hidden=8",
       "--algorithm=fedavg", "--rounds=1", "--local_epochs=1", "--log_every=0",
       "--checkpoint_every=0", f"--workdir={workdir}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["num_clients"] == 2
  assert [c["group"] for c in results["clients"]] == ["f0001_00", "f0003_02"]
  assert [c["n_test"] for c in results["clients"]] == [3, 2]


STACKOVERFLOW_POSTS = {  # user: [(tokens, tags)]
    "00000001": [("how do i sort a list in python ?", "python|list"),
                 ("use sorted ( ) .", "python"),
                 ("what is a monad", "haskell|monads")],
    "00000002": [("no", "c")],  # one post: fewer than MIN_TRAIN, passed over
    "00000003": [("why is my python list empty", "python"), ("print it", "python"),
                 ("a list", "list|python")]}


def _write_stackoverflow(folder, fmt, test_posts):
  splits = {split: {user: {"tokens": np.array([p[0].encode() for p in posts]),
                           "tags": np.array([p[1].encode() for p in posts]),
                           "score": np.zeros(len(posts), np.int64)}
                    for user, posts in users.items()}
            for split, users in (("train", STACKOVERFLOW_POSTS), ("test", test_posts))}
  if fmt == "h5":
    for split, clients in splits.items():
      _write_h5(folder / f"stackoverflow_{split}.h5", clients)
  else:
    _write_sqlite(folder / "stackoverflow.sqlite", splits)


@pytest.mark.parametrize("fmt", ["h5", "sqlite"])
def test_stackoverflow_words_and_tags_per_user(tmp_path, fmt):
  _write_stackoverflow(tmp_path, fmt, {"00000003": [("python list", "python|list")]})
  users = stackoverflow.load_stackoverflow(str(tmp_path), num_clients=2, vocab_size=5,
                                           num_tags=2, seq_len=4)
  assert [u.id for u in users] == ["00000001", "00000003"]
  # The vocabulary from the two users' training posts: a and list 3 times (a seen
  # first), python and is twice, how first of the words seen once.
  words = {"a": 1, "list": 2, "python": 3, "is": 4, "how": 5}
  oov, bos, eos = 6, 7, 8
  first, second = users
  assert first.words_train.shape == (3, 5) and first.words_test.shape == (0, 5)
  # "what is a monad": 4 words, cut at seq_len 4, so no end id.
  assert first.words_train[2].tolist() == [bos, oov, words["is"], words["a"], oov]
  assert first.words_train[1].tolist() == [bos, oov, oov, oov, oov]  # use sorted ( ) .
  assert second.words_test.tolist() == [[bos, words["python"], words["list"], eos, 0]]
  # Tags: python (4 posts), list (2); haskell and monads outside the 2 kept.
  np.testing.assert_array_equal(first.tags_train, [[1, 1], [1, 0], [0, 0]])
  np.testing.assert_array_equal(second.tags_test, [[1, 1]])


def test_stackoverflow_vocabulary_files_and_bad_input(tmp_path):
  _write_stackoverflow(tmp_path, "h5", {"00000009": [("later", "python")]})  # not loaded
  (tmp_path / "stackoverflow.word_count").write_text("what 9\nmonad 8\nlist 7\n")
  (tmp_path / "stackoverflow.tag_count").write_text(json.dumps({"haskell": 5, "python": 9}))
  first = stackoverflow.load_stackoverflow(str(tmp_path), 1, seq_len=3)[0]
  oov, bos = 4, 5  # the file's 3 words are ids 1..3 (what, monad, list)
  assert first.words_train[2].tolist() == [bos, 1, oov, oov]  # what is a (monad cut)
  # Tags by the file's counts: python 0, haskell 1.
  np.testing.assert_array_equal(first.tags_train, [[1, 0], [1, 0], [0, 1]])
  with pytest.raises(DataError, match=r"stackoverflow: no data .*stackoverflow\.tar\.bz2"):
    stackoverflow.load_stackoverflow(str(tmp_path / "stackoverflow.word_count"), 1)
  with pytest.raises(DataError, match=r"2 of its 3 users .* cannot make 3"):
    stackoverflow.load_stackoverflow(str(tmp_path), 3)


def test_char_lstm_is_the_papers_shakespeare_model():
  """Embed 81x8, LSTMs of 256 (4 gates: input and recurrent kernels, one bias each),
  Dense 256x80: the registry's model for --dataset=shakespeare."""
  assert datasets.get_spec("shakespeare").model == "char_lstm"
  model = build_model("char_lstm", num_outputs=80)
  variables = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 80), np.int32))
  lstm = lambda d_in, h: 4 * (d_in * h + h * h + h)
  expected = 81 * 8 + lstm(8, 256) + lstm(256, 256) + 256 * 80 + 80
  assert expected == 817_880
  assert sum(leaf.size for leaf in jax.tree.leaves(variables)) == expected
  assert layers.layer_names(variables) == ["Embed_0", "LSTM_0", "LSTM_1", "Dense_0"]


@pytest.mark.slow  # compiling the LSTM's scan and its gradient: ~20 s on a shared CPU
def test_char_lstm_learns_from_the_sequences_last_step():
  """A task only the last character decides: a few Adam steps solve it, so the model
  reads the sequence to its end (the Dense takes the last LSTM output)."""
  x = np.random.default_rng(0).integers(1, 11, (128, 8)).astype(np.int32)
  y = x[:, -1] - 1
  model = CharLSTM(num_outputs=10, vocab_size=11, hidden=(16,))
  params = model.init(jax.random.key(0), x[:1])
  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, state):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(p, x), y).mean()
    updates, state = optimizer.update(jax.grad(loss)(params), state)
    return optax.apply_updates(params, updates), state
  state = optimizer.init(params)
  for _ in range(60):
    params, state = step(params, state)
  assert (model.apply(params, x).argmax(-1) == y).mean() > 0.9
