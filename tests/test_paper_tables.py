"""The other seed papers' tables (fedora_jax/sweep/paper_*.py): their numbers as data, a
tiny table end to end, the best-round metric, and the refused requests."""

import csv
import fcntl
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments import flags as run_flags
from experiments import reproduce
from fedora_jax import algorithms, metrics, sweep
from fedora_jax.data import datasets, partitions
from fedora_jax.errors import ConfigError, FedoraError
from fedora_jax.sweep import fedora_tables, paper_render, paper_specs, paper_tables, tables
from fedora_jax.models import MODELS
from test_main import ROOT

TABLES = paper_specs.load_tables()
SHAPES = {  # rows, columns, columns with the paper's numbers
    "coaching1": (13, 8, 8), "coaching2": (13, 8, 8), "fedala1": (14, 8, 8),
    "fedala_ala": (18, 3, 3), "confree2": (12, 12, 8)}


def test_the_tables_and_their_shapes():
  assert paper_tables.TABLES == ("coaching1", "coaching2", "fedala1", "fedala_ala",
                                 "confree2")
  assert set(reproduce.FLAGS["table"].parser.enum_values) == set(fedora_tables.TABLES) | set(TABLES)
  for name, (rows, columns, with_numbers) in SHAPES.items():
    table = TABLES[name]
    assert len(table["rows"]) == rows and len(table["columns"]) == columns, name
    assert sum(bool(c["values"]) for c in table["columns"].values()) == with_numbers, name


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_row_and_column_is_well_formed(name):
  table = TABLES[name]
  for key in ("paper", "short", "text", "table", "lines", "caption", "metric", "settings",
              "rows", "columns", "default_columns"):
    assert table[key], (name, key)
  assert table["metric"]["clients"] in metrics.WEIGHTINGS
  first, last = map(int, table["lines"].split("-"))
  for row, spec in table["rows"].items():
    assert spec["label"] and spec["algorithm"] and first <= spec["line"] <= last, row
    for flag in spec.get("flags", {}):  # the plug-ins, the row's own fields, a run flag
      assert flag in run_flags.FLAGS, (row, flag)
    if set(spec.get("flags", {})) - set(paper_specs.ROW_FLAGS) and "reading_of" not in spec:
      assert spec.get("note"), row  # a row off the table's or its algorithm's defaults says why
    if "improves" in spec:  # a host with a plug-in: its host is a row, without the plug-in
      host = table["rows"][spec["improves"]]
      assert host["algorithm"] == spec["algorithm"], row
      assert not set(paper_specs.ROW_FLAGS) & set(host.get("flags", {})), row
  assert set(table["default_columns"]) <= set(table["columns"])
  for column, spec in table["columns"].items():
    assert spec["label"] and spec["paper_column"] and spec["sample_every"] >= 1, column
    assert spec["dataset"] is None or spec["dataset"] in datasets.DATASETS, column
    if spec["dataset"] is None:
      assert "not a --dataset here" in spec["note"], column
    for setting in table["settings"] + spec["settings"]:
      assert setting["setting"] and setting["source"], (column, setting)
      if "flag" in setting:  # every value a run uses is a flag's
        assert setting["flag"] in run_flags.FLAGS, setting
    flags = paper_specs.cell_flags(table, column)
    if spec["dataset"] is not None:  # a column that runs where its data is
      assert flags["partition"] in partitions.KINDS and flags["rounds"] >= 1, column
    for row, value in spec["values"].items():
      assert row in table["rows"], (column, row)
      assert 0 < value["mean"] < 100 and set(value) <= {"mean", "std", "imp"}, (column, row)
      assert value.get("std", 0) >= 0, (column, row)
      host = table["rows"][row].get("improves")
      if "imp" in value:  # printed to two places: its host's number and the gain agree
        assert value["mean"] - spec["values"][host]["mean"] == pytest.approx(
            value["imp"], abs=0.006), (column, row)
    if "imp_from" in spec:  # a cell the paper lacks, shown beside a paper cell's gains
      assert not spec["values"] and table["columns"][spec["imp_from"]]["values"], column
    if spec["values"] and name != "fedala_ala":  # every paper row in every printed column
      assert list(spec["values"]) == [r for r, s in table["rows"].items()
                                      if "reading_of" not in s], column


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_table_states_one_evaluation_rule_and_its_other_readings(name):
  # One rule per table, stated; a row read under another rule is the same
  # algorithm with other evaluation flags, shown beside its row, never in its place.
  table = TABLES[name]
  assert table["evaluation"]["rule"], name
  for row, spec in table["rows"].items():
    if "reading_of" in spec:
      host = table["rows"][spec["reading_of"]]
      assert host["algorithm"] == spec["algorithm"] and "reading_of" not in host, row
      assert host.get("flags", {}) != spec["flags"], row
      assert table["evaluation"]["other"], row


