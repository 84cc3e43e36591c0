"""verification/long.py (make verify-long, check (b)) and the bridges it adds: the CNN's
weights in PyTorch's layout, the batches of clients padded in their bucket, the docs
table rendered from the committed results, and its one line where the references are
missing. The twenty-round runs themselves are make verify-long's (PyTorch, by hand)."""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from fedora_jax import algorithms
from fedora_jax.models import build_model
from fedora_jax.rounds import client_keys
from fedora_jax.simulation import TrainConfig, run_algorithm
from tiny import tiny_data, tiny_model, tiny_trainer
from fedora_jax.engine import batch_stats
from verification import bridges, long, stand_ins, twins


def nchw_fedavg_cnn(layers, x: np.ndarray) -> np.ndarray:
  """PyTorch's FedAvgCNN forward (NCHW, OIHW kernels, [out, in] Linear weights) in NumPy."""
  (w1, b1), (w2, b2), (w3, b3), (w4, b4) = layers
  relu = lambda v: np.maximum(v, 0.0)

  def conv(h, w, b):
    windows = sliding_window_view(h, w.shape[2:], axis=(2, 3))  # [B, C, H', W', k, k]
    return np.einsum("bchwuv,ocuv->bohw", windows, w) + b[None, :, None, None]

  def pool(h):
    b, c, height, width = h.shape
    return h.reshape(b, c, height // 2, 2, width // 2, 2).max(axis=(3, 5))
  h = pool(relu(conv(x, w1, b1)))
  h = pool(relu(conv(h, w2, b2))).reshape(len(x), -1)  # torch.flatten: (c, h, w)
  return relu(h @ w3.T + b3) @ w4.T + b4


def test_the_cnn_in_pytorchs_layout_computes_our_logits():
  model = build_model("fedavg_cnn", 10)
  x = np.random.default_rng(0).normal(size=(3, 28, 28)).astype(np.float32)
  params = model.init(jax.random.key(1), x[:1])
  layers = bridges.cnn_to_torch(params)
  assert [w.shape for w, _ in layers] == [(32, 1, 5, 5), (64, 32, 5, 5), (512, 1024),
                                         (10, 512)]
  ours = np.asarray(model.apply(params, x))
  np.testing.assert_allclose(nchw_fedavg_cnn(layers, x[:, None]), ours, rtol=1e-4,
                             atol=1e-5)
  # Without the flatten order's change the first dense layer reads other features.
  plain = list(layers)
  plain[2] = (np.asarray(params["params"]["Dense_0"]["kernel"]).T, layers[2][1])
  assert np.max(np.abs(nchw_fedavg_cnn(plain, x[:, None]) - ours)) > 1e-2


def test_padded_batches_are_the_ones_the_engine_trains_on():
  data, _ = tiny_data((8, 12, 16), max_pad_ratio=2.0)  # one bucket padded to 16
  assert list(bridges.padded_sizes(data)) == [16, 16, 16]
  key, lr = jax.random.key(5), 0.1
  batches = bridges.padded_client_batches(key, 3, data, epochs=2, batch_size=4)
  for k, n in enumerate((8, 12, 16)):
    for epoch in batches[k][0]:
      assert epoch.shape == (n // 4, 4) and sorted(epoch.ravel().tolist()) == list(range(n))
  model = tiny_model()
  trainer = tiny_trainer(model, lr=lr, epochs=2, batch_size=4)
  bucket = data.buckets[0].train
  client = 0  # 8 real samples of 16 slots
  own = jax.tree.map(lambda a: jnp.asarray(a[client]), bucket)
  params = model.init(jax.random.key(0), own.x[:1])
  trained, _ = trainer.train(params, own,
                             client_keys(jax.random.fold_in(key, 3), 3)[client])
  loss = lambda p, x, y: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, x), y))
  expected = params
  for epoch in batches[client][0]:
    for batch in epoch:
      grads = jax.grad(loss)(expected, own.x[batch], own.y[batch])
      expected = jax.tree.map(lambda p, g: p - lr * g, expected, grads)
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Where no client is padded, the same as check (a)'s client_batches.
  even, _ = tiny_data((8, 8), max_pad_ratio=2.0)
  for ours, theirs in zip(bridges.padded_client_batches(key, 1, even, 2, 4),
                          bridges.client_batches(key, 1, even, 2, 4)):
    for a, b in zip(ours[0], theirs[0]):
      np.testing.assert_array_equal(a, b)


