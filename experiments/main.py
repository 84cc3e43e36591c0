"""Runs one pFL algorithm on one federated dataset and reports the paper's metrics.

  python -m experiments.main --dataset=rmnist             # FEDORA as the paper reports it
  python -m experiments.main --dataset=rmnist --fedora_variant=paper  # equations as printed

Writes results.json, clients.csv, rounds.csv, history.npz, flags.txt and the algorithm's
arrays (FEDORA: similarity.npy; coaching: relation_cube.npy) to --workdir with PNG plots
(fedora_jax/plots.py; coaching's relation cube as relation.png) and per-round TensorBoard
events in <workdir>/tensorboard/<algorithm>, the LOCAL reference it trained to
<workdir>/local/, and prints a per-client table with the summary.
"""

import logging
import os
import sys

from absl import app

import jax

from experiments import flags as run_flags
from fedora_jax import algorithms
from fedora_jax import checkpoint as checkpoint_lib
from fedora_jax import results as results_lib
from fedora_jax.data import datasets
from fedora_jax import new_clients
from fedora_jax import metric_writer, plots
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError, FedoraError
from fedora_jax.simulation import root_keys, run_algorithm
from fedora_jax.models import build_model

FLAGS = run_flags.FLAGS


def run() -> dict:
  spec = datasets.get_spec(FLAGS.dataset)
  num_clients = FLAGS.num_clients or datasets.default_num_clients(FLAGS.dataset,
                                                                  FLAGS.data_dir)
  data_seed = FLAGS.seed if FLAGS.data_seed is None else FLAGS.data_seed
  train = run_flags.train_config()
  config = run_flags.plugged_config(FLAGS.algorithm)  # plug-ins checked before any work
  hidden = run_flags.hidden_widths()
  model_name = FLAGS.model or spec.model
  workdir = FLAGS.workdir or os.path.join(
      "runs", f"{FLAGS.dataset}_{FLAGS.setting}_{FLAGS.algorithm}_seed{FLAGS.seed}")
  # Every process computes the same results: process 0 writes them to the workdir, the
  # others to workdir/process<i> (no two writers), and all save into the workdir's
  # checkpoints (orbax's multi-process saves: one folder, process 0 finalizes).
  checkpoint_root = workdir
  if jax.process_index() > 0:
    workdir = os.path.join(workdir, f"process{jax.process_index()}")
  run_info = {"dataset": FLAGS.dataset, "algorithm": FLAGS.algorithm,
              "setting": FLAGS.setting, "num_clients": num_clients, "seed": FLAGS.seed,
              "data_seed": data_seed, "rounds": FLAGS.rounds, "model": model_name,
              "hidden": list(hidden), "devices": jax.device_count(),
              "processes": jax.process_count(),
              "platform": jax.default_backend(), "train": train.__dict__}
  if spec.task != "classification":
    run_info["task"] = spec.task  # results name MAE in place of accuracy
  if FLAGS.data_source != "files":
    run_info["data_source"] = FLAGS.data_source
  partition = None  # datasets whose clients are given by the data have no partition
  if spec.load_groups is None:
    partition = run_flags.partition_config(FLAGS.dataset)
    if partition.kind != "rotation":  # rotation runs keep their results.json keys
      run_info["partition"] = partition._asdict()
  if FLAGS.new_clients and FLAGS.algorithm != "fedora":
    raise ConfigError("--new_clients is FEDORA's Algorithm 2: use it with --algorithm=fedora")
  if (FLAGS.new_clients and FLAGS.algorithm == "fedora"
      and config.similarity != "principal_angles"):
    raise ConfigError("--new_clients compares a new client's data subspace with the trained"
                      f" clients'; it has no {config.similarity} similarity to them (leave"
                      " out --fedora_similarity)")
  if FLAGS.new_clients and spec.task != "classification":
    raise ConfigError(f"--new_clients reports accuracies; {FLAGS.dataset} is a {spec.task}")
  reference = None
  if FLAGS.reference and FLAGS.algorithm != "local":
    reference = results_lib.load_reference(FLAGS.reference, run_info)
  # Before any work: refuse a workdir holding another run, and find checkpoints to resume.
  defaults = run_flags.identity_defaults()
  checkpointer = checkpoint_lib.open_run(workdir, run_flags.run_identity(FLAGS.algorithm),
                                         FLAGS.rounds, FLAGS.checkpoint_every,
                                         checkpoint_root, defaults)
  local_checkpointer = None
  if FLAGS.algorithm != "local" and reference is None:
    local_checkpointer = checkpoint_lib.open_run(
        os.path.join(workdir, "local"), run_flags.run_identity("local"), FLAGS.rounds,
        FLAGS.checkpoint_every, os.path.join(checkpoint_root, "local"), defaults)

  federated = datasets.build_federated_dataset(
      FLAGS.dataset, FLAGS.data_dir, num_clients, FLAGS.setting, data_seed,
      FLAGS.max_pad_ratio, FLAGS.new_clients, data_source=FLAGS.data_source,
      partition_config=partition)
  run_info["data"] = federated.source.name  # e.g. "CIFAR-10 (JPEG copy)"
  data = federated.data
  logging.info("%s: %s", FLAGS.dataset, datasets.describe(data))
  model = build_model(model_name, data.num_classes, hidden)
  ids, angles = federated.client_ids, federated.partition.angles
  client_info = {"id": ids, **({"angle": angles[ids]} if angles is not None else {}),
                 "n_train": data.split_sizes("train"), "n_val": data.split_sizes("val"),
                 "n_test": data.split_sizes("test")}
  if federated.partition.kind != "rotation" and federated.partition.class_counts is not None:
    client_info["class_counts"] = federated.partition.class_counts[ids]  # [K, C]
  if federated.groups is not None:  # clients are the data's groups (years), not rotations
    client_info = {"id": client_info.pop("id"), "group": federated.groups[federated.client_ids],
                   **{k: v for k, v in client_info.items() if k != "angle"}}

  def save(directory, info, result, ours, local):
    results = results_lib.build_results(info, result, ours, local, client_info)
    results_lib.write_run_files(directory, results, result)
    with open(os.path.join(directory, "flags.txt"), "w") as f:
      f.write(FLAGS.flags_into_string())
    if spec.task == "classification":  # the plots are of accuracies
      plots.write_plots_for_run_dir(directory)
    return results

  with metric_writer.RoundWriter(workdir, FLAGS.algorithm, spec.task) as log_round:
    result = run_algorithm(FLAGS.algorithm, config, model, data, train, on_round=log_round,
                           checkpointer=checkpointer)
  ours = results_lib.accuracies(result, spec.task)
  if FLAGS.algorithm == "local":
    local = ours
  elif reference is not None:
    local = reference
  else:
    logging.info("training the LOCAL reference on the same split and seed")
    with metric_writer.RoundWriter(workdir, "local", spec.task) as log_round:
      local_result = run_algorithm("local", algorithms.get("local").config_class(), model,
                                   data, train, on_round=log_round,
                                   checkpointer=local_checkpointer)
    local = results_lib.accuracies(local_result, spec.task)
    # Kept as a LOCAL run of its own, so later runs can pass it as --reference.
    save(os.path.join(workdir, "local"), {**run_info, "algorithm": "local"}, local_result,
         local, local)

  info = dict(run_info, **({"fedora": config._asdict()} if FLAGS.algorithm == "fedora" else {}))
  if isinstance(config, algorithms.Plugged):
    info["plugins"] = {"ala": config.ala and config.ala._asdict(),
                       "aggregation": config.aggregation and config.aggregation._asdict()}
  if federated.new_data is not None:
    info["new_clients"] = serve_new_clients(federated, config, model, train, result)
  results = save(workdir, info, result, ours, local)
  print(results_lib.format_table(results))
  if federated.new_data is not None:
    print(results_lib.format_new_clients(results["new_clients"]))
  print(f"results in {workdir}")
  return results


