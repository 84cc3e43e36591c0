"""A sweep's finished row as a table reads it (RowRun): the final round's Acc, R-Acc and
PTR, or a best-round metric from the per-round history, and what the row cost; and how a
table names rows not finished."""

import json
import os
from typing import Any, NamedTuple

import numpy as np

from fedora_jax import metrics
from fedora_jax import results as results_lib
from fedora_jax.errors import ConfigError


# What a table says of rows not finished (--finished_only, a sweep in progress).
FINISHED_ONLY_ROWS = ("rows: those finished in the workdir, read; none trained"
                      " (`--finished_only`: a sweep in progress)")


def seeds_finished(finished: int, seeds: int) -> str:
  return f"only {finished} of {seeds} seeds finished"


def seed_unfinished(seed: int, why: str) -> str:
  return f"seed {seed}: {why}"


def seeds_unfinished(whys: list[str] | None) -> str:
  """What a row's seeds not finished are, to follow its text: " (seed 1: not started)"."""
  return f" ({'; '.join(whys)})" if whys else ""


def not_finished(whys: list[str] | None) -> str:
  """A row with no seed finished: "not finished in the workdir (seed 0: not started)"."""
  return f"not finished in the workdir{seeds_unfinished(whys)}"


# --scored_clients: whose accuracies a round's mean takes (-> the metric's text).
SCORED_CLIENTS = {"all": "every client", "sampled": "only the clients sampled to train that round"}


class BestRound(NamedTuple):
  """The other papers' metric: the best accuracy over the rounds sampled."""
  weighting: str            # metrics.WEIGHTINGS: the plain mean over clients, or weighted
  sample_every: int = 1     # the rounds the paper sampled: every n-th, and the last
  scored_clients: str = "all"  # SCORED_CLIENTS


class RowRun(NamedTuple):
  """A finished row's numbers, as its workdir holds them (read_row_run): the final
  round's Acc, R-Acc and PTR, or a best-round metric's (per_round, best, best_round,
  final), and what it cost."""
  results: str                  # its results.json
  round_seconds: float
  wall_seconds: float
  machine: str                  # what trained it (results.machines)
  acc: float | None = None      # the final round's, over clients (results.json)
  r_acc: float | None = None
  ptr: float | None = None
  per_round: Any = None         # [R] the best-round metric's accuracy each round
  best: float | None = None     # the best over the sampled rounds (a fraction)
  best_round: int | None = None  # 1-based
  final: float | None = None    # the last round's


def _per_round(directory: str, results: dict, metric: BestRound) -> np.ndarray:
  """The metric's accuracy over clients each round, from the per-round test accuracies
  (history.npz) and the clients' test sizes. "sampled" averages only the clients that
  trained that round (their local steps), which differs under partial participation."""
  with np.load(os.path.join(directory, "history.npz")) as history:
    test_acc = history["test_acc"]
    scored = None
    if metric.scored_clients == "sampled":
      if "local_steps" not in history:
        raise ConfigError(f"{directory}: history.npz has no local_steps, so the clients"
                          " each round sampled are not known; run the row again")
      scored = history["local_steps"] > 0
      if not scored.any(axis=1).all():
        raise ConfigError(f"{directory}: a round trained no client, so"
                          " --scored_clients=sampled has nothing to score in it")
  n_test = np.array([c["n_test"] for c in results["clients"]])
  per_round = metrics.accuracy_per_round(test_acc, n_test, metric.weighting, scored)
  if np.isnan(per_round).any():
    raise ConfigError(f"{directory}: test was not scored every round (--eval_every > 1),"
                      " and this table's metric is the best round's; run the row again")
  return per_round


def read_row_run(directory: str, metric: BestRound | None = None,
                 results: dict | None = None) -> RowRun:
  """A finished row's numbers from its workdir: with `metric`, its best-round accuracy;
  else the final round's Acc, R-Acc and PTR of `results` (default: its results.json)."""
  if results is None:
    with open(os.path.join(directory, "results.json")) as f:
      results = json.load(f)
  with open(os.path.join(directory, "timing.json")) as f:
    cost = results_lib.run_cost(json.load(f))
  path = os.path.join(directory, "results.json")
  if metric is None:
    return RowRun(path, **cost, acc=results["acc"], r_acc=results["r_acc"],
                  ptr=results["ptr"])
  per_round = _per_round(directory, results, metric)
  best_round, best = metrics.best_sampled_round(per_round, metric.sample_every)
  return RowRun(path, **cost, per_round=per_round, best=best, best_round=best_round,
                final=float(per_round[-1]))
