"""FedMD: the consensus and the digest losses by hand; one client's round (a digest step
towards the consensus, a revisit step on its data, its scores of the next alignment
set) against numpy; the server's round; the public set held out of the clients (data
layer, config); bad values refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import config as config_lib
from fedora_jax.algorithms import fedmd
from fedora_jax.config import AlgorithmConfig, DataConfig, ExperimentConfig
from fedora_jax.data import datasets
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.data.public import hold_out_public
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


def test_consensus_is_the_mean_of_the_scoring_clients():
  scores = jnp.array([[[1.0, 2.0]], [[3.0, 6.0]], [[100.0, 100.0]]])   # [K=3, A=1, C=2]
  np.testing.assert_allclose(fedmd.consensus_of(scores, jnp.array([5.0, 1.0, 0.0])),
                             [[2.0, 4.0]])   # plain mean of clients 0 and 1


def test_matching_losses_by_hand():
  outputs = jnp.array([[1.0, 3.0], [0.0, 0.0], [7.0, 7.0]])
  targets = jnp.array([[2.0, 1.0], [0.0, 4.0], [0.0, 0.0]])
  weights = jnp.array([1.0, 1.0, 0.0])   # the third is padding
  # per sample: mae (1 + 2) / 2, (0 + 4) / 2; mse (1 + 4) / 2, (0 + 16) / 2
  np.testing.assert_allclose(fedmd.matching_loss(outputs, targets, weights, "mae"),
                             (1.5 + 2.0) / 2)
  np.testing.assert_allclose(fedmd.matching_loss(outputs, targets, weights, "mse"),
                             (2.5 + 8.0) / 2)


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.parametrize("loss,received", [("mse", True), ("mae", True), ("mse", False)])
def test_client_round_against_numpy(loss, received):
  """Full batches, plain SGD, a linear model: W -= lr dL/dW on the alignment set (MSE:
  2 x^T (f - c) / (A C); MAE: x^T sign(f - c) / (A C)), then on the private data (CE);
  the upload is the new model's logits on next_x. No consensus: no digest step."""
  rng = np.random.default_rng(0)
  a, n, features, classes, lr = 3, 4, 2, 2, 0.3
  x_pub = rng.normal(size=(a, features)).astype(np.float32)
  consensus = rng.normal(size=(a, classes)).astype(np.float32)
  next_x = rng.normal(size=(a, features)).astype(np.float32)
  x = rng.normal(size=(n, features)).astype(np.float32)
  y = np.array([0, 1, 1, 0], np.int32)
  w = rng.normal(size=(features, classes)).astype(np.float32)
  b = rng.normal(size=(classes,)).astype(np.float32)
  trainer = tiny_trainer(nn.Dense(classes), lr=lr, batch_size=8)
  algorithm = fedmd.fedmd(fedmd.FedMdConfig(loss=loss), trainer)
  message = fedmd.FedMdMessage(x=jnp.asarray(x_pub), consensus=jnp.asarray(consensus),
                               received=jnp.array(received), next_x=jnp.asarray(next_x))
  train = ClientData(x, y, np.ones(n, bool), np.int32(n))
  params = {"params": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}}
  out = algorithm.client_update(params, message, ClientSplits(train, train, train),
                                jax.random.key(0))
  if received:
    gap = x_pub @ w + b - consensus
    d_out = (2 * gap if loss == "mse" else np.sign(gap)) / (a * classes)
    w, b = w - lr * x_pub.T @ d_out, b - lr * d_out.sum(0)
  error = (_softmax(x @ w + b) - np.eye(classes)[y]) / n
  w, b = w - lr * x.T @ error, b - lr * error.sum(0)
  np.testing.assert_allclose(out.state["params"]["kernel"], w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.state["params"]["bias"], b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.upload, next_x @ w + b, rtol=1e-5, atol=1e-6)