def test_padded_loads_are_check_as_where_no_client_is_padded():
  """LONG_LOADS: check (a)'s loaders drawn over a padded size, each epoch a permutation
  of the client's real samples; equal to check (a)'s where the client is not padded."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  key = jax.random.key(7)
  check_a = {"pflda": one_round._da_loads, "fedgh": one_round._gh_loads,
             "fedpcl": one_round._pcl_loads, "fedas": one_round._as_loads,
             "perfedavg": one_round._peravg_loads, "fedfomo": one_round._fomo_loads,
             "fedpac": one_round._pac_loads}
  assert set(long.LONG_LOADS) == set(check_a)
  for name, loads in long.LONG_LOADS.items():
    n = 50 if name == "fedfomo" else 40  # a multiple of its cut (BATCHES_A_CUT)
    for ours, theirs in zip(loads(key, n, n, 2, 10), check_a[name](key, n, 2, 10)):
      assert len(ours) == len(theirs)
      for a, b in zip(ours, theirs):  # an epoch: [batches, B], or batches of other sizes
        assert len(a) == len(b)
        for batch_a, batch_b in zip(a, b):
          np.testing.assert_array_equal(batch_a, batch_b)
    real = 10 * long.BATCHES_A_CUT.get(name, 3)  # padded to 60 slots
    read = real - real // 5 if name == "fedfomo" else real  # its training share
    for load in loads(key, 60, real, 2, 10):
      for epoch in load:
        samples = np.concatenate([np.ravel(batch) for batch in epoch])
        assert sorted(samples.tolist()) == list(range(read)), name
        if isinstance(epoch, np.ndarray):
          assert epoch.shape[1] in (10, 20) and epoch.size == read, name


def test_padded_loads_while_built_are_check_as_where_no_client_is_padded():
  from verification import one_round  # pylint: disable=import-outside-toplevel
  key = jax.random.key(8)
  check_a = {"feddbe": one_round._dbe_built_loads}
  assert set(long.LONG_BUILT_LOADS) == set(check_a)
  for name, loads in long.LONG_BUILT_LOADS.items():
    for ours, theirs in zip(loads(key, 40, 40, 2, 10), check_a[name](key, 40, 2, 10)):
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    for load in loads(key, 50, 30, 2, 10):
      for epoch in load:
        assert epoch.shape == (3, 10) and sorted(epoch.ravel().tolist()) == list(range(30))


def test_without_the_references_it_says_so_in_one_line_and_passes(capsys, tmp_path):
  assert long.main([f"--references={tmp_path}", f"--out={tmp_path / 'out'}"]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert out == [f"verify-long: skipped, no reference implementations at {tmp_path}: the"
                 " project's shared/ folder, laid beside this checkout, holds them (or"
                 " pass --references)"]


def test_an_unknown_algorithm_is_one_line(capsys):
  with pytest.raises(SystemExit):
    long.main(["--algorithms=fedavg,nonesuch"])
  assert "nonesuch not covered" in capsys.readouterr().err


def test_the_docs_table_is_the_one_the_results_render():
  out = os.path.join(bridges.ROOT, "results", "verification", "long")
  rows = long.read_rows(out)
  assert rows and all(len(row["ours"]["accuracy"]) == row["rounds"] for row in rows)
  for row in rows:
    with open(os.path.join(out, f"{row['algorithm']}.json")) as f:
      assert json.load(f)["final_gap_points"] == pytest.approx(100 * abs(
          row["ours"]["accuracy"][-1] - row["reference_run"]["accuracy"][-1]))
  with open(os.path.join(bridges.ROOT, "docs", "verification.md")) as f:
    doc = f.read()
  block = doc.split(long.BEGIN, 1)[1].split(long.END, 1)[0]
  table = [line for line in long.render(rows, out).splitlines() if line.startswith("| ")]
  assert all(line in block for line in table)


def test_absent_modules_get_stand_ins_that_fail_when_called(monkeypatch):
  names = ("sklearn", "sklearn.preprocessing", "sklearn.metrics", "h5py", "dp_accounting",
           "dp_accounting.pld", "dp_accounting.rdp")
  for name in names:
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed
  assert stand_ins.install() == list(names)
  from dp_accounting.pld import privacy_loss_distribution  # pylint: disable=import-outside-toplevel
  from sklearn import metrics  # pylint: disable=import-outside-toplevel
  from sklearn.preprocessing import label_binarize  # pylint: disable=import-outside-toplevel
  import h5py  # pylint: disable=import-outside-toplevel
  for call in (label_binarize, metrics.roc_auc_score, h5py.File, privacy_loss_distribution):
    with pytest.raises(RuntimeError, match="not installed"):
      call()
  assert getattr(h5py, "__file__", None) is None  # what inspect asks every module


def test_on_state_sees_the_state_after_each_round():
  data, _ = tiny_data([12, 10, 12], seed=3)
  train = TrainConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.3, log_every=0)
  make = lambda: algorithms.make("fedavg", algorithms.default_config("fedavg", train))
  seen = []
  result = run_algorithm(make(), tiny_model(), data, train, progress=None,
                         on_state=lambda r, state: seen.append(
                             (r, jax.tree.map(np.array, state.algorithm.server))))
  assert [r for r, _ in seen] == [1, 2, 3]
  two = run_algorithm(make(), tiny_model(), data, dataclasses.replace(train, rounds=2),
                      progress=None)
  for kept, final in ((seen[1][1], two.final_state), (seen[2][1], result.final_state)):
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(final.algorithm.server)):
      np.testing.assert_array_equal(a, b)
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(seen[0][1]),
                                            jax.tree.leaves(seen[2][1])))


def _side(accuracy: list[float], models) -> dict:
  return {"accuracy": accuracy, "client_accuracy": [accuracy[-1]],
          "initial_logits": [[1.0, -2.0]], "server_models": models, "machine": "test",
          "train_sizes": [10], "round_seconds": 0.0, "compile_seconds": 0.0, "seconds": 0.0}


def test_the_server_models_are_compared_round_by_round(tmp_path):
  rng = np.random.default_rng(0)
  theirs = [[rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=3)]
            for _ in range(2)]
  ours = [[w * (1 + 1e-3 * r), b.copy()] for r, (w, b) in enumerate(theirs)]
  # A side's server models travel beside its JSON (--jobs: one process a side).
  long.write_part(str(tmp_path / "fedavg.ours"), _side([0.5, 0.6], ours))
  back = long.read_part(str(tmp_path / "fedavg.ours"))
  for kept, model in zip(back["server_models"], ours):
    for a, b in zip(kept, model):
      np.testing.assert_array_equal(a, b)
  # 814 and 809 right answers of 1,000 (ours a float32 mean): 0.5 point, read 0.500001.
  back["accuracy"] = [0.5, float(np.float32(0.814))]
  row = long.merge("fedavg", 2, back, _side([0.5, 0.809], theirs), long.Setting(),
                   {"command": "test"})
  assert row["server_model_error"][0] == 0.0
  assert row["server_model_error"][1] == pytest.approx(1e-3, rel=1e-3)
  assert row["final_gap_points"] > 0.5 and long.verdict(row) == "within 0.5 point"
  assert long.verdict({**row, "final_gap_points": 0.6}) == "DIFFERS"
  assert "| fedavg | ours, PFLlib | 0.0e+00 | 1.0e-03 | 81.40, 80.90 |" in (
      long.render_model_errors([row]))
  # Beside PFLlib in float64 (--float64_reference): each float32 side against it.
  exact = [[w.astype(np.float64) * (1 + 2e-3), b.astype(np.float64)] for w, b in theirs]
  row = long.merge("fedavg", 2, back, _side([0.5, 0.809], theirs), long.Setting(),
                   {"command": "test"}, _side([0.5, 0.81], exact))
  assert row["float64_run"]["accuracy"] == [0.5, 0.81]
  assert row["server_model_error_float64"]["reference"] == pytest.approx([2e-3 / 1.002] * 2)
  table = long.render_model_errors([row])
  assert "| fedavg | PFLlib, PFLlib float64 | 2.0e-03 | 2.0e-03 | 80.90, 81.00 |" in table
  assert "| fedavg | ours, PFLlib float64 | 2.0e-03 | 1.0e-03 | 81.40, 81.00 |" in table
  # Without server models (LOCAL, or a server holding a part), no errors.
  none = long.merge("local", 2, _side([0.5, 0.6], None), _side([0.5, 0.6], None),
                    long.Setting(), {"command": "test"})
  assert none["server_model_error"] is None and long.render([none], "x").count("round 1") == 0


def _references_or_skip() -> None:
  lack = long.missing(bridges.REFERENCES)
  if lack is not None:
    pytest.skip(lack)


def test_the_twin_rows_run_on_check_as_model_and_its_pixels():
  """FedBN, MOON-BN and pFedLA run on coaching_cnn_bn and check (a)'s twin (uint8 pixels
  ours, pixels / 255 the twin's, each standardised in its forward); APPLE on FedAvgCNN
  and PFLlib's floats."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  for name in ("fedbn", "moon_bn", "pfedla"):
    reference = long.long_reference(name, 20)
    assert long.split_kind(name) == (1, "uint8")
    assert long.model_name(reference) == "coaching_cnn_bn"
    assert long.reference_inputs(reference) is bridges.model_inputs
  apple = long.long_reference("apple", 20)
  assert long.split_kind("apple") == (1, "pfllib") and long.model_name(apple) == long.MODEL
  assert long.reference_inputs(apple) is long.nchw
  assert set(long.OTHERS) <= set(long.DEFAULT) <= set(one_round.REFERENCES)


