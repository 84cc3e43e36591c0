"""Naturally partitioned data: one client per real user, from the files it is published in.

The cross-device benchmarks (LEAF: Caldas et al. 2018; TFF's simulation datasets, Reddi
et al., "Adaptive Federated Optimization", ICLR 2021) give each sample its user. No
TFDS builder carries that id (TFDS 4.9's emnist, cifar100 and tiny_shakespeare have
none, and it has no StackOverflow), so each dataset is read in the format it is
published in (docs/datasets.md says where to get each):

  femnist            LEAF's JSON (leaf_json.py), or TFF's federated EMNIST built from it
                     (fed_emnist HDF5 or emnist_all SQLite, tff_files.py): 62 classes
                     (digits, upper, lower case), one client per writer; images stored
                     as uint8 28x28 with the ink bright (both publish floats with the
                     background at 1.0: 255 * (1 - x))
  shakespeare        LEAF's JSON: next character after 80, one client per speaking role;
                     x the 80 characters as ids 1..80 of LEAF's alphabet (0 for any
                     other character, the padding id the text models mask), y the next
                     character's index 0..79 (samples with another next character
                     dropped)
  cifar100_pachinko  TFF's federated CIFAR-100 (tff_files.py, HDF5 or SQLite): its 500
                     training clients, 100 images each, drawn by the Pachinko allocation
                     (Li & McCallum 2006) over the coarse then the fine labels

`--num_clients=K` takes the first K users, in the files' order for LEAF (file name, then
the file's user order) and in id order for TFF (numeric ids as numbers); a user with fewer
than MIN_TRAIN training samples is passed over. Each user's test samples are its own
samples of the published test split where it has some (LEAF's sample split); otherwise,
as for TFF's CIFAR-100 whose test clients are other people, TEST_FRACTION of its
samples, drawn with a seeded shuffle. VAL_FRACTION of the remaining training samples
(at least one) validate.
"""

import logging
import os
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

from fedora_jax.data import leaf_json, tff_files
from fedora_jax.data import root as data_root
from fedora_jax.data.client_data import Client
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import DataError

logger = logging.getLogger("fedora_jax")

VAL_FRACTION, TEST_FRACTION = 0.1, 0.2
MIN_TRAIN = 3  # a training, a validation and (when carved) a test sample

# LEAF's Shakespeare alphabet (leaf/models/utils/language_utils.py ALL_LETTERS).
SHAKESPEARE_LETTERS = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]"
                       "abcdefghijklmnopqrstuvwxyz}")
SHAKESPEARE_LENGTH = 80  # LEAF's and TFF's snippets: 80 characters, then the next one
SHAKESPEARE_CLASSES = len(SHAKESPEARE_LETTERS)  # 80
FEMNIST_CLASSES = 62


class UserSamples(NamedTuple):
  """One user's arrays: its training samples, and its published test samples (empty
  when the test split does not hold the user)."""
  id: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


class NaturalClients(NamedTuple):
  """A dataset's first users as clients: `source` carries only the name and class count."""
  source: ImageDataset
  clients: list[Client]
  user_ids: np.ndarray  # [K] str


def split_user(user: UserSamples, index: int, seed: int) -> Client:
  """A user's train / val / test splits, shuffled with the seed (seed, index)."""
  rng = np.random.default_rng([seed, index])
  order = rng.permutation(len(user.y_train))
  x_test, y_test = user.x_test, user.y_test
  if len(y_test) == 0:
    n_test = max(1, int(round(len(order) * TEST_FRACTION)))
    x_test, y_test = user.x_train[order[:n_test]], user.y_train[order[:n_test]]
    order = order[n_test:]
  n_val = max(1, int(round(len(order) * VAL_FRACTION)))
  val, train = order[:n_val], order[n_val:]
  return Client(x_train=user.x_train[train], y_train=user.y_train[train],
                x_val=user.x_train[val], y_val=user.y_train[val],
                x_test=x_test, y_test=y_test)