def test_server_round():
  """The consensus of the round's uploads is on the set they scored (next_alignment),
  which becomes the current one; a fresh set is drawn for the next round."""
  algorithm = fedmd.fedmd(fedmd.FedMdConfig(alignment_size=2), tiny_trainer(tiny_model()))
  key = jax.random.key_data(jax.random.key(0))
  server = fedmd.FedMdServer(
      public_x=jnp.arange(8.0).reshape(4, 2), key=key, round=jnp.array(0),
      alignment=jnp.array([0, 0]), consensus=jnp.zeros((2, 3)), received=jnp.array(False),
      next_alignment=jnp.array([3, 1]))
  scores = jnp.stack([jnp.full((2, 3), 1.0), jnp.full((2, 3), 3.0)])
  new = algorithm.aggregate(server, (), scores, jnp.array([2.0, 1.0])).server
  np.testing.assert_allclose(new.consensus, np.full((2, 3), 2.0))
  np.testing.assert_array_equal(new.alignment, [3, 1])
  assert bool(new.received) and int(new.round) == 1
  expected = fedmd.draw_alignment(key, jnp.array(1), 4, 2)
  np.testing.assert_array_equal(new.next_alignment, expected)
  assert len(set(np.asarray(expected).tolist())) == 2   # drawn without replacement
  message = algorithm.broadcast(new, jnp.zeros((5, 1)))
  np.testing.assert_allclose(message.x[4], [[6.0, 7.0], [2.0, 3.0]])   # rows 3 and 1


def test_public_set_is_held_out_of_the_training_split():
  images = np.arange(10, dtype=np.uint8).reshape(10, 1)
  source = ImageDataset("toy", images, np.arange(10, dtype=np.int32), images[:2],
                        np.zeros(2, np.int32), 10)
  rest, public = hold_out_public(source, 3, seed=1)
  assert len(public.y) == 3 and len(rest.y_train) == 7
  # disjoint and together the whole split; images stay with their labels
  assert sorted(public.y.tolist() + rest.y_train.tolist()) == list(range(10))
  np.testing.assert_array_equal(public.x[:, 0], public.y)
  again = hold_out_public(source, 3, seed=1)[1]
  np.testing.assert_array_equal(again.y, public.y)   # seeded
  with pytest.raises(ConfigError, match="public_size"):
    hold_out_public(source, 10, seed=1)
  with pytest.raises(ConfigError, match="public_size"):
    datasets.build_federated_dataset("synthetic", None, 3, "balanced", 0, public_size=5)


def test_the_algorithm_declares_the_public_size():
  def resolved(name, public_size=None):
    return config_lib.resolve(ExperimentConfig(
        data=DataConfig(public_size=public_size),
        algorithm=AlgorithmConfig(name))).data.public_size
  assert resolved("fedmd") == fedmd.FedMdConfig().public_size
  assert resolved("fedmd", 300) == 300
  assert resolved("fedavg") is None   # an algorithm declaring none: the data as before


@pytest.mark.parametrize("field,value", [("alignment_size", 0), ("digest_epochs", 0),
                                         ("public_size", 0), ("loss", "kl")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedmd: {field}"):
    fedmd.fedmd(fedmd.FedMdConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))


def test_a_run_without_a_public_set_is_refused():
  from fedora_jax.algorithms.base import InitContext
  from tiny import tiny_data
  data, _ = tiny_data([4, 4])
  trainer = tiny_trainer(tiny_model())
  context = InitContext(params=None, data=data, trainer=trainer, key=jax.random.key(0))
  with pytest.raises(ConfigError, match="public set"):
    fedmd.fedmd(fedmd.FedMdConfig(), trainer).init(context)
  small = data._replace(public=hold_out_public(ImageDataset(
      "toy", np.zeros((6, 4), np.float32), np.zeros(6, np.int32), np.zeros((1, 4)),
      np.zeros(1, np.int32), 3), 4, seed=0)[1])
  with pytest.raises(ConfigError, match="fedmd: alignment_size"):
    fedmd.fedmd(fedmd.FedMdConfig(), trainer).init(context._replace(data=small))
