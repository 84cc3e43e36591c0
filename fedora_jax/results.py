"""Turns a run's history into the paper's metrics, `results.json` and a printed table.

A regression run (run_info["task"] == "regression") reports the mean absolute error in
place of accuracy: every `acc` key is named `mae` instead (`r_acc` -> `r_mae`,
`best_val_acc` -> `best_val_mae`, ...), the best-validation round is the one with the
lowest validation MAE, and the history's val_score / test_score are saved as val_mae /
test_mae (val_acc / test_acc for classification) (see fedora_jax.metrics for R-MAE and PTR).
"""

import csv
import json
import math
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from fedora_jax import communication, metrics
from fedora_jax.algorithms import REFERENCE
from fedora_jax.data.partitions import PartitionConfig
from fedora_jax.errors import ConfigError
from fedora_jax.simulation import RunResult


class ClientScores(NamedTuple):
  """Per-client test accuracy [K] (regression: MAE) at the final round and at the
  best-validation round."""
  final: np.ndarray
  best_val: np.ndarray
  best_round: int  # 1-based


def task_of(info: dict[str, Any]) -> str:
  return info.get("task", "classification")


def score_name(task: str) -> str:
  """The per-client score's name in results.json: acc, or mae for a regression."""
  return "mae" if task == "regression" else "acc"


def client_scores(result: RunResult, task: str = "classification") -> ClientScores:
  # The history holds numpy arrays (RoundMetrics' fields are typed as the round's).
  val, test = np.asarray(result.history.val_score), np.asarray(result.history.test_score)
  best = metrics.best_validation_round(val, lower_is_better=task == "regression")
  return ClientScores(final=test[-1], best_val=test[best], best_round=best + 1)


# Fields a LOCAL reference must share with the run it is compared against.
_REFERENCE_KEYS = ("dataset", "setting", "num_clients", "data_seed", "seed",
                   "model", "hidden", "partition",  # partition: absent for rotation
                   "split")  # absent: our own sampling
# A LOCAL run of at least as many rounds serves: it is read at this run's last round.
_REFERENCE_TRAIN_KEYS = ("local_epochs", "batch_size", "lr", "momentum", "weight_decay")
# As run flags (those of these names that are flags): a run that changes one cannot use
# that LOCAL as its reference.
REFERENCE_FLAGS = _REFERENCE_KEYS + ("rounds",) + _REFERENCE_TRAIN_KEYS


def _at_defaults(key: str, value: Any, run_value: Any) -> Any:
  """A reference's partition with the fields this run records and it lacks (added since
  it ran) at their defaults: a field added later means its default in older records."""
  if key != "partition" or not isinstance(value, dict) or not isinstance(run_value, dict):
    return value
  defaults = PartitionConfig._field_defaults
  return {**{k: defaults[k] for k in run_value if k not in value and k in defaults}, **value}


def load_reference(path: str, run_info: dict[str, Any]) -> ClientScores:
  """Per-client LOCAL accuracies from a LOCAL run's results.json, checked for the same split."""
  try:
    with open(path) as f:
      reference = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"--reference {path}: cannot read a results.json ({e})") from None
  if reference.get("algorithm") != REFERENCE:
    raise ConfigError(f"--reference {path} is a {reference.get('algorithm')!r} run, not"
                      f" {REFERENCE}")
  if task_of(reference) != task_of(run_info):
    raise ConfigError(f"--reference {path} is a {task_of(reference)} run, this run is a"
                      f" {task_of(run_info)}")
  source = lambda info: info.get("data_source", "files")
  if source(reference) != source(run_info):
    raise ConfigError(f"--reference {path} read its data from {source(reference)}, this run"
                      f" from {source(run_info)}")
  score = score_name(task_of(run_info))
  pairs = [(k, _at_defaults(k, reference.get(k), run_info.get(k)), run_info.get(k))
           for k in _REFERENCE_KEYS]
  pairs += [(k, reference.get("train", {}).get(k), run_info["train"][k])
            for k in _REFERENCE_TRAIN_KEYS]
  mismatched = [(k, theirs, ours) for k, theirs, ours in pairs if theirs != ours]
  if mismatched:
    details = ", ".join(f"{k}={theirs!r} (run: {ours!r})" for k, theirs, ours in mismatched)
    raise ConfigError(f"--reference {path} was made with other settings: {details}")
  rounds = run_info["rounds"]
  if reference.get("rounds") < rounds:
    raise ConfigError(f"--reference {path} ran {reference.get('rounds')} rounds, fewer than"
                      f" this run's {rounds}")
  if reference["rounds"] > rounds:
    return _reference_at_round(path, reference, rounds, task_of(run_info))
  clients = sorted(reference["clients"], key=lambda c: c["id"])
  return ClientScores(final=np.array([c[score] for c in clients]),
                          best_val=np.array([c[f"best_val_{score}"] for c in clients]),
                          best_round=reference["best_val"]["round"])


