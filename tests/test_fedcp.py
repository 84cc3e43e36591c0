"""FedCP: the conditional policy and gated heads, the MMD term, one client step and the
server step against hand computations; its own evaluation used by the round."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedcp
from fedora_jax.algorithms.base import InitContext
from fedora_jax.engine.local_training import epoch_batches
from fedora_jax.errors import ConfigError
from fedora_jax.rounds import RoundState, build_train_round
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _np_gated(policy, context, z, noise, tau, head_p, head_g):
  """The forward of Ensemble / Gate / ConditionalSelection, in numpy."""
  gate_in = z * context / np.linalg.norm(context)
  hidden = gate_in @ policy["kernel"] + policy["bias"]
  hidden = (hidden - hidden.mean(-1, keepdims=True)) / np.sqrt(
      hidden.var(-1, keepdims=True) + 1e-5)
  hidden = np.maximum(hidden * policy["scale"] + policy["offset"], 0.0)
  logits = hidden.reshape(len(z), 2, -1) + noise
  gates = np.exp(logits / tau) / np.exp(logits / tau).sum(axis=1, keepdims=True)
  r, s = gates[:, 0], gates[:, 1]
  return (z * r) @ head_p["kernel"] + head_p["bias"] + (z * s) @ head_g["kernel"] \
      + head_g["bias"], r


def _np_mmd(x, y):
  """clientcp.MMD(x, y, 'rbf')."""
  xx, yy, zz = x @ x.T, y @ y.T, x @ y.T
  rx, ry = np.diag(xx)[None], np.diag(yy)[None]
  dxx, dyy, dxy = rx.T + rx - 2 * xx, ry.T + ry - 2 * yy, rx.T + ry - 2 * zz
  return np.mean(sum(np.exp(-0.5 * dxx / a) + np.exp(-0.5 * dyy / a) - 2 * np.exp(-0.5 * dxy / a)
                     for a in (10, 15, 20, 50)))


def test_gated_output_matches_the_authors_forward():
  rng = np.random.default_rng(0)
  d, c, b = 3, 2, 4
  policy = {k: np.asarray(v, np.float32)
            for k, v in fedcp.init_policy(jax.random.key(1), d).items()}
  policy["scale"] = rng.normal(size=2 * d).astype(np.float32)
  policy["offset"] = rng.normal(size=2 * d).astype(np.float32)
  head_p = {"kernel": rng.normal(size=(d, c)), "bias": rng.normal(size=c)}
  head_g = {"kernel": rng.normal(size=(d, c)), "bias": rng.normal(size=c)}
  context, z = rng.uniform(size=d), np.abs(rng.normal(size=(b, d)))
  noise = rng.gumbel(size=(b, 2, d))
  model = fedcp.FedCpModel(model={"params": {"Dense_1": head_p}},
                           global_head={"params": {"Dense_1": head_g}},
                           policy=policy, context=jnp.asarray(context))
  outputs, r = fedcp.gated_logits(model, "Dense_1", jnp.asarray(z, jnp.float32),
                                  jnp.asarray(noise, jnp.float32), 0.7)
  want, want_r = _np_gated(policy, context, z, noise, 0.7, head_p, head_g)
  np.testing.assert_allclose(outputs, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(r, want_r, rtol=1e-4, atol=1e-6)


def test_mmd_matches_the_authors_and_ignores_padding():
  rng = np.random.default_rng(1)
  x, y = rng.normal(size=(5, 3)) * 3, rng.normal(size=(5, 3)) * 3 + 1
  got = fedcp.mmd(jnp.asarray(x), jnp.asarray(y), jnp.ones(5))
  np.testing.assert_allclose(got, _np_mmd(x, y), rtol=1e-5)
  padded = fedcp.mmd(jnp.asarray(np.vstack([x, 50 * np.ones((2, 3))])),
                     jnp.asarray(np.vstack([y, -50 * np.ones((2, 3))])),
                     jnp.array([1.0] * 5 + [0.0] * 2))
  np.testing.assert_allclose(padded, got, rtol=1e-5)


def _start(algorithm, trainer, data, params):
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape), params)
  return algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                    key=jax.random.key(0)))


def test_client_step_by_hand():
  data, clients = tiny_data([6, 6])
  model = tiny_model()                         # f = Dense_0 + ReLU (5 features), head Dense_1
  trainer = tiny_trainer(model, lr=LR, batch_size=8)   # one full-batch plain SGD step
  lam, tau = 0.5, 0.8
  algorithm = fedcp.fedcp(fedcp.FedCpConfig(lam=lam, temperature=tau), trainer)
  params = init_params(model)
  state = _start(algorithm, trainer, data, params)
  client = jax.tree.map(lambda a: a[0], state.clients)
  # A personal head unlike the global one, so that every part has a gradient.
  client = client._replace(personal_head=jax.tree.map(lambda a: a + 0.3, client.personal_head))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  body = {"params": {"Dense_0": params["params"]["Dense_0"]}}
  key = jax.random.key(7)
  out = jax.jit(algorithm.client_update)(client, body, splits, key)

  # The trainer's one batch: its sample order (epoch_batches) meets the step's noise rows.
  noise_key, train_key = jax.random.split(key)
  train = splits.train
  order, weights = epoch_batches(jax.random.split(train_key, 1)[0], train.mask, train.n, 8, 1)
  x, y, weights = train.x[order[0]], train.y[order[0]], weights[0]
  assert weights.sum() == 6 == len(clients[0].y_train)
  noise = fedcp.step_noise(noise_key, jnp.zeros(()), (8, 2, 5))
  features = lambda dense: jax.nn.relu(x @ dense["kernel"] + dense["bias"])
  received = features(params["params"]["Dense_0"])

  def loss(trained):
    dense, head_p, policy = trained
    z = features(dense)
    context = client.context / jnp.linalg.norm(client.context)
    logits = fedcp.policy_logits(policy, z * context)
    gates = jax.nn.softmax((logits + noise) / tau, axis=1)
    head_g = client.global_head["params"]["Dense_1"]
    out = (z * gates[:, 0]) @ head_p["kernel"] + head_p["bias"] \
        + (z * gates[:, 1]) @ head_g["kernel"] + head_g["bias"]
    ce = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(out, y) * weights) / 6
    return ce + lam * fedcp.mmd(z, received, weights)
  start = (params["params"]["Dense_0"], client.personal_head["params"]["Dense_1"], client.policy)
  want = jax.tree.map(lambda p, g: p - LR * g, start, jax.jit(jax.grad(loss))(start))
  chex.assert_trees_all_close(out.upload.body["params"]["Dense_0"], want[0], atol=1e-6)
  chex.assert_trees_all_close(out.state.personal_head["params"]["Dense_1"], want[1], atol=1e-6)
  chex.assert_trees_all_close(out.upload.policy, want[2], atol=1e-6)
  # The uploaded global head: (h_p + h_g) / 2, the client's copy of h_g unchanged.
  chex.assert_trees_all_close(
      out.upload.global_head["params"]["Dense_1"],
      jax.tree.map(lambda p, g: (p + g) / 2, want[1], client.global_head["params"]["Dense_1"]),
      atol=1e-6)
  chex.assert_trees_all_equal(out.state.global_head, client.global_head)


def test_server_sends_the_new_global_parts_to_the_round_s_clients_only():
  data, _ = tiny_data([6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model)
  algorithm = fedcp.fedcp(fedcp.FedCpConfig(), trainer)
  state = _start(algorithm, trainer, data, init_params(model))
  clients = state.clients._replace(
      personal_head=jax.tree.map(lambda a: a + jnp.arange(3.0).reshape((3,) + (1,) * (a.ndim - 1)),
                                 state.clients.personal_head))
  uploads = fedcp.FedCpServer(
      body=jax.tree.map(lambda a: jnp.stack([a, a + 1, a + 5]), state.server.body),
      global_head=jax.tree.map(lambda a: jnp.stack([a, a + 2, a + 9]), state.server.global_head),
      policy=jax.tree.map(lambda a: jnp.stack([a, a - 1, a + 9]), state.server.policy))
  weights = jnp.array([1.0, 3.0, 0.0])               # client 2 sat the round out
  new = algorithm.aggregate(state.server, clients, uploads, weights)
  chex.assert_trees_all_close(new.server.body, jax.tree.map(lambda a: a + 0.75, state.server.body))
  chex.assert_trees_all_close(new.server.global_head,
                              jax.tree.map(lambda a: a + 1.5, state.server.global_head))
  chex.assert_trees_all_close(new.server.policy,
                              jax.tree.map(lambda a: a - 0.75, state.server.policy))
  for k in (0, 1):
    chex.assert_trees_all_close(jax.tree.map(lambda a, k=k: a[k], new.clients.policy),
                                new.server.policy)
    kernel = clients.personal_head["params"]["Dense_1"]["kernel"][k]
    np.testing.assert_allclose(new.clients.context[k], kernel.sum(axis=1), rtol=1e-6)
  chex.assert_trees_all_equal(jax.tree.map(lambda a: a[2], new.clients.global_head),
                              jax.tree.map(lambda a: a[2], clients.global_head))
  np.testing.assert_array_equal(new.clients.context[2], clients.context[2])


def test_the_round_scores_the_noise_free_gated_model():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)
  algorithm = fedcp.fedcp(fedcp.FedCpConfig(), trainer)
  state = RoundState(round=jnp.zeros((), jnp.int32),
                     algorithm=_start(algorithm, trainer, data, init_params(model)))
  state, metrics = jax.jit(build_train_round(algorithm, trainer, data))(
      state, data.buckets, jax.random.key(1))
  personal = algorithm.personalized_params(state.algorithm.server, state.algorithm.clients)
  for k, client in enumerate(clients):
    one = jax.tree.map(lambda a, k=k: a[k], personal)
    dense = one.model["params"]["Dense_0"]
    z = np.maximum(client.x_test @ dense["kernel"] + dense["bias"], 0.0)
    logits, _ = _np_gated({n: np.asarray(v) for n, v in one.policy.items()},
                          np.asarray(one.context), z, np.zeros((len(z), 2, 5)), 1.0,
                          one.model["params"]["Dense_1"], one.global_head["params"]["Dense_1"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, client.y_test).mean()
    np.testing.assert_allclose(metrics.test_loss[k], ce, rtol=1e-5)
    np.testing.assert_allclose(metrics.test_score[k],
                               np.mean(np.argmax(logits, -1) == client.y_test))


@pytest.mark.parametrize("config, message", [
    (fedcp.FedCpConfig(lam=-1.0), "fedcp: lam"),
    (fedcp.FedCpConfig(temperature=0.0), "fedcp: temperature"),
])
def test_bad_config_is_one_line_error(config, message):
  with pytest.raises(ConfigError, match=message):
    fedcp.fedcp(config, tiny_trainer(tiny_model()))
