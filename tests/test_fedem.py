"""FedEM: the E-step, the weighted loss and the mixture's prediction against hand values;
one client's round (pi's M-step and one SGD step of each linear component) against numpy;
the server's per-component average; bad values refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedem
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


def test_responsibilities_by_hand():
  log_pi = jnp.log(jnp.array([0.5, 0.25, 0.25]))
  losses = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
  q = fedem.responsibilities(log_pi, losses)
  first = np.array([0.5 * np.exp(-1), 0.25 * np.exp(-2), 0.25 * np.exp(-3)])
  np.testing.assert_allclose(q[0], first / first.sum(), rtol=1e-6)
  np.testing.assert_allclose(q[1], [0.5, 0.25, 0.25], rtol=1e-6)   # equal losses: pi


def test_weighted_loss_by_hand():
  losses = jnp.array([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])
  q = jnp.array([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]])
  w = jnp.array([1.0, 1.0, 0.0])   # the third sample is padding
  # (0.25 + 1.5 + 3) / 2
  np.testing.assert_allclose(fedem.weighted_loss(losses, q, w), 4.75 / 2, rtol=1e-6)


def test_mixture_prediction_by_hand():
  logits = jnp.array([[[0.0, 0.0]], [[np.log(3.0), 0.0]]])   # [M=2, B=1, classes=2]
  pi = jnp.array([0.5, 0.5])
  # softmaxes (1/2, 1/2) and (3/4, 1/4): mixture (5/8, 3/8).
  np.testing.assert_allclose(jnp.exp(fedem.mixture_log_probs(logits, pi, "mixture")),
                             [[0.625, 0.375]], rtol=1e-6)
  np.testing.assert_allclose(fedem.mixture_log_probs(logits, pi, "logits"),
                             [[0.5 * np.log(3.0), 0.0]], rtol=1e-6)


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def test_client_round_against_numpy():
  """One full batch, one epoch, plain SGD: pi = mean q, W_m -= lr (1/n) sum q_im x_i
  (softmax_im - onehot_i) for linear components."""
  rng = np.random.default_rng(0)
  n, features, classes, lr = 4, 3, 2, 0.5
  x = rng.normal(size=(n, features)).astype(np.float32)
  y = np.array([0, 1, 1, 0], np.int32)
  model = nn.Dense(classes)
  trainer = tiny_trainer(model, lr=lr, batch_size=8)
  algorithm = fedem.fedem(fedem.FedEmConfig(num_components=2), trainer)
  kernels = rng.normal(size=(2, features, classes)).astype(np.float32)
  biases = rng.normal(size=(2, classes)).astype(np.float32)
  components = {"params": {"kernel": jnp.asarray(kernels), "bias": jnp.asarray(biases)}}
  pi = np.array([0.7, 0.3], np.float32)
  pad = lambda a: np.concatenate([a, np.zeros((2,) + a.shape[1:], a.dtype)])  # noqa: E731
  train = ClientData(pad(x), pad(y), np.arange(n + 2) < n, np.int32(n))
  out = algorithm.client_update(fedem.FedEmClients(mixture=jnp.asarray(pi)), components,
                                ClientSplits(train, train, train), jax.random.key(0))
  probs = np.stack([_softmax(x @ kernels[m] + biases[m]) for m in range(2)])  # [M, n, C]
  losses = -np.log(probs[:, np.arange(n), y]).T                             # [n, M]
  q = np.log(pi)[None] - losses
  q = np.exp(q - q.max(1, keepdims=True))
  q /= q.sum(1, keepdims=True)
  np.testing.assert_allclose(out.state.mixture, q.mean(0), rtol=1e-5)
  error = probs - np.eye(classes)[y][None]                                  # [M, n, C]
  for m in range(2):
    grad_w = np.einsum("i,if,ic->fc", q[:, m], x, error[m]) / n
    grad_b = np.einsum("i,ic->c", q[:, m], error[m]) / n
    np.testing.assert_allclose(out.upload["params"]["kernel"][m], kernels[m] - lr * grad_w,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.upload["params"]["bias"][m], biases[m] - lr * grad_b,
                               rtol=1e-5, atol=1e-6)


def test_server_averages_each_component():
  algorithm = fedem.fedem(fedem.FedEmConfig(num_components=2), tiny_trainer(tiny_model()))
  uploads = {"w": jnp.array([[1.0, 10.0], [3.0, 30.0], [5.0, 50.0]])}   # [K=3, M=2]
  clients = fedem.FedEmClients(mixture=jnp.full((3, 2), 0.5))
  server = fedem.FedEmServer(components={"w": jnp.zeros(2)})
  new = algorithm.aggregate(server, clients, uploads, jnp.array([1.0, 0.0, 3.0]))
  np.testing.assert_allclose(new.server.components["w"], [4.0, 40.0], rtol=1e-6)


@pytest.mark.parametrize("field,value", [("num_components", 0), ("prediction", "vote")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedem: {field}"):
    fedem.fedem(fedem.FedEmConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
