"""FedAvgM: the server's momentum step over two rounds against a hand computation (heavy
ball and FL-bench's Nesterov), and FedAvg at momentum 0."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedavgm
from fedora_jax.algorithms.base import InitContext
from fedora_jax.engine import server_optimizer
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


def _two_rounds(config):
  algorithm = fedavgm.fedavgm(config, tiny_trainer(tiny_model()))
  server = algorithm.init(InitContext(params={"w": jnp.ones(3)}, data=None, trainer=None,
                                      key=None)).server  # x = 1
  weights = jnp.array([1.0, 3.0, 0.0])
  history = []
  for uploads in ({"w": jnp.array([3.0, 5.0, 0.0])}, {"w": jnp.array([2.0, 2.0, 0.0])}):
    server = algorithm.aggregate(server, jnp.zeros(3), uploads, weights).server
    history.append(float(server.params["w"]))
  return history


def test_heavy_ball_server_momentum():
  # g1 = 1 - (1*3 + 3*5)/4 = -3.5: v = -3.5, x = 1 + 0.5*3.5 = 2.75
  # g2 = 2.75 - 2 = 0.75: v = 0.9*(-3.5) + 0.75 = -2.4, x = 2.75 + 0.5*2.4 = 3.95
  np.testing.assert_allclose(_two_rounds(fedavgm.FedAvgMConfig(server_lr=0.5, momentum=0.9)),
                             [2.75, 3.95], rtol=1e-6)


def test_nesterov_server_momentum():
  # step = g + beta v_new: 1: -3.5 + 0.9*(-3.5) = -6.65, x = 1 + 0.5*6.65 = 4.325
  # g2 = 4.325 - 2 = 2.325, v = -3.15 + 2.325 = -0.825, step = 2.325 - 0.7425 = 1.5825,
  # x = 4.325 - 0.5*1.5825 = 3.53375
  np.testing.assert_allclose(
      _two_rounds(fedavgm.FedAvgMConfig(server_lr=0.5, momentum=0.9, nesterov=True)),
      [4.325, 3.53375], rtol=1e-6)


def test_no_momentum_at_server_lr_one_is_fedavg():
  np.testing.assert_allclose(_two_rounds(fedavgm.FedAvgMConfig(server_lr=1.0, momentum=0.0)),
                             [4.5, 2.0], rtol=1e-6)


def test_sampled_weights():
  weights = jnp.array([2.0, 0.0, 5.0])
  np.testing.assert_array_equal(server_optimizer.sampled_weights(weights, "uniform"), [1, 0, 1])
  np.testing.assert_array_equal(server_optimizer.sampled_weights(weights, "weighted"), weights)


@pytest.mark.parametrize("field,value", [("server_lr", 0.0), ("momentum", 1.0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedavgm: {field}"):
    fedavgm.fedavgm(fedavgm.FedAvgMConfig()._replace(**{field: value}),
                    tiny_trainer(tiny_model()))