def test_a_row_s_other_reading_is_rendered_beside_it():
  table = TABLES["coaching1"]

  def run(best):
    return sweep.RowRun("r.json", 1.0, 1.0, "cpu", per_round=np.array([best / 2, best]),
                        best=best, best_round=2, final=best)
  runs = {"local": [run(0.9)], "pfedla": [run(0.8), run(0.6)], "pfedla_local": [run(0.95)]}
  cell = paper_render.summarize_cell(table, "mnist_0.1", runs, seeds=2)
  assert next(e for e in cell if e["row"] == "pfedla_local")["reading_of"] == "pfedla"
  markdown = paper_render.format_markdown("t", table, {"mnist_0.1": cell},
                                          ["evaluation rule, every row: x"], {"mnist_0.1": 2})
  line = next(x for x in markdown.splitlines() if x.startswith("| pfedla |"))
  assert "| 70.00 ± 10.00 |" in line and "pFedLA's local models: 95.00 (only 1 of 2" in line
  assert not any(x.startswith("| pfedla_local |") for x in markdown.splitlines())
  moon = next(x for x in markdown.splitlines() if x.startswith("| moon |"))
  assert "MOON's global model: not run" in moon
  rule = paper_render.setting_lines(table, {}, {}, 0, 1, "c")
  assert any(x.startswith("evaluation rule, every row: each client's personalised model")
             for x in rule)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_row_passes_its_checks_in_every_column_that_can_run(name, tmp_path):
  # What reproduce checks before a sweep trains anything, for every row in every cell: a
  # row the table sets up wrong would stop the full table hours in (FedRep and FedPAC
  # with the PFLlib tables' 1 local epoch did, before their rows set 2).
  table = TABLES[name]
  columns = [c for c in table["columns"] if not paper_specs.column_problem(table, c)]
  rows = [r for r in paper_specs.table_rows(table) if paper_specs.row_problem(table, r) is None]
  flag_values = reproduce.FLAGS
  flag_values(["reproduce"])
  try:
    plan = paper_tables.plan_rows(table, columns, rows, 0, 1, str(tmp_path),
                                  run_flags.settings(), run_flags.given_settings())
  finally:
    flag_values.unparse_flags()
  assert len(plan) == len(columns) * len(rows)
  sweep.check_rows([p.run for p in plan])


def test_a_plugin_row_runs_with_its_hosts_flags():
  table = TABLES["confree2"]
  host = paper_specs.row_flags(table, "cifar10_c20_p30", "fedrep")
  assert host == {"algorithm": "fedrep", "local_epochs": 2, "fedrep_head_epochs": 1}
  assert paper_specs.row_flags(table, "cifar10_c20_p30", "fedrep_confree") == {
      **host, "aggregation": "confree"}
  assert paper_specs.row_flags(table, "cifar10_c20_p30", "apfl_confree") == {
      "algorithm": "apfl", "apfl_alpha": 1.0, "apfl_mixing": "pfllib", "aggregation": "confree"}
  assert paper_specs.row_flags(table, "cifar10_c20_p30", "fedrod_confree") == {
      "algorithm": "fedrod", "aggregation": "confree"}
  # At 2 local epochs FedRep cannot be scored against the cell's 1-epoch LOCAL: the first
  # of the rows at those settings trains its own, and the others share it.
  def references(table, column, row):
    return paper_tables.row_references(table, column, row, paper_specs.table_rows(table),
                                       0, "w")
  cell_local = "w/cifar10_c20_p30/seed0/local/results.json"
  fedrep_local = "w/cifar10_c20_p30/seed0/fedrep/local/results.json"
  assert references(table, "cifar10_c20_p30", "fedrep") == ()
  for row in ("fedrep_confree", "fedpac", "fedpac_confree"):
    assert references(table, "cifar10_c20_p30", row)[0] == fedrep_local, row
    assert cell_local not in references(table, "cifar10_c20_p30", row), row
  assert references(table, "cifar10_c20_p30", "fedrod")[0] == cell_local
  assert fedrep_local not in references(table, "cifar10_c20_p30", "fedrod")
  assert references(TABLES["fedala1"], "mnist_pat", "pfedme")[0] == (
      "w/mnist_pat/seed0/local/results.json")


