"""verification/twins.py: our coaching_cnn_bn beside its PyTorch twin (FedBN's check (a)
row), BatchNorm's parameters and running averages included. Skipped without PyTorch
(the verify extra's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.engine import batch_stats
from fedora_jax.models import build_model
from verification import bridges, twins
from conftest import NEEDS_TORCH

torch = pytest.importorskip("torch", reason=NEEDS_TORCH)


def _model_and_variables():
  model = build_model("coaching_cnn_bn", 10)
  x = np.random.default_rng(0).integers(0, 256, (6, 28, 28)).astype(np.uint8)
  variables = batch_stats.fold(model.init(jax.random.key(0), x[:1]))
  rng = np.random.default_rng(1)

  def statistics(path, leaf):  # running averages away from their initial 0 and 1
    name = getattr(path[-1], "key", None)
    if name == "var":
      return jnp.asarray(rng.uniform(0.5, 2.0, leaf.shape), jnp.float32)
    return jnp.asarray(rng.normal(0, 0.1, leaf.shape), jnp.float32) if name == "mean" else leaf
  return model, jax.tree_util.tree_map_with_path(statistics, variables), x


def test_the_twin_computes_our_logits_and_records_our_running_averages():
  model, variables, x = _model_and_variables()
  twin = twins.coaching_cnn_bn_twin(torch, unbiased_variance=False)
  twins.load_layers(twin, twins.bn_cnn_to_torch(variables))
  inputs = torch.from_numpy(bridges.model_inputs(x))
  twin.eval()
  ours = np.asarray(model.apply(batch_stats.unfold(variables), x))
  np.testing.assert_allclose(twin(inputs).detach().numpy(), ours, rtol=1e-4, atol=1e-5)
  # A train-mode pass: the batch's statistics, and the running averages it records.
  twin.train()
  ours, new = model.apply(batch_stats.unfold(variables), x, mask=jnp.ones(6, bool),
                          mutable=["batch_stats"])
  np.testing.assert_allclose(twin(inputs).detach().numpy(), ours, rtol=1e-4, atol=1e-5)
  recorded = twins.bn_cnn_to_torch(batch_stats.fold(
      {"params": batch_stats.unfold(variables)["params"], **new}))
  for mine, theirs in zip(recorded, twins.torch_layers(twin)):
    for a, b in zip(mine, theirs):
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_pytorchs_own_batchnorm_records_the_unbiased_variance():
  model, variables, x = _model_and_variables()
  twin = twins.coaching_cnn_bn_twin(torch)  # nn.BatchNorm as it is
  twins.load_layers(twin, twins.bn_cnn_to_torch(variables))
  twin.train()
  twin(torch.from_numpy(bridges.model_inputs(x)))
  _, new = model.apply(batch_stats.unfold(variables), x, mask=jnp.ones(6, bool),
                       mutable=["batch_stats"])
  old = float(variables["params"]["DenseBN_1"]["BatchNorm_0"]["batch_stats"]["var"][0])
  ours = float(new["batch_stats"]["DenseBN_1"]["BatchNorm_0"]["var"][0])
  theirs = float(twin.bn4.running_var[0])
  # 0.9 v + 0.1 s^2 (n / (n - 1)) against flax's 0.9 v + 0.1 s^2, n = 6 samples.
  np.testing.assert_allclose(theirs - 0.9 * old, (ours - 0.9 * old) * 6 / 5, rtol=1e-4)
