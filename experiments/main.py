"""Runs one pFL algorithm on one federated dataset and reports the paper's metrics.

  python -m experiments.main --dataset=rmnist             # FEDORA, the authors' code's form
  python -m experiments.main --dataset=rmnist --fedora_variant=paper  # equations as printed
  python -m experiments.main --flagfile=experiments/configs/rfmnist.flags
  python -m experiments.main --algorithm=fedprox --seeds=3 --sweep=fedprox_mu=0.01,0.1

The flags (or a flagfile) map to an ExperimentConfig (experiments/flags.py by way of
fedora_jax/settings.py), which fedora_jax.train.train_and_evaluate runs into --workdir:
results.json, clients.csv, rounds.csv, history.npz, the algorithm's arrays, PNG plots,
TensorBoard events, flags.txt and run_config.json (the config: the same command
resumes), with the LOCAL reference it trains in <workdir>/local/. Prints the summary
(--per_client: each client's scores too); on a terminal a progress bar, otherwise a
line every --log_every rounds.
"""

from absl import app

from experiments import cli
from experiments import flags as run_flags
from fedora_jax import train

FLAGS = run_flags.FLAGS


def run() -> dict | list[dict | None]:
  """The runs the flags describe (one; --seeds', --sweep's as one program where they can
  share one): trained (or resumed), their summaries printed."""
  runs = run_flags.runs()
  if len(runs) > 1 or FLAGS.sweep:
    return cli.run_rows(runs)
  config, workdir = runs[0].config, runs[0].workdir
  with cli.watching() as watchdog:
    results = train.train_and_evaluate(config, workdir, cli.progress_reporter(), watchdog)
  cli.report_run(results, workdir)
  return results


# What --help lists after the docstring above.
__doc__ += cli.grouped_help({  # pylint: disable=redefined-builtin
    "data": ("dataset", "data_dir", "num_clients", "setting"),
    "model and training": ("model", "rounds", "local_epochs", "lr", "batch_size",
                           "participation", "seed", "seeds", "sweep"),
    "algorithm": ("algorithm", "help_algorithm", "ala", "aggregation"),
    "output": ("workdir", "log_every", "checkpoint_every", "stall_timeout"),
    "devices": ("cpu_devices",),
}, "The flags of a first run (--helpfull: all of them, each algorithm's as"
   " --<algorithm>_<field>; --help_algorithm=NAME: one algorithm's):")


def main(argv):
  if FLAGS.help_algorithm:
    cli.print_algorithm_help(FLAGS.help_algorithm)
  else:
    cli.run_command(argv, run, "rerun the same command to resume")


if __name__ == "__main__":
  app.run(main)
