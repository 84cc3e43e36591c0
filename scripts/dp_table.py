"""The accuracy-epsilon tables and figure of docs/privacy.md from the runs results/dp/run.sh
leaves.

  python scripts/dp_table.py [results/dp]

writes, in that folder, table.md (per setting: one row per algorithm, the final round's
test Acc and R-Acc against LOCAL without DP, with clipping only and at each epsilon;
FEDORA's row is the line its DP check stops with), details.md (per setting and
algorithm: each run's noise multiplier z, clip norm C, share of updates clipped and
update norm before clipping, means over the run's rounds and clients) and
accuracy_epsilon.png (Acc against epsilon, one line per algorithm, no DP dashed). A run
not finished is a cell "-", never a number; a run that failed, its error line.
"""

import json
import os
import sys
from typing import NamedTuple

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
import numpy as np  # noqa: E402

from fedora_jax import algorithms  # noqa: E402
from fedora_jax.algorithms import dp as dp_lib  # noqa: E402
from fedora_jax.errors import ConfigError  # noqa: E402


class Setting(NamedTuple):
  prefix: str                  # the runs' folder prefix in results/dp
  title: str
  algorithms: tuple[str, ...]
  epsilons: tuple[int, ...]
  clip_only: bool              # whether run.sh runs a clipping-only row


SETTINGS = (
    Setting("", "Rotated MNIST, 36 clients", ("fedavg", "ditto", "fedrep", "fedala"),
            (8, 4, 2, 1), True),
    Setting("k300_", "Rotated MNIST, 300 clients", ("fedavg", "ditto", "fedrep", "fedala"),
            (8, 4, 2, 1), True),
    Setting("pat_", "MNIST pathological (FedALA's setting), 20 clients",
            ("fedavg", "fedala"), (8, 2), False),
)
NAMES = {"fedavg": "FedAvg", "ditto": "Ditto", "fedrep": "FedRep", "fedala": "FedALA",
         "fedora": "FEDORA"}


