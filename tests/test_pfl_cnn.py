"""pfl-research's CIFAR-10 CNN (--model=pfl_cnn): its layer shapes and parameter count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.models import MODELS, build_model
from fedora_jax.models.pfl_cnn import PflCNN


def pfl_simple_cnn_param_count(side: int, channels: int, classes: int) -> int:
  """simple_cnn's parameters from its architecture (pfl-research benchmarks/model/
  pytorch/cnn.py): two valid 3x3 convolutions (32, 64), a 2x2 pool, Dense 128,
  Dense classes; its flatten size is ((side - 4) // 2) ** 2 * 64 as that file writes."""
  flat = ((side - 4) // 2) ** 2 * 64
  return ((3 * 3 * channels * 32 + 32) + (3 * 3 * 32 * 64 + 64)
          + (flat * 128 + 128) + (128 * classes + classes))


def init(model, shape=(2, 32, 32, 3)):
  x = jnp.zeros(shape, jnp.uint8)
  return model.init(jax.random.PRNGKey(0), x), x


def test_registered_and_param_count_matches_pfl_research():
  assert "pfl_cnn" in MODELS
  params, x = init(build_model("pfl_cnn", 10))
  count = sum(p.size for p in jax.tree_util.tree_leaves(params))
  assert count == pfl_simple_cnn_param_count(32, 3, 10) == 1_626_442
  assert build_model("pfl_cnn", 10).apply(params, x).shape == (2, 10)


def test_layer_shapes():
  params, _ = init(PflCNN(num_outputs=10))
  shapes = jax.tree_util.tree_map(lambda p: p.shape, params["params"])
  assert shapes == {"Conv_0": {"kernel": (3, 3, 3, 32), "bias": (32,)},
                    "Conv_1": {"kernel": (3, 3, 32, 64), "bias": (64,)},
                    "Dense_0": {"kernel": (14 * 14 * 64, 128), "bias": (128,)},
                    "Dense_1": {"kernel": (128, 10), "bias": (10,)}}


def test_glorot_weights():
  """Weights within Glorot's uniform bound sqrt(6 / (fan_in + fan_out)), and filling it."""
  params, _ = init(PflCNN(num_outputs=10))
  p = params["params"]
  for name, fan_in, fan_out in (("Conv_1", 9 * 32, 9 * 64), ("Dense_0", 12544, 128)):
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    w = np.asarray(p[name]["kernel"])
    assert np.abs(w).max() <= bound
    assert np.abs(w).max() > 0.95 * bound


@pytest.mark.parametrize("conv", ["banded", "xla"])
def test_convolutions_agree(conv):
  """The CPU default (banded) and XLA's convolution give im2col's logits."""
  params, _ = init(PflCNN(num_outputs=10))
  x = jax.random.randint(jax.random.PRNGKey(1), (3, 32, 32, 3), 0, 256).astype(jnp.uint8)
  want = PflCNN(num_outputs=10, conv="im2col").apply(params, x)
  got = PflCNN(num_outputs=10, conv=conv).apply(params, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
