"""PFL-DA: the client's head step (cross-entropy plus lambda ||g - h||, the extractor
fixed), then the extractor and the global head under cross-entropy (its own head fixed),
against hand computations; PFLlib's detached penalty; the server's FedAvg of g."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import pflda
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _layers(params, *names):
  return {"params": {n: params["params"][n] for n in names}}


def _merged(*parts):
  return {"params": {k: v for p in parts for k, v in p["params"].items()}}


@pytest.mark.parametrize("gradient", [True, False])
def test_head_then_extractor_under_the_global_head(gradient):
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)     # one full-batch step a phase
  algorithm = pflda.pflda(pflda.PflDaConfig(lam=0.4, penalty_gradient=gradient), trainer)
  own, received = init_params(model, seed=0), init_params(model, seed=1)
  global_head = _layers(received, "Dense_1")
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(own, global_head, splits, jax.random.key(0))

  x, y = clients[0].x_train, clients[0].y_train
  body, head = _layers(own, "Dense_0"), _layers(own, "Dense_1")

  def head_loss(h):
    distance = jnp.sqrt(sum(jnp.sum((a - b) ** 2) for a, b in
                            zip(jax.tree.leaves(global_head), jax.tree.leaves(h))))
    return mean_ce(model, _merged(body, h), x, y) + (0.4 * distance if gradient else 0.0)
  step = lambda p, g: jax.tree.map(lambda a, b: a - LR * b, p, g)
  head = step(head, jax.grad(head_loss)(head))
  both = _merged(body, global_head)
  both = step(both, jax.grad(lambda p: mean_ce(model, p, x, y))(both))
  chex.assert_trees_all_close(out.state, _merged(_layers(both, "Dense_0"), head), atol=1e-6)
  chex.assert_trees_all_close(out.upload, _layers(both, "Dense_1"), atol=1e-6)


def test_server_averages_the_global_heads_of_the_sampled_clients():
  algorithm = pflda.pflda(pflda.PflDaConfig(), tiny_trainer(tiny_model()))
  uploads = {"w": jnp.array([2.0, 8.0, 5.0])}
  state = algorithm.aggregate({"w": jnp.array(0.0)}, {"w": jnp.zeros(3)}, uploads,
                              jnp.array([1.0, 0.0, 3.0]))
  np.testing.assert_allclose(state.server["w"], (2.0 + 15.0) / 4, rtol=1e-6)


def test_bad_values_are_refused():
  with pytest.raises(ConfigError, match="pflda: lam"):
    pflda.pflda(pflda.PflDaConfig(lam=-1.0), tiny_trainer(tiny_model()))
