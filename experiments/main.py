"""Runs one pFL algorithm on one federated dataset and reports the paper's metrics.

  python -m experiments.main --dataset=rmnist             # FEDORA as the paper reports it
  python -m experiments.main --dataset=rmnist --fedora_variant=paper  # equations as printed

A thin command over `fedora_jax.train.train_and_evaluate`: the flags become an
ExperimentConfig, and run_config.json records them so a rerun resumes from checkpoints.
Writes results.json, clients.csv, rounds.csv, history.npz, flags.txt and the algorithm's
arrays (FEDORA: similarity.npy; coaching: relation_cube.npy) to --workdir with PNG plots
and per-round TensorBoard events in <workdir>/tensorboard/<algorithm>, the LOCAL
reference it trained to <workdir>/local/, and prints a per-client table with the summary.
On a terminal each run shows a live progress bar; otherwise a line every --log_every rounds.
"""

import os

from absl import app

import jax

from experiments import cli
from experiments import flags as run_flags
from fedora_jax import progress as progress_lib
from fedora_jax import results as results_lib
from fedora_jax import train

FLAGS = run_flags.FLAGS


def run(progress: progress_lib.Progress | None = None) -> dict:
  """The run the flags describe; returns its results document. `progress` reports its
  rounds (default: cli.progress_reporter(), a bar on a terminal)."""
  config = run_flags.experiment_config()
  workdir = FLAGS.workdir or train.default_workdir(config)
  results = train.train_and_evaluate(config, workdir, run_flags.run_identity,
                                     run_flags.identity_defaults(),
                                     progress or cli.progress_reporter())
  own = workdir if jax.process_index() == 0 else os.path.join(
      workdir, f"process{jax.process_index()}")
  for directory in (own, os.path.join(own, "local")):
    if os.path.isfile(os.path.join(directory, "results.json")):
      with open(os.path.join(directory, "flags.txt"), "w") as f:
        f.write(FLAGS.flags_into_string())
  print(results_lib.format_table(results))
  if "new_clients" in results:
    print(results_lib.format_new_clients(results["new_clients"]))
  print(f"results in {own}")
  return results


def main(argv):
  cli.run_command(argv, run)


if __name__ == "__main__":
  app.run(main)