def serve_new_clients(federated, config, model, train, fedora_result) -> dict:
  """Trains FedAvg on the same clients, then serves the held-out ones (Algorithm 2)."""
  logging.info("training FedAvg on the same clients as the new-client baseline")
  fedavg_result = run_algorithm("fedavg", algorithms.get("fedavg").config_class(), model,
                                federated.data, train)
  finetune_trainer = make_client_trainer(
      model.apply, make_optimizer(train.lr, train.momentum, train.weight_decay),
      FLAGS.new_client_epochs, train.batch_size, train.eval_batch_size)
  accuracy = new_clients.evaluate_new_clients(
      config, finetune_trainer, federated.data, fedora_result.final_state.algorithm,
      federated.new_data, fedavg_result.final_state.algorithm.server,
      root_keys(train.seed)["new_clients"])
  return results_lib.new_client_results(federated.new_client_ids,
                                        federated.partition.angles, accuracy,
                                        FLAGS.new_client_epochs)


def run_command(argv, run_fn, interrupted: str = "interrupted",
                log_level: int = logging.INFO) -> None:
  """Runs `run_fn` as a command: one-line errors and a non-zero exit, never a traceback
  unless --verbose (shared by experiments.main, reproduce and benchmark)."""
  if len(argv) > 1:
    print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
    sys.exit(1)
  logging.getLogger("fedora_jax").setLevel(log_level)
  try:
    run_flags.configure_cpu_devices()
    run_flags.initialize_distributed()
    run_fn()
    run_flags.shutdown_distributed()
  except FedoraError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt:
    print(f"error: {interrupted}", file=sys.stderr)
    sys.exit(130)
  except Exception as e:  # pylint: disable=broad-except
    if FLAGS.verbose:
      raise
    print(f"error: unexpected {type(e).__name__}: {e} (run with --verbose for the"
          " traceback)", file=sys.stderr)
    sys.exit(2)


def main(argv):
  run_command(argv, run)


if __name__ == "__main__":
  app.run(main)
