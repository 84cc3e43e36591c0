"""Bytes per round, and accuracy with and without unreliable clients.

  python scripts/communication_table.py --data_dir=../shared/data --rounds=1
  python scripts/communication_table.py --data_dir=../shared/data --rounds=30 \
      --conditions=none,dropout

trains each algorithm of ALGORITHMS on rotated MNIST (the paper's 36 clients, the
defaults of `experiments.main`) for --rounds rounds under each condition, every run
against one LOCAL reference of as many rounds, and writes, per run,
results/communication/<algorithm>_<condition>_r<rounds>.json (its command, Acc, and the
bytes a client sends and receives in a round and all clients together: history.npz's
bytes_up / bytes_down, fedora_jax/communication.py), then the markdown table of them all
to results/communication/table_r<rounds>.md. A run whose results.json exists is read, not
trained again.

Conditions: none; dropout: --client_dropout=0.3 with 30 % of the clients straggling at
speeds uniform in [0.1, 1] (each completes that share of its local steps).
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = ("fedavg", "ditto", "fedrep", "fedala", "fedora", "pfedhn", "fedfomo")
CONDITIONS = {"none": (),
              "dropout": ("--client_dropout=0.3", "--stragglers=0.3",
                          "--straggler_speed=uniform:0.1,1")}
COMMON = ("--dataset=rmnist", "--log_every=0", "--nokeep_checkpoints")

def fedora_subspace_bytes() -> int:
  """FEDORA's clients also send their data subspace once, before round 1 (not a round's
  message): U_k, the top p right singular vectors of [X_k, onehot(Y_k)], 28 x 28 pixels
  and 10 classes, float32."""
  sys.path.insert(0, ROOT)
  from fedora_jax import algorithms  # pylint: disable=import-outside-toplevel
  return (28 * 28 + 10) * algorithms.default_config("fedora").p * 4


def train(algorithm: str, condition: str, rounds: int, data_dir: str, workdir: str,
          reference: str | None) -> list[str]:
  """Runs experiments.main unless `workdir` holds its results; returns the command."""
  command = [sys.executable, "-m", "experiments.main", f"--algorithm={algorithm}",
             f"--rounds={rounds}", f"--data_dir={data_dir}", f"--workdir={workdir}",
             *COMMON, *CONDITIONS[condition]]
  if reference:
    command.append(f"--reference={reference}")
  if not os.path.exists(os.path.join(workdir, "results.json")):
    subprocess.run(command, cwd=ROOT, check=True)
  return command


def summary(algorithm: str, condition: str, rounds: int, workdir: str,
            command: list[str]) -> dict:
  """The run's Acc and bytes: per client and round (what one message holds), per round
  (means over the rounds), and in all."""
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  with np.load(os.path.join(workdir, "history.npz")) as history:
    up, down = history["bytes_up"].astype(np.int64), history["bytes_down"].astype(np.int64)
    steps = history["local_steps"]
    test_acc = history["test_acc"].mean(axis=1)
  shown = [part for part in command[3:] if not part.startswith(("--data_dir", "--workdir",
                                                                "--reference"))]
  return {
      "command": "python -m experiments.main " + " ".join(shown),
      "algorithm": algorithm, "condition": condition, "rounds": rounds,
      "num_clients": results["num_clients"], "acc": results["acc"],
      "best_val_acc": results["best_val"]["acc"],
      "bytes_up": results["bytes_up"], "bytes_down": results["bytes_down"],
      # One client's message (every client's is the same size in these algorithms).
      "client_bytes_up": int(up.max()), "client_bytes_down": int(down.max()),
      "bytes_up_per_round": float(up.sum(axis=1).mean()),
      "bytes_down_per_round": float(down.sum(axis=1).mean()),
      "clients_sent_per_round": float((up > 0).sum(axis=1).mean()),
      "clients_trained_per_round": float((steps > 0).sum(axis=1).mean()),
      "mean_local_steps": float(steps[steps > 0].mean()),
      "mean_test_acc_per_round": [round(float(a), 6) for a in test_acc],
      **({"setup_bytes_up_per_client": fedora_subspace_bytes()} if algorithm == "fedora"
         else {}),
  }


def table(rows: list[dict], conditions: list[str]) -> str:
  """Markdown: per algorithm, one message each way, and per condition Acc and the mean
  bytes a round."""
  rounds = rows[0]["rounds"]
  head = ["algorithm", "client down (B)", "client up (B)"]
  for condition in conditions:
    head += [f"Acc ({condition})", f"down/round ({condition})", f"up/round ({condition})"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  by_key = {(r["algorithm"], r["condition"]): r for r in rows}
  for algorithm in ALGORITHMS:
    first = by_key[(algorithm, conditions[0])]
    cells = [algorithm, f"{first['client_bytes_down']:,}", f"{first['client_bytes_up']:,}"]
    for condition in conditions:
      row = by_key[(algorithm, condition)]
      cells += [f"{row['acc']:.4f}", f"{row['bytes_down_per_round']:,.0f}",
                f"{row['bytes_up_per_round']:,.0f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return (f"Rotated MNIST, 36 clients, {rounds} round{'s' if rounds > 1 else ''}"
          f" (scripts/communication_table.py):\n\n" + "\n".join(lines) + "\n")


def render(out: str, rounds: int) -> str:
  """table_r<rounds>.md again from the per-run summaries in `out` (nothing trained)."""
  rows = []
  for condition in CONDITIONS:
    for algorithm in ALGORITHMS:
      path = os.path.join(out, f"{algorithm}_{condition}_r{rounds}.json")
      if os.path.exists(path):
        with open(path) as f:
          rows.append(json.load(f))
  return table(rows, [c for c in CONDITIONS if any(r["condition"] == c for r in rows)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data"))
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--conditions", default="none")
  parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "communication"))
  parser.add_argument("--out", default=os.path.join(ROOT, "results", "communication"))
  args = parser.parse_args()
  conditions = args.conditions.split(",")
  unknown = [c for c in conditions if c not in CONDITIONS]
  if unknown:
    parser.error(f"--conditions: unknown {unknown}; known: {', '.join(CONDITIONS)}")
  os.makedirs(args.out, exist_ok=True)
  local = os.path.join(args.runs, f"local_r{args.rounds}")
  train("local", "none", args.rounds, args.data_dir, local, None)
  rows = []
  for condition in conditions:
    for algorithm in ALGORITHMS:
      workdir = os.path.join(args.runs, f"{algorithm}_{condition}_r{args.rounds}")
      command = train(algorithm, condition, args.rounds, args.data_dir, workdir,
                      os.path.join(local, "results.json"))
      row = summary(algorithm, condition, args.rounds, workdir, command)
      with open(os.path.join(args.out, f"{algorithm}_{condition}_r{args.rounds}.json"),
                "w") as f:
        json.dump(row, f, indent=2)
      rows.append(row)
  text = table(rows, conditions)
  with open(os.path.join(args.out, f"table_r{args.rounds}.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