def test_the_twins_compute_our_logits_and_read_back_our_running_averages():
  _references_or_skip()
  import torch  # pylint: disable=import-outside-toplevel
  bridges.import_pfllib()
  model = build_model("coaching_cnn_bn", 10)
  x = np.random.default_rng(0).integers(0, 256, size=(4, 28, 28)).astype(np.uint8)
  params = jax.tree.map(np.array, batch_stats.fold(model.init(jax.random.key(1), x[:1])))
  rng = np.random.default_rng(1)
  for name in twins.BN_MODULES:  # running averages other than the initial 0 and 1
    stats = params["params"][name]["BatchNorm_0"]["batch_stats"]
    stats["mean"] = rng.normal(size=stats["mean"].shape).astype(np.float32)
    stats["var"] = rng.uniform(0.5, 2.0, size=stats["var"].shape).astype(np.float32)
  ours = np.asarray(batch_stats.model_apply(model.apply)(params, x))
  for name in ("fedbn", "moon_bn", "pfedla"):  # moon_bn's split: BaseHeadSplit
    reference = long.long_reference(name, 20)
    layers = long.to_torch(reference, params)
    twin = long.torch_model(reference, "cpu", layers).eval()
    with torch.no_grad():
      theirs = twin(torch.from_numpy(long.reference_inputs(reference)(x))).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    for a, b in zip(long.flat_layers(long.torch_layers(reference, twin)),
                    long.flat_layers(layers)):
      np.testing.assert_array_equal(a, b)