def first_users(candidates: Iterable[tuple[str, int]], num_clients: int,
                name: str) -> list[str]:
  """The ids of the first `num_clients` (id, training samples) with enough samples."""
  if num_clients < 1:
    raise DataError(f"{name}: num_clients must be >= 1, got {num_clients}")
  chosen, seen = [], 0
  for user, n in candidates:
    seen += 1
    if n >= MIN_TRAIN:
      chosen.append(user)
      if len(chosen) == num_clients:
        return chosen
  raise DataError(f"{name}: {len(chosen)} of its {seen} users have >= {MIN_TRAIN}"
                  f" training samples; cannot make {num_clients} clients")


def as_clients(name: str, users: list[UserSamples], num_classes: int,
               seed: int) -> NaturalClients:
  """Users -> clients (split_user), logged."""
  clients = [split_user(u, i, seed) for i, u in enumerate(users)]
  with_test = sum(len(u.y_test) > 0 for u in users)
  logger.info("%s: %d users as clients (%d with published test samples); training"
              " samples per client %d-%d", name, len(users), with_test,
              min(len(c.y_train) for c in clients), max(len(c.y_train) for c in clients))
  empty = np.zeros((0,) + users[0].x_train.shape[1:], users[0].x_train.dtype)
  source = ImageDataset(name=name, x_train=empty, y_train=np.zeros(0, np.int32),
                        x_test=empty, y_test=np.zeros(0, np.int32), num_classes=num_classes)
  return NaturalClients(source, clients, np.array([u.id for u in users]))


def find_folder(name: str, data_dir: str | None, holds: Callable[[str], bool],
                where: str) -> str:
  """`data_dir` itself or its <name>/ folder (data_dir None: the data root's), holding
  the files `holds` checks; else a one-line DataError saying where to get them."""
  root = os.path.expanduser(data_dir) if data_dir else data_root.default_root()
  if data_dir and not os.path.exists(root):
    raise DataError(f"{name}: data directory not found: {root}")
  for folder in (root, os.path.join(root, name)):
    if os.path.isdir(folder) and holds(folder):
      return folder
  raise DataError(f"{name}: no data in {root} or {os.path.join(root, name)}/; {where}")


# LEAF: FEMNIST and Shakespeare.

def _leaf_users(name: str, folder: str, num_clients: int,
                convert: Callable[[leaf_json.LeafUser], tuple[np.ndarray, np.ndarray]]
                ) -> list[UserSamples]:
  """The first users of LEAF's train/ with enough samples, and their test/ samples."""
  converted: dict[str, tuple[np.ndarray, np.ndarray]] = {}

  def candidates() -> Iterator[tuple[str, int]]:
    for user in leaf_json.users(folder, "train"):
      converted[user.id] = convert(user)
      yield user.id, len(converted[user.id][1])
  ids = first_users(candidates(), num_clients, name)
  tests = leaf_json.find_users(folder, "test", set(ids))
  users = []
  for user in ids:
    x, y = converted[user]
    x_test, y_test = convert(tests[user]) if user in tests else (x[:0], y[:0])
    users.append(UserSamples(user, x, y, x_test, y_test))
  return users


def femnist_images(user: str, pixels, labels) -> tuple[np.ndarray, np.ndarray]:
  """LEAF's (and TFF's) 784 floats in [0, 1], background 1.0 -> uint8 [n, 28, 28], ink
  bright; labels -> int32 [n]."""
  try:
    x = np.asarray(pixels, np.float32).reshape(len(pixels), 28, 28)
    y = np.asarray(labels, np.int32).reshape(len(labels))
  except (ValueError, TypeError):
    raise DataError(f"femnist: user {user!r}: x must be lists of 784 numbers and y"
                    " class ids") from None
  if len(y) and (y.min() < 0 or y.max() >= FEMNIST_CLASSES):
    raise DataError(f"femnist: user {user!r}: labels outside [0, {FEMNIST_CLASSES})")
  return np.round(255 * (1 - np.clip(x, 0, 1))).astype(np.uint8), y


