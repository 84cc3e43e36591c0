"""Dataset registry: a name picks the source, the partition and the default model."""

import logging
from typing import Callable, NamedTuple

import numpy as np

from fedora_jax.data import grouped as grouped_lib
from fedora_jax.data import natural as natural_lib
from fedora_jax.data import synthetic as synthetic_lib
from fedora_jax.data.client_data import FederatedData, stack_clients
from fedora_jax.data.gtsrb import load_gtsrb
from fedora_jax.data.leaf import load_leaf
from fedora_jax.data.tfds_source import load_tfds_dataset
from fedora_jax.data.yearbook import load_yearbook
from fedora_jax.data import root as data_root
from fedora_jax.data.cifar import load_cifar10, load_cifar100
from fedora_jax.data.partitions import Partition, PartitionConfig, make_partition
from fedora_jax.data.public import hold_out_public
from fedora_jax.data.sources import ImageDataset, load_fashion_mnist, load_mnist
from fedora_jax.data.tinyimagenet import load_tinyimagenet
from fedora_jax.data.flowers102 import load_flowers102
from fedora_jax.data.agnews import load_agnews
from fedora_jax.errors import ConfigError, FieldError

logger = logging.getLogger("fedora_jax")


class DatasetSpec(NamedTuple):
  description: str
  load_source: Callable[[str | None], ImageDataset] | None  # None: see load_groups
  num_clients: int | None  # the paper's default; None: one client per group in the data
  model: str
  paper_table: str
  task: str = "classification"  # or "regression" (one model output, MSE, MAE)
  tfds_name: str | None = None  # the TFDS dataset --data_source=tfds reads instead
  # Datasets whose clients are given by the data (one per year): loads them grouped.
  load_groups: Callable[[str | None], grouped_lib.GroupedDataset] | None = None
  # The default --partition (fedora_jax/data/partitions.py KINDS) and its class count.
  partition: str = "rotation"
  classes_per_client: int = 2
  generated: bool = False  # clients generated from the data seed (synthetic): no source
  # Datasets of real users (fedora_jax/data/natural.py): (data_dir, K, seed) -> the
  # first K users as clients, each with its own published test samples where it has some.
  load_users: Callable[[str | None, int, int], natural_lib.NaturalClients] | None = None


DATA_SOURCES = ("files", "tfds")


DATASETS: dict[str, DatasetSpec] = {
    "rmnist": DatasetSpec(
        description="Rotated MNIST: client i rotated by 360*i/K degrees",
        load_source=load_mnist, num_clients=36, model="mlp",
        paper_table="FEDORA Table 1 (balanced), Table 3 (imbalanced)",
        tfds_name="mnist"),
}

# Plain and rotated image datasets of FEDORA and the papers it is compared with.
DATASETS.update({
    "mnist": DatasetSpec(
        description="MNIST, label-skew partitions (default iid; --partition=dirichlet)",
        load_source=load_mnist, num_clients=100, model="mlp", partition="iid",
        paper_table="- (Dirichlet label skew as in FedALA / parameter coaching)",
        tfds_name="mnist"),
    "fmnist": DatasetSpec(
        description="Fashion-MNIST, label-skew partitions (default iid;"
                    " --partition=dirichlet)",
        load_source=load_fashion_mnist, num_clients=100, model="mlp", partition="iid",
        paper_table="- (Dirichlet label skew as in parameter coaching, Tables 1-2)",
        tfds_name="fashion_mnist"),
    "rfmnist": DatasetSpec(
        description="Rotated Fashion-MNIST: client i rotated by 360*i/K degrees",
        load_source=load_fashion_mnist, num_clients=72, model="mlp",
        paper_table="FEDORA Table 1 (RFMNIST)", tfds_name="fashion_mnist"),
    "cifar10": DatasetSpec(
        description="CIFAR-10, pathological: 2 classes per client",
        load_source=load_cifar10, num_clients=10, model="cnn", partition="pathological",
        classes_per_client=2, paper_table="FEDORA Table 1 (CIFAR-10)",
        tfds_name="cifar10"),
    "cifar100": DatasetSpec(
        description="CIFAR-100 (100 fine classes), Dirichlet label skew (parameter"
                    " coaching: 10 clients, alpha 0.1 and 0.3)",
        load_source=load_cifar100, num_clients=10, model="cnn", partition="dirichlet",
        paper_table="- (parameter coaching Table 1 uses ResNet-18, not shipped here)",
        tfds_name="cifar100"),
})