def test_tables_that_share_a_workdir_give_a_row_name_one_run():
  # fedala_ala's hosts are fedala1's rows ({"row_of": ...}), so the two share a workdir,
  # where <column>/seed<s>/<row> is a row's directory: a row name both print must run
  # alike in a column both have, or one table's run would refuse the other's (the
  # ALA table's Per-FedAvg and FedPHP run other forms, as perfedavg_host, fedphp_host).
  shared = set()
  for name in paper_specs.PAPER_FILES:
    with open(os.path.join(tables.PAPER_DIR, name)) as f:
      for table_name, table in json.load(f).items():
        if not table_name.startswith("_"):  # "_about"
          shared.update((table_name, spec["row_of"]) for spec in table["rows"].values()
                        if "row_of" in spec)
  assert ("fedala_ala", "fedala1") in shared
  for one, other in shared:
    a, b = TABLES[one], TABLES[other]
    for column in set(a["columns"]) & set(b["columns"]):
      assert paper_specs.cell_flags(a, column) == paper_specs.cell_flags(b, column), column
      for row in set(paper_specs.table_rows(a)) & set(paper_specs.table_rows(b)):
        assert (paper_specs.row_flags(a, column, row)
                == paper_specs.row_flags(b, column, row)), (one, other, column, row)
  assert paper_specs.row_flags(TABLES["fedala_ala"], "cifar10_dir", "perfedavg_ala") == {
      "algorithm": "perfedavg", "perfedavg_beta": 0.005, "ala": True}


def test_every_row_algorithm_and_column_model_is_registered():
  missing = sorted({f"algorithm {spec['algorithm']}" for table in TABLES.values()
                    for spec in table["rows"].values()
                    if spec["algorithm"] not in algorithms.REGISTRY}
                   | {f"model {paper_specs.cell_flags(table, c)['model']}"
                      for table in TABLES.values() for c in table["columns"]
                      if paper_specs.cell_flags(table, c).get("model", "mlp") not in MODELS})
  assert not missing


def test_the_papers_numbers_as_printed():
  coaching1, coaching2 = TABLES["coaching1"]["columns"], TABLES["coaching2"]["columns"]
  assert coaching1["mnist_0.1"]["values"]["coaching"] == {"mean": 97.97, "std": 0.75}
  assert coaching1["cifar100_0.3"]["values"]["local"] == {"mean": 15.56, "std": 0.62}
  assert coaching2["fmnist_0.3"]["values"]["moon"] == {"mean": 60.70, "std": 0.56}
  assert coaching2["mnist_0.1"]["values"]["pfedla"] == {"mean": 58.35, "std": 0.45}
  fedala = TABLES["fedala1"]["columns"]
  assert fedala["tiny_dir"]["values"]["fedphp"] == {"mean": 35.69, "std": 3.26}
  assert fedala["mnist_pat"]["values"]["fedala"] == {"mean": 99.88, "std": 0.01}
  assert fedala["agnews_dir"]["values"]["partialfed"] == {"mean": 85.20, "std": 0.16}
  ala = TABLES["fedala_ala"]["columns"]
  assert ala["cifar100_dir"]["values"]["fedprox_ala"] == {"mean": 56.18, "std": 0.65,
                                                          "imp": 24.19}
  # A host's row without ALA is the main table's number (= the ALA table's Acc. - Imps.).
  assert ala["cifar10_dir"]["values"]["fedavg"] == fedala["cifar10_dir"]["values"]["fedavg"]
  # ... and its run is the main table's row ({"row_of": "fedala1"}): one set of flags.
  for host in ("fedamp", "pfedme", "ditto"):
    shared, main = TABLES["fedala_ala"]["rows"][host], TABLES["fedala1"]["rows"][host]
    assert {k: v for k, v in shared.items() if k != "note"} == {
        k: v for k, v in main.items() if k != "note"}
    assert shared["note"].startswith("without ALA: the main table's number of the column")
    assert shared["note"].endswith(main.get("note", "column"))
  confree = TABLES["confree2"]["columns"]
  assert confree["flowers102_c60_p30"]["values"]["apfl_confree"] == {"mean": 49.30, "imp": 3.42}
  # Its CIFAR-10 cells print the poster's CIFAR-100 gains at the same C and P.
  cell = paper_render.summarize_cell(TABLES["confree2"], "cifar10_c60_p30", {})
  assert {e["row"]: e.get("paper_imp") for e in cell if "improves" in e} == {
      f"{h}_confree": confree["cifar100_c60_p30"]["values"][f"{h}_confree"]["imp"]
      for h in ("apfl", "fedrod", "fedrep", "fedcp", "fedala", "fedpac")}
  assert all(e["paper_acc"] is None for e in cell)
  assert confree["cifar100_c20_p30"]["values"]["fedpac"] == {"mean": 61.45}
  # Each cell's settings, as the papers (or, where they are silent, the code) give them.
  assert {k: paper_specs.cell_flags(TABLES["coaching2"], "cifar100_0.1")[k]
          for k in ("num_clients", "participation", "rounds", "model")} == {
      "num_clients": 100, "participation": 0.1, "rounds": 200, "model": "resnet18"}
  assert TABLES["coaching2"]["columns"]["cifar10_0.3"]["sample_every"] == 5
  assert paper_specs.row_flags(TABLES["coaching1"], "fmnist_0.3", "coaching") == {
      "algorithm": "coaching", "coach_beta": 1.0}
  assert paper_specs.row_flags(TABLES["fedala_ala"], "cifar10_dir", "ditto_ala") == {
      "algorithm": "ditto", "ala": True}
  # FedBN runs on the CNN with BatchNorm where the paper's CNN has none; its R-Acc
  # would compare it with a LOCAL on another model, so it has no --reference.
  for table, column in (("coaching1", "mnist_0.1"), ("coaching2", "fmnist_0.3")):
    assert paper_specs.row_flags(TABLES[table], column, "fedbn") == {
        "algorithm": "fedbn", "model": "coaching_cnn_bn"}
    rows = paper_specs.table_rows(TABLES[table])
    assert paper_tables.row_references(TABLES[table], column, "fedbn", rows, 0, "w") == ()
    assert paper_tables.row_references(TABLES[table], column, "fedavg", rows, 0, "w")[0] == (
        f"w/{column}/seed0/local/results.json")
    assert paper_tables.row_references(TABLES[table], column, "local", rows, 0, "w") == ()
  assert paper_specs.row_flags(TABLES["coaching1"], "cifar10_0.1", "fedbn") == {
      "algorithm": "fedbn"}  # ResNet-18 has BatchNorm of its own
  assert {k: paper_specs.cell_flags(TABLES["confree2"], "cifar10_c60_p30")[k]
          for k in ("num_clients", "participation", "partition", "classes_per_client")} == {
      "num_clients": 60, "participation": 0.3, "partition": "pathological",
      "classes_per_client": 2}