def femnist_arrays(user: leaf_json.LeafUser) -> tuple[np.ndarray, np.ndarray]:
  """A LEAF writer's images and labels (femnist_images)."""
  return femnist_images(user.id, user.x, user.y)


def character_ids(text: str) -> list[int]:
  """Characters -> 1 + their index in LEAF's alphabet, 0 for any other."""
  return [SHAKESPEARE_LETTERS.find(c) + 1 for c in text]


def shakespeare_arrays(user: leaf_json.LeafUser) -> tuple[np.ndarray, np.ndarray]:
  """80-character snippets -> int32 [n, 80] ids; next characters -> classes 0..79."""
  keep = [i for i, c in enumerate(user.y)
          if isinstance(c, str) and len(c) == 1 and c in SHAKESPEARE_LETTERS]
  x = np.zeros((len(keep), SHAKESPEARE_LENGTH), np.int32)
  for row, i in enumerate(keep):
    snippet = user.x[i]
    if not isinstance(snippet, str) or len(snippet) != SHAKESPEARE_LENGTH:
      raise DataError(f"shakespeare: user {user.id!r} sample {i}: x must be a string of"
                      f" {SHAKESPEARE_LENGTH} characters")
    x[row] = character_ids(snippet)
  y = np.array([SHAKESPEARE_LETTERS.index(user.y[i]) for i in keep], np.int32)
  return x, y


LEAF_WHERE = ("get it with LEAF (github.com/TalwalkarLab/leaf): in data/{name}/ run"
              " ./preprocess.sh {args}, then pass --data_dir=<leaf>/data/{name}/data (it"
              " holds train/ and test/)")


# TFF's federated EMNIST (62 classes), the same writers' images: train, test files.
FEMNIST_TFF_FILES = (("fed_emnist_train.h5", "fed_emnist_test.h5"),
                     ("emnist_all.sqlite", "emnist_all.sqlite"))
FEMNIST_TFF_WHERE = ("or TFF's federated EMNIST: fed_emnist.tar.bz2 (HDF5) or"
                     " emnist_all.sqlite.lzma (decompress it with `unlzma`), under"
                     " storage.googleapis.com/tff-datasets-public/")


def _tff_femnist_arrays(client: str, features: dict[str, np.ndarray]
                        ) -> tuple[np.ndarray, np.ndarray]:
  if not {"pixels", "label"} <= features.keys():
    raise DataError(f"femnist: client {client!r} lacks the features pixels and label (has"
                    f" {', '.join(sorted(features))})")
  return femnist_images(client, features["pixels"], features["label"])


def load_femnist(data_dir: str | None, num_clients: int, seed: int) -> NaturalClients:
  """FEMNIST's first `num_clients` writers, from LEAF's JSON or TFF's federated EMNIST
  (fed_emnist or emnist_all: 62 classes), see the module docstring."""
  where = (LEAF_WHERE.format(name="femnist", args="-s niid --sf 1.0 -k 0 -t sample")
           + "; " + FEMNIST_TFF_WHERE)
  has_tff = lambda folder: any(os.path.isfile(os.path.join(folder, train))
                               for train, _ in FEMNIST_TFF_FILES)
  folder = find_folder("femnist", data_dir,
                       lambda f: leaf_json.holds(f) or has_tff(f), where)
  if leaf_json.holds(folder):
    users = _leaf_users("femnist", folder, num_clients, femnist_arrays)
  else:
    train, test = next((os.path.join(folder, a), os.path.join(folder, b))
                       for a, b in FEMNIST_TFF_FILES if os.path.isfile(os.path.join(folder, a)))
    users = _tff_users("femnist", train, test, num_clients, _tff_femnist_arrays)
  return as_clients("femnist", users, FEMNIST_CLASSES, seed)


