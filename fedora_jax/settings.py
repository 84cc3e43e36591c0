"""Flat settings -> ExperimentConfig: the vocabulary of the command line's flags and of the
sweeps' tables (experiments/paper/*.json), one name per setting.

  config = settings.from_settings({"dataset": "rmnist", "algorithm": "fedprox",
                                   "fedprox_mu": 0.1, "rounds": 50})

A section field's setting is its own name (--lr: train.lr, --data_seed: data.data_seed)
unless its metadata names another (config.field(setting=...): --model, --new_clients),
so a field added to a section is a setting at once. The others: the partition's fields
(PARTITION), each registered algorithm's hyperparameters (--<algorithm>_<field>, or the
registry's own name; --<algorithm>_variant picks a preset) and the plug-ins (--ala with
--ala_*, --aggregation=confree with --confree_*, --aggregation=<robust rule> with
--robust_*, --attack with --attackers, --attackers_sampled and --attack_*). An unset setting (None) takes the
config's default; an algorithm's settings count only when it is the one chosen.
"""

import dataclasses
import functools
from typing import Any, Mapping, cast

import jax

from fedora_jax import algorithms
from fedora_jax.algorithms import ala as ala_lib
from fedora_jax.algorithms import byzantine as byzantine_lib
from fedora_jax.algorithms import confree as confree_lib
from fedora_jax.algorithms import dp as dp_lib
from fedora_jax.algorithms import robust as robust_lib
from fedora_jax.config import SETTING, AlgorithmConfig, ExperimentConfig, outside_identity
from fedora_jax.data import datasets
from fedora_jax.errors import ConfigError
from fedora_jax.models import default_client_chunk, default_eval_batch_size

# The partition's settings -> their PartitionConfig fields (data.partition).
PARTITION = {"partition": "kind", "split": "split",
             "classes_per_client": "classes_per_client", "dirichlet_alpha": "dirichlet_alpha",
             "min_client_size": "min_client_size", "fixed_train_size": "train_per_client",
             "fixed_val_size": "val_per_client", "val_fraction": "val_fraction",
             "data_fraction": "data_fraction",
             **{f"synthetic_{f}": f"synthetic_{f}"
                for f in ("alpha", "beta", "size_mu", "size_sigma")}}
# Plug-in switch -> (AlgorithmConfig field, its config class, its settings' prefix, the
# value that turns it on). FedALA's own ALA settings are the --ala_* too.
PLUGINS = {"ala": ("ala", ala_lib.AlaConfig, "ala", True),
           "aggregation": ("aggregation", confree_lib.ConfreeConfig, "confree", "confree")}
# Plug-ins whose switch's value is a field of their config: switch ->
# (AlgorithmConfig field, its config class, the field the switch's value fills, the values
# that turn it on, its settings' prefix, its settings named otherwise than
# <prefix>_<field>). --aggregation=<rule> with --robust_*; --attack=<attack> with
# --attackers, --attackers_sampled and --attack_*.
CHOSEN_PLUGINS = {
    "aggregation": ("aggregation", robust_lib.RobustConfig, "rule", robust_lib.RULES,
                    "robust", {}),
    "attack": ("attack", byzantine_lib.AttackConfig, "attack", byzantine_lib.ATTACKS, "attack",
               {"fraction": "attackers", "sampled": "attackers_sampled"})}
# User-level DP (algorithms/dp.py): on with any of its settings, each a DpConfig
# field a user sets (--dp_clip_norm, --dp_target_epsilon, ...); the run fills the others.
DP_SETTINGS = {f"dp_{field}": field for field in dp_lib.FLAG_HELP}


def fields_of(config_class: Any) -> tuple[str, ...]:
  """The fields of an algorithm's or a plug-in's NamedTuple config class."""
  return tuple(cast(Any, config_class)._fields)


# Training fields whose default depends on the model and the platform (models.py).
_PLATFORM_DEFAULTS = {"client_chunk": default_client_chunk,
                      "eval_batch_size": default_eval_batch_size}


