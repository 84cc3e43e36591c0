"""CIFAR-10 loaders (official python batches, npz), FEDORA's CNN and lax.map over clients."""

import os
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SHARED_DATA, needs_shared
from fedora_jax.data import cifar, datasets
from fedora_jax.data.partitions import PartitionConfig, make_partition
from fedora_jax.engine.buckets import map_over_buckets, over_clients
from fedora_jax.errors import ConfigError, DataError
from fedora_jax.models import build_model, cnn_conv
from fedora_jax.models.cnn import CNN, banded_block_width, banded_conv, max_pool_2x2

SHARED_CIFAR = os.path.join(SHARED_DATA, "cifar10")


def _batch(n, offset, rng):
  """A batch dict as in cifar-10-batches-py: CHW rows, bytes keys (a Python 2 pickle)."""
  images = rng.integers(0, 256, (n, 32, 32, 3), np.uint8)
  images[:, 0, 0] = [offset % 256, 1, 2]  # pixel (0, 0): R = offset, G = 1, B = 2
  return images, {b"batch_label": b"fixture", b"labels": [(offset + i) % 10 for i in range(n)],
                  b"data": images.transpose(0, 3, 1, 2).reshape(n, 3072),
                  b"filenames": [b"x.png"] * n}


def write_batches(folder, n=4):
  os.makedirs(folder)
  rng = np.random.default_rng(0)
  images = {}
  for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
    images[name], batch = _batch(n, 10 * i, rng)
    with open(os.path.join(folder, name), "wb") as f:
      pickle.dump(batch, f, protocol=2)
  return images


def test_official_batches_are_read_in_hwc_order(tmp_path):
  images = write_batches(tmp_path / "cifar-10-batches-py")
  for data_dir in (tmp_path, tmp_path / "cifar-10-batches-py"):
    data = cifar.load_cifar10(str(data_dir))
    assert data.name == "cifar10" and data.num_classes == 10
    assert data.x_train.shape == (20, 32, 32, 3) and data.x_train.dtype == np.uint8
    np.testing.assert_array_equal(data.x_train[:4], images["data_batch_1"])
    np.testing.assert_array_equal(data.x_train[16:], images["data_batch_5"])
    np.testing.assert_array_equal(data.x_test, images["test_batch"])
    np.testing.assert_array_equal(data.x_train[4, 0, 0], [10, 1, 2])
    np.testing.assert_array_equal(data.y_train[:4], [0, 1, 2, 3])
    assert data.y_train.dtype == np.int32


def test_npz_copy_is_named_as_the_jpeg_copy(tmp_path):
  rng = np.random.default_rng(0)
  arrays = dict(x_train=rng.integers(0, 256, (6, 32, 32, 3), np.uint8),
                y_train=np.arange(6, dtype=np.uint8), x_test=np.zeros((2, 32, 32, 3), np.uint8),
                y_test=np.array([3, 9], np.uint8))
  np.savez_compressed(tmp_path / "cifar10_jpeg.npz", **arrays)
  data = cifar.load_cifar10(str(tmp_path))
  assert data.name == "CIFAR-10 (JPEG copy)"
  np.testing.assert_array_equal(data.x_train, arrays["x_train"])
  np.savez_compressed(tmp_path / "other.npz", **arrays)
  assert cifar.load_cifar10(str(tmp_path / "other.npz")).name == "cifar10"


