"""Per-round diagnosis of coaching under client selection.

Runs coaching round by round on the split the run flags describe (those of
experiments.main) and, for the clients each round samples, records:
  * test accuracy of their model before the round, of their coaching model s_i, after
    coaching's local training, and after plain local training from the same model with
    the same batches (LOCAL's step, the counterfactual without the pull);
  * the coaching distance ||w_i - s_i|| per layer before and after training, and the
    pull's gradient norm 2 lambda ||w - s|| (squared f_s) against ||w_i^l||;
  * the relation cube's rows, sampled against stale clients: r_ii, row sums, the weight
    a row puts on clients never trained so far, and how far R moved from its start.

  python scripts/coaching_diagnose.py --diag_rounds=10 --diag_out=results/x.json \
      --dataset=mnist --partition=dirichlet --dirichlet_alpha=0.1 --num_clients=100 \
      --participation=0.1 --model=coaching_cnn --local_epochs=5 --lr=0.01 --momentum=0 \
      --weight_decay=0 --val_fraction=0.1 --data_dir=../shared/data --algorithm=coaching

Nothing is written but --diag_out.

  python scripts/coaching_diagnose.py --diag_summary=results/coaching2_diagnosis/x.json

prints a file's rounds as a table (no training), and

  python scripts/coaching_diagnose.py --diag_gap=results/coaching2

reads a table's workdir (<cell>/seed<n>/{local,coaching}/history.npz) and prints, per
cell and over its seeds, coaching's mean test accuracy minus LOCAL's at chosen rounds and,
at the last round, by how many rounds each client trained (both rows draw the same
clients each round, so the groups hold the same clients).
"""

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import flags as run_flags  # noqa: E402  (defines the run flags)
from fedora_jax import algorithms, simulation  # noqa: E402
from fedora_jax import config as config_lib  # noqa: E402
from fedora_jax.algorithms.base import AlgorithmState  # noqa: E402
from fedora_jax.algorithms.layers import layer_names  # noqa: E402
from fedora_jax.data import datasets  # noqa: E402
from fedora_jax.models import build_model  # noqa: E402
from fedora_jax.rounds import (RoundState, build_train_round, evaluate_clients,  # noqa: E402
                               num_sampled_clients, sampled_clients)

flags.DEFINE_integer("diag_rounds", 10, "rounds to run and measure")
flags.DEFINE_string("diag_out", None, "where to write the per-round measurements (JSON)")
flags.DEFINE_string("diag_summary", None, "print this file's per-round table and exit")
flags.DEFINE_string("diag_gap", None, "print coaching minus LOCAL in this table workdir and exit")
FLAGS = flags.FLAGS


def layer_distances(models, centers) -> np.ndarray:
  """[K, L]: ||models_i^l - centers_i^l|| per client and layer."""
  names = layer_names(jax.tree.map(lambda a: a[0], models))
  out = []
  for name in names:
    pairs = zip(jax.tree.leaves(models["params"][name]), jax.tree.leaves(centers["params"][name]))
    out.append(sum(np.sum(np.square(np.asarray(a - b).reshape(a.shape[0], -1)), axis=1)
                   for a, b in pairs))
  return np.sqrt(np.stack(out, axis=1))


def layer_norms(models) -> np.ndarray:
  zeros = jax.tree.map(jnp.zeros_like, models)
  return layer_distances(models, zeros)


def relation_rows(relation: np.ndarray, rows: np.ndarray, never: np.ndarray) -> dict:
  """Means over `rows` of r_ii, the row sums and the weight on never-trained clients, per
  layer."""
  r = relation[rows]                                     # [n, L, K]
  diag = relation[rows, :, rows]                         # [n, L]
  return {"r_ii": diag.mean(0).tolist(), "row_sum": r.sum(-1).mean(0).tolist(),
          "on_never_trained": r[..., never].sum(-1).mean(0).tolist()}