def load(root: str, name: str) -> dict | None:
  path = os.path.join(root, name, "results.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def variants(setting: Setting) -> list[tuple[str, str]]:
  """(folder suffix, column label) of a setting's runs per algorithm."""
  out = [("", "no DP")] + ([("_clip", "clipping only")] if setting.clip_only else [])
  return out + [(f"_eps{e}", f"epsilon {e}") for e in setting.epsilons]


def failure(root: str, name: str) -> str | None:
  """The error line a run that failed stopped with (run.sh keeps it as failed.md)."""
  path = os.path.join(root, name, "failed.md")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return f.read().strip().removeprefix("error: ")


def cell(root: str, name: str) -> str:
  results = load(root, name)
  if results is None:
    line = failure(root, name)
    return "-" if line is None else f"failed: {line}"
  if results.get("r_acc") is None:
    return f"{results['acc']:.4f}"
  return f"{results['acc']:.4f} ({results['r_acc']:+.4f})"


def fedora_refusal() -> str:
  """The line FEDORA's DP check stops with: the reason, from the code."""
  try:
    algorithms.check_plugins("fedora", dp=dp_lib.DpConfig(clip_norm=1.0))
  except ConfigError as error:
    line = str(error).split(" (supported:")[0]
  else:
    return "takes DP"
  host = algorithms.get("fedora").factory(algorithms.default_config("fedora"),
                                          algorithms.stand_in_trainer())
  if host.state_upload is not None:  # what its server reads of every client
    line += (" (it declares no Algorithm.upload_mean; its server reads each client's"
             " whole trained model, Algorithm.state_upload, to propagate it)")
  return line


def summary(root: str, setting: Setting, local: dict) -> str:
  columns = variants(setting)
  lines = [f"{setting.title}, {local['rounds']} rounds, seed {local['seed']}, every client"
           f" every round, delta 1e-5 (RDP): final-round test Acc (R-Acc against LOCAL,"
           f" {local['acc']:.4f}):", "",
           "| algorithm | " + " | ".join(label for _, label in columns) + " |",
           "|---" * (len(columns) + 1) + "|"]
  for algorithm in setting.algorithms:
    cells = [cell(root, setting.prefix + algorithm + suffix) for suffix, _ in columns]
    lines.append(f"| {NAMES[algorithm]} | " + " | ".join(cells) + " |")
  lines.append(f"| FEDORA | refuses DP: {fedora_refusal()} |" + " |" * (len(columns) - 1))
  return "\n".join(lines)


def detail_row(root: str, name: str, label: str) -> str:
  results = load(root, name)
  if results is None:
    line = failure(root, name)
    return f"| {label} | {'not run' if line is None else 'failed: ' + line} | | | | | | |"
  dp = results.get("dp")
  if dp is None:
    privacy, noise, clip, clipped, norm = "none", "-", "-", "-", "-"
  else:
    history = np.load(os.path.join(root, name, "history.npz"))
    privacy = ("none (no noise)" if dp["epsilon"] is None else
               f"{dp['epsilon']:.3g} at delta {dp['delta']:g}")
    noise = f"{dp['noise_multiplier']:.3g}"
    clip = (f"{dp['clip_norm']:g}" if dp.get("adaptive_clip_quantile") is None else
            f"adaptive from {dp['clip_norm']:g}")
    clipped = f"{np.nanmean(history['dp_clipped']):.2f}"
    norm = f"{np.nanmean(history['dp_update_norm']):.3f}"
  return (f"| {label} | {privacy} | {noise} | {clip} | {clipped} | {norm}"
          f" | {results['acc']:.4f} | {results['best_val']['acc']:.4f} |")


def details(root: str, setting: Setting, local: dict) -> str:
  blocks = []
  for algorithm in setting.algorithms:
    lines = [f"{NAMES[algorithm]}, {setting.title}, {local['rounds']} rounds, seed"
             f" {local['seed']}:", "",
             "| run | user-level DP | z | C | clipped | update norm | final Acc |"
             " best-val Acc |", "|---|---|---|---|---|---|---|---|"]
    lines += [detail_row(root, setting.prefix + algorithm + suffix, label)
              for suffix, label in variants(setting)]
    blocks.append("\n".join(lines))
  return "\n\n".join(blocks)


def figure(root: str, settings: list[tuple[Setting, dict]], path: str) -> None:
  """One panel per setting; an algorithm keeps its colour in every panel."""
  colors = {name: f"C{index}" for index, name in enumerate(NAMES)}
  fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4.6),
                           squeeze=False)
  for ax, (setting, local) in zip(axes[0], settings):
    for algorithm in setting.algorithms:
      points = [(e, load(root, f"{setting.prefix}{algorithm}_eps{e}"))
                for e in setting.epsilons]
      points = [(e, r["acc"]) for e, r in points if r is not None]
      if points:
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, "o-", color=colors[algorithm])
      no_dp = load(root, setting.prefix + algorithm)
      if no_dp is not None:
        ax.axhline(no_dp["acc"], color=colors[algorithm], linestyle="--", linewidth=1)
    ax.axhline(local["acc"], color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(setting.epsilons), [str(e) for e in sorted(setting.epsilons)])
    ax.set_xlabel("epsilon (delta 1e-5)")
    ax.set_ylabel("final test Acc")
    ax.set_title(f"{setting.title}\n{local['rounds']} rounds", fontsize=9)
  shown = sorted({a for s, _ in settings for a in s.algorithms}, key=list(NAMES).index)
  handles = [Line2D([], [], color=colors[a], marker="o", label=NAMES[a]) for a in shown]
  handles += [Line2D([], [], color="black", linestyle="--", label="no DP (same colour)"),
              Line2D([], [], color="gray", linestyle=":", label="LOCAL")]
  fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def finished(root: str) -> list[tuple[Setting, dict]]:
  """The settings whose LOCAL reference has finished, with it."""
  done = [(s, load(root, f"{s.prefix}local")) for s in SETTINGS]
  return [(s, local) for s, local in done if local is not None]


def table(root: str) -> str:
  """table.md's text (scripts/render_docs.py embeds it in docs/privacy.md)."""
  return "\n\n".join(summary(root, s, local) for s, local in finished(root))


def detail_tables(root: str) -> str:
  """details.md's text."""
  return "\n\n".join(details(root, s, local) for s, local in finished(root))


def main(root: str) -> None:
  for name, text in (("table.md", table(root)), ("details.md", detail_tables(root))):
    with open(os.path.join(root, name), "w") as f:
      f.write(text + "\n")
  figure(root, finished(root), os.path.join(root, "accuracy_epsilon.png"))


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("results", "dp"))