def load_shakespeare(data_dir: str | None, num_clients: int, seed: int) -> NaturalClients:
  """Shakespeare's first `num_clients` roles (LEAF JSON), see the module docstring."""
  where = LEAF_WHERE.format(name="shakespeare", args="-s niid --sf 1.0 -k 0 -t sample")
  folder = find_folder("shakespeare", data_dir, leaf_json.holds, where)
  users = _leaf_users("shakespeare", folder, num_clients, shakespeare_arrays)
  return as_clients("shakespeare", users, SHAKESPEARE_CLASSES, seed)


# TFF: CIFAR-100 by the Pachinko allocation.

CIFAR100_FILES = ("fed_cifar100_train.h5", "cifar100.sqlite")
CIFAR100_WHERE = ("get TFF's federated CIFAR-100: fed_cifar100.tar.bz2 (HDF5; holds"
                  " fed_cifar100_train.h5) or cifar100.sqlite.lzma (decompress it with"
                  " `unlzma`), both under storage.googleapis.com/tff-datasets-public/")


def tff_file(folder: str, names: tuple[str, ...]) -> str:
  """The first of `names` in `folder` (find_folder checked one is there)."""
  return next(os.path.join(folder, n) for n in names
              if os.path.isfile(os.path.join(folder, n)))


def numeric_order(sizes: list[tuple[str, int]]) -> list[tuple[str, int]]:
  """Ids in numeric order when all are numbers (TFF's "0".."499"), else as given."""
  if all(c.isdigit() for c, _ in sizes):
    return sorted(sizes, key=lambda s: int(s[0]))
  return sizes


def cifar100_arrays(client: str, features: dict[str, np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray]:
  """A TFF CIFAR-100 client's image and label features -> uint8 [n, 32, 32, 3], int32."""
  if not {"image", "label"} <= features.keys():
    raise DataError(f"cifar100_pachinko: client {client!r} lacks the features image and"
                    f" label (has {', '.join(sorted(features))})")
  image, label = features["image"], features["label"]
  if image.size != len(label) * 32 * 32 * 3:
    raise DataError(f"cifar100_pachinko: client {client!r}: images are not 32x32x3")
  y = np.asarray(label, np.int32).reshape(len(label))
  if len(y) and (y.min() < 0 or y.max() >= 100):
    raise DataError(f"cifar100_pachinko: client {client!r}: labels outside [0, 100)")
  return np.asarray(image).reshape(len(y), 32, 32, 3).astype(np.uint8), y


def _tff_users(name: str, train_path: str, test_path: str | None, num_clients: int,
               convert: Callable[[str, dict[str, np.ndarray]], tuple[np.ndarray, np.ndarray]]
               ) -> list[UserSamples]:
  """The first training clients of a TFF file with enough examples, with their examples
  of `test_path`'s test split where it holds them (None: no per-client test split)."""
  ids = first_users(numeric_order(tff_files.client_sizes(train_path, "train")),
                    num_clients, name)
  train = tff_files.read_clients(train_path, "train", ids)
  test = {} if test_path is None else tff_files.read_clients(test_path, "test", ids)
  users = []
  for client in ids:
    x, y = convert(client, train[client])
    x_test, y_test = convert(client, test[client]) if client in test else (x[:0], y[:0])
    users.append(UserSamples(client, x, y, x_test, y_test))
  return users


def load_cifar100_pachinko(data_dir: str | None, num_clients: int,
                           seed: int) -> NaturalClients:
  """TFF's CIFAR-100 training clients 0..num_clients-1, see the module docstring."""
  holds = lambda folder: any(os.path.isfile(os.path.join(folder, n)) for n in CIFAR100_FILES)
  path = tff_file(find_folder("cifar100_pachinko", data_dir, holds, CIFAR100_WHERE),
                  CIFAR100_FILES)
  # Its test clients are other people than its training clients: no test_path.
  users = _tff_users("cifar100_pachinko", path, None, num_clients, cifar100_arrays)
  return as_clients("cifar100_pachinko", users, 100, seed)
