"""Converts run_config.json files of the flag-named format (before schema_version 2) into
the current one: the run's ExperimentConfig (fedora_jax/config.py), so that a workdir or
a kept row of results/ recorded before the change still resumes or is read.

  python scripts/migrate_run_configs.py results/            # every record under it
  python scripts/migrate_run_configs.py runs/x --dry_run     # say what would change

An old record is the flags a run was given (their command-line names, those that changed
nothing a run computes left out), which are the settings fedora_jax/settings.py builds a
config from, read under the rules of the time: FEDORA's variant absent from a record
means "paper", its default until 2026-11-26. What the record left out (the rounds, how
clients were batched) is taken from the run's results.json where there is one.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from fedora_jax import config as config_lib
from fedora_jax import settings
from fedora_jax.checkpoint import RUN_CONFIG
from fedora_jax.errors import FedoraError

# The default of --fedora_variant before 2026-11-26: a record without it ran that one.
OLD_DEFAULTS = {"fedora_variant": "paper"}
# results.json's `train` fields the old records left out.
FROM_RESULTS = ("rounds", "log_every", "eval_every", "eval_batch_size", "client_chunk")


def old_settings(record: dict, results: dict | None) -> dict:
  """The settings an old record (and the run's results.json) describe."""
  given = dict(record)
  if given.get("algorithm") == "fedora":
    given = {**OLD_DEFAULTS, **given}
  train = (results or {}).get("train", {})
  for name in FROM_RESULTS:
    if name in train and given.get(name) is None:
      given[name] = 0 if name == "client_chunk" and train[name] is None else train[name]
  return given


def migrate(path: str, dry_run: bool) -> str:
  """Converts one run_config.json; returns what it did."""
  with open(path) as f:
    record = json.load(f)
  if "schema_version" in record:
    return "current"
  results_path = os.path.join(os.path.dirname(path), "results.json")
  results = None
  if os.path.isfile(results_path):
    with open(results_path) as f:
      results = json.load(f)
  config = settings.from_settings(old_settings(record, results))
  if not dry_run:
    with open(path + ".tmp", "w") as f:
      json.dump(config_lib.record(config), f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
  return "converted"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("paths", nargs="+", help="workdirs or folders holding them")
  parser.add_argument("--dry_run", action="store_true")
  args = parser.parse_args()
  counts: dict[str, int] = {}
  for root in args.paths:
    for directory, _, files in sorted(os.walk(root)):
      if RUN_CONFIG in files:
        path = os.path.join(directory, RUN_CONFIG)
        try:
          outcome = migrate(path, args.dry_run)
        except FedoraError as e:
          outcome = "failed"
          print(f"{path}: {e}", file=sys.stderr)
        counts[outcome] = counts.get(outcome, 0) + 1
  print(", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "no run_config.json")


if __name__ == "__main__":
  main()
