"""Per-round metrics as TensorBoard event files, through tensorboardX (no TensorFlow).

A run logs to <workdir>/tensorboard/<algorithm>, so the LOCAL reference it trains lands
beside it (tensorboard/local) and `tensorboard --logdir <workdir>/tensorboard` overlays
the two under the same tags.

  with RoundWriter(workdir, "fedora") as on_round:
    run_algorithm(..., on_round=on_round)
"""

import os

import numpy as np
from tensorboardX import SummaryWriter

from fedora_jax.rounds import RoundMetrics

# RoundMetrics field -> TensorBoard tag; each is logged as its mean over clients.
MEAN_TAGS = {"train_loss": "train/loss", "val_loss": "val/loss", "val_score": "val/accuracy",
             "test_loss": "test/loss", "test_score": "test/accuracy"}
# RoundMetrics field -> tag, logged as its sum over clients (what the round sent).
SUM_TAGS = {"bytes_up": "communication/bytes_up", "bytes_down": "communication/bytes_down"}
# A regression's val_score / test_score hold the mean absolute error.
_REGRESSION_TAGS = {"val/accuracy": "val/mae", "test/accuracy": "test/mae"}


def tensorboard_dir(workdir: str, algorithm: str) -> str:
  return os.path.join(workdir, "tensorboard", algorithm)


def round_scalars(metrics: RoundMetrics, algorithm: str,
                  task: str = "classification") -> dict[str, float]:
  """Tag -> mean over clients, for one round; algorithm extras go under `<algorithm>/`."""
  # A field no client reported this round (test under --eval_every) is left out.
  scalars = {tag: float(np.nanmean(getattr(metrics, field))) for field, tag in MEAN_TAGS.items()
             if not np.isnan(getattr(metrics, field)).all()}
  if task == "regression":
    scalars = {_REGRESSION_TAGS.get(tag, tag): value for tag, value in scalars.items()}
  scalars.update({tag: float(np.sum(getattr(metrics, field), dtype=np.int64))
                  for field, tag in SUM_TAGS.items() if getattr(metrics, field) is not None})
  scalars.update({f"{algorithm}/{name}": float(np.nanmean(values))  # NaN: sat out
                  for name, values in metrics.extra.items()})
  return scalars


class RoundWriter:
  """`on_round` callback for run_algorithm that writes each round's scalars.

  Also a histogram of the per-client test accuracies: a personalized method's spread
  across clients is part of what it is judged on. Use as a context manager so the
  events are flushed even when training stops with an error.
  """

  def __init__(self, workdir: str, algorithm: str, task: str = "classification",
               series: dict[str, np.ndarray] | None = None):
    self.algorithm = algorithm
    self.task = task
    # Tag -> a value per round [rounds] known outside the round (DP's epsilon).
    self.series = series or {}
    self.logdir = tensorboard_dir(workdir, algorithm)
    self._writer = SummaryWriter(self.logdir)

  def __call__(self, round_number: int, metrics: RoundMetrics) -> None:
    for tag, value in round_scalars(metrics, self.algorithm, self.task).items():
      self._writer.add_scalar(tag, value, round_number)
    for tag, values in self.series.items():
      if np.isfinite(values[round_number - 1]):
        self._writer.add_scalar(tag, float(values[round_number - 1]), round_number)
    histogram = "test/client_mae" if self.task == "regression" else "test/client_accuracy"
    if not np.isnan(metrics.test_score).all():
      self._writer.add_histogram(histogram, np.asarray(metrics.test_score), round_number)

  def close(self) -> None:
    self._writer.close()

  def __enter__(self) -> "RoundWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
