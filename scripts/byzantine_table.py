"""The Byzantine table of docs/robustness.md from the runs results/byzantine/run.sh leaves.

  python scripts/byzantine_table.py [results/byzantine] > results/byzantine/table.md

One row per aggregation, one column per attack: the final round's test accuracy averaged
over the honest clients (history.npz's `attacker` marks the others; all clients where
nobody attacks), and in brackets the drop from the same rule without attack.
"""

import json
import os
import sys

import numpy as np

AGGREGATIONS = ("mean", "median", "trimmed_mean", "krum", "centered_clip")
ATTACKS = ("none", "sign_flip", "alie")


def honest_accuracy(run: str) -> float | None:
  """The final round's mean test accuracy over the clients that did not attack."""
  path = os.path.join(run, "history.npz")
  if not os.path.exists(path):
    return None
  history = np.load(path)
  accuracy = history["test_acc"][-1]
  attacker = history["attacker"][-1] if "attacker" in history else np.zeros_like(accuracy)
  return float(np.mean(accuracy[attacker != 1]))


def table(root: str) -> str:
  with open(os.path.join(root, "local", "results.json")) as f:
    local = json.load(f)["acc"]
  lines = ["| aggregation | no attack | sign_flip 20 % | alie 20 % |", "|---|---|---|---|"]
  for aggregation in AGGREGATIONS:
    cells = []
    clean = honest_accuracy(os.path.join(root, f"{aggregation}_none"))
    for attack in ATTACKS:
      value = honest_accuracy(os.path.join(root, f"{aggregation}_{attack}"))
      if value is None:
        cells.append("not run")
      elif attack == "none" or clean is None:
        cells.append(f"{value:.4f}")
      else:
        cells.append(f"{value:.4f} ({value - clean:+.4f})")
    lines.append(f"| {aggregation} | " + " | ".join(cells) + " |")
  lines.append("")
  lines.append(f"LOCAL (no communication, no attack): {local:.4f}.")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table(sys.argv[1] if len(sys.argv) > 1 else os.path.join("results", "byzantine")))
