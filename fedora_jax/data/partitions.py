"""Client partitions of a centralised dataset.

Rotated MNIST follows FEDORA's Appendix B (Wu et al., KDD 2023): client i sees images
rotated by 360 * i / K degrees.
  - balanced: each client draws `train_per_client` (128) training and `val_per_client`
    (64) validation images, without replacement, from the official training set;
  - imbalanced: K - 1 clients as above; client K // 2 takes the rest of the training set,
    2/3 for training and 1/3 for validation;
  - test: the official test set, shuffled, split into K equal parts (the remainder,
    10000 mod K images, is dropped, as in the authors' code).
Rotation is nearest-neighbour about the image centre with zero fill and no resizing,
like torchvision's `rotate` defaults used by the authors (pixel for pixel but for
~0.002% of pixels, near the image border; docs/datasets.md).

`split` picks who draws the rotation clients' indices (both keep the sizes above):
  - "ours" (default): one `np.random.default_rng(seed)` permutation of the training set,
    cut into consecutive 128 + 64 blocks (train, then validation), and one of the test set;
  - "authors": the FEDORA authors' loader (github.com/junwu6/FEDORA,
    utils/load_rotate_mnist.py, BaseNodes_RotateMNIST) draw for draw: NumPy's legacy RNG
    seeded with `seed` (their `set_seed(args.seed)`, 42 by default) shuffles
    arange(n_train), whose last 10000 are the validation pool and the rest the training
    pool, then shuffles arange(n_test); client k takes the k-th block of 128 of the
    training pool, of 64 of the validation pool and of n_test // K of the test order
    (their code writes 10000, the MNIST / Fashion-MNIST test set's size).
    `np.random.RandomState(seed)` gives the same draws as their global `np.random` right
    after `np.random.seed(seed)` (nothing else draws from it before the loader). Balanced
    clients only: their loader has no imbalanced setting.
Both draw without replacement: no index serves two clients or two splits.

`split="authors"` with the pathological kind (CIFAR-10) is the loader the FEDORA code
ships for it (utils/data_loader.py, pFedHN's `gen_random_loaders`; the released mains
never call it, so that their CIFAR-10 run seeded it as their MNIST run does is our
assumption), draw for draw (`authors_pathological_indices`):
  1. `torch.utils.data.random_split` after `torch.manual_seed(seed)` cuts the training
     set into a training pool and a validation pool of its last 10,000 (torch's CPU
     randperm: Fisher-Yates over MT19937 outputs, u mod (n - i), emulated here);
  2. client k holds the classes k*c .. k*c+c-1 (mod C) in class order, no permutation;
     each class draws `uniform(0.4, 0.6)` for each of its holders from NumPy's global
     RNG, normalised, handed out last first (their `.pop()`);
  3. Python's `random` shuffles each class's positions, for the training pool, then the
     validation pool, then the test set; client by client, each of its classes gives it
     the next 10 training images (20 a client), and int(class count x its proportion)
     validation and test images (about 1,000 each). `train_per_client` (the
     --fixed_train_size flag), if set, takes train_per_client / c of each class instead:
     the paper's CIFAR-10 numbers need not come from the 10 the released loader takes.
Exact images need the official archive (cifar-10-python.tar.gz, torchvision's order);
the JPEG copy, sorted by label, gives the same sizes and classes but other images.

Label-skew partitions (`make_partition`, kinds iid / pathological / dirichlet) share one
protocol, so that every kind gives each client train / validation / test splits the way
the rotation protocol does:
  1. a [K, C] matrix of shares says which fraction of class c's samples client k gets;
  2. the official training set is cut by it, class by class, into disjoint client pools;
     with `train_per_client` set, a regular client keeps a random `train_per_client` +
     `val_per_client` of its pool (the fixed sizes of Appendix B), else all of it;
  3. each pool is shuffled and split into validation (`val_fraction`, default 1/3: the
     64 : 128 of Appendix B) and training;
  4. the official test set is cut by the same shares, so each client's test set has its
     training label distribution, and no test image goes to two clients.
With `data_fraction` f < 1, a seeded random f of the training set and f of the test set
(uniform, without replacement, their own random stream so the rest of the protocol draws
as before) stand for the whole dataset from step 1 on.
Shares per kind (`setting` picks balanced sizes or, as in FEDORA's imbalanced setting,
one large client K // 2, weighted K - 1 times any other client wherever it holds a class):
  - iid: every client gets the same fraction of every class;
  - pathological: client k holds `classes_per_client` distinct classes, k*c .. k*c + c - 1
    (mod C) of a seeded class permutation (the cyclic assignment of pFedHN's loader that
    FEDORA's code ships); a class is shared equally among the clients holding it;
  - dirichlet: per class, proportions ~ Dir(alpha) over clients; clients already at their
    target size get no more (NIID-Bench / PFLlib); redrawn, at most `max_redraws` times,
    until every client has `min_client_size` training samples and at least one
    validation and one test sample.
An impossible request raises a one-line ConfigError before any client is built.
"""

