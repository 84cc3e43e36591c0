"""The accuracy-epsilon tables of docs/privacy.md from the runs results/dp/run.sh leaves.

  python scripts/dp_table.py [results/dp] > results/dp/table.md

One table per client count (the runs' folder prefix: none for 36 clients, k300_ for
300), one row per run: its privacy (epsilon at delta, or none), the noise multiplier z, the
clip norm C, the share of updates clipped and the update norm before clipping (means
over the run's rounds and clients), and the final and best-validation test accuracy.
"""

import json
import os
import sys

import numpy as np

ROWS = (("fedavg", "no DP"), ("fedavg_clip", "clipping only"), ("fedavg_eps8", "epsilon 8"),
        ("fedavg_eps4", "epsilon 4"), ("fedavg_eps2", "epsilon 2"),
        ("fedavg_eps1", "epsilon 1"))


def row(root: str, name: str, label: str) -> str:
  path = os.path.join(root, name, "results.json")
  if not os.path.exists(path):
    return f"| {label} | not run | | | | | | |"
  with open(path) as f:
    results = json.load(f)
  dp = results.get("dp")
  history = np.load(os.path.join(root, name, "history.npz"))
  if dp is None:
    privacy, noise, clip, clipped, norm = "none", "-", "-", "-", "-"
  else:
    privacy = ("none (no noise)" if dp["epsilon"] is None else
               f"{dp['epsilon']:.3g} at delta {dp['delta']:g}")
    noise, clip = f"{dp['noise_multiplier']:.3g}", f"{dp['clip_norm']:g}"
    clipped = f"{np.nanmean(history['dp_clipped']):.2f}"
    norm = f"{np.nanmean(history['dp_update_norm']):.3f}"
  return (f"| {label} | {privacy} | {noise} | {clip} | {clipped} | {norm}"
          f" | {results['acc']:.4f} | {results['best_val']['acc']:.4f} |")


PREFIXES = ("", "k300_")


def table(root: str, prefix: str) -> str:
  with open(os.path.join(root, f"{prefix}local", "results.json")) as f:
    local = json.load(f)
  lines = [f"FedAvg on rotated MNIST ({local['num_clients']} clients, every client every"
           f" round), {local['rounds']} rounds, seed {local['seed']}:", "",
           "| run | user-level DP | z | C | clipped | update norm | final Acc |"
           " best-val Acc |", "|---|---|---|---|---|---|---|---|"]
  lines += [row(root, prefix + name, label) for name, label in ROWS]
  lines += ["", f"LOCAL (nothing leaves a client): final Acc {local['acc']:.4f}."]
  return "\n".join(lines)


if __name__ == "__main__":
  root = sys.argv[1] if len(sys.argv) > 1 else os.path.join("results", "dp")
  print("\n\n".join(table(root, prefix) for prefix in PREFIXES
                     if os.path.exists(os.path.join(root, f"{prefix}local", "results.json"))))