def test_coaching_cells_carry_the_papers_settings():
  flags = paper_specs.cell_flags(TABLES["coaching1"], "mnist_0.3")
  assert {k: flags[k] for k in ("num_clients", "participation", "data_fraction",
                                "local_epochs", "lr", "partition", "dirichlet_alpha",
                                "model", "rounds", "dataset")} == {
      "num_clients": 10, "participation": 1.0, "data_fraction": 0.1, "local_epochs": 5,
      "lr": 0.01, "partition": "dirichlet", "dirichlet_alpha": 0.3,
      "model": "coaching_cnn", "rounds": 50, "dataset": "mnist"}
  fedala = paper_specs.cell_flags(TABLES["fedala1"], "mnist_pat")
  assert {k: fedala[k] for k in ("num_clients", "batch_size", "lr", "local_epochs",
                                 "model", "partition", "classes_per_client", "ala_s",
                                 "ala_p")} == {
      "num_clients": 20, "batch_size": 10, "lr": 0.005, "local_epochs": 1,
      "model": "fedavg_cnn", "partition": "pathological", "classes_per_client": 2,
      "ala_s": 80.0, "ala_p": 1}


def test_best_round_accuracy_by_hand():
  test_acc = np.array([[0.5, 1.0], [0.9, 0.4], [0.6, 0.8], [0.7, 0.7], [0.2, 0.2],
                       [0.1, 0.1], [0.3, 0.3]])
  n_test = np.array([30, 10])
  mean = metrics.accuracy_per_round(test_acc, n_test, "mean")
  np.testing.assert_allclose(mean, [0.75, 0.65, 0.7, 0.7, 0.2, 0.1, 0.3])
  weighted = metrics.accuracy_per_round(test_acc, n_test, "weighted")
  np.testing.assert_allclose(weighted[:2], [(15 + 10) / 40, (27 + 4) / 40])  # 0.625, 0.775
  assert metrics.best_sampled_round(mean) == (1, 0.75)
  assert metrics.best_sampled_round(weighted) == (2, pytest.approx(0.775))
  # Every 5th round and the last: rounds 5 and 7 only.
  assert metrics.best_sampled_round(mean, 5) == (7, pytest.approx(0.3))
  assert metrics.best_sampled_round(mean, 2) == (4, pytest.approx(0.7))  # 2, 4, 6, 7
  with pytest.raises(ValueError, match="unknown weighting"):
    metrics.accuracy_per_round(test_acc, n_test, "median")


