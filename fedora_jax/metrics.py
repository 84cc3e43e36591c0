"""The paper's metrics (Wu et al., KDD 2023, section 5.1).

Acc: mean over clients of per-client test accuracy. R-Acc_k = (Acc_k - Acc_k^LOCAL) /
Acc_k^LOCAL against LOCAL trained on the same split and seed (Definition 3.2); R-Acc is
its mean over clients. PTR: the fraction of clients with Acc_k >= Acc_k^LOCAL
(Definition 3.3).

Where LOCAL scored 0 on client k (a few test samples, all missed), Definition 3.2 divides
by zero: R-Acc_k is undefined (NaN here, null in results.json, "n/a" in the table), not
+inf (it would swamp the mean) nor a substitute the paper does not give. The mean R-Acc is
then over the clients where it is defined (`defined_count` says how many); PTR is defined
for every client and counts them all. Likewise R-MAE where LOCAL's MAE is 0.

Regression (the agriculture task), where lower is better: MAE is the mean over clients of
per-client test mean absolute error; R-MAE_k = (MAE_k^LOCAL - MAE_k) / MAE_k^LOCAL, the
relative form of R-Acc with the sign kept so that positive means better than LOCAL;
R-MAE is its mean over clients. PTR: the fraction of clients with MAE_k <= MAE_k^LOCAL.

Ties. An accuracy is a count over n test samples, computed in float32 on the device; two
programs (LOCAL's and another algorithm's) can round the same count c / n to float32s one
bit apart (XLA may divide through a reciprocal: 16 of the 278 counts over 277 samples
differ so), while two different counts differ by at least 1 / n. Accuracies within
ACCURACY_TIE of each other are therefore the same count: "equal" for PTR's >= and an
R-Acc_k of exactly 0. Before 2026-11-27 they were compared bit for bit, and a tie counted
or not by the rounding: on Table 3's rotated Fashion-MNIST FedAvg+FT, 4 of 72 clients tie
with LOCAL and 1 of them counted (PTR 0.375; 0.417 with the ties).
"""

from typing import NamedTuple

import numpy as np


# Far above float32's rounding of a ratio in [0, 1] (6e-8) and results.json's 6 decimals
# (a LOCAL reference is read from there), below 1 / n for a test set of n < 500,000.
ACCURACY_TIE = 1e-6


class Summary(NamedTuple):
  acc: float
  r_acc: float | None
  ptr: float | None


def same_accuracy(acc: np.ndarray, local_acc: np.ndarray) -> np.ndarray:
  """[K] whether each client's two accuracies are the same count (within ACCURACY_TIE)."""
  return np.abs(np.asarray(acc, np.float64) - np.asarray(local_acc, np.float64)) <= ACCURACY_TIE


def relative_accuracy(acc: np.ndarray, local_acc: np.ndarray) -> np.ndarray:
  """[K] (acc - local) / local, 0 where they tie; NaN where LOCAL scored 0 (undefined)."""
  acc, local_acc = np.asarray(acc, np.float64), np.asarray(local_acc, np.float64)
  difference = np.where(same_accuracy(acc, local_acc), 0.0, acc - local_acc)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(local_acc > 0, difference / local_acc, np.nan)


def defined_mean(values: np.ndarray) -> float | None:
  """Mean over the clients where a relative score is defined (not NaN); None if nowhere."""
  values = np.asarray(values, np.float64)
  defined = ~np.isnan(values)
  return float(np.nanmean(values)) if defined.any() else None


def defined_count(values) -> int:
  """How many clients a relative score is defined for (not NaN / None)."""
  return sum(v is not None and not np.isnan(v) for v in values)


def summarize(acc: np.ndarray, local_acc: np.ndarray | None) -> Summary:
  acc = np.asarray(acc, np.float64)
  # None or all NaN: no LOCAL reference (--reference=none), so no R-Acc or PTR.
  if local_acc is None or np.isnan(np.asarray(local_acc, np.float64)).all():
    return Summary(acc=float(acc.mean()), r_acc=None, ptr=None)
  r_acc = relative_accuracy(acc, local_acc)
  return Summary(acc=float(acc.mean()), r_acc=defined_mean(r_acc),
                 ptr=float(np.mean((acc >= np.asarray(local_acc, np.float64))
                                   | same_accuracy(acc, local_acc))))


def best_validation_round(val_score: np.ndarray, lower_is_better: bool = False) -> int:
  """Index of the round with the highest mean validation accuracy (the first, on ties);
  with `lower_is_better` (a regression's MAE), the lowest."""
  means = np.asarray(val_score).mean(axis=1)
  return int(np.argmin(means) if lower_is_better else np.argmax(means))


class RegressionSummary(NamedTuple):
  mae: float
  r_mae: float | None
  ptr: float | None