def test_apple_and_pfedla_take_check_as_settings_at_this_runs_scale():
  """APPLE: check (a)'s ratios at 20 clients, lr 0.005 and 20 rounds (PFLlib's core step
  N lr, its p step dr_learning_rate, L 1 of its global rounds); pFedLA: one client a
  round (its reference trains a round's clients one after another)."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  setting = long.Setting()
  apple = long.long_reference("apple", 20)
  assert apple.config["core_lr_scale"] == setting.clients
  assert apple.config["p_lr_scale"] * setting.lr == pytest.approx(
      apple.args["dr_learning_rate"]) and apple.args["dr_learning_rate"] == one_round.APPLE_DRLR
  assert apple.config["reg_rounds"] == int(apple.args["L"] * apple.args["global_rounds"]) == 20
  pfedla = long.long_reference("pfedla", 20)
  train = long.train_config(setting, 20, pfedla)
  assert train.participation * setting.clients == pytest.approx(1.0)
  assert long.num_sampled_clients(train.participation, setting.clients) == 1
  assert "1 client a round" in long.describe(setting, np.array([240, 270]), 20, pfedla)
  assert long.train_config(setting, 20, apple).participation == 1.0


def test_ala_rows_take_their_hosts_settings():
  """An ALA row runs its host's check (b) settings: FedPHP's mu ramped over the run (check
  (a)'s row ramps over its 3 rounds), pFedMe's eta and personal lr, Per-FedAvg's 2B cut,
  and its host's padded loaders keyed as with_ala keys the host (the client key's second
  half): check (a)'s perfedavg_ala loaders where no client is padded."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  assert long.settings_of("pfedme_ala") == "pfedme" and long.settings_of("fedavg") == "fedavg"
  assert long.long_reference("fedphp_ala", 20).config["mu_participations"] == 20
  assert long.long_reference("pfedme_ala", 20).config["personal_lr"] == 0.01
  assert long.long_reference("pfedme_ala", 20).args["p_learning_rate"] == 0.01
  assert long.split_kind("perfedavg_ala") == long.split_kind("perfedavg") == (2, "pfllib")
  data, _ = tiny_data([40, 40])
  key, reference = jax.random.key(3), one_round.REFERENCES["perfedavg_ala"]
  ours = long.round_batches("perfedavg_ala", reference, key, 0, data, 1, 10)
  keys = client_keys(jax.random.fold_in(key, 0), 2)
  for k in range(2):
    for a, b in zip(ours[k], reference.loads(keys[k], 40, 1, 10)):
      for epoch_a, epoch_b in zip(a, b):
        np.testing.assert_array_equal(np.asarray(epoch_a), np.asarray(epoch_b))


