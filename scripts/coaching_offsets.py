"""LOCAL's and FedAvg's offsets in the coaching tables: the candidate
readings of how a client's test data is drawn, and of which FedAvg model is scored.

The coaching paper (Zhi et al., AAAI 2024, line 234) says only "10% training data and
test data is selected randomly" (Table 1) and "all the training and test data are used"
(Table 2). Our partition cuts the test set by each client's Dirichlet class shares
(fedora_jax/data/partitions.py, step 4). This trains LOCAL and FedAvg once each on the
cell the run flags describe and, after every round, scores them under each reading:

  test data ("shares": the table's; "uniform": the same images dealt to the clients
  uniformly at random, each keeping its test size; "whole": every client scored on the
  union of the clients' test sets, the dataset's whole (sampled) test set);
  FedAvg's model ("global": the aggregate after the round, the table's; "local": each
  client's model after its local training, before aggregation; FedProx with mu = 0 and
  --fedprox_evaluate=local keeps them, and its step is FedAvg's).

Each reading's number is the table's metric: the best round of the plain mean over
clients. Nothing is written but --offsets_out (JSON, per round and client).

  python scripts/coaching_offsets.py --offsets_out=results/coaching1_offsets/mnist_0.1_seed0.json \
      --dataset=mnist --partition=dirichlet --dirichlet_alpha=0.1 --data_fraction=0.1 \
      --num_clients=10 --model=coaching_cnn --local_epochs=5 --lr=0.01 --momentum=0 \
      --weight_decay=0 --batch_size=64 --val_fraction=0.1 --rounds=50 --seed=0 \
      --data_dir=../shared/data
  python scripts/coaching_offsets.py --offsets_summary=results/coaching1_offsets/mnist_0.1_seed0.json
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import flags as run_flags  # noqa: E402  (defines the run flags)
from fedora_jax import algorithms, simulation  # noqa: E402
from fedora_jax import config as config_lib  # noqa: E402
from fedora_jax.algorithms.fedprox import FedProxConfig  # noqa: E402
from fedora_jax.data import datasets  # noqa: E402
from fedora_jax.data.client_data import ClientData, pad_and_stack  # noqa: E402
from fedora_jax.models import build_model  # noqa: E402
from fedora_jax.sweep.tables import PAPER_DIR  # noqa: E402

flags.DEFINE_string("offsets_out", None, "where to write the per-round scores (JSON)")
flags.DEFINE_string("offsets_summary", None, "print this file's readings and exit")
flags.DEFINE_list("offsets_rows", ["local", "fedavg"], "which rows to train (local, fedavg)")
FLAGS = flags.FLAGS

READINGS = ("shares", "uniform", "whole")


def test_sets(tests: list[tuple[np.ndarray, np.ndarray]], seed: int) -> dict[str, ClientData]:
  """Each reading's test data, stacked over the clients (padded, masked): the clients'
  own ("shares"), their union dealt at random in the same sizes ("uniform"), and the
  union for every client ("whole")."""
  xs = np.concatenate([x for x, _ in tests])
  ys = np.concatenate([y for _, y in tests])
  order = np.random.default_rng(seed).permutation(len(ys))
  cuts = np.cumsum([len(y) for _, y in tests])[:-1]
  dealt = np.split(order, cuts)
  return {"shares": pad_and_stack([x for x, _ in tests], [y for _, y in tests]),
          "uniform": pad_and_stack([xs[i] for i in dealt], [ys[i] for i in dealt]),
          "whole": pad_and_stack([xs] * len(tests), [ys] * len(tests))}


def best_round(per_client: np.ndarray) -> tuple[float, int]:
  """The table's metric from [rounds, K] accuracies: the best round's plain mean over
  clients (a fraction) and that round (1-based)."""
  means = per_client.mean(axis=1)
  return float(means.max()), int(means.argmax()) + 1


def summary(path: str) -> str:
  with open(path) as f:
    runs = json.load(f)["scores"]
  lines = ["| row | model | test data | best mean (round) | final |", "|---|---|---|---|---|"]
  for row, models in runs.items():
    for model, readings in models.items():
      for reading in READINGS:
        acc = np.asarray(readings[reading])
        best, at = best_round(acc)
        lines.append(f"| {row} | {model} | {reading} | {100 * best:.2f} ({at}) |"
                     f" {100 * acc[-1].mean():.2f} |")
  return "\n".join(lines)


# (row, model) as the tables' rows name them, in the docs' order.
TABLE_ROWS = (("local", "local", "LOCAL"),
              ("fedavg", "global", "FedAvg, global model (the table's)"),
              ("fedavg", "local", "FedAvg, each client's local model"))


def table(folder: str, seed: int = 0) -> str:
  """docs/coaching.md's offsets table: every Table 1 cell with both rows' files in
  `folder` (<cell>_seed<s>_{local,fedavg}.json), each reading's best mean accuracy, %
  (its round), beside the paper's number."""
  with open(os.path.join(PAPER_DIR, "coaching_tables.json")) as f:
    columns = json.load(f)["coaching1"]["columns"]
  lines = ["| cell | row, model | shares (the table's) | uniform | whole | the paper |",
           "|---|---|---|---|---|---|"]
  for cell, column in columns.items():
    paths = {row: os.path.join(folder, f"{cell}_seed{seed}_{row}.json")
             for row in ("local", "fedavg")}
    if not all(os.path.exists(path) for path in paths.values()):
      continue
    scores = {}
    for row, path in paths.items():
      with open(path) as f:
        scores[row] = json.load(f)["scores"][row]
    for row, model, label in TABLE_ROWS:
      cells = []
      for reading in READINGS:
        best, at = best_round(np.asarray(scores[row][model][reading]))
        cells.append(f"{100 * best:.2f} ({at})")
      paper = column["values"][row]["mean"]
      lines.append(f"| {column['label']} | {label} | {' | '.join(cells)} | {paper:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if FLAGS.offsets_summary:
    print(summary(FLAGS.offsets_summary))
    return
  if not FLAGS.offsets_out:
    raise app.UsageError("--offsets_out (or --offsets_summary) is required")
  config = config_lib.resolve(run_flags.experiment_config())
  data_config, train = config.data, config.train
  federated = datasets.build_federated_dataset(
      data_config.dataset, data_config.data_dir, data_config.num_clients,
      data_config.setting, data_config.data_seed, data_config.max_pad_ratio,
      data_source=data_config.data_source, partition_config=data_config.partition)
  data = federated.data
  clients = [federated.partition.clients[i] for i in federated.client_ids]
  sets = {name: jax.device_put(split) for name, split in test_sets(
      [(c.x_test, c.y_test) for c in clients], train.seed).items()}
  model = build_model(config.model.name, data.num_classes, config.model.hidden)
  trainer = simulation.client_trainer(model, data, train)
  per_client = jax.jit(jax.vmap(lambda p, d: trainer.evaluate(p, d).score))
  shared = jax.jit(jax.vmap(lambda p, d: trainer.evaluate(p, d).score, in_axes=(None, 0)))

  runs = {"local": algorithms.make("local"),
          "fedavg": algorithms.make("fedprox", FedProxConfig(mu=0.0, evaluate="local"))}
  scores: dict = {}
  record = {"flags": sys.argv[1:], "test_sizes": [int(len(c.y_test)) for c in clients],
            "scores": scores}
  os.makedirs(os.path.dirname(FLAGS.offsets_out) or ".", exist_ok=True)

  def write():  # after every round: a run cut short keeps the rounds it scored
    with open(FLAGS.offsets_out, "w") as f:
      json.dump(record, f)
  for row in FLAGS.offsets_rows:
    algorithm = runs[row]
    models = ("local",) if row == "local" else ("global", "local")
    scores[row] = {m: {r: [] for r in READINGS} for m in models}

    def on_state(round_number, state, row=row, models=models):
      for model_name in models:
        for reading in READINGS:
          if model_name == "global":
            acc = shared(state.algorithm.server, sets[reading])
          else:
            acc = per_client(state.algorithm.clients, sets[reading])
          scores[row][model_name][reading].append(np.asarray(acc).tolist())
      write()
    simulation.run_algorithm(algorithm, model, data, train, on_state=on_state,
                             progress="auto")
  print(summary(FLAGS.offsets_out))


if __name__ == "__main__":
  app.run(main)
