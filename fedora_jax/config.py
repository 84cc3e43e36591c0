"""ExperimentConfig: what one experiment computes, as nested typed configs, and its identity.

  config = ExperimentConfig(data=DataConfig(dataset="rmnist", num_clients=12),
                            train=TrainConfig(rounds=50),
                            algorithm=AlgorithmConfig("fedavg", ala=AlaConfig()))

The config is the single source of truth: `train.train_and_evaluate` runs it, the command
line and the sweeps build it from flat settings (fedora_jax/settings.py), and a workdir's
run_config.json records it (`record`). Its identity (`identity`) is every field but
those declared `outside` the identity in their metadata (where the data sits, how often
to log, how clients are batched, how many rounds: a longer run extends a shorter one);
a rerun whose identity matches the record resumes from the workdir's checkpoints. A
field added later counts, in a record made before it existed, as its default, so adding
one with a default that keeps the old numbers keeps every workdir; changing a default
means a new SCHEMA_VERSION and a migration of the kept records (scripts/).
"""

import dataclasses
import json
from typing import Any, ClassVar, cast

from fedora_jax import algorithms
from fedora_jax.algorithms.ala import AlaConfig
from fedora_jax.algorithms.byzantine import AttackConfig
from fedora_jax.algorithms.confree import ConfreeConfig
from fedora_jax.algorithms.dp import DpConfig
from fedora_jax.algorithms.robust import RobustConfig
from fedora_jax.data import datasets
from fedora_jax.data.partitions import PartitionConfig
from fedora_jax.simulation import TrainConfig

# run_config.json's layout. 1: the flag-named records before 2026-12-05.
SCHEMA_VERSION = 2

# Field metadata: OUTSIDE marks a field outside the identity; SETTING names the flat
# setting (the flag) of a field whose name differs from it.
OUTSIDE = "outside_identity"
SETTING = "setting"


def field(default: Any, *, outside: bool = False, setting: str | None = None) -> Any:
  """A config field: `outside` the identity (it changes no number the run computes), or
  set by a flat setting of another name than its own."""
  metadata = {**({OUTSIDE: True} if outside else {}), **({SETTING: setting} if setting else {})}
  return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The federated dataset: which data, how many clients, how they are cut."""
  dataset: str = "rmnist"
  data_dir: str | None = field(None, outside=True)  # the data root; moving it keeps a run
  data_source: str = "files"        # or "tfds"
  num_clients: int | None = None    # None: the dataset's (36 for rmnist)
  setting: str = "balanced"         # client sizes: balanced or imbalanced
  partition: PartitionConfig | None = None  # None: the dataset's default
  data_seed: int | None = None      # None: train.seed
  max_pad_ratio: float = 2.0
  # Training samples held out of every client as a public set (data/public.py); None:
  # the size the algorithm declares (algorithms.public_size), none if it declares none.
  public_size: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str | None = field(None, setting="model")  # None: the dataset's
  hidden: tuple[int, ...] = (128, 128)              # the MLP's hidden widths


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """The algorithm, its hyperparameters and the plug-ins around it (each None: off)."""
  name: str = field("fedora", setting="algorithm")
  config: Any = None  # its registered NamedTuple config; None: the registry's default
  ala: AlaConfig | None = None               # FedALA's ALA before the client update
  # ConFREE or a robust rule (robust.py) in place of the server mean
  aggregation: ConfreeConfig | RobustConfig | None = None
  attack: AttackConfig | None = None         # Byzantine clients (byzantine.py)
  dp: DpConfig | None = None                 # user-level DP around the server mean (dp.py)


@dataclasses.dataclass(frozen=True)
class NewClientsConfig:
  """FEDORA's Algorithm 2: clients held out of training, served afterwards."""
  count: int = field(0, setting="new_clients")
  epochs: int = field(5, setting="new_client_epochs")  # fine-tuning epochs with labels


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """What one experiment computes. Defaults: the paper's rotated-MNIST FEDORA run."""
  SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION
  data: DataConfig = DataConfig()
  model: ModelConfig = ModelConfig()
  train: TrainConfig = TrainConfig()
  algorithm: AlgorithmConfig = AlgorithmConfig()
  new_clients: NewClientsConfig = NewClientsConfig()
  reference: str | None = field(None, outside=True)  # a LOCAL run's results.json
  checkpoint_every: int = field(50, outside=True)     # 0: no checkpoints
  keep_checkpoints: bool = field(True, outside=True)  # False: deleted once finished


def plugins(algorithm: AlgorithmConfig) -> dict[str, Any]:
  """The plug-ins that are on: field name -> its config."""
  return {f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)
          if f.name not in ("name", "config") and getattr(algorithm, f.name) is not None}


def runnable(algorithm: AlgorithmConfig) -> Any:
  """What algorithms.make takes: the config, or an algorithms.Plugged with the plug-ins."""
  on = plugins(algorithm)
  return algorithms.Plugged(algorithm.config, **on) if on else algorithm.config