def _write_timing(directory, seconds):
  """timing.json of a row one process trained in `seconds`."""
  segment = {"first_round": 0, "last_round": 2, "compile_seconds": 0.0,
             "round_seconds": 1.0, "train_seconds": seconds, "machine": "cpu x1, 1 core"}
  (directory / "timing.json").write_text(json.dumps(
      {"resumed_from_round": 0, "segments": [segment], "round_seconds_all": 1.0,
       "seconds_all": seconds}))


def test_a_round_s_mean_over_its_sampled_clients_by_hand(tmp_path):
  test_acc = np.array([[0.5, 1.0, 0.2], [0.9, 0.4, 0.6]])
  n_test = np.array([30, 10, 20])
  sampled = np.array([[True, False, True], [False, True, True]])
  np.testing.assert_allclose(metrics.accuracy_per_round(test_acc, n_test, "mean", sampled),
                             [(0.5 + 0.2) / 2, (0.4 + 0.6) / 2])
  np.testing.assert_allclose(metrics.accuracy_per_round(test_acc, n_test, "weighted", sampled),
                             [(15 + 4) / 50, (4 + 12) / 30])
  assert np.isnan(metrics.accuracy_per_round(test_acc, n_test, "mean",
                                             np.zeros((2, 3), bool))).all()
  # A row's run: the clients with local steps that round are the ones it sampled.
  np.savez(tmp_path / "history.npz", test_acc=test_acc,
           local_steps=np.where(sampled, 5, 0))
  (tmp_path / "results.json").write_text(json.dumps(
      {"clients": [{"n_test": int(n)} for n in n_test]}))
  _write_timing(tmp_path, 2.0)
  every = sweep.read_row_run(str(tmp_path), sweep.BestRound("mean", 1))
  only_sampled = sweep.read_row_run(str(tmp_path), sweep.BestRound("mean", 1, "sampled"))
  np.testing.assert_allclose(every.per_round, [1.7 / 3, 1.9 / 3])
  assert (only_sampled.best_round, only_sampled.best) == (2, pytest.approx(0.5))
  np.savez(tmp_path / "history.npz", test_acc=test_acc, local_steps=np.zeros((2, 3)))
  with pytest.raises(ConfigError, match="a round trained no client"):
    sweep.read_row_run(str(tmp_path), sweep.BestRound("mean", 1, "sampled"))
  np.savez(tmp_path / "history.npz", test_acc=test_acc)
  with pytest.raises(ConfigError, match="history.npz has no local_steps"):
    sweep.read_row_run(str(tmp_path), sweep.BestRound("mean", 1, "sampled"))


def test_a_row_without_every_round_s_test_scores_is_refused(tmp_path):
  test_acc = np.array([[0.5, 0.7], [np.nan, np.nan], [0.6, 0.8]])  # run with --eval_every
  np.savez(tmp_path / "history.npz", test_acc=test_acc)
  (tmp_path / "results.json").write_text(json.dumps(
      {"clients": [{"n_test": 10}, {"n_test": 30}]}))
  _write_timing(tmp_path, 3.0)
  with pytest.raises(ConfigError, match="test was not scored every round"):
    sweep.read_row_run(str(tmp_path), sweep.BestRound("mean", 1))