def setting_name(owner: str, field: str) -> str:
  """The setting of an algorithm's or a plug-in's field: <owner>_<field>, unless the
  registry names it otherwise (coaching's lambda: coach_lambda)."""
  if owner in algorithms.REGISTRY:
    return algorithms.get(owner).flag_names.get(field, f"{owner}_{field}")
  for switch, (_, _, chosen, _, prefix, renamed) in CHOSEN_PLUGINS.items():
    if owner == prefix:  # the field the switch fills is the switch (--attack), --attackers
      return switch if field == chosen else renamed.get(field, f"{owner}_{field}")
  return f"{owner}_{field}"


@functools.cache
def section_settings() -> dict[str, tuple[str, ...]]:
  """Setting -> the path of the config field it sets, for every field of the config's
  sections and its own fields (the algorithm and the partition have their own)."""
  paths: dict[str, tuple[str, ...]] = {}
  for f in dataclasses.fields(ExperimentConfig):
    section = f.default
    if f.name == "algorithm":
      continue
    if dataclasses.is_dataclass(section):
      for g in dataclasses.fields(section):
        if g.name != "partition":
          paths[g.metadata.get(SETTING, g.name)] = (f.name, g.name)
    else:
      paths[f.metadata.get(SETTING, f.name)] = (f.name,)
  return paths


@functools.cache
def algorithm_settings() -> dict[str, str]:
  """Each algorithm's own setting -> the algorithm: its hyperparameters (those not taken
  from the client training) and, with presets, --<algorithm>_variant."""
  owner = {}
  for name, registered in algorithms.REGISTRY.items():
    if registered.presets:
      owner[f"{name}_variant"] = name
    for field in fields_of(registered.config_class):
      if field not in registered.train_fields:
        owner[setting_name(name, field)] = name
  return owner


@functools.cache
def plugin_settings() -> dict[str, str]:
  """Each plug-in's setting (--ala_s, --confree_c) -> its switch (ala, aggregation)."""
  return {setting_name(prefix, field): switch
          for switch, (_, config_class, prefix, _) in PLUGINS.items()
          for field in fields_of(config_class)}


def chosen_plugin_settings(switch: str) -> dict[str, str]:
  """A CHOSEN_PLUGINS entry's settings: its config's field -> the setting (--robust_beta,
  --attackers), all but the field its switch fills."""
  _, config_class, chosen, _, prefix, _ = CHOSEN_PLUGINS[switch]
  return {f: setting_name(prefix, f) for f in fields_of(config_class) if f != chosen}


def names() -> set[str]:
  """Every setting's name."""
  chosen = {name for switch in CHOSEN_PLUGINS for name in
            chosen_plugin_settings(switch).values()}
  return ({"algorithm", *PLUGINS, *CHOSEN_PLUGINS, *PARTITION} | set(section_settings())
          | set(algorithm_settings()) | set(plugin_settings()) | chosen | set(DP_SETTINGS))


def outside(name: str) -> bool:
  """Whether setting `name` changes no number a run computes (config.OUTSIDE)."""
  path = section_settings().get(name)
  return path is not None and outside_identity(path)


def _given(settings: Mapping[str, Any]) -> dict[str, Any]:
  given = {k: v for k, v in settings.items() if v is not None}
  unknown = sorted(set(given) - names())
  if unknown:
    raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
  return given


def _hidden(widths: Any) -> tuple[int, ...]:
  try:
    return tuple(int(w) for w in widths)
  except (TypeError, ValueError):
    raise ConfigError(f"--hidden must be comma-separated integers, got {widths}") from None


def _sections(given: Mapping[str, Any]) -> dict[str, Any]:
  """The config's sections and own fields from the settings that set them."""
  fields: dict[str, dict[str, Any]] = {}
  top = {}
  for name, path in section_settings().items():
    if name in given and len(path) == 2:
      fields.setdefault(path[0], {})[path[1]] = given[name]
    elif name in given:
      top[path[0]] = given[name]
  defaults = ExperimentConfig()
  sections = {name: dataclasses.replace(getattr(defaults, name), **values)
              for name, values in fields.items()}
  return {**top, **sections}


