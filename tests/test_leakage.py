"""Leakage measures (fedora_jax/leakage.py): the observed gradient of a FedSGD step, iDLG's
label, DLG's reconstruction of a one-sample step, PSNR / SSIM / the pairing against
closed forms, and the membership attack's AUC and losses by hand."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax import leakage
from fedora_jax.data.client_data import ClientData
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_model


def _batch(size, seed=0, features=4, classes=3):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.uniform(size=(size, features)), jnp.float32),
          jnp.asarray(rng.integers(0, classes, size), jnp.int32))


def test_a_fedsgd_update_reveals_the_batch_mean_gradient():
  model = tiny_model()
  params = init_params(model)
  x, y = _batch(3)
  update = leakage.fedsgd_update(model.apply, params, x, y, lr=0.1)
  mean_ce = lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, x), y))
  expected = jax.grad(mean_ce)(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               leakage.gradient_from_update(update, 0.1), expected)


def test_idlg_reads_the_label_off_the_output_bias_gradient():
  model = tiny_model()
  params = init_params(model)
  for label in range(3):
    x, _ = _batch(1, seed=label)
    y = jnp.array([label])
    gradient = leakage.gradient_from_update(
        leakage.fedsgd_update(model.apply, params, x, y, 0.1), 0.1)
    assert int(leakage.idlg_label(gradient, 3)) == label
  with pytest.raises(ConfigError, match="this model has 2 bias vectors of 5 entries"):
    leakage.idlg_label({"a": {"bias": jnp.zeros(5)}, "b": {"bias": jnp.zeros(5)}}, 5)


def test_dlg_and_idlg_reconstruct_a_one_sample_step():
  model = tiny_model(hidden=(8,))
  params = init_params(model)
  x, y = _batch(1, seed=3)
  target = leakage.gradient_from_update(
      leakage.fedsgd_update(model.apply, params, x, y, 0.1), 0.1)
  for labels in (None, leakage.idlg_label(target, 3)[None]):
    found = leakage.invert_gradient(model.apply, params, target, (4,), 1, 3,
                                    jax.random.key(0), steps=100, labels=labels)
    assert leakage.psnr(np.asarray(x), np.asarray(found.images)) > 40
    assert int(found.labels[0]) == int(y[0])
    assert float(found.match) < 1e-6


def test_psnr_ssim_and_pairing_against_closed_forms():
  image = np.random.default_rng(0).uniform(size=(28, 28))
  assert leakage.psnr(image, image) == float("inf")
  assert leakage.psnr(np.zeros((4, 4)), np.full((4, 4), 0.1)) == pytest.approx(20.0)
  assert leakage.ssim(image, image) == pytest.approx(1.0)
  # Two constant images: no variance, so SSIM is its luminance term alone,
  # (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1).
  c1 = 0.01 ** 2
  assert leakage.ssim(np.full((8, 8), 0.5), np.full((8, 8), 0.25)) == pytest.approx(
      (0.25 + c1) / (0.3125 + c1))
  batch = np.random.default_rng(1).uniform(size=(3, 5, 5))
  order = np.array([2, 0, 1])
  shuffled = batch[order] + 0.01
  np.testing.assert_array_equal(leakage.pair_reconstructions(batch, shuffled), [1, 2, 0])


def test_membership_auc_and_per_sample_losses_by_hand():
  # 0.1 < 0.15, 0.1 < 0.3, 0.2 > 0.15, 0.2 < 0.3: three of four pairs.
  assert leakage.membership_auc(np.array([0.1, 0.2]), np.array([0.15, 0.3])) == 0.75
  assert leakage.membership_auc(np.array([0.1]), np.array([0.1])) == 0.5
  model = tiny_model()
  params = init_params(model)
  x, y = _batch(4)
  data = ClientData(x=x, y=y, mask=jnp.array([True, True, True, False]), n=jnp.int32(3))
  expected = optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y)
  np.testing.assert_allclose(leakage.per_sample_losses(model.apply, params, data),
                             expected[:3], rtol=1e-6)


@pytest.mark.slow  # the command end to end, in subprocesses
def test_the_command_writes_its_report_or_one_line(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  common = [sys.executable, "-m", "experiments.leakage", "--num_clients=4", "--hidden=16",
            f"--out={tmp_path}"]
  proc = subprocess.run(common + ["--measure=dlg", "--batch_sizes=1,2", "--trials=1",
                                  "--steps=20"], cwd=root, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads((tmp_path / "dlg.json").read_text())
  assert {(r["batch"], r["method"]) for r in report["rows"]} == {
      (1, "dlg"), (1, "idlg"), (2, "dlg")}
  assert (tmp_path / "dlg.png").exists() and "| 1 | idlg |" in proc.stdout
  proc = subprocess.run(common + ["--measure=membership", "--algorithms=fedavg,apfl",
                                  "--rounds=1"], cwd=root, capture_output=True, text=True,
                        timeout=600)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 1 and len(errors) == 1 and "apfl scores its clients" in errors[0]