def test_rows_of_another_model_name_their_setting():
  rows = [long.merge(name, 2, _side([0.5, 0.6], None), _side([0.5, 0.6], None),
                     long.Setting(), {"command": "test"}) for name in ("local", "fedbn",
                                                                        "pfedla")]
  text = long.render(rows, "x")
  assert text.count("FedAvgCNN") == 1 and "fedbn: MNIST" in text
  assert "coaching_cnn_bn (BatchNorm) and its PyTorch twin" in text
  assert "pfedla: MNIST" in text and "1 client a round, sampled as ours" in text
  assert rows[2]["reference"].startswith("KarhouTam/pFedLA@")
  # One setting: the sentence as before.
  assert long.render(rows[:1], "x").count("MNIST pathological") == 1


def test_the_pfedla_driver_scores_each_round_without_changing_the_run():
  _references_or_skip()
  from fedora_jax.algorithms import pfedla  # pylint: disable=import-outside-toplevel
  from verification import one_round, pfedla_driver  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(2)
  clients = [one_round.Client(rng.integers(0, 256, (20, 28, 28)).astype(np.uint8),
                              rng.integers(0, 10, 20), None, None,
                              rng.integers(0, 256, (10, 28, 28)).astype(np.uint8),
                              rng.integers(0, 10, 10)) for _ in range(2)]
  model = build_model("coaching_cnn_bn", 10)
  layers = twins.COACHING_CNN_BN.to_torch(batch_stats.fold(
      model.init(jax.random.key(3), clients[0].x_train[:1])))
  hypernetworks = pfedla.init_hypernetworks(jax.random.key(4), 2, 5, 8, 8)
  batches = [[[[rng.permutation(20).reshape(2, 10)]] for _ in clients] for _ in range(2)]
  active = lambda r: np.arange(2) == r % 2

  def run(on_round=None):
    return pfedla_driver.run(clients, layers, batches, hypernetworks, active, 5e-3, 10,
                             0.05, 1, one_round._torch_accuracy, on_round=on_round)  # pylint: disable=protected-access
  scored = []
  final = run(lambda personalised: scored.append(personalised()))
  plain = run()
  flat = lambda models: [a for model in models for a in long.flat_layers(model)]
  assert len(scored) == 2 and scored[-1][1] == final[1] == plain[1]
  for ours, theirs in zip(flat(final[0]), flat(plain[0])):
    np.testing.assert_array_equal(ours, theirs)
  for ours, theirs in zip(flat(scored[-1][0]), flat(final[0])):
    np.testing.assert_array_equal(ours, theirs)
  assert any(np.any(a != b) for a, b in zip(flat(scored[0][0]), flat(scored[1][0])))
