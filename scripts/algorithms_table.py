"""Every algorithm at its defaults beside LOCAL and FedAvg: the table of one
`--sweep=algorithm=local,fedavg,...` run's folder (docs/results.md), from its runs' files.

  python scripts/algorithms_table.py [results/algorithms20/mnist_pat]

Its rows in the sweep's order (sweep.json); each the final round's Acc (the plain mean of
the clients' test accuracies), its difference to FedAvg's, R-Acc and PTR against the
sweep's LOCAL run, and the seconds a round took (timing.json: the machine and its load
were the sweep's, so they compare rows of one sweep only). A row without results.json
is named as not finished.
"""

import json
import os
import sys

DEFAULT = "results/algorithms20/mnist_pat"


def _read(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def table(root: str) -> str:
  with open(os.path.join(root, "sweep.json")) as f:
    sweep = json.load(f)
  runs = {}
  for entry in sweep["runs"]:
    name = entry["run"].removeprefix("algorithm=")
    runs[name] = (_read(os.path.join(root, entry["run"], "results.json")),
                  _read(os.path.join(root, entry["run"], "timing.json")))
  fedavg = runs["fedavg"][0]
  lines = [f"`{sweep['command']}`", "",
           "| algorithm | Acc | Acc - FedAvg | R-Acc | PTR | s a round |",
           "|---|---:|---:|---:|---:|---:|"]
  for name, (results, timing) in runs.items():
    if results is None:
      lines.append(f"| {name} | not finished | | | | |")
      continue
    versus = "" if fedavg is None else f"{results['acc'] - fedavg['acc']:+.4f}"
    seconds = "" if timing is None else f"{timing['round_seconds']:.2f}"
    lines.append(f"| {name} | {results['acc']:.4f} | {versus} | {results['r_acc']:+.4f}"
                 f" | {results['ptr']:.2f} | {seconds} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.stdout.write(table(sys.argv[1] if len(sys.argv) > 1 else DEFAULT))