def _reference_at_round(path: str, reference: dict, rounds: int, task: str) -> ClientScores:
  """A longer LOCAL run's scores as they stood after `rounds` rounds, from its
  history.npz: the test scores of that round, and of the best-validation round among
  the first `rounds` (clients in id order, as the history holds them)."""
  score = score_name(task)
  history_path = os.path.join(os.path.dirname(path), "history.npz")
  try:
    with np.load(history_path) as history:
      test, val = history[f"test_{score}"][:rounds], history[f"val_{score}"][:rounds]
  except (OSError, KeyError, ValueError) as e:
    raise ConfigError(f"--reference {path} ran {reference['rounds']} rounds; reading it at"
                      f" round {rounds} needs its history.npz ({e})") from None
  best = metrics.best_validation_round(val, lower_is_better=task == "regression")
  if not (np.isfinite(test[-1]).all() and np.isfinite(test[best]).all()):
    raise ConfigError(f"--reference {path} did not score test at round {rounds} (it ran"
                      " with --eval_every); give it a LOCAL run of as many rounds")
  return ClientScores(final=test[-1], best_val=test[best], best_round=best + 1)


def _rounded(x):
  return None if x is None or not np.isfinite(x) else round(float(x), 6)


def _summaries(acc, local_acc, best_val_acc, local_best_val_acc):
  """[K] accuracies -> final and best-validation summaries, and each one's per-client
  R-Acc."""
  return (metrics.summarize(acc, local_acc), metrics.summarize(best_val_acc, local_best_val_acc),
          metrics.relative_accuracy(acc, local_acc),
          metrics.relative_accuracy(best_val_acc, local_best_val_acc))


def build_results(run_info: dict[str, Any], result: RunResult, ours: ClientScores,
                  local: ClientScores, client_info: dict[str, np.ndarray]) -> dict:
  """The results.json document. Headline numbers are the final round's."""
  if task_of(run_info) == "regression":
    return _build_regression_results(run_info, result, ours, local, client_info)
  final, best, r_final, r_best = _summaries(ours.final, local.final, ours.best_val,
                                            local.best_val)
  clients = []
  for k in range(len(ours.final)):
    entry = {"id": k}  # tolist: scalars, or lists such as class_counts
    entry.update({name: values[k].tolist() for name, values in client_info.items()})
    entry.update(acc=_rounded(ours.final[k]), local_acc=_rounded(local.final[k]),
                 r_acc=_rounded(r_final[k]), best_val_acc=_rounded(ours.best_val[k]),
                 local_best_val_acc=_rounded(local.best_val[k]),
                 best_val_r_acc=_rounded(r_best[k]))
    clients.append(entry)
  return {
      **run_info,
      "reported_round": "final",
      "acc": _rounded(final.acc), "r_acc": _rounded(final.r_acc), "ptr": _rounded(final.ptr),
      "local_acc": _rounded(local.final.mean()),
      "best_val": {"round": ours.best_round, "local_round": local.best_round,
                   "acc": _rounded(best.acc), "r_acc": _rounded(best.r_acc),
                   "ptr": _rounded(best.ptr), "local_acc": _rounded(local.best_val.mean())},
      **communication_totals(result),
      "clients": clients,
  }


def communication_totals(result: RunResult) -> dict:
  """results.json's `bytes_up` and `bytes_down`: what every client sent and received over
  the run (communication.py; null where a resumed checkpoint's rounds were not counted)."""
  history = result.history
  return {"bytes_up": communication.run_total(history.bytes_up),
          "bytes_down": communication.run_total(history.bytes_down)}