def run_reproduce(*args):
  return subprocess.run([sys.executable, "-m", "experiments.reproduce", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


# Tiny: 3 clients on 2% of MNIST (the copy in the package), 2 rounds of one epoch, the
# MLP; each is a departure from Table 1's settings the output names.
TINY = ["--table=coaching1", "--columns=mnist_0.3", "--num_clients=3", "--rounds=2",
        "--local_epochs=1", "--data_fraction=0.02", "--model=mlp", "--hidden=16",
        "--log_every=1"]


def test_a_tiny_coaching_table_end_to_end(tmp_path):
  proc = run_reproduce("--rows=local,fedavg", f"--workdir={tmp_path}", *TINY)
  assert proc.returncode == 0, proc.stderr[-3000:]
  table = json.loads((tmp_path / "coaching1.json").read_text())
  column = table["columns"]["mnist_0.3"]
  assert column["rounds"] == 2 and column["paper_rounds"] == 50
  rows = {r["row"]: r for r in column["rows"]}
  assert list(rows) == list(TABLES["coaching1"]["rows"])  # every row printed, in order
  for name in ("local", "fedavg"):
    run_dir = tmp_path / "mnist_0.3" / "seed0" / name
    with np.load(run_dir / "history.npz") as history:
      test_acc = history["test_acc"]
    # The best round of the plain mean over clients, from every round's accuracies.
    per_round = test_acc.mean(axis=1)
    assert test_acc.shape == (2, 3)
    assert rows[name]["acc"] == pytest.approx(100 * per_round.max(), abs=0.006)
    assert rows[name]["best_round"] == [int(np.argmax(per_round)) + 1]
    assert rows[name]["final_acc"] == pytest.approx(100 * per_round[-1], abs=0.006)
    assert rows[name]["machine"].startswith("cpu x")  # what trained it, named in the table
    run = json.loads((run_dir / "results.json").read_text())
    assert run["partition"]["data_fraction"] == 0.02  # the override reached the run
    assert run["partition"]["dirichlet_alpha"] == 0.3 and run["train"]["lr"] == 0.01
    assert run["train"]["momentum"] == 0.0 and run["model"] == "mlp"
  assert rows["fedavg"]["paper_acc"] == 64.78 and rows["fedavg"]["paper_std"] == 0.04
  assert rows["fedavg"]["diff"] == pytest.approx(rows["fedavg"]["acc"] - 64.78, abs=0.011)
  assert rows["fedbn"]["acc"] is None and rows["fedbn"]["paper_acc"] == 95.16
  markdown = (tmp_path / "coaching1.md").read_text()
  assert "2 rounds, FEWER than the paper's 50" in markdown
  for flag in ("--rounds=2", "--num_clients=3", "--model=mlp", "--data_fraction=0.02"):
    assert f"DEPARTURE from the table's settings: {flag} (command line)" in markdown
  assert ("DEPARTURE: --hidden=16 (command line; the table leaves it at its default)"
          in markdown)
  assert "--log_every" not in markdown.split("command: ")[0]  # changes nothing computed
  fedavg_line = [l for l in markdown.splitlines() if l.startswith("| fedavg |")][0]
  assert f"| {rows['fedavg']['acc']:.2f} | 64.78 ± 0.04 |" in fedavg_line
  assert ("Columns this command ran: MNIST alpha=0.3; the paper's numbers only here (run by"
          " another command, or not at all): MNIST alpha=0.1") in markdown
  # The column's own table, which a later command over other columns leaves alone.
  column_markdown = (tmp_path / "mnist_0.3" / "coaching1.md").read_text()
  assert fedavg_line in column_markdown and "## MNIST alpha=0.3" in column_markdown
  with open(tmp_path / "coaching1.csv", newline="") as f:
    lines = list(csv.DictReader(f))
  assert len(lines) == 13 and lines[1]["row"] == "fedavg"  # the other readings included
  assert float(lines[1]["acc"]) == rows["fedavg"]["acc"] and lines[1]["paper_acc"] == "64.78"
  assert (tmp_path / "coaching1.png").stat().st_size > 0
  assert (tmp_path / "coaching1_curves.png").stat().st_size > 0

  # Other settings in a finished row's directory: refused before anything trains.
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", "--rows=local,fedavg", f"--workdir={tmp_path}", "--lr=0.1",
               *TINY])
  try:
    with pytest.raises(ConfigError, match=r"holds a run with other settings: train.lr=0.01 \(now"
                       r" 0.1\)") as error:
      reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
  assert str(error.value).startswith(
      f"--workdir {tmp_path / 'mnist_0.3' / 'seed0' / 'local'} holds a run")

  # The same sweep again: its finished rows are read, not run (nothing trains or
  # compiles), even without their checkpoints, and give the same table.
  shutil.rmtree(tmp_path / "mnist_0.3" / "seed0" / "fedavg" / "checkpoints")
  timing = (tmp_path / "mnist_0.3" / "seed0" / "fedavg" / "timing.json").read_text()
  flag_values(["reproduce", "--rows=local,fedavg", f"--workdir={tmp_path}", *TINY])
  try:
    reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
  assert json.loads((tmp_path / "coaching1.json").read_text())["columns"] == table["columns"]
  assert (tmp_path / "mnist_0.3" / "seed0" / "fedavg" / "timing.json").read_text() == timing

  # Scored over each round's sampled clients: its own files, beside the default's. Every
  # client trains every round in this table, so the numbers are the same.
  flag_values(["reproduce", "--rows=local,fedavg", f"--workdir={tmp_path}",
               "--scored_clients=sampled", *TINY])
  try:
    reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
  sampled = json.loads((tmp_path / "coaching1_sampled.json").read_text())
  assert sampled["scored_clients"] == "sampled" and table["scored_clients"] == "all"
  assert sampled["columns"] == table["columns"]
  assert ("clients scored each round: only the clients sampled to train that round"
          in (tmp_path / "mnist_0.3" / "coaching1_sampled.md").read_text())
  assert json.loads((tmp_path / "coaching1.json").read_text())["columns"] == table["columns"]

  # --finished_only trains nothing: the rows finished so far, in every column that has
  # one. Another process is running fedavg now (it holds its lock), so it is left out;
  # fedprox, seed 1 and MNIST alpha 0.1 have no finished row.
  held = open(tmp_path / "mnist_0.3" / "seed0" / "fedavg" / sweep.ROW_LOCK, "a")
  fcntl.flock(held, fcntl.LOCK_EX)
  flag_values(["reproduce", "--finished_only", "--seeds=2", "--rows=local,fedavg,fedprox",
               f"--workdir={tmp_path}", TINY[0], "--columns=mnist_0.1,mnist_0.3", *TINY[2:]])
  try:
    document = reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
    held.close()
  assert list(document["columns"]) == ["mnist_0.3"] and document["finished_only"]
  assert document["not_run"]["mnist_0.1"] == "no row finished in the workdir (--finished_only)"
  read = {r["row"]: r for r in document["columns"]["mnist_0.3"]["rows"]}
  assert read["local"]["acc"] == rows["local"]["acc"] and read["local"]["seeds"] == 1
  assert read["local"]["partial"] == "only 1 of 2 seeds finished (seed 1: not started)"
  assert read["fedavg"]["acc"] is None and read["fedprox"]["acc"] is None
  assert read["fedavg"]["not_run"] == ("not finished in the workdir (seed 0: running in"
                                       " another process; seed 1: not started)")
  assert read["fedprox"]["not_run"] == ("not finished in the workdir (seed 0: not started;"
                                        " seed 1: not started)")
  assert read["fedbn"]["not_run"] == "not asked for (--rows)"
  assert not (tmp_path / "mnist_0.1").exists() and not (tmp_path / "mnist_0.3" / "seed1").exists()
  markdown = (tmp_path / "coaching1.md").read_text()
  assert "rows: those finished in the workdir, read; none trained (`--finished_only`" in markdown
  assert "- MNIST alpha=0.1: no row finished in the workdir (--finished_only)" in markdown
  local_line = next(l for l in markdown.splitlines() if l.startswith("| local |"))
  assert local_line.endswith("; only 1 of 2 seeds finished (seed 1: not started) |")
  flag_values(["reproduce", "--finished_only", f"--workdir={tmp_path / 'none'}", *TINY])
  try:
    with pytest.raises(ConfigError, match="--finished_only: no row of --table=coaching1 is"
                       " finished in"):
      reproduce.reproduce()
  finally:
    flag_values.unparse_flags()


