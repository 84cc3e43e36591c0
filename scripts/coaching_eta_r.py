"""docs/coaching.md's table of coaching at the paper's stated R step, eta_r = 0.01.

  bash results/coaching_eta_r/run.sh        # the runs (a few CPU-minutes)
  python scripts/coaching_eta_r.py          # print the table

A pure function of the runs' files in results/coaching_eta_r/: each run's flags
(flags.md, run.sh writes it) and how it ended: the engine's one-line error (failed.md)
or, had it finished, its results.json.
"""

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "results", "coaching_eta_r")
# The runs in the table's order, each with what its flags stand for.
RUNS = {"rmnist": "rotated MNIST, 36 clients, MLP, the project's training (lr 0.005,"
                  " momentum 0.9)",
        "mnist01": "MNIST Dirichlet 0.1, 10 clients of 600 images, MLP, 5 local epochs,"
                   " SGD lr 0.01",
        "mnist01_cnn": "the same split, FEDORA's CNN, 1 local epoch, SGD lr 0.01"}
DIVERGED = re.compile(r"NaN or Inf loss in round (\d+) .*\((\d+) of (\d+)\)")


def _read(path: str) -> str:
  with open(path) as f:
    return f.read().strip()


def outcome(folder: str) -> str:
  """How a run ended: the round its loss went NaN, or its final accuracy."""
  failed = os.path.join(folder, "failed.md")
  if os.path.exists(failed):
    line = _read(failed)
    match = DIVERGED.search(line)
    return (f"NaN loss in round {match[1]} ({match[2]} of {match[3]} clients)" if match
            else line.removeprefix("error: "))
  with open(os.path.join(folder, "results.json")) as f:
    return f"finished, Acc {json.load(f)['acc']:.4f}"


def table(folder: str = FOLDER) -> str:
  lines = ["| run | flags (beside `--algorithm=coaching --coach_lr_r_rule=fixed"
           " --coach_lr_r=0.01`) | result |", "|---|---|---|"]
  for name, what in RUNS.items():
    run = os.path.join(folder, name)
    if os.path.isdir(run):
      lines.append(f"| {what} | `{_read(os.path.join(run, 'flags.md'))}` | {outcome(run)} |")
  lines.append("\nSeed 0; `bash results/coaching_eta_r/run.sh`.")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table())
  sys.exit(0)