def _build_regression_results(run_info: dict[str, Any], result: RunResult,
                               ours: ClientScores, local: ClientScores,
                               client_info: dict[str, np.ndarray]) -> dict:
  """build_results for a regression: MAE, R-MAE and PTR (MAE_k <= LOCAL's) in the
  places of Acc, R-Acc and PTR."""
  final = metrics.summarize_regression(ours.final, local.final)
  best = metrics.summarize_regression(ours.best_val, local.best_val)
  r_final = metrics.relative_mae(ours.final, local.final)
  r_best = metrics.relative_mae(ours.best_val, local.best_val)
  clients = []
  for k in range(len(ours.final)):
    entry = {"id": k}
    entry.update({name: values[k].item() for name, values in client_info.items()})
    entry.update(mae=_rounded(ours.final[k]), local_mae=_rounded(local.final[k]),
                 r_mae=_rounded(r_final[k]), best_val_mae=_rounded(ours.best_val[k]),
                 local_best_val_mae=_rounded(local.best_val[k]),
                 best_val_r_mae=_rounded(r_best[k]))
    clients.append(entry)
  return {
      **run_info,
      "reported_round": "final",
      "mae": _rounded(final.mae), "r_mae": _rounded(final.r_mae), "ptr": _rounded(final.ptr),
      "local_mae": _rounded(local.final.mean()),
      "best_val": {"round": ours.best_round, "local_round": local.best_round,
                   "mae": _rounded(best.mae), "r_mae": _rounded(best.r_mae),
                   "ptr": _rounded(best.ptr), "local_mae": _rounded(local.best_val.mean())},
      **communication_totals(result),
      "clients": clients,
  }


def this_machine() -> str:
  """What this process trains on, for timing.json: the accelerator kind and count, or on
  a CPU the devices and the cores this process may use (taskset narrows them)."""
  if jax.default_backend() == "cpu":
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count())
    return f"cpu x{jax.device_count()}, {cores} core{'' if cores == 1 else 's'}"
  return f"{jax.devices()[0].device_kind} x{jax.device_count()}"


def joined_machines(names) -> str:
  """Machine names, each once, in order: "NVIDIA H200 x1 + cpu x1, 1 core"."""
  return " + ".join(dict.fromkeys(names))


def machines(timing_record: dict) -> str:
  """The machines that trained a run, from its timing.json, in the order they did."""
  return joined_machines(s["machine"] for s in timing_record["segments"]) or "unrecorded"


def run_cost(timing_record: dict) -> dict:
  """A table row's cost from its timing.json, over every process that trained it. A run
  whose every round was trained by processes stopped before they wrote timing.json costs
  NaN seconds (printed "—"), not 0."""
  if timing_record["resumed_from_round"] and not timing_record["segments"]:
    return {"round_seconds": math.nan, "wall_seconds": math.nan,
            "machine": "untimed (trained by a stopped process)"}
  return {"round_seconds": timing_record["round_seconds_all"],
          "wall_seconds": timing_record["seconds_all"],
          "machine": machines(timing_record)}


def timing(result: RunResult, machine: str, earlier: dict | None = None) -> dict:
  """timing.json: wall times, kept out of results.json so that the same flags and seed give
  a byte-identical results.json, resumed or not.

  The top-level fields are this process's. `segments` lists every finished process that
  trained rounds of this run (resumed runs carry the earlier ones over from `earlier`, the
  previous timing.json); `round_seconds_all` and `seconds_all` sum them up, so a sweep
  extended from checkpoints still reports its whole cost. A process killed before it
  wrote this file leaves no segment. A segment names the `machine` it ran on
  (this_machine()), so a table built on several machines says which row ran where.
  """
  first, last = result.resumed_from_round, int(np.shape(result.history.test_score)[0])
  segments = [segment for segment in (earlier or {}).get("segments", [])
              if first and segment["last_round"] <= first]
  if last > first:
    segments.append({"first_round": first, "last_round": last,
                     "compile_seconds": round(result.compile_seconds, 3),
                     "round_seconds": round(result.round_seconds, 5),
                     "train_seconds": round(result.total_seconds, 3),
                     "machine": machine})
  rounds = [s["last_round"] - s["first_round"] for s in segments]
  return {"compile_seconds": round(result.compile_seconds, 3),
          "round_seconds": round(result.round_seconds, 5),
          "train_seconds": round(result.total_seconds, 3),
          "resumed_from_round": first,
          "segments": segments,
          # rounds-weighted mean of the segments' median round times
          "round_seconds_all": round(sum(n * s["round_seconds"] for n, s in
                                         zip(rounds, segments)) / max(sum(rounds), 1), 5),
          "seconds_all": round(sum(s["compile_seconds"] + s["train_seconds"]
                                   for s in segments), 3)}


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_timing(workdir: str, result: RunResult) -> None:
  """timing.json for `result`'s rounds. Written as soon as the rounds end as well as with
  the other files, so a process stopped later (in its LOCAL reference) keeps its times;
  writing it again for the same result changes nothing."""
  os.makedirs(workdir, exist_ok=True)
  timing_path = os.path.join(workdir, "timing.json")
  earlier = _read_json(timing_path) if result.resumed_from_round else None
  trained = np.shape(result.history.test_score)[0] > result.resumed_from_round
  if trained or earlier is None:  # a rerun of a finished run keeps the times it measured
    with open(timing_path, "w") as f:
      json.dump(timing(result, this_machine(), earlier), f, indent=2)


