"""Every paper table the sweeps reproduce: FEDORA's (fedora_tables.py) and the other
seed papers' (paper_tables.py), by name."""

from fedora_jax import sweep
from fedora_jax.sweep import fedora_tables, paper_tables
from fedora_jax.sweep.tables import Request, Table

TABLES = fedora_tables.TABLES + paper_tables.TABLES


def reproduce(request: Request, options: sweep.Options = sweep.Options()) -> Table:
  """Runs (or reads) the table's rows and writes the table into its workdir."""
  if request.table in paper_tables.TABLES:
    return paper_tables.reproduce(request, options)
  return fedora_tables.reproduce(request, options)
