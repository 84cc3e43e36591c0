"""FedU's Laplacian step and FedAMP's attention-weighted cloud models, by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import similarity
from fedora_jax.algorithms import fedamp, fedu
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def test_fedu_laplacian_step_by_hand():
  # eta * lambda = 0.05; theta_k - 0.05 * sum_{l != k} (theta_k - theta_l).
  params = {"w": jnp.array([[1.0], [2.0], [6.0]]), "b": jnp.array([0.0, 0.0, 3.0])}
  algorithm = fedu.fedu(fedu.FedUConfig(lam=0.5, eta=0.1), tiny_trainer(tiny_model()))
  state = algorithm.aggregate((), params, (), jnp.ones(3))
  np.testing.assert_allclose(state.clients["w"][:, 0],
                             [1 + 0.05 * 6, 2 + 0.05 * 3, 6 - 0.05 * 9], rtol=1e-6)
  np.testing.assert_allclose(state.clients["b"], [0.15, 0.15, 3 - 0.3], rtol=1e-6)


def test_fedu_rejects_negative_lambda():
  with pytest.raises(ConfigError, match="fedu: lam"):
    fedu.fedu(fedu.FedUConfig(lam=-1.0), tiny_trainer(tiny_model()))


def test_fedu_code_forms_reject_unknown_values():
  for field in ("update", "step", "graph"):
    with pytest.raises(ConfigError, match=f"fedu: {field}"):
      fedu.fedu(fedu.FedUConfig(**{field: "other"}), tiny_trainer(tiny_model()))


def test_fedu_updates_only_the_sampled_clients_over_each_other_by_hand():
  # Clients 0 and 2 took part (weight > 0): each steps over the other alone (the code's
  # user_list is the selected users); clients 1 and 3 keep their models. eta lambda = 0.05.
  params = {"w": jnp.array([[1.0], [2.0], [6.0], [4.0]]), "b": jnp.array([0.0, 5.0, 3.0, 1.0])}
  algorithm = fedu.fedu(fedu.FedUConfig(lam=0.5, eta=0.1, update="sampled"),
                        tiny_trainer(tiny_model()))
  state = algorithm.aggregate((), params, (), jnp.array([2.0, 0.0, 1.0, 0.0]))
  np.testing.assert_allclose(state.clients["w"][:, 0],
                             [1 - 0.05 * (1 - 6), 2, 6 - 0.05 * (6 - 1), 4], rtol=1e-6)
  np.testing.assert_allclose(state.clients["b"], [0 - 0.05 * (0 - 3), 5, 3 - 0.05 * 3, 1],
                             rtol=1e-6)
  # Every client sampled: the same as the default's step over all.
  every = algorithm.aggregate((), params, (), jnp.ones(4))
  default = fedu.fedu(fedu.FedUConfig(lam=0.5, eta=0.1), tiny_trainer(tiny_model()))
  chex.assert_trees_all_close(every.clients,
                              default.aggregate((), params, (), jnp.ones(4)).clients,
                              rtol=1e-6)


def test_fedu_codes_step_and_random_graph_by_hand():
  # The code's step: 0.5 * local_epochs * eta * lambda = 0.5 * 5 * 0.1 * 0.5 = 0.125 per
  # unit a_kl; its graph drawn once at init by similarity.random_similarity (threshold 0.25).
  trainer = tiny_trainer(tiny_model(), epochs=5)
  config = fedu.FedUConfig(lam=0.5, eta=0.1, step="code", graph="random")
  assert fedu.step_size(config, 5) == pytest.approx(0.125)
  assert fedu.step_size(config._replace(step="paper"), 5) == pytest.approx(0.05)
  params = {"w": jnp.array([[1.0], [2.0], [6.0]])}
  key = jax.random.key(3)
  algorithm = fedu.fedu(config, trainer)
  state = algorithm.init(InitContext(params=params, data=None, trainer=trainer, key=key))
  graph = np.asarray(similarity.random_similarity(key, 3, 0.25))
  np.testing.assert_array_equal(state.server, graph)
  assert np.all(graph == graph.T) and np.all((graph == 0) | (graph >= 0.25))
  after = algorithm.aggregate(state.server, params, (), jnp.ones(3))
  w = np.array([1.0, 2.0, 6.0])
  expected = [w[k] - 0.125 * sum(graph[k, l] * (w[k] - w[l]) for l in range(3) if l != k)
              for k in range(3)]
  np.testing.assert_allclose(after.clients["w"][:, 0], expected, rtol=1e-6)


def test_fedamp_distance_attention_and_cloud_models_by_hand():
  params = {"w": jnp.array([[0.0], [1.0], [3.0]])}
  config = fedamp.FedAmpConfig(alpha_k=0.5, sigma=2.0)
  algorithm = fedamp.fedamp(config, tiny_trainer(tiny_model()))
  state = algorithm.init(InitContext(params=params, data=None, trainer=None,
                                     key=jax.random.key(0)))
  squared = np.array([[0.0, 1.0, 9.0], [1.0, 0.0, 4.0], [9.0, 4.0, 0.0]])
  xi = 0.5 * np.exp(-squared / 2.0) / 2.0
  np.fill_diagonal(xi, 0.0)
  np.fill_diagonal(xi, 1.0 - xi.sum(axis=1))
  np.testing.assert_allclose(state.server.attention, xi, rtol=1e-6)
  message = algorithm.broadcast(state.server, params)
  np.testing.assert_allclose(message.cloud_model["w"][:, 0], xi @ np.array([0.0, 1.0, 3.0]),
                             rtol=1e-6)
  np.testing.assert_allclose(message.self_weight, np.diag(xi), rtol=1e-6)
  # aggregate recomputes the attention from the round's models.
  moved = {"w": jnp.array([[0.0], [0.0], [3.0]])}
  after = algorithm.aggregate(state.server, moved, (), jnp.ones(3)).server.attention
  np.testing.assert_allclose(after[0, 1], 0.5 * np.exp(0.0) / 2.0, rtol=1e-6)


def test_fedamp_cosine_attention_by_hand():
  params = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])}
  config = fedamp.FedAmpConfig(attention="cosine", self_weight=0.4, cosine_scale=2.0)
  xi = fedamp.attention_matrix(params, config)
  c = 1.0 / np.sqrt(2.0)
  cos = np.array([[1.0, 0.0, c], [0.0, 1.0, c], [c, c, 1.0]])
  expected = np.zeros((3, 3))
  for i in range(3):
    others = [j for j in range(3) if j != i]
    e = np.exp(2.0 * cos[i, others])
    expected[i, others] = 0.6 * e / e.sum()
    expected[i, i] = 0.4
  np.testing.assert_allclose(xi, expected, rtol=1e-5)


def test_fedamp_client_takes_the_proximal_step_towards_its_cloud_model():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch SGD step
  config = fedamp.FedAmpConfig(alpha_k=0.5, lam=2.0)  # proximal weight 2 / (2 * 0.5) = 2
  algorithm = fedamp.fedamp(config, trainer)
  params, cloud = init_params(model, seed=0), init_params(model, seed=1)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  message = fedamp.FedAmpMessage(cloud_model=cloud, self_weight=jnp.float32(0.3),
                                 prox_weight=jnp.float32(2.0))
  out = algorithm.client_update(params, message, splits, jax.random.key(0))
  grads = jax.grad(lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(params)
  expected = jax.tree.map(lambda p, g, u: p - lr * (g + 2.0 * 2.0 * (p - u)),
                          params, grads, cloud)
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)
  np.testing.assert_allclose(out.metrics["self_weight"], 0.3)


def test_fedamp_warns_when_the_first_cloud_models_extrapolate(caplog):
  # All clients start equal (d = 0): xi_ij = alpha_k / sigma, xi_ii = 1 - (K - 1) alpha_k / sigma.
  params = {"w": jnp.zeros((4, 2))}
  assert fedamp.first_round_self_weight(4, fedamp.FedAmpConfig(alpha_k=0.5, sigma=2.0)) == 0.25
  trainer = tiny_trainer(tiny_model())
  context = InitContext(params=params, data=None, trainer=trainer, key=jax.random.key(0))
  with caplog.at_level("WARNING"):
    state = fedamp.fedamp(fedamp.FedAmpConfig(clip_step=False), trainer).init(context)
  np.testing.assert_allclose(np.diag(state.server.attention), -2.0)
  assert "xi_ii = -2 < 0" in caplog.text and "sigma / (K - 1) = 0.333" in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING"):
    fedamp.fedamp(fedamp.FedAmpConfig(alpha_k=0.3, clip_step=False), trainer).init(context)
    fedamp.fedamp(fedamp.FedAmpConfig(), trainer).init(context)  # clipped to 1/3
  assert "extrapolate" not in caplog.text


def test_fedamp_clips_the_step_to_the_papers_bound_by_hand():
  # K = 3, sigma = 1: the bound is alpha_k <= sigma / (K - 1) = 0.5, so alpha_k = 1 is
  # clipped to 0.5 in xi; the proximal weight keeps lambda / (2 alpha_k) = 0.3 / 2.
  params = {"w": jnp.array([[0.0], [1.0], [3.0]])}
  config = fedamp.FedAmpConfig(alpha_k=1.0, lam=0.3, sigma=1.0)
  algorithm = fedamp.fedamp(config, tiny_trainer(tiny_model()))
  state = algorithm.init(InitContext(params=params, data=None, trainer=None,
                                     key=jax.random.key(0)))
  squared = np.array([[0.0, 1.0, 9.0], [1.0, 0.0, 4.0], [9.0, 4.0, 0.0]])
  xi = 0.5 * np.exp(-squared)
  np.fill_diagonal(xi, 0.0)
  np.fill_diagonal(xi, 1.0 - xi.sum(axis=1))
  np.testing.assert_allclose(state.server.attention, xi, rtol=1e-6)
  assert np.all(np.diag(xi) >= 0)
  message = algorithm.broadcast(state.server, params)
  np.testing.assert_allclose(message.prox_weight, [0.15, 0.15, 0.15], rtol=1e-6)
  # Equal models (the first round): xi_ii = 1 - 2 * 0.5 = 0, never negative.
  same = {"w": jnp.zeros((3, 1))}
  np.testing.assert_allclose(np.diag(fedamp.attention_matrix(same, config)), 0.0, atol=1e-7)
  # clip_step=False keeps alpha_k = 1 in xi (PFLlib): xi_ii = 1 - 2 = -1.
  raw = config._replace(clip_step=False)
  np.testing.assert_allclose(np.diag(fedamp.attention_matrix(same, raw)), -1.0, atol=1e-7)
  raw_message = fedamp.fedamp(raw, tiny_trainer(tiny_model())).broadcast(state.server, params)
  np.testing.assert_allclose(raw_message.prox_weight, [0.15, 0.15, 0.15], rtol=1e-6)


def test_fedamp_attention_from_the_uploaders_only_by_hand():
  # Clients 0 and 2 uploaded (weight > 0), 1 and 3 sat the round out (PFLlib's
  # send_models): xi_ij = alpha_k exp(-d_ij / sigma) / sigma for an uploader j != i, 0
  # for the others, xi_ii = 1 - row sum, whether or not i uploaded.
  params = {"w": jnp.array([[0.0], [1.0], [3.0], [2.0]])}
  config = fedamp.FedAmpConfig(alpha_k=0.5, sigma=2.0, attention_from="uploaders")
  algorithm = fedamp.fedamp(config, tiny_trainer(tiny_model()))
  weights = jnp.array([3.0, 0.0, 1.0, 0.0])
  attention = algorithm.aggregate(None, params, (), weights).server.attention
  w = np.array([0.0, 1.0, 3.0, 2.0])
  xi = np.zeros((4, 4))
  for i in range(4):
    for j in (0, 2):
      if j != i:
        xi[i, j] = 0.5 * np.exp(-(w[i] - w[j]) ** 2 / 2.0) / 2.0
    xi[i, i] = 1.0 - xi[i].sum()
  np.testing.assert_allclose(attention, xi, rtol=1e-6)
  assert xi[0, 2] > 0 and xi[1, 3] == 0 and xi[3, 1] == 0
  message = algorithm.broadcast(fedamp.FedAmpServer(attention=attention), params)
  np.testing.assert_allclose(message.cloud_model["w"][:, 0], xi @ w, rtol=1e-6)
  # Every client uploaded: the same as attending to all (our default).
  every = algorithm.aggregate(None, params, (), jnp.ones(4)).server.attention
  np.testing.assert_allclose(every, fedamp.attention_matrix(params, config._replace(
      attention_from="all")), rtol=1e-6)
  # The default ignores who uploaded.
  default = fedamp.fedamp(config._replace(attention_from="all"), tiny_trainer(tiny_model()))
  np.testing.assert_allclose(default.aggregate(None, params, (), weights).server.attention,
                             every, rtol=1e-6)


def test_fedamp_cosine_attention_from_the_uploaders_only_by_hand():
  # Only client 1 uploaded: clients 0 and 2 attend to it alone (softmax over one: 1 - 0.4),
  # client 1 has no other uploader and keeps its own model.
  params = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])}
  config = fedamp.FedAmpConfig(attention="cosine", self_weight=0.4,
                               attention_from="uploaders")
  xi = fedamp.attention_matrix(params, config, uploaded=jnp.array([False, True, False]))
  np.testing.assert_allclose(xi, [[0.4, 0.6, 0.0], [0.0, 1.0, 0.0], [0.0, 0.6, 0.4]],
                             atol=1e-7)


def test_fedamp_rejects_an_unknown_attention_set():
  with pytest.raises(ConfigError, match="fedamp: attention_from"):
    fedamp.fedamp(fedamp.FedAmpConfig(attention_from="sampled"), tiny_trainer(tiny_model()))
