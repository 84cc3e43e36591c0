"""FedNova: ||a_i||_1 against the authors' step-by-step counter, the client's normalised
update from a run with momentum, and the server's step against a hand computation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fednova
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_step_weight_norm_counts_as_the_authors_code(momentum):
  counter, norm = 0.0, 0.0
  for steps in range(1, 8):
    # Their optimiser: counter = rho counter + 1; normalizing vector += counter.
    counter = momentum * counter + 1.0 if momentum else 1.0
    norm += counter
    # float32's closed form: [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) cancels.
    np.testing.assert_allclose(fednova.step_weight_norm(jnp.array(steps), momentum), norm,
                               rtol=1e-5)


def test_client_uploads_its_update_over_its_norm():
  data, _ = tiny_data([13, 13])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=0.1, momentum=0.5, batch_size=4, epochs=1)
  x = init_params(model)
  algorithm = fednova.fednova(fednova.FedNovaConfig(momentum=0.5), trainer)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])  # 13 samples: 4 steps
  out = algorithm.client_update(jnp.zeros(()), x, splits, jax.random.key(0))
  y, _ = trainer.train(x, splits.train, jax.random.key(0))
  norm = 1 + 1.5 + 1.75 + 1.875
  assert int(out.train.steps) == 4
  np.testing.assert_allclose(out.upload.norm, norm, rtol=1e-6)
  chex.assert_trees_all_close(out.upload.normalized,
                              jax.tree.map(lambda a, b: (a - b) / norm, x, y), atol=1e-6)


def test_server_step():
  # Clients 0 and 1 sampled (weights 1 and 3), norms 2 and 6, normalised updates 0.5, -1.
  algorithm = fednova.fednova(fednova.FedNovaConfig(), tiny_trainer(tiny_model()))
  uploads = fednova.Upload(normalized={"w": jnp.array([0.5, -1.0, 0.0])},
                           norm=jnp.array([2.0, 6.0, 0.0]))
  new = algorithm.aggregate({"w": jnp.array(1.0)}, jnp.zeros(3), uploads,
                            jnp.array([1.0, 3.0, 0.0])).server
  # tau_eff = (2 + 18) / 4 = 5;  x - 5 (0.5 - 3) / 4 = 1 + 3.125
  np.testing.assert_allclose(new["w"], 4.125, rtol=1e-6)


def test_equal_step_counts_give_fedavgs_mean():
  algorithm = fednova.fednova(fednova.FedNovaConfig(), tiny_trainer(tiny_model()))
  x, ys, norm = 1.0, np.array([3.0, 5.0]), 4.0
  uploads = fednova.Upload(normalized={"w": jnp.asarray((x - ys) / norm)},
                           norm=jnp.full(2, norm))
  new = algorithm.aggregate({"w": jnp.array(x)}, jnp.zeros(2), uploads, jnp.array([1.0, 3.0]))
  np.testing.assert_allclose(new.server["w"], (3.0 + 3 * 5.0) / 4, rtol=1e-6)


def test_bad_momentum_is_refused():
  with pytest.raises(ConfigError, match="fednova: momentum"):
    fednova.fednova(fednova.FedNovaConfig(momentum=1.0), tiny_trainer(tiny_model()))