def test_rows_off_the_cells_training_settings_share_one_local(tmp_path, monkeypatch):
  # Two rows at 2 local epochs, beside the cell's 1-epoch LOCAL: the first trains its
  # own LOCAL for its R-Acc, the second is scored against that one, trained once.
  table = json.loads(json.dumps(TABLES["coaching1"]))
  table["rows"] = {name: {"label": name, "algorithm": name, "flags": {"local_epochs": 2}}
                   for name in ("fedavg", "fedprox")}
  monkeypatch.setattr(paper_tables, "load_tables", lambda: {**TABLES, "coaching1": table})
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", f"--workdir={tmp_path}", *TINY[:3], "--rounds=1",
               *TINY[5:8]])
  try:
    reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
  seed_dir = tmp_path / "mnist_0.3" / "seed0"
  own_local = json.loads((seed_dir / "fedavg" / "local" / "results.json").read_text())
  assert own_local["train"]["local_epochs"] == 2
  assert not (seed_dir / "fedprox" / "local").exists()
  scored = json.loads((seed_dir / "fedprox" / "results.json").read_text())
  cell_local = json.loads((seed_dir / "local" / "results.json").read_text())
  assert [c["local_acc"] for c in scored["clients"]] == [c["acc"] for c in own_local["clients"]]
  assert [c["local_acc"] for c in scored["clients"]] != [c["acc"] for c in cell_local["clients"]]


