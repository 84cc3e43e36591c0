"""FedGH: a client's round (the global header under its own extractor, then its class
prototypes) and the server's header step on the prototypes of the sampled clients, each
against a hand computation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedgh
from fedora_jax.algorithms.fedproto import Prototypes
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_a_client_trains_under_the_global_header_and_uploads_its_prototypes():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  algorithm = fedgh.fedgh(fedgh.FedGhConfig(), tiny_trainer(model, lr=LR, batch_size=8))
  own, received = init_params(model, seed=0), init_params(model, seed=1)
  body = {"params": {"Dense_0": own["params"]["Dense_0"]}}
  header = {"params": {"Dense_1": received["params"]["Dense_1"]}}
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(body, header, splits, jax.random.key(0))

  start = {"params": {**body["params"], **header["params"]}}
  x, y = clients[0].x_train, clients[0].y_train
  grads = jax.grad(lambda p: mean_ce(model, p, x, y))(start)
  trained = jax.tree.map(lambda p, g: p - LR * g, start, grads)
  chex.assert_trees_all_close(out.state["params"]["Dense_0"], trained["params"]["Dense_0"],
                              atol=1e-6)
  layer = trained["params"]["Dense_0"]
  z = np.asarray(jax.nn.relu(x @ layer["kernel"] + layer["bias"]))
  for c in range(3):
    expected = z[y == c].mean(0) if (y == c).any() else np.zeros(5)
    np.testing.assert_allclose(out.upload.prototypes.means[c], expected, rtol=1e-5, atol=1e-6)
    assert out.upload.prototypes.counts[c] == (y == c).sum()


@pytest.mark.parametrize("start", ["global", "first_client"])
def test_the_server_trains_the_header_on_the_sampled_clients_prototypes(start):
  # Batch 8 >= the 4 real pairs: one full-batch step.
  algorithm = fedgh.fedgh(fedgh.FedGhConfig(server_lr=0.5, server_head_start=start),
                          tiny_trainer(tiny_model(), batch_size=8))
  rng = np.random.default_rng(1)
  means = jnp.asarray(rng.normal(size=(3, 3, 5)), jnp.float32)
  counts = jnp.array([[2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [4.0, 3.0, 0.0]])
  header = {"params": {"Dense_1": {"kernel": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
                                   "bias": jnp.zeros(3)}}}
  client_header = jax.tree.map(lambda a: jnp.stack([a + 1.0, a, a]), header)
  server = fedgh.GhServer(head=header, key=jax.random.key_data(jax.random.key(0)),
                          round=jnp.array(0))
  uploads = fedgh.GhUpload(prototypes=Prototypes(means=means, counts=counts),
                           head=client_header)
  new = algorithm.aggregate(server, {"params": {}}, uploads, jnp.array([3.0, 0.0, 7.0]))
  # Client 1 sat out; client 0 lacks class 1, client 2 class 2: four pairs.
  x = jnp.stack([means[0, 0], means[0, 2], means[2, 0], means[2, 1]])
  y = jnp.array([0, 2, 0, 1])
  first = jax.tree.map(lambda a: a[0], client_header) if start == "first_client" else header

  def loss(h):
    layer = h["params"]["Dense_1"]
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ layer["kernel"] + layer["bias"], y).mean()
  expected = jax.tree.map(lambda p, g: p - 0.5 * g, first, jax.grad(loss)(first))
  chex.assert_trees_all_close(new.server.head, expected, atol=1e-6)
  assert int(new.server.round) == 1


@pytest.mark.parametrize("field,value", [("server_lr", 0.0), ("server_head_start", "mean")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedgh: {field}"):
    fedgh.fedgh(fedgh.FedGhConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
