"""What every paper table shares: where the papers' numbers and settings are
(experiments/paper/*.json), the request (which table, rows, columns, seeds, and the
settings the command line gives), and the written table."""

import json
import os
from typing import Any, Mapping, NamedTuple, Sequence

# The papers' tables as data: experiments/paper/*_tables.json in this repository.
PAPER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments", "paper")


class Request(NamedTuple):
  """A table to reproduce (or, finished_only, to read from the rows finished)."""
  table: str
  base: Mapping[str, Any] = {}   # every setting, defaults included (the flags' values)
  given: Mapping[str, Any] = {}  # the settings the command line gives: they win
  workdir: str | None = None     # default runs/reproduce_<table>[_<dataset>]
  seeds: int = 1                 # seeds `seed` .. `seed` + seeds - 1
  rows: Sequence[str] = ()       # default: every row that runs here
  columns: Sequence[str] = ()    # the other papers' cells (default: the table's)
  scored_clients: str = "all"    # sweep.SCORED_CLIENTS
  finished_only: bool = False    # train nothing: the rows finished so far
  command: str = ""              # the command line, quoted in the table


def first_seed(request: Request) -> int:
  return int(request.given.get("seed", request.base.get("seed", 0)) or 0)


class Table(NamedTuple):
  document: dict   # <table>.json
  markdown: str    # <table>.md
  where: str       # where its files are


def write_table(out: str, document: dict, markdown: str) -> None:
  """<out>.json and <out>.md."""
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(f"{out}.json", "w") as f:
    json.dump(document, f, indent=2)
  with open(f"{out}.md", "w") as f:
    f.write(markdown)