def seconds_text(seconds: float, digits: int) -> str:
  """A table's seconds, "—" for an untimed run (NaN)."""
  return "—" if math.isnan(seconds) else f"{seconds:.{digits}f}"


def cost_cells(cost: dict) -> str:
  """A table row's "s/round | wall s | machine" cells from its run_cost fields."""
  return (f"{seconds_text(cost['round_seconds'], 3)} | {seconds_text(cost['wall_seconds'], 0)}"
          f" | {cost['machine']}")


def write_run_files(workdir: str, results: dict, result: RunResult,
                    series: dict[str, np.ndarray] | None = None) -> None:
  """results.json, timing.json, clients.csv, per-round history (rounds.csv, history.npz),
  artifacts. `series`: name -> a value per round known outside the round (DP's
  dp_epsilon), a column of its own in rounds.csv and an array in history.npz."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  write_timing(workdir, result)
  with open(os.path.join(workdir, "clients.csv"), "w", newline="") as f:
    client_writer = csv.DictWriter(f, fieldnames=list(results["clients"][0]))
    client_writer.writeheader()
    client_writer.writerows(results["clients"])
  history = result.history
  score = "mae" if task_of(results) == "regression" else "acc"  # the files' column names
  per_round = {name.replace("_score", f"_{score}"): getattr(history, name)
               for name in history._fields
               if name != "extra" and getattr(history, name) is not None}
  per_round.update(history.extra)
  series = series or {}
  np.savez_compressed(os.path.join(workdir, "history.npz"), **{**per_round, **series})
  with open(os.path.join(workdir, "rounds.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    # Means over the clients, but the bytes: the round's totals over them.
    writer.writerow(["round"] + [name if name in SUMMED else f"mean_{name}"
                                 for name in per_round] + list(series))
    for r in range(history.test_score.shape[0]):
      writer.writerow([r + 1] + [_sum_text(v[r]) if name in SUMMED else _mean_text(v[r])
                                 for name, v in per_round.items()]
                      + [_mean_text(v[r]) for v in series.values()])
  for name, array in result.artifacts.items():
    np.save(os.path.join(workdir, f"{name}.npy"), array)


# The history's per-client fields that rounds.csv sums over the clients.
SUMMED = ("bytes_up", "bytes_down")


def _sum_text(values: np.ndarray) -> str:
  """rounds.csv's cell of a summed field: the round's total ("" if not counted: -1)."""
  values = np.asarray(values, np.int64)
  return "" if (values < 0).any() else str(int(values.sum()))


def _mean_text(values: np.ndarray) -> str:
  """rounds.csv's cell: the mean over the clients that reported a value (NaN: sat the
  round out); empty where none did (test under --eval_every)."""
  values = np.asarray(values, np.float64)
  return "" if np.isnan(values).all() else f"{float(np.nanmean(values)):.6g}"


def _signed(value: float | None, width: int = 0) -> str:
  """A relative score, signed; "n/a" where it is undefined (LOCAL scored 0: metrics.py)."""
  return format("n/a" if value is None else format(value, "+.4f"), f">{width}")


def _relative_mean(name: str, mean: float | None, results: dict, key: str) -> str:
  """`name` and its mean, saying over how many clients where the per-client `key` of
  `results` is not defined for all."""
  per_client = [c[key] for c in results["clients"]]
  text = f"{name} {_signed(mean)}"
  defined = metrics.defined_count(per_client)
  if defined < len(per_client):
    text += f" (over {defined} of {len(per_client)} clients; LOCAL scored 0 on the others)"
  return text


def split_label(results: dict) -> str:
  """How the run's clients were cut, for titles: "balanced" for the rotated datasets
  (FEDORA's setting), else the partition and the setting: "Dirichlet alpha=0.1, balanced".
  """
  partition = results.get("partition") or {}
  kind, setting = partition.get("kind", "rotation"), results.get("setting", "")
  if kind == "rotation":
    return setting
  if kind == "dirichlet":
    kind = f"Dirichlet alpha={partition['dirichlet_alpha']:g}"
  elif kind == "pathological":
    kind = f"pathological, {partition['classes_per_client']} classes a client"
  return f"{kind}, {setting}" if setting else kind


def plugin_labels(plugins: dict) -> list[str]:
  """results.json's plug-ins that are on, in words: "ala", "confree" or a robust rule
  ("krum"), and an attack with its fraction ("alie 0.2")."""
  def label(plugin: str, value: dict) -> str:
    if plugin == "aggregation":  # ConFREE's config has no rule
      return value.get("rule", "confree")
    if plugin == "attack":
      return f"{value['attack']} {value['fraction']:g}"
    return plugin
  return [label(plugin, value) for plugin, value in plugins.items() if value]


def run_label(results: dict) -> str:
  """"fedavg+ala on rmnist (balanced, 36 clients, seed 0, participation 0.5)": the
  algorithm with its plug-ins, the data, and a participation below 1."""
  name = results["algorithm"] + "".join(
      f"+{label}" for label in plugin_labels(results.get("plugins") or {}))
  participation = (results.get("train") or {}).get("participation", 1.0)
  extra = f", participation {participation:g}" if participation != 1.0 else ""
  return (f"{name} on {results['dataset']} ({split_label(results)},"
          f" {results['num_clients']} clients, seed {results['seed']}{extra})")


def format_table(results: dict) -> str:
  """Per-client table and the summary lines, final round and best-validation round."""
  return format_clients(results) + "\n" + format_summary(results)


def format_clients(results: dict) -> str:
  """One line per client: its score and LOCAL's at the final and best-validation round."""
  score = score_name(task_of(results))
  width = 9 if score == "mae" else 7  # MAE in any unit, accuracy in [0, 1]
  local_width = max(width, 8)
  lines = [f"{'client':>6} {'n_train':>7} {score:>{width}} {'local':>{width}}"
           f" {'r_' + score:>8} {'bv_' + score:>{width}} {'bv_local':>{local_width}}"]
  for c in results["clients"]:
    lines.append(f"{c['id']:>6} {c['n_train']:>7} {c[score]:>{width}.4f}"
                 f" {c['local_' + score]:>{width}.4f} {_signed(c['r_' + score], 8)}"
                 f" {c['best_val_' + score]:>{width}.4f}"
                 f" {c['local_best_val_' + score]:>{local_width}.4f}")
  return "\n".join(lines)


def format_summary(results: dict) -> str:
  """The run's label, and its mean scores, R-Acc and PTR against LOCAL at the final and
  the best-validation round; a DP run's privacy after them."""
  scores = _format_scores(results)
  return scores if not results.get("dp") else f"{scores}\n  {format_privacy(results)}"


def format_privacy(results: dict) -> str:
  """A DP run's guarantee in one line (results.json's `dp` block)."""
  dp = results["dp"]
  if dp["epsilon"] is None:
    return f"user-level DP: no noise, no guarantee (updates clipped to {dp['clip_norm']:g})"
  cohort = (f"{dp['expected_clients']:g} of {results['num_clients']} clients a round"
            if dp["sampling"] == "fixed" else
            f"each of {results['num_clients']} clients with probability {dp['sampling_rate']:g}")
  return (f"user-level DP: epsilon {dp['epsilon']:.4g} at delta {dp['delta']:g} after"
          f" {results['rounds']} rounds ({dp['accountant']}; {cohort}; noise multiplier"
          f" {dp['noise_multiplier']:.4g}, clip norm {dp['clip_norm']:g})")


def _format_scores(results: dict) -> str:
  best = results["best_val"]
  if task_of(results) == "regression":
    nan = float("nan")
    fmt = lambda x, spec: format(nan if x is None else x, spec)
    return "\n".join([
        f"{run_label(results)}, {results['rounds']} rounds (regression; MAE: lower is"
        " better, R-MAE = (MAE_LOCAL - MAE) / MAE_LOCAL, PTR = share of clients with MAE"
        " <= LOCAL's):",
        f"  final round {results['rounds']}:        MAE {fmt(results['mae'], '.4f')}"
        f"  {_relative_mean('R-MAE', results['r_mae'], results, 'r_mae')}"
        f"  PTR {fmt(results['ptr'], '.4f')}"
        f"  (LOCAL MAE {fmt(results['local_mae'], '.4f')})",
        f"  best-validation round {best['round']}: MAE {fmt(best['mae'], '.4f')}"
        f"  {_relative_mean('R-MAE', best['r_mae'], results, 'best_val_r_mae')}"
        f"  PTR {fmt(best['ptr'], '.4f')}"
        f"  (LOCAL MAE {fmt(best['local_mae'], '.4f')}, its round {best['local_round']})"])
  if results["local_acc"] is None:  # --reference=none: no LOCAL, so no R-Acc or PTR
    return "\n".join([
        f"{run_label(results)}, {results['rounds']} rounds (no LOCAL reference):",
        f"  final round {results['rounds']}:        Acc {results['acc']:.4f}",
        f"  best-validation round {best['round']}: Acc {best['acc']:.4f}"])
  return "\n".join([
      f"{run_label(results)}, {results['rounds']} rounds:",
      f"  final round {results['rounds']}:        Acc {results['acc']:.4f}"
      f"  {_relative_mean('R-Acc', results['r_acc'], results, 'r_acc')}  PTR {results['ptr']:.4f}"
      f"  (LOCAL Acc {results['local_acc']:.4f})",
      f"  best-validation round {best['round']}: Acc {best['acc']:.4f}"
      f"  {_relative_mean('R-Acc', best['r_acc'], results, 'best_val_r_acc')}"
      f"  PTR {best['ptr']:.4f}"
      f"  (LOCAL Acc {best['local_acc']:.4f}, its round {best['local_round']})"])


def format_row(results: dict) -> str:
  """One line for a sweep's row: the final round's scores against LOCAL."""
  if task_of(results) == "regression":
    return (f"MAE {format(float('nan') if results['mae'] is None else results['mae'], '.4f')}"
            f"  PTR {format(float('nan') if results['ptr'] is None else results['ptr'], '.4f')}")
  r_acc = results["r_acc"]
  return (f"Acc {results['acc']:.4f}  R-Acc {'n/a' if r_acc is None else format(r_acc, '+.4f')}"
          f"  PTR {results['ptr']:.4f}  (LOCAL {results['local_acc']:.4f})")


def new_client_results(client_ids: np.ndarray, angles: np.ndarray, accuracy,
                       epochs: int) -> dict:
  """The `new_clients` block of results.json: means and per-client accuracies."""
  per_client = [{"id": int(k), **({"angle": float(angles[k])} if angles is not None else {}),
                 **{name: _rounded(values[i]) for name, values in accuracy._asdict().items()}}
                for i, k in enumerate(client_ids)]
  return {"count": len(client_ids), "finetune_epochs": epochs,
          **{name: _rounded(np.mean(values)) for name, values in accuracy._asdict().items()},
          "clients": per_client}


def format_new_clients(block: dict) -> str:
  return "\n".join([
      f"new clients ({block['count']}, held out of training; FEDORA Algorithm 2):",
      f"  without labels: FEDORA propagated model {block['fedora_without_labels']:.4f}"
      f"   FedAvg global model {block['fedavg_without_labels']:.4f}",
      f"  with labels ({block['finetune_epochs']} epochs): FEDORA {block['fedora_with_labels']:.4f}"
      f"   FedAvg fine-tuned {block['fedavg_with_labels']:.4f}"])
