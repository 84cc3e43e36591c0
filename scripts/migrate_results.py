"""Brings finished runs' results.json and timing.json, written by earlier versions, to the
current format, so that the readers (fedora_jax/results.py, fedora_jax/sweep/) need know
only that one. Run it once over a results folder or a workdir; a second run changes
nothing.

  python scripts/migrate_results.py results/              # every run under it
  python scripts/migrate_results.py runs/x --dry_run       # say what would change

What it changes:
- results.json written before PTR and R-Acc counted ties (metrics.ACCURACY_TIE): the
  summaries and the per-client R-Acc are computed again from the per-client accuracies.
  Those were kept to 6 decimals, so two accuracies that are one count are here within
  TIE_OF_ROUNDED (each rounded by up to 5e-7), still far below 1 / n. A record whose PTR
  agrees is left as it is: its R-Acc came from the unrounded values.
- timing.json: a segment that does not name its machine gets results.json's `platform`
  (what trained it, as far as the record knows); "1 cores" becomes "1 core".
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from fedora_jax import metrics
from fedora_jax import results as results_lib

TIE_OF_ROUNDED = 2e-6


def _rounded(x):
  return None if x is None or not np.isfinite(x) else round(float(x), 6)


def _tied_to_local(acc: np.ndarray, local_acc: np.ndarray) -> np.ndarray:
  """acc with each value within TIE_OF_ROUNDED of LOCAL's replaced by LOCAL's."""
  return np.where(np.abs(acc - local_acc) <= TIE_OF_ROUNDED, local_acc, acc)


def summarized_again(report: dict) -> dict:
  """A classification results.json with its PTR and R-Acc (final, best validation, per
  client) computed from its per-client accuracies by today's metrics."""
  clients = report["clients"]
  def column(name):
    return np.array([np.nan if c[name] is None else c[name] for c in clients], np.float64)
  scored = {}
  for acc_name, local_name in (("acc", "local_acc"), ("best_val_acc", "local_best_val_acc")):
    local = column(local_name)
    acc = _tied_to_local(column(acc_name), local)
    scored[acc_name] = (metrics.summarize(acc, local), metrics.relative_accuracy(acc, local))
  (final, r_final), (best, r_best) = scored["acc"], scored["best_val_acc"]
  return {**report, "r_acc": _rounded(final.r_acc), "ptr": _rounded(final.ptr),
          "best_val": {**report["best_val"], "r_acc": _rounded(best.r_acc),
                       "ptr": _rounded(best.ptr)},
          "clients": [{**c, "r_acc": _rounded(r_final[k]),
                       "best_val_r_acc": _rounded(r_best[k])}
                      for k, c in enumerate(clients)]}


def migrated_results(report: dict) -> dict | None:
  """The current form of a results.json document, or None if it is current."""
  if results_lib.task_of(report) != "classification" or report.get("ptr") is None:
    return None  # a regression, or a run without a LOCAL reference: nothing to count
  again = summarized_again(report)
  if (again["ptr"], again["best_val"]["ptr"]) == (report["ptr"], report["best_val"]["ptr"]):
    return None
  return again


def migrated_timing(timing: dict, platform: str | None) -> dict | None:
  """The current form of a timing.json document, or None if it is current."""
  segments = [{**s, "machine": (s.get("machine") or platform or "unrecorded")
               .replace(", 1 cores", ", 1 core")} for s in timing["segments"]]
  return None if segments == timing["segments"] else {**timing, "segments": segments}


def _read(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def migrate(root: str, dry_run: bool) -> list[str]:
  """Migrates every run under `root`; returns the files it changed (or would)."""
  changed = []
  for directory, _, files in sorted(os.walk(root)):
    if "results.json" not in files:
      continue
    results_path = os.path.join(directory, "results.json")
    report = _read(results_path)
    timing_path = os.path.join(directory, "timing.json")
    timing = _read(timing_path)
    updates = {results_path: migrated_results(report),
               timing_path: timing and migrated_timing(timing, report.get("platform"))}
    for path, document in updates.items():
      if document is None:
        continue
      changed.append(path)
      if not dry_run:
        with open(path, "w") as f:
          json.dump(document, f, indent=2)
  return changed


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("root", help="a results folder or a workdir")
  parser.add_argument("--dry_run", action="store_true", help="only list what would change")
  args = parser.parse_args()
  if not os.path.isdir(args.root):
    sys.exit(f"migrate_results: {args.root} is not a folder")
  changed = migrate(args.root, args.dry_run)
  for path in changed:
    print(("would change " if args.dry_run else "changed ") + path)
  print(f"{len(changed)} file(s) {'to change' if args.dry_run else 'changed'}")


if __name__ == "__main__":
  main()