import random
from typing import NamedTuple

import numpy as np
import scipy.ndimage

from fedora_jax.data.client_data import Client
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import ConfigError, DataError, FieldError

SETTINGS = ("balanced", "imbalanced")
KINDS = ("rotation", "iid", "pathological", "dirichlet")
SPLITS = ("ours", "authors")  # who draws the rotation clients' indices (module docstring)
AUTHORS_VAL_POOL = 10000  # load_rotate_mnist.py: val_size, the training set's last 10000


class Partition(NamedTuple):
  clients: list[Client]
  angles: np.ndarray | None = None   # [K] rotation of each client, degrees (rotation only)
  large_client: int | None = None    # the client holding the rest (imbalanced), else None
  kind: str = "rotation"
  class_counts: np.ndarray | None = None  # [K, C] training samples per class


class PartitionConfig(NamedTuple):
  """How to cut a centralised dataset into clients; see the module docstring."""
  kind: str = "rotation"
  setting: str = "balanced"
  classes_per_client: int = 2           # pathological
  dirichlet_alpha: float = 0.3          # dirichlet
  min_client_size: int = 1              # training samples every client must get
  train_per_client: int | None = None   # None: rotation 128, others all of the pool
  val_per_client: int | None = None     # None: rotation 64, others train_per_client // 2
  val_fraction: float = 1 / 3           # validation share of a pool (no fixed sizes)
  max_redraws: int = 100                # dirichlet
  split: str = "ours"                   # "ours" or "authors" (rotation, pathological)
  # A random share of the official training set and of the test set, drawn before the
  # partition (parameter coaching's 10 clients hold "10% training data and test data
  # selected randomly from the dataset"); 1.0: all of it.
  data_fraction: float = 1.0
  # --dataset=synthetic (fedora_jax/data/synthetic.py): its clients are generated, not
  # cut; these are its generator's parameters (kind "synthetic").
  synthetic_alpha: float = 1.0
  synthetic_beta: float = 1.0
  synthetic_size_mu: float = 4.0
  synthetic_size_sigma: float = 2.0


def rotation_angles(num_clients: int) -> np.ndarray:
  return 360.0 * np.arange(num_clients) / num_clients


def rotate_images(images: np.ndarray, angle: float) -> np.ndarray:
  """Rotates a batch [n, H, W(, C)] by `angle` degrees (counter-clockwise), nearest pixel."""
  if angle % 360 == 0:
    return images.copy()
  return scipy.ndimage.rotate(images, angle, axes=(2, 1), reshape=False, order=0,
                              mode="constant", cval=0)


