"""How much a client's data leaks (fedora_jax/leakage.py; docs/leakage.md):

  python -m experiments.leakage --measure=dlg --batch_sizes=1,2,4,8 --out=results/leakage
      DLG (and iDLG at batch 1) against one local SGD step of each of --trials clients,
      the step on its first B training images at the run's initial model: PSNR, SSIM and
      label accuracy per batch size (dlg.json), the images beside their reconstructions
      (dlg.png);
  python -m experiments.leakage --measure=membership --algorithms=local,fedavg,ditto \\
      --rounds=30 --out=results/leakage
      trains each algorithm, then the loss-threshold attack's AUC on each client's
      training samples against its test samples, under the model it ends with
      (personalised) and, where the algorithm sends one, under the global model it
      receives (membership.json, membership.md).

Takes the run flags of experiments.main that set the data, model and training (--dataset,
--data_dir, --num_clients, --seed, --hidden, --model, --lr, --local_epochs, --batch_size,
--momentum, --weight_decay, --rounds); the rest are this command's.
"""

import functools
import json
import os

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from experiments import flags as run_flags
from experiments.cli import run_command
from fedora_jax import algorithms, leakage
from fedora_jax.data import datasets
from fedora_jax.errors import ConfigError
from fedora_jax.models import build_model
from fedora_jax.simulation import (TrainConfig, client_trainer, initial_model, root_keys,
                                   run_algorithm)

FLAGS = run_flags.FLAGS
_MEASURE = flags.DEFINE_enum("measure", "dlg", ["dlg", "membership"],
                             "What to measure: dlg (gradient inversion) or membership"
                             " (loss-threshold membership inference).")
_OUT = flags.DEFINE_string("out", "results/leakage", "Folder for the JSON, table and figure.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"],
                                 "dlg: the batch sizes of the attacked step.")
_TRIALS = flags.DEFINE_integer("trials", 4, "dlg: clients attacked per batch size (clients"
                               " 0, 1, ...).", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 300, "dlg: L-BFGS steps (DLG's 300).", lower_bound=1)
_ALGORITHMS = flags.DEFINE_list("algorithms", ["local", "fedavg", "ditto", "fedrep", "fedora"],
                                "membership: the algorithms trained and attacked.")


def _data_and_model():
  dataset = FLAGS.dataset
  spec = datasets.get_spec(dataset)
  if spec.task != "classification":
    raise ConfigError(f"--measure reads class labels; {dataset} is a {spec.task}")
  federated = datasets.build_federated_dataset(
      dataset, FLAGS.data_dir, FLAGS.num_clients or spec.num_clients, FLAGS.setting,
      FLAGS.seed)
  model = build_model(FLAGS.model or spec.model, federated.data.num_classes,
                      tuple(int(w) for w in FLAGS.hidden))
  return federated.data, model


def _train_config() -> TrainConfig:
  return TrainConfig(rounds=FLAGS.rounds, local_epochs=FLAGS.local_epochs,
                     batch_size=FLAGS.batch_size, lr=FLAGS.lr, momentum=FLAGS.momentum,
                     weight_decay=FLAGS.weight_decay, seed=FLAGS.seed, log_every=0)


def _client_batch(data, client: int, size: int):
  """Client `client`'s first `size` training samples (x, y)."""
  for ids, bucket in zip(data.client_ids, data.buckets):
    where = np.flatnonzero(np.asarray(ids) == client)
    if where.size:
      n = int(bucket.train.n[where[0]])
      if size > n:
        raise ConfigError(f"--batch_sizes: client {client} holds {n} training samples,"
                          f" fewer than {size}")
      return (jnp.asarray(bucket.train.x[where[0], :size]),
              jnp.asarray(bucket.train.y[where[0], :size]))
  raise ConfigError(f"--trials: there is no client {client}")


def measure_dlg() -> dict:
  data, model = _data_and_model()
  params = initial_model(model, data, root_keys(FLAGS.seed)["init"])
  rows = []
  for size in (int(b) for b in _BATCH_SIZES.value):
    for client in range(_TRIALS.value):
      x, y = _client_batch(data, client, size)
      update = leakage.fedsgd_update(model.apply, params, x, y, FLAGS.lr)
      target = leakage.gradient_from_update(update, FLAGS.lr)
      originals = np.asarray(x, np.float32) / 255.0
      key = jax.random.fold_in(jax.random.key(FLAGS.seed), 1000 * size + client)
      methods = {"dlg": None}
      if size == 1:
        methods["idlg"] = leakage.idlg_label(target, data.num_classes)[None]
      for method, labels in methods.items():
        invert = functools.partial(leakage.invert_gradient, model.apply, params, target,
                                   x.shape[1:], size, data.num_classes, steps=_STEPS.value,
                                   labels=labels)
        found = jax.jit(invert)(key)
        images = np.asarray(found.images)
        pairs = leakage.pair_reconstructions(originals, images)
        rows.append({
            "batch": size, "client": client, "method": method,
            "psnr": [leakage.psnr(originals[i], images[j]) for i, j in enumerate(pairs)],
            "ssim": [leakage.ssim(originals[i], images[j]) for i, j in enumerate(pairs)],
            "label_accuracy": float(np.mean(np.asarray(found.labels)[pairs] ==
                                            np.asarray(y))),
            "gradient_distance": float(found.match),
            # Client 0's images, for the figure only (not kept in the JSON).
            "originals": originals if client == 0 else None,
            "reconstructions": images[pairs] if client == 0 else None})
  return {"settings": _settings(), "rows": rows}


