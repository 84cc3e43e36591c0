"""The other seed papers' tables as data (experiments/paper/{coaching,fedala,confree}_tables
.json): every number the papers print (in percent, as printed), every setting a paper
states with the line it is on, and where it states none, the value used here and where
that came from. A table's columns are cells (a dataset with its partition, or a client
count and participation) and its rows algorithms with their settings (the flags' names,
fedora_jax/settings.py); this module reads them, and says which can run in this build.
"""

import json
import os

from fedora_jax import algorithms
from fedora_jax.errors import ConfigError
from fedora_jax.models import MODELS
from fedora_jax.sweep.tables import PAPER_DIR

PAPER_FILES = ("coaching_tables.json", "fedala_tables.json", "confree_tables.json")
REFERENCE_ROW = algorithms.REFERENCE
# The settings that say which cell or row a run is: the table sets them, never the command.
COLUMN_FLAGS = ("dataset", "partition", "dirichlet_alpha", "classes_per_client")
ROW_FLAGS = ("algorithm", "ala", "aggregation")  # and the row algorithm's own <name>_<field>


def load_tables() -> dict[str, dict]:
  """Table name -> the table as experiments/paper/*_tables.json hold it, each row given
  as {"row_of": table} resolved to that table's row of the same name."""
  tables = {}
  for name in PAPER_FILES:
    with open(os.path.join(PAPER_DIR, name)) as f:
      tables.update({k: v for k, v in json.load(f).items() if not k.startswith("_")})
  for table in tables.values():
    table["rows"] = {row: shared_row(tables, row, spec) for row, spec in table["rows"].items()}
  return tables


def shared_row(tables: dict[str, dict], row: str, spec: dict) -> dict:
  """A row another table also prints (fedala_ala's hosts are fedala1's rows): that row,
  its label, algorithm, flags and line, so the two run and are read alike; its note
  follows this table's own."""
  if "row_of" not in spec:
    return spec
  source = tables[spec["row_of"]]["rows"][row]
  notes = [n for n in (spec.get("note"), source.get("note")) if n]
  return {**source, **({"note": "; ".join(notes)} if notes else {})}


TABLES = tuple(load_tables())


def settings_flags(settings: list[dict]) -> dict[str, object]:
  """flag -> value of the settings that map to a flag."""
  return {s["flag"]: s["value"] for s in settings if "flag" in s}


def cell_flags(table: dict, column: str) -> dict[str, object]:
  """Every flag a run of the cell sets: the table's settings, then the column's."""
  spec = table["columns"][column]
  return {**settings_flags(table["settings"]), "dataset": spec["dataset"],
          **settings_flags(spec["settings"])}


def row_flags(table: dict, column: str, row: str) -> dict[str, object]:
  """The row's own flags in the cell: its algorithm, its plug-ins, its hyperparameters.
  A host with a plug-in runs with its host row's flags too, so the two differ by the
  plug-in alone."""
  spec = table["rows"].get(row, {"algorithm": row})
  host = table["rows"][spec["improves"]].get("flags", {}) if "improves" in spec else {}
  return {"algorithm": spec["algorithm"], **host, **spec.get("flags", {}),
          **table["columns"][column].get("row_flags", {}).get(row, {})}


def owned_flags(table: dict) -> tuple[str, ...]:
  """Every flag the table sets in some cell or row."""
  names = set(ROW_FLAGS)
  for column in table["columns"]:
    names.update(cell_flags(table, column))
    for row in table_rows(table):
      names.update(row_flags(table, column, row))
  return tuple(sorted(names))


def table_rows(table: dict) -> list[str]:
  """The rows in the paper's order, the LOCAL reference first (ours where the paper has
  no LOCAL row)."""
  return [REFERENCE_ROW] + [r for r in table["rows"] if r != REFERENCE_ROW]


def column_problem(table: dict, column: str) -> str | None:
  """Why the column cannot run in this build (None: it can): no dataset here, or a model
  not registered."""
  spec = table["columns"][column]
  if spec["dataset"] is None:
    return spec.get("note", "no --dataset here")
  model = cell_flags(table, column).get("model")
  if model is not None and model not in MODELS:
    return f"needs --model={model}, which this build does not register"
  return None


def row_problem(table: dict, row: str) -> str | None:
  """Why the row cannot run in this build (None: it can): its algorithm is not registered,
  or it does not take the row's plug-in."""
  if row == REFERENCE_ROW and row not in table["rows"]:
    return None
  spec = table["rows"][row]
  if spec["algorithm"] not in algorithms.REGISTRY:
    return f"{spec['algorithm']} is not registered in this build"
  flags = spec.get("flags", {})
  try:
    algorithms.check_plugins(spec["algorithm"], True if flags.get("ala") else None,
                             True if flags.get("aggregation") == "confree" else None)
  except ConfigError as e:
    return str(e)
  return None


def why_not_run(table: dict, column: str) -> str:
  """Why a column of the table was not run: it cannot run here, or its note, or it was
  not asked for."""
  return (column_problem(table, column) or table["columns"][column].get("note")
          or "not asked for (--columns)")
