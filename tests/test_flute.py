"""FLUTE: the NC term, the client's loss by hand; the server's NC step against numpy
finite differences; the head phase keeps the body, the joint phase moves it; bad values
refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import flute
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


def test_nc_penalty_by_hand():
  # W W^T = I: normalised I / sqrt 2. u = (1, 1): target (I - 11^T / 2) / sqrt(1)
  # = [[.5, -.5], [-.5, .5]]; the difference has diagonal 1/sqrt2 - .5, off-diagonal .5.
  expected = math.sqrt(2 * (1 / math.sqrt(2) - 0.5) ** 2 + 2 * 0.25)
  np.testing.assert_allclose(flute.nc_penalty(jnp.eye(2), jnp.ones(2)), expected, rtol=1e-6)
  # Only class 1 present: target [[0, 0], [0, .5]].
  expected = math.sqrt(0.5 + (1 / math.sqrt(2) - 0.5) ** 2)
  np.testing.assert_allclose(flute.nc_penalty(jnp.eye(2), jnp.array([0.0, 1.0])), expected,
                             rtol=1e-6)
  # A simplex ETF over 3 classes (scaled) scores 0 when every class is present.
  etf = jnp.eye(3) - 1 / 3
  np.testing.assert_allclose(flute.nc_penalty(3.0 * etf, jnp.ones(3)), 0.0, atol=1e-5)


def test_present_classes_by_hand():
  y = jnp.array([2, 0, 2, 1])
  mask = jnp.array([True, True, True, False])   # the class-1 sample is padding
  np.testing.assert_allclose(flute.present_classes(y, mask, 4), [1.0, 0.0, 1.0, 0.0])


def _identity_params():
  return {"params": {"Dense_0": {"kernel": jnp.eye(2), "bias": jnp.zeros(2)},
                     "Dense_1": {"kernel": jnp.eye(2), "bias": jnp.zeros(2)}}}


def test_client_loss_by_hand():
  # x = (1, 2) through identity layers: z = (1, 2), logits (1, 2), y = 1.
  model = tiny_model(num_classes=2, hidden=(2,))
  config = flute.FluteConfig()
  labels = jnp.array([0.0, 1.0])
  x, y, w = jnp.array([[1.0, 2.0], [5.0, 5.0]]), jnp.array([1, 0]), jnp.array([1.0, 0.0])
  ce = math.log1p(math.exp(-1.0))
  nc = math.sqrt(0.5 + (1 / math.sqrt(2) - 0.5) ** 2)
  head_phase = ce + 0.25 * nc + 0.0025 * 2.0             # ||W||_F^2 = 2
  joint = head_phase + 0.0005 * 5.0                      # ||z||^2 = 1 + 4; padding ignored
  for on, expected in ((False, head_phase), (True, joint)):
    loss = flute.flute_loss(model.apply, "Dense_1", config, labels, jnp.array(on))
    np.testing.assert_allclose(loss(_identity_params(), x, y, w), expected, rtol=1e-6)


def _numpy_nc(kernel, labels):
  gram = kernel.T @ kernel
  num = labels.shape[0]
  target = (np.eye(num) - 1 / num) * np.outer(labels, labels) / math.sqrt(num - 1)
  return np.linalg.norm(gram / np.linalg.norm(gram) - target)


def test_server_step_against_finite_differences():
  rng = np.random.default_rng(0)
  kernels = rng.normal(size=(3, 4, 3))
  labels = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
  took_part = np.array([True, False, True])
  stepped = flute.server_nc_step(jnp.asarray(kernels, jnp.float32), jnp.asarray(labels),
                                 jnp.asarray(took_part), lr=0.5)
  eps = 1e-6
  for i in range(3):
    grad = np.zeros_like(kernels[i])
    for idx in np.ndindex(*kernels[i].shape):
      up, down = kernels[i].copy(), kernels[i].copy()
      up[idx] += eps
      down[idx] -= eps
      grad[idx] = (_numpy_nc(up, labels[i]) - _numpy_nc(down, labels[i])) / (2 * eps)
    # (1/S) sum over the S = 2 clients that took part; the other keeps its head.
    expected = kernels[i] - 0.5 * grad / 2 if took_part[i] else kernels[i]
    np.testing.assert_allclose(stepped[i], expected, rtol=1e-4, atol=1e-5)


def _train(head_steps):
  rng = np.random.default_rng(1)
  model = tiny_model(num_classes=3, hidden=(4,))
  trainer = tiny_trainer(model, lr=0.1, epochs=2, batch_size=4)
  x = rng.normal(size=(8, 4)).astype(np.float32)
  y = np.array([0, 1, 0, 1, 0, 1, 1, 0], np.int32)   # class 2 absent
  params = model.init(jax.random.key(0), x[:1])
  labels = flute.present_classes(jnp.asarray(y), jnp.ones(8, bool), 3)
  trained, _ = flute.head_then_joint_train(
      trainer, params, "Dense_1", jnp.float32(head_steps),
      lambda joint: flute.flute_loss(trainer.apply, "Dense_1", flute.FluteConfig(), labels,
                                     joint),
      ClientData(x, y, np.ones(8, bool), np.int32(8)), jax.random.key(2))
  return params, trained


def test_head_phase_keeps_the_body_joint_phase_moves_it():
  for head_steps, body_moves in ((100, False), (2, True), (0, True)):   # 4 steps in all
    params, trained = _train(head_steps)
    assert not np.allclose(trained["params"]["Dense_1"]["kernel"],
                           params["params"]["Dense_1"]["kernel"])
    same = np.array_equal(trained["params"]["Dense_0"]["kernel"],
                          params["params"]["Dense_0"]["kernel"])
    assert same != body_moves, head_steps


def test_client_update_uploads_body_head_and_classes():
  rng = np.random.default_rng(1)
  model = tiny_model(num_classes=3, hidden=(4,))
  algorithm = flute.flute(flute.FluteConfig(), tiny_trainer(model, epochs=2, batch_size=4))
  x = rng.normal(size=(6, 4)).astype(np.float32)
  y = np.array([0, 2, 0, 2, 1, 1], np.int32)   # the class-1 samples are padding
  params = model.init(jax.random.key(0), x[:1])
  train = ClientData(x, y, np.arange(6) < 4, np.int32(4))
  body = {"params": {"Dense_0": params["params"]["Dense_0"]}}
  out = algorithm.client_update(params, body, ClientSplits(train, train, train),
                                jax.random.key(2))
  np.testing.assert_allclose(out.upload.labels, [1.0, 0.0, 1.0])
  np.testing.assert_array_equal(out.upload.kernel, out.state["params"]["Dense_1"]["kernel"])
  np.testing.assert_array_equal(out.upload.body["params"]["Dense_0"]["kernel"],
                                out.state["params"]["Dense_0"]["kernel"])
  assert list(out.upload.body["params"]) == ["Dense_0"]


def test_server_averages_bodies_and_steps_the_heads_that_took_part():
  model = tiny_model(num_classes=2, hidden=(2,))
  algorithm = flute.flute(flute.FluteConfig(server_lr=0.5), tiny_trainer(model, epochs=2))
  one = _identity_params()
  clients = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), one)
  bodies = {"params": {"Dense_0": {"kernel": jnp.stack([jnp.eye(2), 3 * jnp.eye(2)]),
                                   "bias": jnp.zeros((2, 2))}}}
  uploads = flute.FluteUpload(body=bodies, kernel=jnp.zeros((2, 2, 2)),
                              labels=jnp.ones((2, 2)))
  uploads = uploads._replace(kernel=uploads.kernel.at[0].set(jnp.array([[1.0, 0.5],
                                                                       [0.0, 1.0]])))
  new = algorithm.aggregate(None, clients, uploads, jnp.array([1.0, 0.0]))
  np.testing.assert_allclose(new.server["params"]["Dense_0"]["kernel"], jnp.eye(2))
  expected = flute.server_nc_step(uploads.kernel[:1], uploads.labels[:1],
                                  jnp.array([True]), 0.5)[0]
  np.testing.assert_allclose(new.clients["params"]["Dense_1"]["kernel"][0], expected)
  np.testing.assert_allclose(new.clients["params"]["Dense_1"]["kernel"][1], 2 * jnp.eye(2))


@pytest.mark.parametrize("field,value", [("rep_epochs", 0), ("rep_epochs", 3),
                                         ("lambda1", -1.0), ("server_lr", float("nan"))])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"flute: {field}"):
    flute.flute(flute.FluteConfig()._replace(**{field: value}),
                tiny_trainer(tiny_model(), epochs=2))