def summary(path: str) -> str:
  """A markdown table of a --diag_out file: per round, the sampled clients' mean test
  accuracy before, of s_i, after coaching and after LOCAL's step from the same model;
  the pull's gradient norm before and after training; the mean update norm over layers
  against LOCAL's step's, and the mean weight norm; r_ii of the sampled and the stale
  rows and the sampled rows' weight on never-trained clients (means over layers); how
  far R moved from its start."""
  with open(path) as f:
    rounds = json.load(f)["rounds"]
  lines = ["| round | never trained after it | before | s_i | after coaching |"
           " after LOCAL step | pull 2 lam norm(w - s) before -> after |"
           " update norm: coaching / LOCAL step (weight norm) |"
           " r_ii sampled / stale rows | sampled rows' weight on never-trained |"
           " R moved |", "|" + "---|" * 11]
  for r in rounds:
    rows, stale = r["relation_rows"]["sampled"], r["relation_rows"]["stale"]
    local_update = (f"{np.mean(r['update_norm_local_step']):.3f}"
                    if "update_norm_local_step" in r else "-")
    lines.append(
        f"| {r['round']} | {r['never_trained_fraction']:.2f} | {r['sampled_acc_before']:.3f}"
        f" | {r['sampled_acc_coach_model']:.3f} | {r['sampled_acc_after_coaching']:.3f}"
        f" | {r['sampled_acc_after_local_step']:.3f}"
        f" | {r['pull_grad_norm_before']:.2f} -> {r['pull_grad_norm_after']:.2f}"
        f" | {np.mean(r['update_norm']):.3f} / {local_update} ({np.mean(r['layer_norm']):.2f})"
        f" | {np.mean(rows['r_ii']):.4f} / {np.mean(stale['r_ii']):.4f}"
        f" | {np.mean(rows['on_never_trained']):.2f}"
        f" | {r['relation_moved_from_start']:.1e} |")
  cost = [r["sampled_acc_after_coaching"] - r["sampled_acc_after_local_step"] for r in rounds]
  lines.append(f"\nafter coaching - after LOCAL step, mean over rounds: {np.mean(cost):+.4f}"
               f" (min {np.min(cost):+.4f}, max {np.max(cost):+.4f})")
  return "\n".join(lines)