def rotation_partition(dataset: ImageDataset, num_clients: int, setting: str = "balanced",
                       seed: int = 0, train_per_client: int = 128,
                       val_per_client: int = 64) -> Partition:
  """Rotated clients per FEDORA's Appendix B; see the module docstring."""
  if setting not in SETTINGS:
    raise DataError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
  if num_clients < 1:
    raise DataError(f"num_clients must be >= 1, got {num_clients}")
  if train_per_client < 1 or val_per_client < 1:
    raise DataError("train and validation samples per client must be >= 1")
  n_train, n_test = len(dataset.x_train), len(dataset.x_test)
  per_client = train_per_client + val_per_client
  regular = num_clients - 1 if setting == "imbalanced" else num_clients
  # The large client needs at least one training and one validation image.
  needed = regular * per_client + (3 if setting == "imbalanced" else 0)
  if needed > n_train:
    raise DataError(
        f"{dataset.name}: {num_clients} {setting} clients need {needed} training images"
        f" ({per_client} each), but the training set has {n_train}")
  if n_test < num_clients:
    raise DataError(f"{dataset.name}: cannot split {n_test} test images over"
                    f" {num_clients} clients")

  rng = np.random.default_rng(seed)
  train_order = rng.permutation(n_train)
  test_order = rng.permutation(n_test)
  test_per_client = n_test // num_clients
  large_client = num_clients // 2 if setting == "imbalanced" else None
  angles = rotation_angles(num_clients)

  clients, offset = [], 0
  for k in range(num_clients):
    if k == large_client:
      continue  # takes what the others leave, below
    block = train_order[offset:offset + per_client]
    offset += per_client
    clients.append((k, block[:train_per_client], block[train_per_client:]))
  if large_client is not None:
    rest = train_order[offset:]
    cut = (2 * len(rest)) // 3
    clients.insert(large_client, (large_client, rest[:cut], rest[cut:]))

  built = [_rotated_client(dataset, angles[k], train_idx, val_idx,
                           test_order[k * test_per_client:(k + 1) * test_per_client])
           for k, train_idx, val_idx in clients]
  return Partition(clients=built, angles=angles, large_client=large_client)


def _rotated_client(dataset: ImageDataset, angle: float, train_idx: np.ndarray,
                    val_idx: np.ndarray, test_idx: np.ndarray) -> Client:
  """A client of these training-set (train, validation) and test-set indices, rotated."""
  return Client(
      x_train=rotate_images(dataset.x_train[train_idx], angle),
      y_train=dataset.y_train[train_idx],
      x_val=rotate_images(dataset.x_train[val_idx], angle),
      y_val=dataset.y_train[val_idx],
      x_test=rotate_images(dataset.x_test[test_idx], angle),
      y_test=dataset.y_test[test_idx])


def authors_rotation_indices(n_train: int, n_test: int, num_clients: int, seed: int,
                             train_per_client: int = 128, val_per_client: int = 64,
                             val_pool: int = AUTHORS_VAL_POOL
                             ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Per client, its (training, validation) training-set indices and its test-set
  indices, drawn as the FEDORA authors' BaseNodes_RotateMNIST draws them (module
  docstring). Where their loop would silently hand out short or empty slices, this
  raises DataError."""
  train_pool = n_train - val_pool
  test_per_client = n_test // num_clients
  if not 0 < val_pool < n_train:
    raise DataError(f"the authors' split holds out the last {val_pool} of the training"
                    f" set for validation; it has {n_train} images")
  for what, need, have in (("training", num_clients * train_per_client, train_pool),
                           ("validation", num_clients * val_per_client, val_pool)):
    if need > have:
      raise DataError(f"the authors' split: {num_clients} clients need {need} {what}"
                      f" images, but their {what} pool holds {have}")
  if test_per_client < 1:
    raise DataError(f"cannot split {n_test} test images over {num_clients} clients")
  rng = np.random.RandomState(seed)  # = their global np.random after np.random.seed(seed)
  order = np.arange(n_train)
  rng.shuffle(order)
  train_order, val_order = order[:-val_pool], order[-val_pool:]
  test_order = np.arange(n_test)
  rng.shuffle(test_order)
  return [(train_order[k * train_per_client:(k + 1) * train_per_client],
           val_order[k * val_per_client:(k + 1) * val_per_client],
           test_order[k * test_per_client:(k + 1) * test_per_client])
          for k in range(num_clients)]


def authors_rotation_partition(dataset: ImageDataset, num_clients: int, seed: int,
                               train_per_client: int = 128,
                               val_per_client: int = 64) -> Partition:
  """Balanced rotated clients sampled as the FEDORA authors' code samples them."""
  angles = rotation_angles(num_clients)
  indices = authors_rotation_indices(len(dataset.x_train), len(dataset.x_test),
                                     num_clients, seed, train_per_client, val_per_client)
  clients = [_rotated_client(dataset, angles[k], *idx) for k, idx in enumerate(indices)]
  return Partition(clients=clients, angles=angles, large_client=None)