def test_bad_cifar_inputs_are_one_line_data_errors(tmp_path):
  # Missing from the (tests' empty, offline) default root and from a root given.
  with pytest.raises(ConfigError, match=r"cifar-10-python.tar.gz .* into .*cifar10/"):
    cifar.load_cifar10(None)
  with pytest.raises(DataError, match="not found"):
    cifar.load_cifar10(str(tmp_path / "nowhere"))
  with pytest.raises(ConfigError, match=f"{tmp_path}/cifar10/"):
    cifar.load_cifar10(str(tmp_path))
  write_batches(tmp_path / "b")
  raw = (tmp_path / "b" / "data_batch_3").read_bytes()
  (tmp_path / "b" / "data_batch_3").write_bytes(raw[:len(raw) // 2])
  with pytest.raises(DataError, match="data_batch_3"):
    cifar.load_cifar10(str(tmp_path / "b"))
  (tmp_path / "b" / "data_batch_3").unlink()
  with pytest.raises(DataError, match="not found"):
    cifar.load_cifar10(str(tmp_path / "b"))
  np.savez(tmp_path / "cifar10.npz", x_train=np.zeros((2, 28, 28), np.uint8))
  with pytest.raises(DataError, match="lacks"):
    cifar.load_cifar10(str(tmp_path))


@pytest.mark.skipif(not os.path.isdir(SHARED_CIFAR),
                    reason=needs_shared("cifar10"))
def test_real_jpeg_copy_and_fedoras_pathological_split():
  data = cifar.load_cifar10(SHARED_CIFAR)
  assert data.name == "CIFAR-10 (JPEG copy)"
  assert data.x_train.shape == (50000, 32, 32, 3) and data.x_test.shape == (10000, 32, 32, 3)
  np.testing.assert_array_equal(np.bincount(data.y_train), [5000] * 10)
  part = make_partition(data, 10, PartitionConfig("pathological", classes_per_client=2))
  assert ((part.class_counts > 0).sum(axis=1) == 2).all()
  assert all(len(c.x_test) == 1000 for c in part.clients)


def test_cnn_is_the_authors_lenet():
  model = build_model("cnn", 10)
  params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.uint8))
  shapes = jax.tree.map(lambda a: a.shape, params)["params"]
  assert shapes["Conv_0"]["kernel"] == (5, 5, 3, 16)
  assert shapes["Conv_1"]["kernel"] == (5, 5, 16, 32)
  assert [shapes[f"Dense_{i}"]["kernel"] for i in range(3)] == [(800, 120), (120, 84), (84, 10)]
  assert sum(a.size for a in jax.tree.leaves(params)) == 121182
  x = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), np.uint8)
  assert model.apply(params, x).shape == (3, 10)
  # Grayscale 28 x 28 works too (GTSRB-, MNIST-shaped inputs).
  gray = CNN(num_outputs=43)
  gray_params = gray.init(jax.random.key(0), np.zeros((1, 28, 28), np.uint8))
  assert gray.apply(gray_params, np.zeros((2, 28, 28), np.uint8)).shape == (2, 43)


def test_im2col_and_banded_convolutions_equal_xla_convolution():
  x = np.random.default_rng(1).integers(0, 256, (4, 32, 32, 3), np.uint8)
  params = CNN().init(jax.random.key(0), x)
  expected = CNN(conv="xla").apply(params, x)
  for conv in ("im2col", "banded"):
    np.testing.assert_allclose(CNN(conv=conv).apply(params, x), expected,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape, size, block", [
    ((2, 9, 11, 3), 5, 7), ((2, 9, 11, 3), 5, 1), ((3, 8, 12, 4), 3, 5), ((1, 6, 6, 2), 2, 5)])