def gap(workdir: str, rounds=(1, 2, 3, 5, 10, 20, 30, 50)) -> str:
  """Coaching minus LOCAL, in points, per cell of a table's workdir: the mean over clients
  at `rounds`, and at the last round by the clients' number of training rounds
  (clients: n)."""
  lines = [f"{workdir}: coaching minus LOCAL, points"]
  cells = [c for c in sorted(os.listdir(workdir)) if os.path.isdir(os.path.join(workdir, c))]
  for cell in cells:
    seeds = sorted(d for d in os.listdir(os.path.join(workdir, cell)) if d.startswith("seed")
                   and os.path.isdir(os.path.join(workdir, cell, d)))
    if not seeds:
      continue
    by_round, by_sessions = [], {}
    for seed in seeds:
      runs = [np.load(os.path.join(workdir, cell, seed, row, "history.npz"))
              for row in ("local", "coaching")]
      local, coached = (run["test_acc"] for run in runs)
      by_round.append(coached.mean(1) - local.mean(1))
      sessions = (runs[0]["local_steps"] > 0).sum(0)
      for n in np.unique(sessions):
        group = sessions == n
        counts = by_sessions.setdefault(int(n), [0, 0.0])
        counts[0] += int(group.sum())
        counts[1] += float((coached[-1][group] - local[-1][group]).sum())
    per_round = np.mean(by_round, 0)
    shown = [r for r in rounds if r <= len(per_round)]
    lines.append(f"{cell} ({len(seeds)} seeds): rounds " + ", ".join(
        f"{r}: {100 * per_round[r - 1]:+.1f}" for r in shown))
    if len(by_sessions) > 1:
      lines.append("  last round, by rounds trained (clients, all seeds): " + ", ".join(
          f"{n} ({c}): {100 * total / c:+.1f}" for n, (c, total) in sorted(by_sessions.items())))
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.diag_summary:
    print(summary(FLAGS.diag_summary))
    return
  if FLAGS.diag_gap:
    print(gap(FLAGS.diag_gap))
    return
  config = run_flags.experiment_config()
  train = dataclasses.replace(config.train, rounds=FLAGS.diag_rounds)
  config = config_lib.resolve(config)
  data_config = config.data
  federated = datasets.build_federated_dataset(
      data_config.dataset, data_config.data_dir, data_config.num_clients,
      data_config.setting, data_config.data_seed, data_config.max_pad_ratio,
      data_source=data_config.data_source, partition_config=data_config.partition)
  data = federated.data
  model = build_model(config.model.name, data.num_classes, config.model.hidden)
  trainer = simulation.client_trainer(model, data, train)
  coach_config = config.algorithm.config
  algorithm = simulation.build_algorithm(algorithms.make("coaching", coach_config), trainer)
  local = simulation.build_algorithm(algorithms.make("local"), trainer)
  keys = simulation.root_keys(train.seed)
  params = simulation.initial_model(model, data, keys["init"])
  state = RoundState(round=jnp.zeros((), jnp.int32), algorithm=simulation.jitted_init(
      algorithm, trainer, data)(params, data.buckets, keys["algorithm"]))
  start_relation = np.asarray(state.algorithm.server.relation)

  def round_fn(alg):
    return jax.jit(build_train_round(alg, trainer, data, train.client_chunk,
                                     train.participation, client_weights=train.client_weights))
  coach_round, local_round = round_fn(algorithm), round_fn(local)
  evaluate = jax.jit(lambda p, b: evaluate_clients(trainer, p, data, b, train.client_chunk,
                                                   split_names=("test",))[0].score)
  broadcast = jax.jit(algorithm.broadcast)
  num_clients = data.num_clients
  num_sampled = num_sampled_clients(train.participation, num_clients)
  lam = coach_config.lam
  trained_ever = np.zeros(num_clients, bool)
  accuracy = np.asarray(evaluate(state.algorithm.clients, data.buckets))
  records = []
  for r in range(train.rounds):
    began = time.perf_counter()
    active = np.asarray(sampled_clients(jax.random.fold_in(keys["train"], state.round),
                                        num_clients, num_sampled))
    server, before = state.algorithm
    coach = broadcast(server, before)
    coach_accuracy = np.asarray(evaluate(coach, data.buckets))
    gap_before = layer_distances(before, coach)
    norms = layer_norms(before)
    relation = np.asarray(server.relation)
    rows = {"sampled": relation_rows(relation, active, ~trained_ever),
            "stale": relation_rows(relation, ~active, ~trained_ever)}
    counterfactual = RoundState(round=state.round,
                                algorithm=AlgorithmState(server=(), clients=before))
    local_state, local_metrics = local_round(counterfactual, data.buckets, keys["train"])
    state, metrics = coach_round(state, data.buckets, keys["train"])
    after = state.algorithm.clients
    gap_after = layer_distances(after, coach)
    moved = layer_distances(after, before)
    moved_local = layer_distances(local_state.algorithm.clients, before)
    trained_ever |= active
    after_accuracy = np.asarray(metrics.test_score)
    s = active
    record = {
        "round": r + 1,
        "sampled": np.flatnonzero(s).tolist(),
        "never_trained_fraction": float(1 - trained_ever.mean()),
        "acc_all_mean": float(after_accuracy.mean()),
        "sampled_acc_before": float(accuracy[s].mean()),
        "sampled_acc_coach_model": float(coach_accuracy[s].mean()),
        "sampled_acc_after_coaching": float(after_accuracy[s].mean()),
        "sampled_acc_after_local_step": float(np.asarray(local_metrics.test_score)[s].mean()),
        "coach_distance_before": gap_before[s].mean(0).tolist(),
        "coach_distance_after": gap_after[s].mean(0).tolist(),
        "pull_grad_norm_before": float(2 * lam * np.sqrt((gap_before[s] ** 2).sum(1)).mean()),
        "pull_grad_norm_after": float(2 * lam * np.sqrt((gap_after[s] ** 2).sum(1)).mean()),
        "layer_norm": norms[s].mean(0).tolist(),
        "update_norm": moved[s].mean(0).tolist(),
        "update_norm_local_step": moved_local[s].mean(0).tolist(),
        "relation_rows": rows,
        "relation_moved_from_start": float(np.abs(relation - start_relation).mean()),
        "seconds": time.perf_counter() - began,
    }
    records.append(record)
    accuracy = after_accuracy
    print(f"round {r + 1}: sampled acc before {record['sampled_acc_before']:.3f}"
          f" coach-model {record['sampled_acc_coach_model']:.3f}"
          f" after coaching {record['sampled_acc_after_coaching']:.3f}"
          f" after local step {record['sampled_acc_after_local_step']:.3f};"
          f" ||w-s|| {np.round(record['coach_distance_before'], 3).tolist()} ->"
          f" {np.round(record['coach_distance_after'], 3).tolist()};"
          f" r_ii sampled {np.round(rows['sampled']['r_ii'], 4).tolist()}"
          f" on never-trained {np.round(rows['sampled']['on_never_trained'], 3).tolist()}"
          f" ({record['seconds']:.0f} s)", flush=True)
  if FLAGS.diag_out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.diag_out)), exist_ok=True)
    with open(FLAGS.diag_out, "w") as f:
      json.dump({"argv": sys.argv[1:], "layers": layer_names(params),
                 "coaching": coach_config._asdict(), "rounds": records}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