@pytest.mark.parametrize("args,message", [
    (["--table=coaching1", "--dataset=cifar10"],
     "--table=coaching1 sets --dataset itself, per column and row; pick columns with"
     " --columns (its columns: mnist_0.1, mnist_0.3, fmnist_0.1,"),
    (["--table=confree2", "--aggregation=confree"], "--table=confree2 sets --aggregation"),
    (["--table=coaching2", "--columns=mnist_0.5"],
     "--table=coaching2 has no column mnist_0.5; its columns: mnist_0.1,"),
    (["--table=fedala1", "--columns=mnist_pat,tiny_star_dir"],
     "--table=fedala1 column tiny_star_dir cannot run here: TINY* is not defined on the"),
    (["--table=fedala_ala", "--rows=fedavg_ala,nope"],
     "--table=fedala_ala has no row nope; its rows: local, fedavg, fedavg_ala,"),
    (["--table=coaching2", "--eval_every=5"],
     "--eval_every: --table=coaching2's metric is the best test accuracy over the rounds"),
    (["--table=fedora1", "--columns=mnist_0.1"],
     "--columns picks the cells of coaching1, coaching2, fedala1, fedala_ala, confree2;"
     " --table=fedora1 runs the --dataset column"),
    (["--table=fedora3", "--scored_clients=sampled"],
     "--scored_clients picks whose accuracy coaching1, coaching2, fedala1, fedala_ala,"
     " confree2 average each round; --table=fedora3 reports every client's"),
])
def test_bad_tables_columns_and_rows_are_refused_in_one_line(args, message):
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", *args])
  try:
    with pytest.raises(ConfigError) as error:
      reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("table_name,column,dataset,model,missing", [
    ("fedala1", "tiny_dir", "tinyimagenet", "fedavg_cnn", "tinyimagenet: no data in"),
    ("fedala_ala", "tiny_dir", "tinyimagenet", "fedavg_cnn", "tinyimagenet: no data in"),
    # AG News downloads where there is a network; the tests run offline.
    ("fedala1", "agnews_dir", "agnews", "fasttext", "ag_news is not in"),
    ("confree2", "flowers102_c60_p30", "flowers102", "fedavg_cnn", "flowers102: no data in"),
])
def test_columns_of_data_not_held_here_run_where_it_is(tmp_path, table_name, column, dataset,
                                                        model, missing):
  table = TABLES[table_name]
  flags = paper_specs.cell_flags(table, column)
  assert flags["dataset"] == dataset and flags["model"] == model
  assert paper_specs.column_problem(table, column) is None
  assert column not in table["default_columns"]  # shared/data does not hold it
  assert paper_tables.pick_columns(table_name, table, [column]) == [column]
  # Asked for without its files: the loader's one-line error, before anything trains.
  flag_values = reproduce.FLAGS
  flag_values(["reproduce", f"--table={table_name}", f"--columns={column}", "--rows=local",
               f"--data_dir={tmp_path}", f"--workdir={tmp_path / 'runs'}"])
  try:
    with pytest.raises(FedoraError, match=f"^{missing}") as error:
      reproduce.reproduce()
  finally:
    flag_values.unparse_flags()
  assert "\n" not in str(error.value)


def test_rows_this_build_cannot_run_say_why():
  table = {"rows": {"nope": {"label": "N", "algorithm": "nope"},
                    "local_ala": {"label": "L", "algorithm": "local", "flags": {"ala": True}},
                    "fedavg_ala": {"label": "F", "algorithm": "fedavg",
                                   "flags": {"ala": True}}},
           "columns": {"c": {"dataset": "mnist", "settings": [], "values": {}}},
           "settings": []}
  assert paper_specs.row_problem(table, "nope") == "nope is not registered in this build"
  assert paper_specs.row_problem(table, "local_ala").startswith(
      "--ala needs an algorithm that sends a global model; local does not")
  assert paper_specs.row_problem(table, "fedavg_ala") is None
  assert paper_tables.pick_rows("t", table, []) == ["local", "fedavg_ala"]
  with pytest.raises(ConfigError, match="^--table=t row nope cannot run here: nope is not"):
    paper_tables.pick_rows("t", table, ["nope"])
  # A model this build lacks keeps its column to the paper's numbers.
  table["columns"]["c"]["settings"] = [{"setting": "model", "paper": "x", "source": "y",
                                        "flag": "model", "value": "no_such_model"}]
  assert paper_specs.column_problem(table, "c") == (
      "needs --model=no_such_model, which this build does not register")


def test_a_table_s_rounds_are_named_for_whose_they_are():
  # Coaching's paper states its rounds; FedALA's and ConFREE's come from their code.
  assert paper_render.rounds_note(TABLES["coaching1"], "mnist_0.1", 2) == (
      "2 rounds, FEWER than the paper's 50")
  assert paper_render.rounds_note(TABLES["fedala1"], "mnist_pat", 10) == (
      "10 rounds, FEWER than the authors' code's 1000")
  assert paper_render.rounds_note(TABLES["confree2"], "cifar10_c20_p30", 2000) == (
      "2000 rounds (the authors' code's: 2000)")
