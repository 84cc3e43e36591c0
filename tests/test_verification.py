"""verification/ (make verify): its bridges, and that it passes, saying why, where the
reference implementations or PyTorch are missing. The side-by-side runs themselves are
`make verify`'s, which also exercises the PyTorch side of the weight bridge (PyTorch is
the verify extra's, not the test extra's)."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from fedora_jax.engine.local_training import epoch_batches
from fedora_jax.models import build_model
from fedora_jax.rounds import client_keys
from tiny import tiny_data
from verification import bridges, verify

def test_without_the_references_it_says_so_in_one_line_and_passes(monkeypatch, capsys):
  monkeypatch.setattr(bridges, "REFERENCES", "/nonexistent/references")
  assert verify.main([]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert out == ["verify: skipped, no reference implementations at /nonexistent/references:"
                 " the project's shared/ folder, laid beside this checkout, holds them"]


def test_a_row_whose_package_is_missing_is_skipped_in_one_line(monkeypatch, capsys):
  # FedPAC's reference imports cvxpy, which the other rows do not need.
  if verify.missing() is not None:
    pytest.skip(verify.missing())
  from verification import one_round  # pylint: disable=import-outside-toplevel
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *rest: None if name == "cvxpy" else real(name, *rest))
  ran = []

  def compare(name, setting, control=False):  # no training: only what runs is recorded
    ran.append(name)
    return one_round.Comparison(name, "reference", 1, 1.0 if control else 0.0, 0.0, [], [])
  monkeypatch.setattr(one_round, "compare", compare)
  assert verify.main(["--algorithms=fedavg,fedpac"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert [line for line in out if line.startswith("verify: fedpac")] == [
      "verify: fedpac skipped, cvxpy (PFLlib's FedPAC server solves its heads' QP with it)"
      " is not installed: make verify installs it"]
  assert ran == ["fedavg", "fedavg"]  # the row and the control, no fedpac


def test_the_batches_are_the_engines_own_each_sample_once_an_epoch():
  data, _ = tiny_data((8, 8, 8), max_pad_ratio=1.0)
  key = jax.random.key(3)
  batches = bridges.client_batches(key, 2, data, epochs=2, batch_size=4)
  assert len(batches) == 3 and all(len(client) == 1 for client in batches)
  for client in batches:
    for epoch in client[0]:
      assert epoch.shape == (2, 4) and sorted(epoch.ravel().tolist()) == list(range(8))
  # Client 1's second epoch, as local_training.train draws it from its client key.
  client_key = client_keys(jax.random.fold_in(key, 2), 3)[1]
  expected, _ = epoch_batches(jax.random.split(client_key, 2)[1], np.ones(8, bool), 8, 4, 2)
  np.testing.assert_array_equal(batches[1][0][1], expected)
  # Two trainings from keys split off the client key (Ditto's personal one first).
  two = bridges.client_batches(key, 2, data, 2, 4, lambda k: list(jax.random.split(k))[::-1])
  personal, _ = epoch_batches(jax.random.split(jax.random.split(client_key)[1], 2)[0],
                              np.ones(8, bool), 8, 4, 2)
  np.testing.assert_array_equal(two[1][0][0], personal)


def test_dense_layers_become_pytorch_linears():
  model = build_model("mlp", 10, (100,))
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28), np.uint8))
  layers = bridges.dense_stack_to_torch(params)
  assert [w.shape for w, _ in layers] == [(100, 784), (10, 100)]
  np.testing.assert_array_equal(layers[0][0], np.asarray(params["params"]["Dense_0"]["kernel"]).T)


def test_the_docs_table_is_the_one_the_results_file_renders():
  with open(os.path.join(bridges.ROOT, "results", "verification", "one_round.json")) as f:
    rendered = verify.render(json.load(f))
  with open(os.path.join(bridges.ROOT, "docs", "verification.md")) as f:
    doc = f.read()
  rows = [line for line in rendered.splitlines() if line.startswith("| ")]
  assert len(rows) >= 5 and all(row in doc for row in rows)


def _row(name, error, control=False):
  return {"algorithm": name, "reference": "ref", "rounds": 1, "max_relative_error": error,
          "accuracy_gap": 1.19e-8, "control": control}


def _document(rows, date):
  return {"setting": "s", "date": date, "machine": "m", "command": "c", "rows": rows}


def test_a_run_of_some_algorithms_merges_into_the_written_rows(tmp_path):
  path = str(tmp_path / "one_round.json")
  verify.write(path, _document([_row("fedavg", 2e-7), _row("ditto", 3e-7),
                                _row("fedavg", 3e-2, control=True)], "day 1"))
  # fedavg again with digits below the one shown moved: kept as written, date too.
  merged = verify.write(path, _document([_row("fedavg", 2.04e-7)], "day 2"))
  assert merged["date"] == "day 1" and merged["rows"][0]["max_relative_error"] == 2e-7
  # ditto's shown digit moves and a new row comes: both written, the rest kept, in order.
  merged = verify.write(path, _document([_row("ditto", 5e-7), _row("mystery", 1e-7)], "day 3"))
  with open(path) as f:
    assert json.load(f) == merged
  assert merged["date"] == "day 3"
  assert [(r["algorithm"], r["max_relative_error"], r["control"]) for r in merged["rows"]] == [
      ("fedavg", 2e-7, False), ("ditto", 5e-7, False), ("mystery", 1e-7, False),
      ("fedavg", 3e-2, True)]
  # A row run at another seed (Reference.seed) is written though its line reads alike.
  merged = verify.write(path, _document([{**_row("fedavg", 2e-7), "seed": 1}], "day 4"))
  assert merged["date"] == "day 4" and merged["rows"][0]["seed"] == 1


def test_the_table_does_not_flip_on_digits_it_does_not_show():
  before = _document([_row("fedavg", 1.9996e-7), _row("fedkd", 6.89e-6)], "d")
  after = _document([_row("fedavg", 2.03e-7), _row("fedkd", 7.2e-6)], "d")
  assert verify.render(before) == verify.render(after)
  assert "| fedavg | ref | 1 | 2e-07 | 1e-08 | equal |" in verify.render(before)


def test_the_two_pfllib_snapshots_swap_in_one_process():
  # The a41f7ba rows run PFLlib at the commit behind FedALA's table, the others its head:
  # the same package names (flcore, utils), each imported from the snapshot asked for.
  if verify.missing() is not None:
    pytest.skip(verify.missing())
  try:
    for snapshot in ("PFLlib-a41f7ba", "PFLlib", "PFLlib-a41f7ba"):
      system = bridges.import_pfllib(snapshot)
      module = importlib.import_module("flcore.servers.serverperavg")
      assert module.__file__.startswith(system + os.sep), (snapshot, module.__file__)
  finally:
    bridges.import_pfllib("PFLlib")


def test_a_reference_round_is_the_same_every_run():
  # PFLlib's server uploads in a random.sample order, which sets its sums' rounding; the
  # harness seeds it so that a row's number does not change from one run to the next.
  if verify.missing() is not None:
    pytest.skip(verify.missing())
  import random  # pylint: disable=import-outside-toplevel
  from verification import one_round  # pylint: disable=import-outside-toplevel
  first = one_round.compare("fedbabu_uniform")
  random.seed(12345)  # whatever state the process left behind
  second = one_round.compare("fedbabu_uniform")
  assert first.max_relative_error == second.max_relative_error
  assert first.reference_accuracy == second.reference_accuracy
  assert first.max_relative_error < 1e-5


def test_the_summary_adds_each_algorithms_recorded_twenty_rounds(tmp_path):
  folder = tmp_path / "results" / "verification" / "long_cpu"
  folder.mkdir(parents=True)
  row = {"algorithm": "fedavg", "ours": {"accuracy": [0.5, 0.742]},
         "reference_run": {"accuracy": [0.5, 0.743]}, "final_gap_points": 0.1,
         "date": "2026-12-04"}
  (folder / "fedavg.json").write_text(json.dumps(row))
  text = verify.long_summary(["fedavg", "ditto_uniform"], root=str(tmp_path))
  assert "| fedavg | 74.20 | 74.30 | 0.10 | within 0.5 point | 2-core CPU, 2026-12-04 |" in text
  assert text.endswith("No 20-round record (docs/verification.md says why): ditto")


def test_a_row_variant_with_a_twenty_round_record_of_its_own_lists_it(tmp_path):
  folder = tmp_path / "results" / "verification" / "long_cpu"
  folder.mkdir(parents=True)
  for name, ours in (("moon", 0.727), ("moon_bn", 0.812)):
    (folder / f"{name}.json").write_text(json.dumps(
        {"algorithm": name, "ours": {"accuracy": [ours]},
         "reference_run": {"accuracy": [0.801]}, "final_gap_points": 1.1,
         "date": "2026-12-05"}))
  text = verify.long_summary(["moon", "moon_bn", "fedbabu_uniform"], root=str(tmp_path))
  assert "| moon | 72.70 | 80.10 |" in text and "| moon_bn | 81.20 | 80.10 |" in text
  assert text.endswith("No 20-round record (docs/verification.md says why): fedbabu")


def test_the_ala_host_driver_runs_ala_in_place_of_the_hosts_copy():
  # A host whose set_parameters copies the global model into its model and its anchor
  # (FedProx's form): under the driver the anchor is still the global model, and ALA
  # gets the global model and the client's own, whose result the model then holds.
  if verify.missing() is not None:
    pytest.skip(verify.missing())
  import torch  # pylint: disable=import-outside-toplevel
  from verification import ala_hosts  # pylint: disable=import-outside-toplevel

  class Host:
    def __init__(self):
      self.model = torch.nn.Linear(2, 1)
      self.anchor = [p.data.clone() for p in self.model.parameters()]

    def set_parameters(self, model):
      for new, anchor, param in zip(model.parameters(), self.anchor, self.model.parameters()):
        anchor.data, param.data = new.data.clone(), new.data.clone()

  class HalfWay:  # stands in for utils/ALA.py: theta_hat halfway, the call kept
    def adaptive_local_aggregation(self, global_model, local_model):
      self.seen = [(g.data.clone(), p.data.clone())
                   for g, p in zip(global_model.parameters(), local_model.parameters())]
      for g, p in zip(global_model.parameters(), local_model.parameters()):
        p.data = (g.data + p.data) / 2

  on = ala_hosts.AlaOn(received=ala_hosts.whole_model, local=ala_hosts.whole_model)
  client = ala_hosts.ala_client(Host, on)()
  client.ALA = HalfWay()
  own = [p.data.clone() for p in client.model.parameters()]
  sent = torch.nn.Linear(2, 1)
  client.set_parameters(sent)
  for (seen_global, seen_own), new, mine, anchor, param in zip(
      client.ALA.seen, sent.parameters(), own, client.anchor, client.model.parameters()):
    assert torch.equal(seen_global, new.data) and torch.equal(seen_own, mine)
    assert torch.equal(anchor, new.data)
    assert torch.equal(param.data, (new.data + mine) / 2)