def _settings() -> dict:
  names = ("dataset", "num_clients", "seed", "hidden", "model", "lr", "rounds",
           "local_epochs", "batch_size", "momentum", "weight_decay")
  own = {"measure": _MEASURE.value, "batch_sizes": _BATCH_SIZES.value,
         "trials": _TRIALS.value, "steps": _STEPS.value, "algorithms": _ALGORITHMS.value}
  return {**{name: FLAGS[name].value for name in names}, **own}


def _client_aucs(apply, models, data, shared: bool) -> list[float]:
  """Each client's attack AUC under its model (models [K, ...]; shared: one model)."""
  aucs = [0.0] * data.num_clients
  for ids, bucket in zip(data.client_ids, data.buckets):
    for slot, client in enumerate(np.asarray(ids)):
      model = models if shared else _take(models, client)
      aucs[client] = leakage.membership_auc(
          leakage.per_sample_losses(apply, model, _take(bucket.train, slot)),
          leakage.per_sample_losses(apply, model, _take(bucket.test, slot)))
  return aucs


def _take(stacked, index: int):
  return jax.tree.map(lambda leaf: leaf[index], stacked)


def measure_membership() -> dict:
  data, model = _data_and_model()
  train = _train_config()
  trainer = client_trainer(model, data, train)
  built = {}
  for name in map(algorithms.canonical_name, _ALGORITHMS.value):  # all checked first
    built[name] = algorithms.build(name, algorithms.default_config(name, train), trainer)
    if built[name].evaluate is not None:
      raise ConfigError(f"--algorithms: {name} scores its clients with more than a model"
                        " (Algorithm.evaluate); the loss-threshold attack reads one model")
  rows = []
  for name, algorithm in built.items():
    result = run_algorithm(algorithm, model, data, train, progress=None)
    state = result.final_state.algorithm
    row = {"algorithm": name, "test_acc": float(np.mean(result.history.test_score[-1]))}
    if algorithm.shared_model is not None:
      row["personalised_auc"] = _client_aucs(model.apply, algorithm.shared_model(
          state.server), data, shared=True)
    else:
      personal = algorithm.personalized_params(state.server, state.clients)
      row["personalised_auc"] = _client_aucs(model.apply, personal, data, shared=False)
      hooks = algorithm.ala_hooks
      if hooks is not None:  # the global model the host sends, where it is a whole model
        received = hooks.received(algorithm.broadcast(state.server, state.clients))
        if jax.tree.structure(received) == jax.tree.structure(personal):
          row["global_auc"] = _client_aucs(model.apply, received, data, shared=False)
    rows.append(row)
  return {"settings": _settings(), "rows": rows}


def membership_table(report: dict) -> str:
  lines = ["| algorithm | test acc | AUC, personalised model | AUC, global model |",
           "|---|---|---|---|"]
  def cell(values):
    return "-" if values is None else f"{np.mean(values):.4f} (max {np.max(values):.4f})"
  for row in report["rows"]:
    lines.append(f"| {row['algorithm']} | {row['test_acc']:.4f} |"
                 f" {cell(row.get('personalised_auc'))} | {cell(row.get('global_auc'))} |")
  return "\n".join(lines)


def dlg_table(report: dict) -> str:
  lines = ["| batch | method | images | PSNR (dB): median (min, max) | images over 30 dB |"
           " SSIM, median | label accuracy |", "|---|---|---|---|---|---|---|"]
  for size, method in sorted({(r["batch"], r["method"]) for r in report["rows"]}):
    rows = [r for r in report["rows"] if r["batch"] == size and r["method"] == method]
    psnrs = np.concatenate([r["psnr"] for r in rows])
    ssims = np.concatenate([r["ssim"] for r in rows])
    labels = np.mean([r["label_accuracy"] for r in rows])
    lines.append(f"| {size} | {method} | {len(psnrs)} | {np.median(psnrs):.1f}"
                 f" ({np.min(psnrs):.1f}, {np.max(psnrs):.1f}) | {np.mean(psnrs > 30):.2f} |"
                 f" {np.median(ssims):.3f} | {labels:.2f} |")
  return "\n".join(lines)


def dlg_figure(report: dict, path: str) -> None:
  """Client 0's images (top) and DLG's reconstructions (below), one column pair per batch
  size."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  rows = [r for r in report["rows"] if r["client"] == 0 and r["method"] == "dlg"]
  width = max(len(r["originals"]) for r in rows)
  figure = Figure(figsize=(1.1 * width, 2.3 * len(rows)))
  axes = figure.subplots(2 * len(rows), width, squeeze=False)
  for index, row in enumerate(rows):
    for column in range(width):
      for offset, key in ((0, "originals"), (1, "reconstructions")):
        axis = axes[2 * index + offset, column]
        axis.axis("off")
        if column < len(row[key]):
          axis.imshow(row[key][column].squeeze(), cmap="gray", vmin=0, vmax=1)
      if column == 0:
        axes[2 * index, 0].set_title(f"batch {row['batch']}: true (top), DLG", fontsize=8,
                                     loc="left")
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def run() -> None:
  os.makedirs(_OUT.value, exist_ok=True)
  if _MEASURE.value == "dlg":
    report = measure_dlg()
    table = dlg_table(report)
    dlg_figure(report, os.path.join(_OUT.value, "dlg.png"))
  else:
    report = measure_membership()
    table = membership_table(report)
  name = _MEASURE.value
  for row in report["rows"]:
    for images in ("originals", "reconstructions"):
      row.pop(images, None)
  with open(os.path.join(_OUT.value, f"{name}.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(_OUT.value, f"{name}.md"), "w") as f:
    f.write(table + "\n")
  print(table)


def main(argv):
  run_command(argv, run)


if __name__ == "__main__":
  app.run(main)