def test_banded_convolution_and_its_gradients_equal_xla(shape, size, block):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=shape), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(size, size, shape[-1], 3)), jnp.float32)
  def xla(x, kernel):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
  out, xla_vjp = jax.vjp(xla, x, kernel)
  banded, banded_vjp = jax.vjp(lambda x, k: banded_conv(x, k, block), x, kernel)
  np.testing.assert_allclose(banded, out, rtol=1e-5, atol=1e-5)
  cotangent = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
  for got, want in zip(banded_vjp(cotangent), xla_vjp(cotangent)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_banded_block_width_divides_the_output_width():
  assert banded_block_width(28, 3) == 4   # the LeNet-5's first layer: 7 blocks of 4
  assert banded_block_width(10, 16) == 2  # its second: 5 blocks of 2
  assert banded_block_width(24, 1) == 4   # MNIST CNNs
  assert banded_block_width(7, 3) == 1    # a prime width: im2col
  assert banded_block_width(9, 1) == 3


def test_registered_cnns_use_banded_convolutions_on_cpus():
  assert cnn_conv("cpu") == "banded" and cnn_conv("gpu") == "im2col"
  for name in ("cnn", "coaching_cnn", "coaching_cnn_bn", "fedavg_cnn"):
    assert build_model(name, 10).conv == cnn_conv(jax.default_backend())


def test_max_pool_equals_flax_max_pool_in_values_and_gradients():
  # Odd sizes (the last row and column dropped) and ties (the first maximum in row-major
  # order takes the gradient, as in select-and-scatter and PyTorch).
  x = jnp.asarray(np.random.default_rng(0).integers(0, 3, (2, 7, 5, 3)), jnp.float32)
  def flax_pool(v):
    return nn.max_pool(v, (2, 2), strides=(2, 2))
  np.testing.assert_array_equal(max_pool_2x2(x), flax_pool(x))
  weights = jnp.arange(2 * 3 * 2 * 3, dtype=jnp.float32).reshape(2, 3, 2, 3)
  def grad_of(pool):
    return jax.grad(lambda v: jnp.sum(pool(v) * weights))(x)
  np.testing.assert_array_equal(grad_of(max_pool_2x2), grad_of(flax_pool))
  # By hand: one window [[1, 2], [2, 0]] sends its gradient to its first 2 only.
  window = jnp.asarray([[1.0, 2.0], [2.0, 0.0]]).reshape(1, 2, 2, 1)
  grad = jax.grad(lambda v: max_pool_2x2(v).sum())(window)
  np.testing.assert_array_equal(grad.reshape(2, 2), [[0.0, 1.0], [0.0, 0.0]])


def test_cnn_evaluation_in_small_chunks_equals_one_chunk():
  # The CNNs evaluate in chunks of 64 on CPUs (models.default_eval_batch_size); 130
  # images are two full chunks and a padded third.
  from fedora_jax.data.client_data import ClientData
  from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
  model = CNN()
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (140, 32, 32, 3), np.uint8)
  data = ClientData(x=x, y=rng.integers(0, 10, 140).astype(np.int32),
                    mask=np.arange(140) < 130, n=np.int32(130))
  params = model.init(jax.random.key(0), x[:1])
  stats = {size: make_client_trainer(model.apply, make_optimizer(0.1), 1, 64,
                                     eval_batch_size=size).evaluate(params, data)
           for size in (64, 1024)}
  np.testing.assert_allclose(stats[64].loss, stats[1024].loss, rtol=1e-5)
  assert stats[64].score == stats[1024].score
  logits = model.apply(params, x[:130])
  np.testing.assert_allclose(stats[64].score,
                             np.mean(np.argmax(logits, -1) == data.y[:130]), rtol=1e-6)


def test_lax_map_over_clients_equals_vmap():
  def fn(w, key, data):
    return jnp.tanh(data @ w).sum() + jax.random.normal(key)
  rng = np.random.default_rng(0)
  w = rng.normal(size=(5, 3, 2)).astype(np.float32)
  keys = jax.random.split(jax.random.key(0), 5)
  data = rng.normal(size=(5, 4, 3)).astype(np.float32)
  expected = over_clients(fn)(w, keys, data)
  for client_chunk in (1, 2, 5, 8):
    np.testing.assert_allclose(over_clients(fn, client_chunk)(w, keys, data), expected,
                               rtol=1e-6)
  # Two buckets, out of order: the scatter back to client order is the same.
  ids = (np.array([0, 3, 4]), np.array([1, 2]))
  buckets = (data[ids[0]], data[ids[1]])
  for client_chunk in (None, 2):
    np.testing.assert_allclose(
        map_over_buckets(fn, (w, keys), buckets, ids, 5, client_chunk=client_chunk), expected,
        rtol=1e-6)
  with pytest.raises(ValueError):
    over_clients(fn, 0)


def test_cifar10_registry_entry():
  spec = datasets.get_spec("cifar10")
  assert (spec.num_clients, spec.model, spec.partition, spec.classes_per_client) == (
      10, "cnn", "pathological", 2)
  with pytest.raises(ConfigError, match="--data_dir"):
    datasets.build_federated_dataset("cifar10", None, 10, "balanced", 0)
