"""FedADMM: the augmented-Lagrangian local step, the dual update and the uploaded Delta
against a hand computation, the authors' random epochs, and the server's step with its
late learning rate."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedadmm
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR, RHO = 0.1, 0.3


def _client(epochs="fixed", trainer_epochs=2, seed=0):
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=trainer_epochs)  # full batches
  theta = init_params(model)
  dual = jax.tree.map(lambda p: jnp.full_like(p, 0.5), theta)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  algorithm = fedadmm.fedadmm(fedadmm.FedAdmmConfig(rho=RHO, epochs=epochs), trainer)
  out = algorithm.client_update(dual, theta, splits, jax.random.key(seed))
  return model, clients[0], theta, out


def test_client_step_dual_and_delta():
  model, client, theta, out = _client()
  # w <- w - lr (grad CE + y + rho (w - theta)), twice, from theta.
  w = theta
  for _ in range(2):
    g = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(w)
    w = jax.tree.map(lambda w, g, t: w - LR * (g + 0.5 + RHO * (w - t)), w, g, theta)
  # y <- y + rho (w - theta); Delta = (w - theta) + (y_new - y) / rho = 2 (w - theta).
  chex.assert_trees_all_close(out.state, jax.tree.map(lambda w, t: 0.5 + RHO * (w - t),
                                                      w, theta), atol=1e-6)
  chex.assert_trees_all_close(out.upload, jax.tree.map(lambda w, t: 2 * (w - t), w, theta),
                              atol=1e-5)
  assert int(out.train.steps) == 2


@pytest.mark.parametrize("seed", range(4))
def test_random_epochs_take_a_drawn_number_of_epochs(seed):
  *_, out = _client("random", trainer_epochs=3, seed=seed)
  epochs_key, _ = jax.random.split(jax.random.key(seed))
  drawn = round(float(fedadmm.epoch_fraction(epochs_key, 3)) * 3)
  assert 1 <= drawn <= 3
  assert int(out.train.steps) == drawn   # one full batch an epoch


def test_server_step_and_late_learning_rate():
  config = fedadmm.FedAdmmConfig(late_round=3, server_lr=1.0, late_server_lr=0.5)
  algorithm = fedadmm.fedadmm(config, tiny_trainer(tiny_model()))
  uploads = {"w": jnp.array([2.0, 9.0, -1.0])}   # the second slot sat the round out
  weights = jnp.array([1.0, 0.0, 3.0])
  early = algorithm.aggregate(fedadmm.AdmmServer({"w": jnp.array(1.0)}, jnp.array(2)),
                              {"w": jnp.zeros(3)}, uploads, weights).server
  # uniform mean of (2, -1) = 0.5; eta 1 before round 3
  np.testing.assert_allclose(early.params["w"], 1.5, rtol=1e-6)
  late = algorithm.aggregate(early, {"w": jnp.zeros(3)}, uploads, weights).server
  np.testing.assert_allclose(late.params["w"], 1.75, rtol=1e-6)   # eta 0.5 at round 3
  weighted = fedadmm.fedadmm(config._replace(server_mean="weighted"),
                             tiny_trainer(tiny_model()))
  new = weighted.aggregate(fedadmm.AdmmServer({"w": jnp.array(1.0)}, jnp.array(0)),
                           {"w": jnp.zeros(3)}, uploads, weights).server
  # (1 * 2 + 3 * -1) / 4 = -0.25
  np.testing.assert_allclose(new.params["w"], 0.75, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("rho", 0.0), ("late_round", -1),
                                         ("epochs", "some"), ("server_mean", "median")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedadmm: {field}"):
    fedadmm.fedadmm(fedadmm.FedAdmmConfig()._replace(**{field: value}),
                    tiny_trainer(tiny_model()))