def _platform_defaults(config: ExperimentConfig, given: Mapping[str, Any]) -> ExperimentConfig:
  """client_chunk and eval_batch_size where unset: the model's on this platform (0 chunk:
  vmap every client, None)."""
  model = config.model.name or datasets.get_spec(config.data.dataset).model
  values: dict[str, Any] = {
      name: given[name] if name in given else default(model, jax.default_backend())
      for name, default in _PLATFORM_DEFAULTS.items()}
  values["client_chunk"] = values["client_chunk"] or None
  return dataclasses.replace(config, train=dataclasses.replace(config.train, **values))


def _algorithm(given: Mapping[str, Any], train) -> AlgorithmConfig:
  """The chosen algorithm: its preset, its settings, and the plug-ins switched on."""
  name = algorithms.canonical_name(given.get("algorithm", AlgorithmConfig.name))
  registered = algorithms.get(name)
  own = {field: given[setting_name(name, field)] for field in fields_of(registered.config_class)
         if field not in registered.train_fields and setting_name(name, field) in given}
  config = algorithms.default_config(name, train, given.get(f"{name}_variant"), **own)
  for field, (other, value) in registered.only_with.items():
    if field in own and getattr(config, other) != value:
      raise ConfigError(f"--{setting_name(name, field)} only acts with"
                        f" --{setting_name(name, other)}={value}; this run's is"
                        f" {getattr(config, other)}")
  plugins = {}
  for switch, (field, config_class, prefix, on) in PLUGINS.items():
    if given.get(switch) == on:
      plugins[field] = config_class(**{f: given[setting_name(prefix, f)]
                                       for f in fields_of(config_class)
                                       if setting_name(prefix, f) in given})
  plugins.update(_chosen_plugins(given))
  dp = {field: given[setting] for setting, field in DP_SETTINGS.items() if setting in given}
  if dp:
    plugins["dp"] = dp_lib.DpConfig(**dp)
  for field, plugin in registered.only_under.items():
    if field in own and plugin not in plugins:
      raise ConfigError(f"--{setting_name(name, field)} only acts under --{plugin}, which"
                        " this run does not use")
  algorithms.check_plugins(name, **plugins)
  return AlgorithmConfig(name=name, config=config, **plugins)


def _chosen_plugins(given: Mapping[str, Any]) -> dict[str, Any]:
  """The CHOSEN_PLUGINS the settings switch on, each with its settings; attackers
  without an attack is a one-line error."""
  plugins = {}
  for switch, (field, config_class, chosen, values, _, _) in CHOSEN_PLUGINS.items():
    settings = chosen_plugin_settings(switch)
    if given.get(switch) in values:
      plugins[field] = config_class(**{chosen: given[switch]}, **{
          f: given[setting] for f, setting in settings.items() if setting in given})
  if "attack" not in plugins and given.get("attackers"):
    raise ConfigError(f"--attackers needs --attack (one of"
                      f" {', '.join(byzantine_lib.ATTACKS)})")
  return plugins


def from_settings(settings: Mapping[str, Any]) -> ExperimentConfig:
  """The ExperimentConfig that flat `settings` (name -> value; None: unset) describe,
  plug-ins and an algorithm's tied fields checked (one-line ConfigErrors)."""
  given = _given(settings)
  config = dataclasses.replace(ExperimentConfig(), **_sections(given))
  config = _platform_defaults(config, given)
  config = dataclasses.replace(config, model=dataclasses.replace(
      config.model, hidden=_hidden(config.model.hidden)))
  partition_given = sorted(k for k in given if k in PARTITION)
  if partition_given and datasets.natural_users(config.data.dataset):
    raise ConfigError(f"--dataset={config.data.dataset} has one client per user (or group) of"
                      f" the data; --{', --'.join(partition_given)} would be ignored: drop it")
  partition = datasets.default_partition(
      config.data.dataset, config.data.setting,
      **{PARTITION[k]: v for k, v in given.items() if k in PARTITION})
  return dataclasses.replace(config, data=dataclasses.replace(config.data, partition=partition),
                             algorithm=_algorithm(given, config.train))