# FedALA's (Zhang et al., AAAI 2023) and ConFREE's columns whose data is not held here:
# read from their official distributions in the data root (no download; docs/datasets.md).
DATASETS.update({
    "tinyimagenet": DatasetSpec(
        description="Tiny-ImageNet (200 classes, 64x64 RGB; its val set is the test set),"
                    " Dirichlet label skew (FedALA: 20 clients, alpha 0.1)",
        load_source=load_tinyimagenet, num_clients=20, model="fedavg_cnn",
        partition="dirichlet",
        paper_table="FedALA Table 2 (Tiny-ImageNet, 4-layer CNN; ResNet-18: --model=resnet18)"),
    "agnews": DatasetSpec(
        description="AG News (4 classes) as 200 token ids per article (vocabulary of the"
                    " training set), Dirichlet label skew (FedALA: 20 clients, alpha 0.1)",
        load_source=load_agnews, num_clients=20, model="fasttext", partition="dirichlet",
        paper_table="FedALA Table 2 (AG News, fastText)"),
    "flowers102": DatasetSpec(
        description="Oxford Flowers102 (102 classes, resized to 64x64 RGB as PFLlib does;"
                    " official train+val / test), Dirichlet label skew",
        load_source=load_flowers102, num_clients=20, model="fedavg_cnn",
        partition="dirichlet",
        paper_table="ConFREE Table 2 (Flowers102, C = 20 and 60; the poster names no"
                    " model: PFLlib's 4-layer CNN here)"),
})

# The remaining FEDORA datasets: no public source to download them from (see
# docs/datasets.md); put them in the data root (--data_dir, fedora_jax/data/root.py).
DATASETS.update({
    "gtsrb": DatasetSpec(
        description="Rotated GTSRB traffic signs (43 classes, 32x32 RGB): client i"
                    " rotated by 360*i/K degrees",
        load_source=load_gtsrb, num_clients=10, model="cnn", paper_table="FEDORA"),
    "yearbook": DatasetSpec(
        description="Yearbook portraits, gender (M/F), one client per year 1930-2013",
        load_source=None, load_groups=load_yearbook, num_clients=84, model="cnn",
        paper_table="FEDORA"),
    "leaf": DatasetSpec(
        description="Leaf hyperspectral reflectance -> trait (regression, MAE), one"
                    " client per collection year",
        load_source=None, load_groups=load_leaf, num_clients=None, model="mlp",
        paper_table="FEDORA Table 2 (agriculture)", task="regression"),
})

# Generated on the spot, any number of clients.
DATASETS["synthetic"] = DatasetSpec(
    description="Synthetic(alpha, beta) of FedProx / LEAF: 60 features, 10 classes, each"
                " client its own softmax model and feature mean (--synthetic_alpha,"
                " --synthetic_beta), lognormal client sizes; generated from the data seed",
    load_source=None, num_clients=100, model="mlp", partition="synthetic",
    paper_table="- (FedProx Section 5.1; client scaling, docs/performance.md)",
    generated=True)


# One client per real user, read from the files each is published in.
DATASETS.update({
    "femnist": DatasetSpec(
        description="FEMNIST (LEAF): handwritten digits and letters, 62 classes, one"
                    " client per writer",
        load_source=None, load_users=natural_lib.load_femnist, num_clients=100,
        model="fedavg_cnn",
        paper_table="- (LEAF; the CNN is FedALA's 4-layer one, LEAF's has Dense 2048)"),
    "shakespeare": DatasetSpec(
        description="Shakespeare (LEAF): the next character after 80, one client per"
                    " speaking role",
        load_source=None, load_users=natural_lib.load_shakespeare, num_clients=100,
        model="char_lstm",
        paper_table="- (LEAF; FedAvg's and LEAF's character LSTM, models/char_lstm.py)"),
    "cifar100_pachinko": DatasetSpec(
        description="CIFAR-100 as TFF splits it: 500 clients of 100 images, Pachinko"
                    " allocation over coarse then fine labels",
        load_source=None, load_users=natural_lib.load_cifar100_pachinko, num_clients=500,
        model="fedavg_cnn",
        paper_table="- (Reddi et al. 2021 use ResNet-18 with group norm)"),
})


def natural_users(name: str) -> bool:
  """Whether `name`'s clients are given by the data (years, users): no partition."""
  spec = get_spec(name)
  return spec.load_groups is not None or spec.load_users is not None