def relative_mae(mae: np.ndarray, local_mae: np.ndarray) -> np.ndarray:
  """[K] (local - mae) / local: positive where the client beats LOCAL; NaN where LOCAL's
  MAE is 0 (undefined)."""
  mae, local_mae = np.asarray(mae, np.float64), np.asarray(local_mae, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(local_mae > 0, (local_mae - mae) / local_mae, np.nan)


def summarize_regression(mae: np.ndarray, local_mae: np.ndarray | None) -> RegressionSummary:
  mae = np.asarray(mae, np.float64)
  if local_mae is None:
    return RegressionSummary(mae=float(mae.mean()), r_mae=None, ptr=None)
  r_mae = relative_mae(mae, local_mae)
  return RegressionSummary(mae=float(mae.mean()), r_mae=defined_mean(r_mae),
                           ptr=float(np.mean(mae <= np.asarray(local_mae, np.float64))))


# Best-round accuracy, the metric of parameter coaching's Tables 1-2 ("best mean
# accuracy", accuracy sampled every round on MNIST / FMNIST, every 5 on CIFAR10, every 10 on
# CIFAR100) and of FedALA's and ConFREE's tables (their code reports the maximum over
# rounds of sum(correct) / sum(test samples) over all clients: TsingZ0/FedALA
# serverALA.py, PFLlib).
WEIGHTINGS = ("mean", "weighted")


def accuracy_per_round(test_acc: np.ndarray, n_test: np.ndarray,
                       weighting: str = "mean",
                       scored: np.ndarray | None = None) -> np.ndarray:
  """[R] accuracy over clients each round from [R, K] per-client test accuracies: "mean",
  the plain mean over clients; "weighted", each client weighed by its test samples
  `n_test` [K] (the fraction of all test samples classified right). `scored` [R, K]
  (bool), if given, keeps only those clients in each round's mean (the clients a round
  sampled); a round that scores none is NaN."""
  test_acc = np.asarray(test_acc, np.float64)
  if weighting not in WEIGHTINGS:
    raise ValueError(f"unknown weighting {weighting!r}; known: {', '.join(WEIGHTINGS)}")
  weights = np.ones(test_acc.shape[1]) if weighting == "mean" else n_test
  weights = np.broadcast_to(np.asarray(weights, np.float64), test_acc.shape)
  if scored is not None:
    scored = np.asarray(scored, bool)
    weights = np.where(scored, weights, 0.0)
    test_acc = np.where(scored, test_acc, 0.0)  # an unscored client's NaN drops out too
  total = weights.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(total > 0, (test_acc * weights).sum(axis=1) / total, np.nan)


def best_sampled_round(per_round: np.ndarray, sample_every: int = 1) -> tuple[int, float]:
  """(round, value): the best of the rounds a paper sampled, every `sample_every`-th
  (rounds sample_every, 2 sample_every, ...; the last round always counts), 1-based; the
  first on ties."""
  per_round = np.asarray(per_round, np.float64)
  rounds = np.arange(1, len(per_round) + 1)
  sampled = (rounds % sample_every == 0) | (rounds == len(per_round))
  best = int(np.argmax(np.where(sampled, per_round, -np.inf)))
  return best + 1, float(per_round[best])


# The FEDORA paper's Figure 3 claim about its imbalanced setting (Table 3): methods that
# regularise towards an average model (Ditto, FedPer) help only the clients whose rotation
# is near the large client's. Distances in degrees: near <= 30 < middle < 90 <= far.
ROTATION_DISTANCE_GROUPS = ("near", "middle", "far")


def rotation_distance(angles: np.ndarray, reference: float) -> np.ndarray:
  """Degrees between each rotation in `angles` and `reference`, in [0, 180]."""
  return np.abs((np.asarray(angles, np.float64) - reference + 180.0) % 360.0 - 180.0)


def relative_accuracy_by_distance(angles: np.ndarray, n_train: np.ndarray,
                                  r_acc: np.ndarray) -> dict[str, tuple[int, float | None]]:
  """{group: (clients, mean R-Acc_k)} of the clients other than the largest (most training
  samples), grouped by their rotation's distance from the largest client's (None where a
  group is empty or R-Acc_k undefined for all its clients)."""
  angles, n_train = np.asarray(angles, np.float64), np.asarray(n_train)
  r_acc = np.asarray(r_acc, np.float64)
  largest = int(np.argmax(n_train))
  distance = rotation_distance(angles, angles[largest])
  others = np.arange(len(angles)) != largest
  masks = {"near": distance <= 30, "middle": (distance > 30) & (distance < 90),
           "far": distance >= 90}
  return {group: (int((others & mask).sum()), defined_mean(r_acc[others & mask]))
          for group, mask in masks.items()}