def torch_randperm(n: int, seed: int) -> np.ndarray:
  """torch.randperm(n) right after torch.manual_seed(seed), on the CPU: Fisher-Yates over
  the 32-bit outputs of MT19937 seeded with `seed` (swap r[i] with r[i + u_i mod (n-i)]).
  NumPy's legacy seeding gives the same MT19937 state."""
  generator = np.random.MT19937()
  # numpy's stubs type get_state(legacy=False) as a plain dict; it is MT19937's state.
  generator.state = np.random.RandomState(seed).get_state(legacy=False)  # type: ignore[assignment]
  draws = generator.random_raw(max(n - 1, 0))
  order = np.arange(n)
  for i in range(n - 1):
    j = i + int(draws[i]) % (n - i)
    order[i], order[j] = order[j], order[i]
  return order


def authors_pathological_indices(y_train: np.ndarray, y_test: np.ndarray, num_clients: int,
                                 seed: int, classes_per_client: int = 2,
                                 val_pool: int = AUTHORS_VAL_POOL, train_per_class: int = 10
                                 ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Per client, its (training, validation) training-set indices and its test indices,
  drawn as the FEDORA code's pFedHN loader draws them (module docstring)."""
  num_classes = int(max(y_train.max(), y_test.max())) + 1
  if (classes_per_client * num_clients) % num_classes:
    raise DataError(f"the authors' pathological split needs every class held equally"
                    f" often: {num_clients} clients x {classes_per_client} classes is not"
                    f" a multiple of {num_classes}")
  if not 0 < val_pool < len(y_train):
    raise DataError(f"the authors' split holds out {val_pool} training images for"
                    f" validation; the training set has {len(y_train)}")
  order = torch_randperm(len(y_train), seed)
  pools = {"train": order[:-val_pool], "val": order[-val_pool:]}
  labels = {"train": y_train[pools["train"]], "val": y_train[pools["val"]], "test": y_test}
  holders_per_class = classes_per_client * num_clients // num_classes
  numpy_rng = np.random.RandomState(seed)  # their global np.random after np.random.seed
  proportions = []
  for _ in range(num_classes):
    draw = numpy_rng.uniform(0.4, 0.6, size=holders_per_class)
    proportions.append(list(draw / draw.sum()))
  classes = [[(k * classes_per_client + j) % num_classes for j in range(classes_per_client)]
             for k in range(num_clients)]
  shares = [[proportions[c].pop() for c in held] for held in classes]
  python_rng = random.Random(seed)  # their `random` after random.seed(seed)
  per_split = {}
  for split in ("train", "val", "test"):
    by_class = [np.flatnonzero(labels[split] == c) for c in range(num_classes)]
    for positions in by_class:  # swapped in place, as a 1-D array allows
      python_rng.shuffle(positions)  # type: ignore[arg-type]
    counts = np.bincount(labels[split], minlength=num_classes)
    taken = []
    for held, share in zip(classes, shares):
      mine = []
      for c, p in zip(held, share):
        n = train_per_class if split == "train" else int(counts[c] * p)
        if n > len(by_class[c]):
          raise DataError(f"the authors' split: class {c} has {len(by_class[c])} {split}"
                          f" images left for a client that takes {n}")
        mine.append(by_class[c][:n])
        by_class[c] = by_class[c][n:]
      taken.append(np.concatenate(mine))
    per_split[split] = taken
  return [(pools["train"][per_split["train"][k]], pools["val"][per_split["val"][k]],
           per_split["test"][k]) for k in range(num_clients)]


def random_subset(dataset: ImageDataset, fraction: float, seed: int) -> ImageDataset:
  """A seeded random `fraction` of the training set and of the test set (at least one
  sample each), in their original order; its own stream, apart from the partition's."""
  rng = np.random.default_rng([seed, 2])

  def keep(n: int) -> np.ndarray:
    return np.sort(rng.choice(n, max(1, int(np.floor(fraction * n + 1e-9))), replace=False))

  train, test = keep(len(dataset.x_train)), keep(len(dataset.x_test))
  return dataset._replace(x_train=dataset.x_train[train], y_train=dataset.y_train[train],
                          x_test=dataset.x_test[test], y_test=dataset.y_test[test])


def class_counts(clients: list[Client], num_classes: int) -> np.ndarray:
  """[K, C] training samples of each class per client."""
  return np.stack([np.bincount(np.asarray(c.y_train, np.int64), minlength=num_classes)
                   [:num_classes] for c in clients]).astype(np.int32)


def make_partition(dataset: ImageDataset, num_clients: int, config: PartitionConfig,
                   seed: int = 0) -> Partition:
  """Cuts `dataset` into `num_clients` clients as `config` says (module docstring)."""
  _validate(dataset, num_clients, config)
  if config.data_fraction < 1.0:
    dataset = random_subset(dataset, config.data_fraction, seed)
    if num_clients > len(dataset.x_train):
      raise FieldError("partition", "data_fraction",
                       f"({config.data_fraction}) leaves {len(dataset.x_train)} training"
                       f" samples of {dataset.name} for {num_clients} clients")
  if config.kind == "rotation":
    train_per_client = config.train_per_client or 128
    val_per_client = config.val_per_client or 64
    if config.min_client_size > train_per_client:
      raise FieldError("partition", "min_client_size",
                       f"({config.min_client_size}) is more than the {train_per_client}"
                       " training samples a rotation client gets")
    if config.split == "authors":
      partition = authors_rotation_partition(dataset, num_clients, seed, train_per_client,
                                             val_per_client)
    else:
      partition = rotation_partition(dataset, num_clients, config.setting, seed,
                                     train_per_client, val_per_client)
    return partition._replace(class_counts=class_counts(partition.clients,
                                                        dataset.num_classes))
  if config.split == "authors":  # pathological (_validate)
    per_class = (10 if config.train_per_client is None  # their end_idx = 10
                 else config.train_per_client // config.classes_per_client)
    indices = authors_pathological_indices(dataset.y_train, dataset.y_test, num_clients,
                                           seed, config.classes_per_client,
                                           train_per_class=per_class)
    clients = [Client(x_train=dataset.x_train[t], y_train=dataset.y_train[t],
                      x_val=dataset.x_train[v], y_val=dataset.y_train[v],
                      x_test=dataset.x_test[e], y_test=dataset.y_test[e])
               for t, v, e in indices]
    return Partition(clients=clients, kind=config.kind,
                     class_counts=class_counts(clients, dataset.num_classes))
  rng = np.random.default_rng(seed)
  large = num_clients // 2 if config.setting == "imbalanced" else None
  weights = np.ones(num_clients)
  if large is not None:
    weights[large] = max(num_clients - 1, 1)
  train_sizes = np.bincount(dataset.y_train, minlength=dataset.num_classes)
  test_sizes = np.bincount(dataset.y_test, minlength=dataset.num_classes)

  if config.kind == "dirichlet":
    shares = _dirichlet_shares(rng, weights, train_sizes, test_sizes, config, large)
  else:
    if config.kind == "iid":
      holders = np.ones((num_clients, dataset.num_classes), bool)
    else:
      holders = _pathological_holders(rng, num_clients, dataset.num_classes,
                                      config.classes_per_client)
    shares = _equal_shares(holders, weights)
    problem = _size_problem(shares, train_sizes, test_sizes, config, large)
    if problem:
      raise ConfigError(f"{dataset.name}: {config.kind} partition into {num_clients}"
                        f" clients: {problem}")

  train_pools = _cut_indices(dataset.y_train, shares, rng)
  test_pools = _cut_indices(dataset.y_test, shares, rng)
  clients = []
  for k, (pool, test_idx) in enumerate(zip(train_pools, test_pools)):
    idx = rng.permutation(pool)
    if config.train_per_client is not None and k != large:
      n_val = _val_per_client(config)
      idx = idx[:config.train_per_client + n_val]
    else:
      n_val = _val_count(len(idx), config.val_fraction)
    val_idx, train_idx = idx[:n_val], idx[n_val:]
    clients.append(Client(
        x_train=dataset.x_train[train_idx], y_train=dataset.y_train[train_idx],
        x_val=dataset.x_train[val_idx], y_val=dataset.y_train[val_idx],
        x_test=dataset.x_test[test_idx], y_test=dataset.y_test[test_idx]))
  return Partition(clients=clients, angles=None, large_client=large, kind=config.kind,
                   class_counts=class_counts(clients, dataset.num_classes))


def _validate(dataset: ImageDataset, num_clients: int, config: PartitionConfig) -> None:
  if config.kind not in KINDS:
    raise ConfigError(f"unknown partition {config.kind!r}; known: {', '.join(KINDS)}")
  if config.setting not in SETTINGS:
    raise ConfigError(f"unknown setting {config.setting!r}; known: {', '.join(SETTINGS)}")
  if num_clients < 1:
    raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
  if num_clients > len(dataset.x_train):
    raise ConfigError(f"{dataset.name}: {num_clients} clients but only"
                      f" {len(dataset.x_train)} training samples")
  if config.split not in SPLITS:
    raise FieldError("partition", "split",
                     f"must be one of {', '.join(SPLITS)}, got {config.split!r}")
  if config.split == "authors" and config.kind not in ("rotation", "pathological"):
    raise FieldError("partition", "split",
                     f"authors: the FEDORA authors' sampling cuts rotated or pathological"
                     f" clients; the {config.kind} partition has only its own")
  if config.split == "authors" and config.kind == "pathological":
    if config.data_fraction < 1 or config.val_per_client is not None:
      raise FieldError("partition", "split",
                       "authors: the authors' pathological clients have their own"
                       " validation and test sizes; leave out --data_fraction and"
                       " --fixed_val_size")
    if (config.train_per_client is not None
        and config.train_per_client % config.classes_per_client):
      raise FieldError("partition", "train_per_client",
                       f"({config.train_per_client}) must be a multiple of the"
                       f" {config.classes_per_client} classes a client holds: the authors'"
                       " loader takes the same number of each")
  if config.split == "authors" and config.setting != "balanced":
    raise FieldError("partition", "split",
                     f"authors: the FEDORA authors' loader has no {config.setting} clients;"
                     " use the balanced setting")
  if config.min_client_size < 0:
    raise FieldError("partition", "min_client_size",
                     f"must be >= 0, got {config.min_client_size}")
  if not 0 < config.val_fraction < 1:
    raise FieldError("partition", "val_fraction",
                     f"must be in (0, 1), got {config.val_fraction}")
  if not 0 < config.data_fraction <= 1:
    raise FieldError("partition", "data_fraction",
                     f"must be in (0, 1], got {config.data_fraction}")
  if config.train_per_client is not None and config.train_per_client < 1:
    raise FieldError("partition", "train_per_client",
                     f"must be >= 1, got {config.train_per_client}")
  if config.val_per_client is not None and config.val_per_client < 1:
    raise FieldError("partition", "val_per_client",
                     f"must be >= 1, got {config.val_per_client}")
  if config.kind == "pathological" and not (
      1 <= config.classes_per_client <= dataset.num_classes):
    raise FieldError("partition", "classes_per_client",
                     f"must be between 1 and {dataset.num_classes} ({dataset.name}'s"
                     f" classes), got {config.classes_per_client}")
  if config.kind == "dirichlet" and not config.dirichlet_alpha > 0:
    raise FieldError("partition", "dirichlet_alpha",
                     f"must be > 0, got {config.dirichlet_alpha}")
  if config.kind == "dirichlet" and config.max_redraws < 1:
    raise ConfigError(f"max_redraws must be >= 1, got {config.max_redraws}")


def _val_per_client(config: PartitionConfig) -> int:
  """A fixed-size client's validation samples (config.train_per_client is set)."""
  assert config.train_per_client is not None
  return config.val_per_client or max(config.train_per_client // 2, 1)


def _val_count(pool_size, val_fraction: float):
  """Validation samples of a pool of `pool_size`: floor(size * fraction)."""
  return (np.floor(np.asarray(pool_size) * val_fraction + 1e-9)).astype(np.int64)


def _bounds(column_shares: np.ndarray, class_size: int) -> np.ndarray:
  """[K + 1] cut points of a class of `class_size` samples by clients' shares."""
  cumulative = np.minimum(np.cumsum(column_shares), 1.0)
  cuts = np.floor(cumulative * class_size + 1e-9).astype(np.int64)
  return np.concatenate([[0], np.minimum(cuts, class_size)])


def _cut_counts(shares: np.ndarray, class_sizes: np.ndarray) -> np.ndarray:
  """[K, C] samples of each class each client gets."""
  return np.stack([np.diff(_bounds(shares[:, c], n)) for c, n in enumerate(class_sizes)],
                  axis=1)


def _cut_indices(labels: np.ndarray, shares: np.ndarray,
                 rng: np.random.Generator) -> list[np.ndarray]:
  """Per client, the indices of its samples: each class shuffled, then cut by shares."""
  pools: list[list[np.ndarray]] = [[] for _ in range(shares.shape[0])]
  for c in range(shares.shape[1]):
    members = rng.permutation(np.flatnonzero(labels == c))
    bounds = _bounds(shares[:, c], len(members))
    for k in range(shares.shape[0]):
      pools[k].append(members[bounds[k]:bounds[k + 1]])
  return [np.concatenate(p) for p in pools]


def _equal_shares(holders: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """Each class shared among its holders in proportion to their weights."""
  mass = holders * weights[:, None]
  totals = mass.sum(axis=0, keepdims=True)
  return np.divide(mass, totals, out=np.zeros_like(mass, dtype=float), where=totals > 0)


def _pathological_holders(rng: np.random.Generator, num_clients: int, num_classes: int,
                          classes_per_client: int) -> np.ndarray:
  """[K, C] bool: client k holds classes k*c .. k*c+c-1 (mod C) of a seeded permutation."""
  order = rng.permutation(num_classes)
  holders = np.zeros((num_clients, num_classes), bool)
  for k in range(num_clients):
    holders[k, order[(k * classes_per_client + np.arange(classes_per_client)) % num_classes]] = True
  return holders


def _size_problem(shares: np.ndarray, train_sizes: np.ndarray, test_sizes: np.ndarray,
                  config: PartitionConfig, large: int | None) -> str | None:
  """Why these shares cannot give every client its splits, or None if they can."""
  pool = _cut_counts(shares, train_sizes).sum(axis=1)
  test = _cut_counts(shares, test_sizes).sum(axis=1)
  regular = np.arange(len(pool)) != (-1 if large is None else large)
  if config.train_per_client is not None:
    needed = config.train_per_client + _val_per_client(config)
    short = np.flatnonzero(regular & (pool < needed))
    if len(short):
      return (f"client {short[0]} gets {pool[short[0]]} training-set samples, fewer than"
              f" the {needed} (--train_per_client + --val_per_client) it needs"
              f" ({len(short)} client(s) short)")
    n_val = np.where(regular, _val_per_client(config), _val_count(pool, config.val_fraction))
    n_train = np.where(regular, config.train_per_client, pool - n_val)
  else:
    n_val = _val_count(pool, config.val_fraction)
    n_train = pool - n_val
  minimum = max(config.min_client_size, 1)
  for name, sizes, least in (("training", n_train, minimum), ("validation", n_val, 1),
                             ("test", test, 1)):
    short = np.flatnonzero(sizes < least)
    if len(short):
      return (f"client {short[0]} gets {sizes[short[0]]} {name} samples, fewer than"
              f" {least} ({len(short)} client(s) short)")
  return None


def _dirichlet_shares(rng: np.random.Generator, weights: np.ndarray,
                      train_sizes: np.ndarray, test_sizes: np.ndarray,
                      config: PartitionConfig, large: int | None) -> np.ndarray:
  """NIID-Bench's Dirichlet label skew, redrawn until every client meets the minimum."""
  num_clients, num_classes = len(weights), len(train_sizes)
  targets = train_sizes.sum() * weights / weights.sum()
  problem = None
  for _ in range(config.max_redraws):
    shares = np.zeros((num_clients, num_classes))
    counts = np.zeros(num_clients)
    for c in range(num_classes):
      p = rng.dirichlet(np.full(num_clients, config.dirichlet_alpha)) * weights
      p = p * (counts < targets)  # clients at their target size take no more
      if p.sum() <= 0:
        p = weights.astype(float)
      shares[:, c] = p / p.sum()
      counts += np.diff(_bounds(shares[:, c], train_sizes[c]))
    problem = _size_problem(shares, train_sizes, test_sizes, config, large)
    if problem is None:
      return shares
  raise ConfigError(
      f"dirichlet partition (alpha {config.dirichlet_alpha}) into {num_clients} clients:"
      f" no draw of {config.max_redraws} met the sizes, e.g. {problem}; use fewer clients,"
      " a larger --dirichlet_alpha or a smaller --min_client_size")