def resolve(config: ExperimentConfig) -> ExperimentConfig:
  """The config with every default it leaves to the code filled in (the registry's
  algorithm config, the dataset's partition and model, the data seed), so two configs
  that compute the same run read the same. Checks nothing else (train.check_config)."""
  algorithm = config.algorithm
  name = algorithms.canonical_name(algorithm.name)
  own = algorithm.config
  if isinstance(own, algorithms.Plugged):  # a Plugged given as the config: its parts
    algorithm = dataclasses.replace(
        algorithm, **{k: v for k, v in own._asdict().items() if k != "config" and v})
    own = own.config
  algorithm = dataclasses.replace(
      algorithm, name=name,
      config=own if own is not None else algorithms.default_config(name, config.train))
  data = config.data
  spec = datasets.get_spec(data.dataset)
  # Datasets whose clients are given by the data (years, users) have no partition.
  partition = (None if datasets.natural_users(data.dataset) else
               data.partition or datasets.default_partition(data.dataset, data.setting))
  data = dataclasses.replace(data, partition=partition, data_seed=(
      config.train.seed if data.data_seed is None else data.data_seed),
      public_size=(algorithms.public_size(name, algorithm.config)
                   if data.public_size is None else data.public_size))
  model = dataclasses.replace(config.model, name=config.model.name or spec.model,
                              hidden=tuple(config.model.hidden))
  return dataclasses.replace(config, data=data, model=model, algorithm=algorithm)


def reference_config(config: ExperimentConfig) -> ExperimentConfig:
  """The LOCAL run every run is measured against: the same data, model and training."""
  return dataclasses.replace(config, algorithm=AlgorithmConfig(algorithms.REFERENCE))


def as_dict(value: Any) -> Any:
  """A config (or any part of it) as JSON's types: dicts, lists, numbers, strings."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: as_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
    return {k: as_dict(v) for k, v in zip(cast(Any, value)._fields, value)}
  if isinstance(value, (tuple, list)):
    return [as_dict(v) for v in value]
  return json.loads(json.dumps(value, default=str))


def record(config: ExperimentConfig) -> dict:
  """run_config.json: the resolved config, every field, under its schema version."""
  return {"schema_version": SCHEMA_VERSION, "config": as_dict(resolve(config))}


def _strip(tree: dict, template: Any) -> dict:
  """`tree` (a config as a dict) without the fields `template`'s classes declare outside
  the identity; the algorithm's own config has none."""
  out = dict(tree)
  for f in dataclasses.fields(template):
    if f.metadata.get(OUTSIDE):
      out.pop(f.name, None)
      continue
    part = getattr(template, f.name)
    if dataclasses.is_dataclass(part) and isinstance(out.get(f.name), dict):
      out[f.name] = _strip(out[f.name], part)
  return out


# AlgorithmConfig's plug-ins: one may read what its host ignores (a robust mean, the weights).
PLUG_INS = ("ala", "aggregation", "attack", "dp")


def _identity_of(tree: dict) -> dict:
  """The identity of a config given as a dict (a record, or as_dict of a config)."""
  identity = _strip(tree, ExperimentConfig())
  name = identity.get("algorithm", {}).get("name")
  plugged = any(identity.get("algorithm", {}).get(part) for part in PLUG_INS)
  ignored = algorithms.get(name).ignores if name in algorithms.REGISTRY and not plugged else ()
  if ignored:  # training fields the algorithm never reads: one run serves every value
    defaults = as_dict(TrainConfig())
    identity["train"] = {**identity["train"], **{k: defaults[k] for k in ignored}}
  return identity


def identity(config: ExperimentConfig) -> dict:
  """What the run computes (resolved, every field but those outside the identity)."""
  return _identity_of(as_dict(resolve(config)))


def _defaults(value: Any) -> Any:
  """Each field's default along `value`'s structure (the values a record made before the
  field existed ran with)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    out = {}
    for f in dataclasses.fields(value):
      part = getattr(value, f.name)
      if dataclasses.is_dataclass(part) or hasattr(part, "_fields"):
        out[f.name] = _defaults(part)
      else:
        out[f.name] = as_dict(f.default if f.default is not dataclasses.MISSING else None)
    return out
  if hasattr(value, "_fields"):  # a NamedTuple: its class's defaults
    return {k: as_dict(v) for k, v in cast(Any, type(value))._field_defaults.items()}
  return as_dict(value)


_ABSENT = object()


def _show(value: Any) -> str:
  return "absent" if value is _ABSENT else repr(value)


def _compare(recorded: dict, current: dict, defaults: Any, path: str) -> list[str]:
  if "name" in current and recorded.get("name", current["name"]) != current["name"]:
    # Another algorithm (or model): its name says it, not each of its fields.
    return [f"{path}name={recorded['name']!r} (now {current['name']!r})"]
  differences = []
  for key in sorted(set(recorded) | set(current)):
    default = defaults.get(key, _ABSENT) if isinstance(defaults, dict) else _ABSENT
    ours = current.get(key, _ABSENT)
    theirs = recorded.get(key, default)  # added since the record: it ran at the default
    if isinstance(theirs, dict) and isinstance(ours, dict):
      differences += _compare(theirs, ours, default, f"{path}{key}.")
    elif theirs != ours:
      differences.append(f"{path}{key}={_show(theirs)} (now {_show(ours)})")
  return differences


def differences(recorded: dict, config: ExperimentConfig) -> list[str]:
  """How the run a record (run_config.json, this SCHEMA_VERSION) holds differs from
  `config`'s in identity: "train.lr=0.005 (now 0.1)" per field; empty: the same run."""
  resolved = resolve(config)
  return _compare(_identity_of(recorded.get("config", {})), _identity_of(as_dict(resolved)),
                  _defaults(resolved), "")


def outside_identity(path: tuple[str, ...]) -> bool:
  """Whether the field at `path` ("data", "data_dir") is outside the identity."""
  node: Any = ExperimentConfig()
  for name in path:
    f = {f.name: f for f in dataclasses.fields(node)}[name]
    if f.metadata.get(OUTSIDE):
      return True
    node = getattr(node, name)
  return False
