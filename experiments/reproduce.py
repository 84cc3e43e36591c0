"""Reproduces a paper's table: every row run (or read where it finished) and written beside
the paper's numbers. A thin command over fedora_jax/sweep/ (the tables: experiments/paper/).

  python -m experiments.reproduce --table=fedora1 --dataset=rmnist        # FEDORA Table 1
  python -m experiments.reproduce --table=fedora3 --dataset=rfmnist       # Table 3
  python -m experiments.reproduce --table=fedora1 --seeds=3 --rounds=100  # mean +- std
  python -m experiments.reproduce --table=coaching1 --columns=mnist_0.1   # one cell
  python -m experiments.reproduce --table=confree2 --finished_only        # the rows done

FEDORA's tables (fedora1, fedora3, fedora4, fedora5) run the --dataset column, with LOCAL,
every row the paper prints and `fedora_paper` (the equations as printed); the other seed
papers' tables (coaching1, coaching2, fedala1, fedala_ala, confree2) run the cells that
--columns picks, scored by the papers' best-round metric. Each row runs in its own
workdir, <workdir>/[<column>/]seed<s>/<row>: a killed sweep rerun resumes, a finished row
is read (its checkpoints or not), processes sharing a workdir run each row once, and a
row directory holding a run with other settings is refused before anything trains.
Every run flag (--rounds, --lr, --<algorithm>_<field>, ...) passes through to every row;
those that pick a row or a column are the table's. Writes the table (.md, .json, .csv,
.png) into --workdir; --finished_only trains nothing and writes the table of the rows
finished so far. More: docs/results.md and docs/reproduce_other_papers.md.
"""

import sys

from absl import app, flags

from experiments import cli
from experiments import flags as run_flags
from fedora_jax import sweep
from fedora_jax.sweep import papers
from fedora_jax.sweep.tables import Request

FLAGS = run_flags.FLAGS

flags.DEFINE_enum("table", "fedora1", papers.TABLES,
                  "fedora1: Table 1 (balanced, every method); fedora3: Table 3 (imbalanced);"
                  " fedora4: Table 4 (FEDORA's similarity measure); fedora5: Table 5"
                  " (FEDORA with a constant lambda_k); coaching1, coaching2: parameter"
                  " coaching's Tables 1 and 2; fedala1: FedALA's main table; fedala_ala:"
                  " FedALA's ALA applicability table; confree2: ConFREE's Table 2.")
flags.DEFINE_list("rows", [], "Rows to run (default: every row of the table; LOCAL always"
                  " runs).")
flags.DEFINE_enum("scored_clients", "all", list(sweep.SCORED_CLIENTS),
                  "coaching1, coaching2, fedala1, fedala_ala, confree2: whose test accuracy"
                  " a round's mean takes: every client's (all), or only the clients sampled"
                  " to train that round (sampled: history.npz's local_steps > 0; differs"
                  " only under partial participation). The sampled view's files are"
                  " <table>_sampled.*, beside the default's; its rows are the same runs.")
flags.DEFINE_bool("finished_only", False, "Train nothing: the table of the rows already"
                  " finished in --workdir (a sweep in progress, or one whose cells ran as"
                  " separate commands); a row not finished, or running in another process"
                  " now, is left out, saying which (\"seed 1: stopped after round 30 of"
                  " 50\").")
flags.DEFINE_list("columns", [], "coaching1, coaching2, fedala1, fedala_ala, confree2: the"
                  " columns (cells) to run (default: the table's columns on the data held"
                  " in shared/data). FEDORA's tables run the --dataset column.")


def request() -> Request:
  """The table the flags ask for, with every run setting and those the command gives."""
  return Request(FLAGS.table, run_flags.settings(), run_flags.given_settings(),
                 FLAGS.workdir, FLAGS.seeds, FLAGS.rows, FLAGS.columns,
                 FLAGS.scored_clients, FLAGS.finished_only,
                 " ".join(["python -m experiments.reproduce", *sys.argv[1:]]))


def reproduce() -> dict:
  table = papers.reproduce(request(), cli.sweep_options(FLAGS.finished_only))
  print(table.markdown)
  print(f"table in {table.where}")
  return table.document


# What --help lists after the docstring above.
__doc__ += cli.grouped_help({  # pylint: disable=redefined-builtin
    "the table": ("table", "dataset", "columns", "rows", "seeds", "seed", "rounds"),
    "where": ("data_dir", "workdir", "finished_only"),
    "output": ("log_every", "stall_timeout"),
}, "The flags of a sweep (--helpfull: all of them; every run flag passes through to each"
   " row):")


def main(argv):
  cli.run_command(argv, reproduce, "rerun the same command to resume the sweep")


if __name__ == "__main__":
  app.run(main)
