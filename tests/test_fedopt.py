"""FedOpt: FedAdam's, FedYogi's and FedAdagrad's server steps over two rounds against
Reddi et al.'s Algorithm 2 written out in numpy, and the uniform 1/|S| mean."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import fedopt
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer

ETA, BETA1, BETA2, TAU = 0.1, 0.9, 0.99, 1e-3
UPLOADS = (np.array([[3.0, -1.0], [5.0, 0.0], [0.0, 0.0]]),   # [clients, parameters]
           np.array([[2.0, 1.0], [2.5, 1.0], [0.0, 0.0]]))
WEIGHTS = np.array([1.0, 3.0, 0.0])  # client 2 sat both rounds out


def _by_hand(kind):
  """Algorithm 2: Delta = mean over S of (y_i - x), m, v from v_{-1} = tau^2, no bias
  correction; x += eta m / (sqrt(v) + tau)."""
  x, m, v = np.array([1.0, 0.5]), np.zeros(2), np.full(2, TAU ** 2)
  history = []
  for uploads in UPLOADS:
    delta = uploads[:2].mean(axis=0) - x
    m = BETA1 * m + (1 - BETA1) * delta
    if kind == "adagrad":
      v = v + delta ** 2
    elif kind == "adam":
      v = BETA2 * v + (1 - BETA2) * delta ** 2
    else:
      v = v - (1 - BETA2) * delta ** 2 * np.sign(v - delta ** 2)
    x = x + ETA * m / (np.sqrt(v) + TAU)
    history.append(x)
  return np.array(history)


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_server_steps_are_algorithm_2s(kind):
  config = fedopt.FedOptConfig(server_optimizer=kind, server_lr=ETA, beta1=BETA1,
                               beta2=BETA2, tau=TAU)
  algorithm = fedopt.fedopt(config, tiny_trainer(tiny_model()))
  server = algorithm.init(InitContext(params={"w": jnp.array([[1.0, 0.5]] * 3)}, data=None,
                                      trainer=None, key=None)).server
  history = []
  for uploads in UPLOADS:
    server = algorithm.aggregate(server, jnp.zeros(3), {"w": jnp.asarray(uploads)},
                                 jnp.asarray(WEIGHTS)).server
    history.append(np.asarray(server.params["w"]))
  np.testing.assert_allclose(history, _by_hand(kind), rtol=1e-5)


def test_variants_set_the_server_optimizer():
  for variant, kind in (("fedadam", "adam"), ("fedyogi", "yogi"), ("fedadagrad", "adagrad")):
    assert algorithms.default_config("fedopt", preset=variant).server_optimizer == kind
  assert algorithms.default_config("fedopt").server_optimizer == "adam"


@pytest.mark.parametrize("field,value", [("server_optimizer", "sgd"), ("server_lr", 0.0),
                                         ("tau", 0.0), ("beta1", 1.0), ("beta2", -0.1),
                                         ("server_mean", "median")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedopt: {field}"):
    fedopt.fedopt(fedopt.FedOptConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