def get_spec(name: str) -> DatasetSpec:
  if name not in DATASETS:
    raise ConfigError(f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
  return DATASETS[name]


def default_partition(name: str, setting: str = "balanced", **overrides) -> PartitionConfig:
  """`name`'s client partition (its kind and class count), `overrides` on top."""
  spec = get_spec(name)
  fields = dict(kind=spec.partition, setting=setting,
                classes_per_client=spec.classes_per_client)
  return PartitionConfig(**{**fields, **overrides})


class FederatedDataset(NamedTuple):
  data: FederatedData                 # the clients that train
  partition: Partition                # every client, held-out ones included
  source: ImageDataset                # a GroupedDataset for clients given by the data
  client_ids: np.ndarray              # [K] partition index of each training client
  new_data: FederatedData | None      # clients held out to join after training
  new_client_ids: np.ndarray          # [N] their partition indices
  groups: np.ndarray | None = None    # [K_all] each partition client's group (its year)
                                      # for datasets whose clients are given by the data


def load_source(name: str, data_dir: str | None, data_source: str = "files") -> ImageDataset:
  """`name`'s centralised source from its files, or (data_source="tfds") from TFDS.

  `data_dir`: the data root (fedora_jax/data/root.py; None: the default one), or the
  dataset's own folder; with "tfds", TFDS's data_dir.
  """
  spec = get_spec(name)
  if data_source not in DATA_SOURCES:
    raise ConfigError(f"unknown data source {data_source!r}; known: {', '.join(DATA_SOURCES)}")
  if data_source == "tfds":
    if spec.tfds_name is None:
      supported = sorted(k for k, v in DATASETS.items() if v.tfds_name is not None)
      raise FieldError("experiment", "data_source",
                       f"tfds: {name} has no TFDS source; datasets that have one:"
                       f" {', '.join(supported)}")
    tfds_dir = data_root.tfds_data_dir(spec.tfds_name, data_dir)
    return load_tfds_dataset(spec.tfds_name, tfds_dir, name=f"{spec.tfds_name} (TFDS)")
  if spec.generated:
    raise ConfigError(f"{name}: its clients are generated; it has no centralised source")
  if spec.load_source is None:
    raise ConfigError(f"{name}: its clients are given by the data (its groups); it has no"
                      " centralised source")
  return spec.load_source(data_dir)


def default_num_clients(name: str, data_dir: str | None) -> int:
  """The paper's client count, or for a dataset of groups without one, its group count."""
  spec = get_spec(name)
  if spec.num_clients is not None:
    return spec.num_clients
  assert spec.load_groups is not None  # a dataset without a client count has groups
  return len(spec.load_groups(data_dir).groups)


def _build_grouped(spec: DatasetSpec, name: str, data_dir: str | None, num_clients: int,
                   setting: str, seed: int, data_source: str):
  """Clients given by the data: the first `num_clients` groups, split and standardized."""
  if data_source != "files":
    raise FieldError("experiment", "data_source",
                     f"{data_source}: {name} is read from its files only")
  if setting != "balanced":
    raise FieldError("experiment", "setting",
                     f"{setting}: {name}'s clients are its years, with the sizes the data"
                     " gives them; use the default, balanced")
  assert spec.load_groups is not None  # called for datasets of groups only
  source = spec.load_groups(data_dir)
  if source.task != spec.task:
    raise ConfigError(f"{name}: the loader gives a {source.task} task, the registry says"
                      f" {spec.task}")
  clients, stats = grouped_lib.standardize(
      grouped_lib.group_clients(source, num_clients, seed))
  if "y_std" in stats:
    logger.info("%s: targets standardized with the training mean %.6g and std %.6g;"
                " MAE is in units of that std", name, stats["y_mean"], stats["y_std"])
  partition = Partition(clients=clients, kind="groups")  # no angles: clients are years
  return source, partition, source.groups[:num_clients]


def _build_users(spec: DatasetSpec, name: str, data_dir: str | None, num_clients: int,
                 setting: str, seed: int, data_source: str):
  """Real users: the first `num_clients` users of the published files."""
  if data_source != "files":
    raise FieldError("experiment", "data_source",
                     f"{data_source}: {name} is read from its published files only")
  if setting != "balanced":
    raise FieldError("experiment", "setting",
                     f"{setting}: {name}'s clients are its users, with the sizes the data"
                     " gives them; use the default, balanced")
  assert spec.load_users is not None  # called for datasets of users only
  users = spec.load_users(data_dir, num_clients, seed)
  # Each user's training samples per class: its label skew, reported per client.
  counts = np.stack([np.bincount(c.y_train, minlength=users.source.num_classes)
                     for c in users.clients])
  return (users.source, Partition(clients=users.clients, kind="users", class_counts=counts),
          users.user_ids)


def synthetic_config(partition: PartitionConfig | None) -> synthetic_lib.SyntheticConfig:
  """The generator's parameters a partition config carries (defaults: Synthetic(1, 1))."""
  p = partition or PartitionConfig(kind="synthetic")
  return synthetic_lib.SyntheticConfig(
      alpha=p.synthetic_alpha, beta=p.synthetic_beta, size_mu=p.synthetic_size_mu,
      size_sigma=p.synthetic_size_sigma)


def _build_synthetic(partition_config: PartitionConfig | None, num_clients: int,
                     setting: str, seed: int, data_source: str
                     ) -> tuple[ImageDataset, Partition]:
  """Clients 0..num_clients-1 of Synthetic(alpha, beta), each from (seed, its index)."""
  if data_source != "files":
    raise FieldError("experiment", "data_source", f"{data_source}: synthetic is generated")
  if setting != "balanced":
    raise FieldError("experiment", "setting", f"{setting}: synthetic's client sizes come"
                     " from its generator (--synthetic_size_mu, --synthetic_size_sigma)")
  if partition_config is not None and partition_config.kind not in (None, "synthetic"):
    raise FieldError("experiment", "partition", f"{partition_config.kind}: synthetic's"
                     " clients are generated, not partitioned")
  config = synthetic_config(partition_config)
  clients = synthetic_lib.make_clients(config, num_clients, seed)
  empty = np.zeros((0, synthetic_lib.NUM_FEATURES), np.float32)
  source = ImageDataset(name=f"Synthetic({config.alpha:g}, {config.beta:g})",
                        x_train=empty, y_train=np.zeros(0, np.int32), x_test=empty,
                        y_test=np.zeros(0, np.int32), num_classes=synthetic_lib.NUM_CLASSES)
  return source, Partition(clients=clients, kind="synthetic")


def held_out_clients(num_clients: int, num_new: int, seed: int) -> np.ndarray:
  """Which clients join only after training: a seeded random choice, sorted."""
  if num_new < 0:
    raise FieldError("experiment", "new_clients", f"must be >= 0, got {num_new}")
  if num_new >= num_clients:
    raise FieldError("experiment", "new_clients",
                     f"({num_new}) leaves no client to train of the {num_clients}")
  rng = np.random.default_rng([seed, 1])
  return np.sort(rng.choice(num_clients, num_new, replace=False))


def build_federated_dataset(name: str, data_dir: str | None, num_clients: int,
                            setting: str, seed: int, max_pad_ratio: float = 2.0,
                            new_clients: int = 0, train_per_client: int = 128,
                            val_per_client: int = 64,
                            data_source: str = "files",
                            partition_config: PartitionConfig | None = None,
                            public_size: int = 0) -> FederatedDataset:
  """Loads `name`'s source files, partitions them and stacks the clients in size buckets.

  With `new_clients` = N > 0, N of the `num_clients` clients are held out of training
  (FEDORA's Algorithm 2); they come back stacked on their own in `new_data`.
  `train_per_client` / `val_per_client`: a regular client's sizes (the paper's 128 / 64);
  smaller ones let K grow past what the training set holds at full size (benchmarks).
  `data_source`: "files" (the dataset's own files) or "tfds" (prepared TFDS data).
  `partition_config`: how to cut the clients (default: the dataset's partition, with
  `setting`, `train_per_client` and `val_per_client`); its `kind` None means the dataset's.
  `public_size` > 0: that many training samples held out of every client as the public
  set (data/public.py), in the training clients' `data.public`.
  """
  spec = get_spec(name)
  new_ids = held_out_clients(num_clients, new_clients, seed)
  groups = None
  public = None
  if public_size and (spec.generated or natural_users(name)):
    raise FieldError("experiment", "public_size",
                     f"{name}'s clients are not cut from one training split, so it has no"
                     " slice to hold out as a public set")
  if spec.generated:
    source, partition = _build_synthetic(partition_config, num_clients, setting, seed,
                                         data_source)
  elif spec.load_users is not None:
    source, partition, groups = _build_users(spec, name, data_dir, num_clients, setting,
                                             seed, data_source)
  elif spec.load_groups is not None:
    source, partition, groups = _build_grouped(spec, name, data_dir, num_clients, setting,
                                               seed, data_source)
  else:
    source = load_source(name, data_dir, data_source)
    if public_size:
      source, public = hold_out_public(source, public_size, seed)
    config = partition_config or PartitionConfig(
        kind=spec.partition, classes_per_client=spec.classes_per_client,
        train_per_client=train_per_client, val_per_client=val_per_client)
    kind = config.kind or spec.partition
    if kind != "rotation" and partition_config is None:
      config = config._replace(train_per_client=None, val_per_client=None)
    partition = make_partition(source, num_clients,
                               config._replace(kind=kind, setting=setting), seed)
  train_ids = np.setdiff1d(np.arange(num_clients), new_ids)
  stack = lambda ids: stack_clients([partition.clients[k] for k in ids],
                                    source.num_classes, max_pad_ratio)
  return FederatedDataset(data=stack(train_ids)._replace(public=public),
                          partition=partition, source=source,
                          client_ids=train_ids,
                          new_data=stack(new_ids) if len(new_ids) else None,
                          new_client_ids=new_ids, groups=groups)


def describe(data: FederatedData) -> str:
  sizes = data.split_sizes("train")
  return (f"{data.num_clients} clients in {len(data.buckets)} size bucket(s);"
          f" train samples per client: min {sizes.min()}, median {int(np.median(sizes))},"
          f" max {sizes.max()}")
