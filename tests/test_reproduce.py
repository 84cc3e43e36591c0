"""`python -m experiments.reproduce`: a tiny table end to end, extended, and its errors."""

import csv
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from experiments import flags as run_flags
from experiments import reproduce
from fedora_jax import algorithms, settings, sweep
from fedora_jax import config as config_lib
from fedora_jax.algorithms import fedora as fedora_lib
from fedora_jax.data import datasets, partitions
from fedora_jax.errors import ConfigError
from fedora_jax.sweep import fedora_render, fedora_tables, tables
from test_main import FAST, ROOT


def run_reproduce(*args):
  return subprocess.run([sys.executable, "-m", "experiments.reproduce", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_table_rows_run_and_a_rerun_adds_rows_keeping_finished_ones(tmp_path):
  common = ["--table=fedora1", "--dataset=rmnist", f"--workdir={tmp_path}", *FAST]
  proc = run_reproduce("--rows=local,fedavg", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  fedavg_timing = (tmp_path / "seed0" / "fedavg" / "timing.json").read_text()

  # The same sweep with one more row: the finished rows are read, not run again, even
  # without their checkpoints (a row brought back from another machine has none).
  shutil.rmtree(tmp_path / "seed0" / "fedavg" / "checkpoints")
  proc = run_reproduce("--rows=fedora,fedavg", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"row 2/3 fedavg seed 0: finished in {tmp_path}/seed0/fedavg, read" in proc.stderr
  assert "fedavg: resuming" not in proc.stderr and "row 3/3 fedora seed 0 ->" in proc.stderr
  assert (tmp_path / "seed0" / "fedavg" / "timing.json").read_text() == fedavg_timing

  table = json.loads((tmp_path / "table.json").read_text())
  rows = {row["algorithm"]: row for row in table["rows"]}
  assert list(rows) == ["local", "fedavg", "fedora"]  # LOCAL always, in the table's order
  for row in rows.values():
    assert 0.0 <= row["acc"] <= 1.0 and row["round_seconds"] > 0 and row["wall_seconds"] > 0
    assert row["machine"].startswith("cpu x") and row["machine"].endswith((" core", " cores"))
  fedavg = json.loads((tmp_path / "seed0" / "fedavg" / "results.json").read_text())
  assert rows["fedavg"]["acc"] == pytest.approx(fedavg["acc"], abs=1e-4)
  assert rows["local"]["r_acc"] == pytest.approx(0.0, abs=1e-6)
  # The fedora row is the default, authors' variant.
  fedora = json.loads((tmp_path / "seed0" / "fedora" / "results.json").read_text())
  assert fedora["fedora"]["pull"] == "decoupled" and fedora["fedora"]["top_k"] == 2
  # The paper's numbers come from the data file, with where they were printed.
  paper = fedora_tables.load_paper_rows("fedora1", "rmnist")
  for name, row in rows.items():
    assert row["paper_acc"] == paper[name]["acc"]
    assert row["paper_source"] == f"Table 1, {paper[name]['label']} row, Rotated MNIST"
  assert rows["fedavg"]["paper_acc"] == 0.6889 and rows["fedavg"]["paper_ptr"] == 0.0
  markdown = (tmp_path / "table.md").read_text()
  assert "# FEDORA Table 1 (Rotated MNIST): Results on image data sets" in markdown
  assert "| 0.6889 | -0.0976 | 0.0000 |" in _line(markdown, "fedavg")
  assert "| 0.8251 | +0.0806 | 1.0000 |" in _line(markdown, "fedora")
  assert (tmp_path / "table.png").stat().st_size > 0
  with open(tmp_path / "table.csv", newline="") as f:
    csv_rows = list(csv.DictReader(f))
  assert [r["algorithm"] for r in csv_rows] == list(rows)
  assert list(csv_rows[0]) == list(fedora_render.CSV_COLUMNS)
  for line in csv_rows:
    row = rows[line["algorithm"]]
    for column in ("acc", "r_acc", "ptr", "paper_acc", "round_seconds", "wall_seconds"):
      assert float(line[column]) == pytest.approx(row[column])
    assert line["seeds"] == "1" and line["acc_std"] == ""  # one seed: no spread
    assert line["paper_source"] == row["paper_source"]
  np.testing.assert_equal(table["rounds"], 2)

  # --finished_only trains nothing: the rows finished so far, with the seeds they have.
  reproduce.FLAGS(["reproduce", "--finished_only", "--seeds=2", "--rows=fedavg,fedprox",
                   *common])
  try:
    read = reproduce.reproduce()
  finally:
    reproduce.FLAGS.unparse_flags()
  assert [row["algorithm"] for row in read["rows"]] == ["local", "fedavg"]
  assert [row["seeds"] for row in read["rows"]] == [1, 1]
  assert read["rows"][1]["acc"] == rows["fedavg"]["acc"]
  assert not (tmp_path / "seed0" / "fedprox").exists() and not (tmp_path / "seed1").exists()
  markdown = (tmp_path / "table.md").read_text()
  assert "2 seed(s) from 0" in markdown and "(`--finished_only`: a sweep in progress)" in markdown
  assert _line(markdown, "fedavg").endswith(
      "FedAvg [25]; ours: only 1 of 2 seeds finished (seed 1: not started) |")
  assert read["unfinished"]["fedprox"] == ["seed 0: not started", "seed 1: not started"]
  assert json.loads((tmp_path / "table.json").read_text())["unfinished"] == read["unfinished"]
  assert ("- fedprox: not finished in the workdir (seed 0: not started; seed 1: not started)"
          in markdown.splitlines())

  # Asked for more rounds than they ran, the rows are not finished: LOCAL's checkpoint
  # says where it stopped; fedavg's checkpoints were removed above.
  for row, why in (("local", "stopped after round 2 of 3"),
                   ("fedavg", "not finished, no checkpoint saved")):
    reproduce.FLAGS(["reproduce", *common, "--rounds=3"])
    try:
      [(_, _, row_run)] = fedora_tables.plan("fedora1", [row], str(tmp_path), 0, 1,
                                         run_flags.settings(), run_flags.given_settings())
    finally:
      reproduce.FLAGS.unparse_flags()
    assert row_run.workdir == str(tmp_path / "seed0" / row)
    assert sweep.read_if_finished(row_run) == (None, True, why)


def _line(markdown: str, row: str) -> str:
  [line] = [line for line in markdown.splitlines() if line.startswith(f"| {row} |")]
  return line


def test_paper_data_has_every_row_of_every_table_with_finite_numbers():
  tables = fedora_tables.load_paper_tables()
  assert {name: t["table"] for name, t in tables.items()} == {
      "fedora1": 1, "fedora3": 3, "fedora4": 4, "fedora5": 5}
  expected_rows = {"fedora1": 16, "fedora3": 16, "fedora4": 4, "fedora5": 5}
  expected_columns = {"fedora1": ["rmnist", "rfmnist", "cifar10", "yearbook", "gtsrb"],
                      "fedora3": ["rmnist", "rfmnist"], "fedora4": ["rmnist"],
                      "fedora5": ["rmnist"]}
  for name, table in tables.items():
    assert table["caption"] and table["setting"] in partitions.SETTINGS
    assert table["metrics"] == list(fedora_tables.METRICS)
    assert len(table["rows"]) == expected_rows[name]
    assert list(table["datasets"]) == expected_columns[name]
    for dataset, column in table["datasets"].items():
      assert dataset in datasets.DATASETS and column["column"]
      assert column["num_clients"] == datasets.get_spec(dataset).num_clients
      assert list(column["values"]) == list(table["rows"])  # every row, in its order
      for row, values in column["values"].items():
        assert set(values) == set(fedora_tables.METRICS)
        assert 0.0 < values["acc"] < 1.0
        if row == "local":  # the reference: the paper prints "-"
          assert values["r_acc"] is None and values["ptr"] is None
          continue
        assert np.isfinite(values["r_acc"]) and -1.0 < values["r_acc"] < 1.0
        # PTR is a fraction of K clients: a transcription slip would rarely keep that.
        clients = values["ptr"] * column["num_clients"]
        assert clients == pytest.approx(round(clients), abs=0.01), (name, dataset, row)
      # Every row runs as one of ours.
      for row in table["rows"]:
        assert row in fedora_tables.RUNS, row
      if "local" not in column["values"]:  # LOCAL's numbers from a table of its setting
        other = tables[column["local_from"]["table"]]
        assert other["setting"] == table["setting"]
        assert other["datasets"][dataset]["values"]["fedora"] == column["values"]["fedora"]
  for run in fedora_tables.RUNS.values():
    assert run["algorithm"] in algorithms.REGISTRY


@pytest.mark.parametrize("table", fedora_tables.TABLES)
def test_every_row_of_every_table_prints_the_papers_numbers(table, tmp_path):
  results = tmp_path / "results.json"
  results.write_text(json.dumps({"best_val": {"acc": 0.6}}))
  for dataset in fedora_tables.load_paper_tables()[table]["datasets"]:
    paper = fedora_tables.load_paper_rows(table, dataset)
    runs = {row: [sweep.RowRun(acc=0.5, r_acc=0.01, ptr=0.5, round_seconds=0.1,
                               wall_seconds=1.0, machine="cpu x1, 1 core",
                               results=str(results))]
            for row in fedora_tables.check_rows([], table)}
    summary = fedora_tables.table_summary(table, runs, paper)
    markdown = fedora_render.format_markdown("T", "settings", summary)
    # Every row the paper prints, LOCAL (run as the reference) and our fedora_paper.
    assert [r["algorithm"] for r in summary] == fedora_tables.table_rows(table)
    assert {r["algorithm"] for r in summary} >= set(paper)
    for row in fedora_tables.table_rows(table):
      values = paper[fedora_tables.extra_rows(table).get(row, row)]
      line = _line(markdown, row)
      cells = [c.strip() for c in line.split("|")[6:9]]  # paper_acc, paper_r_acc, paper_ptr
      assert cells[0] == f"{values['acc']:.4f}", (table, dataset, row)
      if row != "local":
        assert cells[1] == f"{values['r_acc']:+.4f}" and cells[2] == f"{values['ptr']:.4f}"
      assert "not run" not in line


def test_rows_tables_and_datasets_are_checked():
  with pytest.raises(ConfigError, match="--table=fedora1 has no row nope; its rows: local,"):
    fedora_tables.check_rows(["fedavg", "nope"], "fedora1")
  assert fedora_tables.check_rows(["fedora", "fedavg"], "fedora1") == ["local", "fedavg", "fedora"]
  # By default every row of the table, in its order, LOCAL first.
  assert fedora_tables.check_rows([], "fedora1")[-2:] == ["fedora", "fedora_paper"]
  assert len(fedora_tables.check_rows([], "fedora1")) == 17
  assert fedora_tables.check_rows([], "fedora4") == [
      "local", "fedora_random_similarity", "fedora_parameter_similarity",
      "fedora_gradient_similarity", "fedora", "fedora_paper"]
  assert fedora_tables.check_rows([], "fedora5") == [
      "local", "fedora_lambda_0.01", "fedora_lambda_0.1", "fedora_lambda_1",
      "fedora_lambda_10", "fedora", "fedora_paper"]
  assert fedora_tables.check_rows(["fedora_lambda_10", "fedora"], "fedora5") == [
      "local", "fedora_lambda_10", "fedora"]
  with pytest.raises(ConfigError, match="Table 3 reports rmnist, rfmnist, not cifar10"):
    fedora_tables.load_paper_rows("fedora3", "cifar10")
  assert fedora_tables.load_paper_rows("fedora1", "cifar10")["fedora"]["acc"] == 0.8570
  # Table 5 prints no LOCAL row: Table 3's, whose FEDORA row it repeats, with a note.
  local = fedora_tables.load_paper_rows("fedora5", "rmnist")["local"]
  assert local["acc"] == 0.7736 and "Table 5 prints no LOCAL row" in local["note"]


@pytest.mark.parametrize("args,column_flags,values", [
    # CIFAR-10's column: the calibrated protocol of docs/datasets.md.
    (["--dataset=cifar10"], {"split": "authors", "data_seed": 42, "fixed_train_size": 200,
                             "ifca_num_clusters": 5, "fesem_num_clusters": 5},
     ("authors", 42, 200)),
    # A flag on the command line wins over the column's.
    (["--dataset=cifar10", "--fixed_train_size=20", "--ifca_num_clusters=3"],
     {"split": "authors", "data_seed": 42, "fesem_num_clusters": 5}, ("authors", 42, 20)),
    (["--dataset=rmnist"], {}, ("ours", None, None)),
])
def test_a_column_runs_its_own_flags_unless_the_command_line_gives_them(args, column_flags,
                                                                        values):
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", "--table=fedora1", *args])
  try:
    given = run_flags.given_settings()
    assert fedora_tables.column_settings("fedora1", flag_values.dataset, given) == column_flags
    config = fedora_tables.row_config("fedora1", "fedavg", 0, run_flags.settings(), given)
  finally:
    flag_values.unparse_flags()
  partition = config.data.partition
  assert (partition.split, config.data.data_seed, partition.train_per_client) == values


def test_table_3_weighs_by_samples_with_the_uniform_reading_beside():
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", "--table=fedora3", "--dataset=rmnist"])
  try:
    given = run_flags.given_settings()
    assert fedora_tables.column_settings("fedora3", "rmnist", given) == {}
    config = lambda row: fedora_tables.row_config("fedora3", row, 0, run_flags.settings(),
                                                  given)
    samples, uniform, fedamp = config("fedavg"), config("fedavg_uniform"), config("fedamp")
  finally:
    flag_values.unparse_flags()
  # The paper's rule by default; the other reading beside the rows it moves, and only them.
  assert samples.train.client_weights == "samples" == fedamp.train.client_weights
  assert uniform.train.client_weights == "uniform"
  assert dataclasses.replace(uniform, train=samples.train) == samples
  rows = fedora_tables.table_rows("fedora3")
  assert rows[rows.index("fedavg") + 1] == "fedavg_uniform"
  assert "fedamp_uniform" not in rows and "fedora_uniform" not in rows
  local = config_lib.reference_config(samples)  # LOCAL averages nothing: either serves
  assert config_lib.identity(local) == config_lib.identity(dataclasses.replace(
      local, train=dataclasses.replace(local.train, client_weights="uniform")))
  # The table runs both readings, so the command line may not pick one.
  with pytest.raises(ConfigError, match="--table=fedora3 runs its rows under both readings"
                                        " of --client_weights; leave it out"):
    fedora_tables.check_request(tables.Request(table="fedora3",
                                               given={"client_weights": "uniform"}))
  flag_values(["reproduce", "--table=fedora1", "--dataset=rmnist"])
  try:  # Table 1's clients are all one size: nothing to set
    given = run_flags.given_settings()
    assert fedora_tables.column_settings("fedora1", "rmnist", given) == {}
    assert fedora_tables.row_config("fedora1", "fedavg", 0, run_flags.settings(),
                                given).train.client_weights == "samples"
    assert "fedavg_uniform" not in fedora_tables.table_rows("fedora1")
  finally:
    flag_values.unparse_flags()


# Table 3's rows that run under both weightings, and those that compute the same
# either way (their servers read a client's weight only as "took part or not").
_TABLE_3_BASELINES = [row for row in fedora_tables.table_rows("fedora3")
                      if row in fedora_tables.RUNS and row != "local"]


@pytest.mark.parametrize("row", _TABLE_3_BASELINES)
def test_table_3s_other_reading_names_exactly_the_rows_the_weights_move(row):
  import jax  # pylint: disable=import-outside-toplevel
  import tiny  # pylint: disable=import-outside-toplevel
  from fedora_jax.simulation import TrainConfig, run_algorithm  # pylint: disable=import-outside-toplevel
  name = fedora_tables.RUNS[row]["algorithm"]
  data, _ = tiny.tiny_data([2, 3, 7, 5])
  train = TrainConfig(rounds=2, local_epochs=1, batch_size=2, lr=0.1, log_every=0)
  states = [jax.tree.leaves(run_algorithm(
      algorithms.make(name, tiny.default_config(name)), tiny.tiny_model(), data,
      dataclasses.replace(train, client_weights=weights)).final_state.algorithm)
            for weights in ("samples", "uniform")]
  same = all(np.array_equal(a, b) for a, b in zip(*states))
  moved = row in fedora_tables.other_reading("fedora3")["rows"]
  assert same != moved, row
  # Those that declare it share one run between the weightings (FeSEM does not: its
  # m_step=uploaders reads them).
  assert ("client_weights" in algorithms.get(name).ignores) == (not moved and row != "fesem")


def test_a_sweep_from_before_the_default_changed_is_refused_before_training(tmp_path):
  # Until 2026-11-26 the fedora row ran the printed equations.
  old_row = tmp_path / "seed0" / "fedora"
  old_row.mkdir(parents=True)
  paper = settings.from_settings({"fedora_variant": "paper", "num_clients": 4, "rounds": 2,
                                  "local_epochs": 1, "hidden": ["16"]})
  (old_row / "run_config.json").write_text(json.dumps(config_lib.record(paper)))
  (old_row / "results.json").write_text("{}")
  proc = run_reproduce("--table=fedora1", "--rows=fedora", f"--workdir={tmp_path}", *FAST)
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: --workdir {old_row} holds a run with other settings")
  assert "algorithm.config.pull='prox' (now 'decoupled')" in last
  assert not (tmp_path / "seed0" / "local").exists()  # nothing trained
  proc = run_reproduce("--fedora_variant=paper", f"--workdir={tmp_path}", *FAST)
  assert proc.returncode == 1 and "leave out --fedora_variant" in proc.stderr


def test_bad_row_hyperparameters_fail_before_the_sweep(tmp_path):
  proc = run_reproduce("--table=fedora1", "--rows=fedamp", "--fedamp_sigma=0",
                       f"--workdir={tmp_path}", *FAST)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].endswith("fedamp_sigma must be > 0, got 0.0")
  assert not os.path.exists(tmp_path / "seed0")


def test_seeds_give_mean_and_population_std_beside_the_paper(tmp_path):
  # Each seed's results.json: Acc at its round of best validation accuracy.
  for name, best in (("a", 0.72), ("b", 0.78)):
    (tmp_path / name).write_text(json.dumps({"best_val": {"acc": best}}))
  runs = [sweep.RowRun(acc=0.70, r_acc=0.01, ptr=0.5, round_seconds=0.2,
                       wall_seconds=10.0, machine="NVIDIA H200 x1",
                       results=str(tmp_path / "a")),
          sweep.RowRun(acc=0.80, r_acc=0.03, ptr=None, round_seconds=0.4,
                       wall_seconds=30.0, machine="cpu x2, 2 cores",
                       results=str(tmp_path / "b"))]
  paper = {"fedora": {"acc": 0.8251, "r_acc": 0.0806, "ptr": 1.0, "label": "FEDORA",
                      "source": "Table 1"}}
  row = fedora_tables.summarize("fedora", runs, paper)
  assert row["acc"] == pytest.approx(0.75) and row["acc_std"] == pytest.approx(0.05)
  assert row["r_acc"] == pytest.approx(0.02) and row["r_acc_std"] == pytest.approx(0.01)
  assert row["ptr"] == pytest.approx(0.5)  # a missing value is left out, not taken as 0
  assert row["paper_acc"] == 0.8251 and row["paper_source"] == "Table 1"
  assert row["round_seconds"] == pytest.approx(0.3) and row["wall_seconds"] == 40.0
  assert row["acc_seeds"] == [0.70, 0.80] and row["ptr_seeds"] == [0.5, None]
  assert row["best_val_acc"] == pytest.approx(0.75) and row["best_val_acc_std"] == 0.03
  markdown = fedora_render.format_markdown("T", "settings", [row])
  assert ("| fedora | 0.7500 ± 0.0500 | +0.0200 ± 0.0100 | 0.5000 ± 0.0000 |"
          " 0.7500 ± 0.0300 |") in markdown


def test_table_csv_has_a_line_per_row_with_ours_the_papers_and_timing(tmp_path):
  for name, best_val_acc in (("a", 0.72), ("b", 0.82)):
    (tmp_path / name).write_text(json.dumps({"best_val": {"acc": best_val_acc}}))
  runs = [sweep.RowRun(acc=0.70, r_acc=0.01, ptr=0.5, round_seconds=0.2,
                       wall_seconds=10.0, machine="NVIDIA H200 x1",
                       results=str(tmp_path / "a")),
          sweep.RowRun(acc=0.80, r_acc=0.03, ptr=1.0, round_seconds=0.4,
                       wall_seconds=30.0, machine="cpu x2, 2 cores",
                       results=str(tmp_path / "b"))]
  paper = fedora_tables.load_paper_rows("fedora1", "rmnist")
  rows = fedora_tables.table_summary("fedora1", {"local": runs, "fedora_paper": runs}, paper)
  fedora_render.write_csv(str(tmp_path / "table.csv"), rows)
  lines = (tmp_path / "table.csv").read_text().splitlines()
  assert lines[0] == ("algorithm,seeds,acc,acc_std,r_acc,r_acc_std,ptr,ptr_std,best_val_acc,"
                      "best_val_acc_std,paper_acc,paper_r_acc,paper_ptr,round_seconds,wall_seconds,machine,"
                      "paper_row,paper_source")
  assert lines[1] == ("local,2,0.75,0.05,0.02,0.01,0.75,0.25,0.77,0.05,0.7642,,,0.3,40.0,"
                      '"NVIDIA H200 x1 + cpu x2, 2 cores",LOCAL,"Table 1, LOCAL row,'
                      ' Rotated MNIST"')
  assert lines[2] == ("fedora_paper,2,0.75,0.05,0.02,0.01,0.75,0.25,0.77,0.05,0.8251,0.0806,"
                      "1.0,0.3,"
                      '40.0,"NVIDIA H200 x1 + cpu x2, 2 cores",FEDORA,"Table 1, FEDORA row,'
                      ' Rotated MNIST (ours: not a paper row)"')


def test_cells_round_to_four_places_without_negative_zero():
  assert fedora_render._cell(-0.00001, signed=True) == "+0.0000"
  assert fedora_render._cell(0.08056, 0.01, signed=True) == "+0.0806 ± 0.0100"
  assert fedora_render._cell(None) == "—"


def test_each_ablation_row_is_the_fedora_row_with_its_own_flags(tmp_path):
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", "--table=fedora5"])
  try:
    def row_config(row):
      config = fedora_tables.row_config("fedora5", row, 0, run_flags.settings(),
                                    run_flags.given_settings())
      return config.algorithm.config, config_lib.identity(config)

    fedora_row, fedora_identity = row_config("fedora")
    assert fedora_row == fedora_lib.config_for_variant("authors", lr=flag_values.lr)
    for row, fields in [
        ("fedora_lambda_0.01", dict(lambda_rule="constant", lambda_value=0.01)),
        ("fedora_lambda_10", dict(lambda_rule="constant", lambda_value=10.0)),
        ("fedora_gradient_similarity", dict(similarity="gradients")),  # lambda reset
        ("fedora_random_similarity", dict(similarity="random")),
        ("fedora_parameter_similarity", dict(similarity="parameters"))]:
      config, identity = row_config(row)
      assert config == fedora_row._replace(**fields), row
      # The run's identity (run_config.json) names what the row changed, and only that.
      assert {**identity, "algorithm": None} == {**fedora_identity, "algorithm": None}, row
      row_fields, base = identity["algorithm"]["config"], fedora_identity["algorithm"]["config"]
      assert {k: v for k, v in row_fields.items() if base[k] != v} == fields, row
    # Back to the plain row: nothing left over from the ablations.
    assert row_config("fedora") == (fedora_row, fedora_identity)
    # A constant without the constant rule is an error, not silently ignored.
    with pytest.raises(ConfigError, match="--fedora_lambda_value only acts with"
                       " --fedora_lambda_rule=constant; this run's is authors"):
      settings.from_settings({"fedora_lambda_value": 0.1})
  finally:
    flag_values.unparse_flags()


def test_the_ablation_flags_are_left_to_reproduce():
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", "--table=fedora4", "--fedora_similarity=random"])
  try:
    with pytest.raises(ConfigError, match="reproduce sets --fedora_similarity row by row"):
      reproduce.reproduce()
  finally:
    flag_values.unparse_flags()


def test_imbalanced_tables_break_r_acc_down_by_distance_from_the_large_client(tmp_path):
  def results_file(name, r_acc):
    clients = [{"angle": a, "n_train": n, "r_acc": r}
               for a, n, r in zip([0, 20, 60, 180], [500, 10, 10, 10], r_acc)]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"clients": clients}))
    return str(path)

  # Distances from the large client's 0 degrees: 20 (near), 60 (middle), 180 (far).
  seeds = [results_file("s0", [0.0, 0.1, None, -0.2]), results_file("s1", [0.0, 0.3, 0.2, 0.0])]
  by_distance = fedora_render.r_acc_by_distance(seeds)
  assert by_distance == {"near": [1, pytest.approx(0.2)], "middle": [1, pytest.approx(0.2)],
                         "far": [1, pytest.approx(-0.1)]}  # seed 0's undefined is left out
  rows = [{"algorithm": "local", "r_acc_by_distance": by_distance},
          {"algorithm": "ditto", "r_acc_by_distance": by_distance}]
  section = fedora_render.format_distance_section(rows)
  assert "| algorithm | near (1 clients) | middle (1 clients) | far (1 clients) |" in section
  assert "| ditto | +0.2000 | +0.2000 | -0.1000 |" in section and "| local |" not in section
  no_angles = tmp_path / "dirichlet.json"
  no_angles.write_text(json.dumps({"clients": [{"n_train": 5, "r_acc": 0.0}]}))
  assert fedora_render.r_acc_by_distance([str(no_angles)]) is None


def test_a_row_another_process_holds_is_waited_for(tmp_path):
  # Another process running the row holds its lock (flock: any other open of the file).
  held = open(tmp_path / sweep.ROW_LOCK, "a")
  fcntl.flock(held, fcntl.LOCK_EX)
  entered = threading.Event()

  def claim():
    with sweep.row_claimed(str(tmp_path)):
      entered.set()

  waiter = threading.Thread(target=claim)
  waiter.start()
  assert not entered.wait(0.5)  # still waiting while the row is held
  with sweep.row_claimed(str(tmp_path), wait=False) as claimed:
    assert not claimed  # --finished_only's read: at once, without the row
  fcntl.flock(held, fcntl.LOCK_UN)
  held.close()
  waiter.join(10)
  assert entered.is_set()
  with sweep.row_claimed(str(tmp_path)) as claimed:  # released again: taken at once
    assert claimed
