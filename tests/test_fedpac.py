"""FedPAC: the feature statistics, the alignment loss, the classifier-combination QP against
closed-form solutions, the two-stage client step and the server step, all by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedpac
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1
weights_of = jax.jit(fedpac.combination_weights, static_argnums=(3, 4))


def test_statistics_match_the_authors_formula_and_ignore_padding():
  z = jnp.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [100.0, 100.0]])
  y = jnp.array([0, 0, 1, 1])
  weights = jnp.array([1.0, 1.0, 1.0, 0.0])          # the last sample is padding
  sums = fedpac.feature_sums(z, y, weights, num_classes=3)
  variance, bias = fedpac.statistics(sums)
  np.testing.assert_allclose(sums.counts, [2, 1, 0])
  np.testing.assert_allclose(bias, [[4 / 3, 0], [0, 2 / 3], [0, 0]], rtol=1e-6)
  # statistics_extraction: sum_k p_k tr(F_k^T F_k / n_k) - p_k^2 ||mu_k||^2, then / n.
  classes = [np.array([[1.0, 0.0], [3.0, 0.0]]), np.array([[0.0, 2.0]])]
  p = np.array([2 / 3, 1 / 3])
  v = sum(p[k] * np.trace(f.T @ f / len(f)) - p[k] ** 2 * np.sum(f.mean(0) ** 2)
          for k, f in enumerate(classes)) / 3
  np.testing.assert_allclose(variance, v, rtol=1e-6)
  np.testing.assert_allclose(variance, 22 / 27, rtol=1e-6)
  np.testing.assert_allclose(fedpac.class_means(sums), [[2, 0], [0, 2], [0, 0]])


def test_alignment_loss_is_the_mse_to_the_class_targets():
  z = jnp.array([[1.0, 2.0], [0.0, 1.0], [9.0, 9.0]])
  y = jnp.array([1, 0, 0])
  targets = jnp.array([[0.0, 0.0], [1.0, 0.0]])
  loss = fedpac.alignment_loss(z, y, jnp.array([1.0, 1.0, 0.0]), targets)
  np.testing.assert_allclose(loss, (4.0 + 1.0) / (2 * 2))


def test_simplex_projection():
  np.testing.assert_allclose(
      fedpac.project_to_simplex(jnp.array([0.5, 0.4, 9.0]), jnp.array([True, True, False])),
      [0.55, 0.45, 0.0], rtol=1e-6)
  np.testing.assert_allclose(
      fedpac.project_to_simplex(jnp.array([2.0, 0.0, 0.1]), jnp.ones(3, bool)), [1, 0, 0])


def test_combination_weights_two_clients_closed_form():
  # 1-d statistics h = (0, 1), V = (1, 1): client 0 minimises a0^2 + a1^2 + a1^2 on
  # a0 + a1 = 1, so a = (2/3, 1/3); client 1 symmetrically (1/3, 2/3). A third client
  # outside the round gets no weight.
  bias = jnp.array([0.0, 1.0, 5.0]).reshape(3, 1, 1)
  variance = jnp.array([1.0, 1.0, 0.1])
  alpha = weights_of(variance, bias, jnp.array([True, True, False]), 500)
  np.testing.assert_allclose(alpha[:2], [[2 / 3, 1 / 3, 0], [1 / 3, 2 / 3, 0]], atol=1e-5)


def test_combination_weights_with_an_active_bound():
  # h = (0, 1, 2), V = (1, .01, .01). Client 0: a0^2 + .01 a1^2 + .01 a2^2 + (a1 + 2 a2)^2;
  # without a >= 0 it would take a2 < 0. With a2 = 0: a0^2 + 1.01 a1^2 on a0 + a1 = 1,
  # a = (1.01, 1, 0) / 2.01; KKT holds (d/da2 = 4 a1 > d/da0 = 2 a0).
  bias = jnp.array([0.0, 1.0, 2.0]).reshape(3, 1, 1)
  variance = jnp.array([1.0, 0.01, 0.01])
  alpha = weights_of(variance, bias, jnp.ones(3, bool), 500)
  np.testing.assert_allclose(alpha[0], [1.01 / 2.01, 1 / 2.01, 0.0], atol=1e-4)
  # Weights under min_weight are dropped and the rest renormalised (authors' eps).
  tiny = weights_of(jnp.array([1.0, 1.0]), jnp.array([0.0, 30.0]).reshape(2, 1, 1),
                    jnp.ones(2, bool), 500, 1e-2)
  np.testing.assert_allclose(tiny[0], [1.0, 0.0])     # unclipped: (901, 1) / 902
  # PFLlib's add_heads uses them as zeroed, summing below 1 (renormalize=False).
  kept = jax.jit(fedpac.combination_weights, static_argnums=(3, 4, 5))(
      jnp.array([1.0, 1.0]), jnp.array([0.0, 30.0]).reshape(2, 1, 1), jnp.ones(2, bool),
      2000, 1e-2, False)
  np.testing.assert_allclose(kept[0], [901 / 902, 0.0], rtol=1e-5)


def test_global_prototypes_by_class_counts_or_by_clients():
  # Client 0 holds one sample of class 0 (feature 2); client 1 two of class 0 (features
  # summing to 6, mean 3) and three of class 1 (sum 9, mean 3); client 2 sat out.
  counts = jnp.array([[1.0, 0.0], [2.0, 3.0], [5.0, 5.0]])
  sums = jnp.array([[[2.0], [0.0]], [[6.0], [9.0]], [[50.0], [50.0]]])
  members = jnp.array([True, True, False])
  protos, has = fedpac.global_prototypes(counts, sums, members, "counts")
  np.testing.assert_allclose(protos, [[8 / 3], [3.0]], rtol=1e-6)   # (2 + 6) / (1 + 2)
  np.testing.assert_array_equal(has, [True, True])
  protos, has = fedpac.global_prototypes(counts, sums, members, "clients")
  np.testing.assert_allclose(protos, [[2.5], [3.0]], rtol=1e-6)     # (2 + 3) / 2; 3 / 1
  # A class no member holds: no prototype, zeros.
  protos, has = fedpac.global_prototypes(counts, sums, jnp.array([True, False, False]),
                                         "clients")
  np.testing.assert_allclose(protos, [[2.0], [0.0]])
  np.testing.assert_array_equal(has, [True, False])


def test_alignment_loss_leaves_unknown_classes_unpulled_but_counted():
  # PFLlib's clientpac: a sample whose class has no global prototype is its own target.
  z = jnp.array([[1.0, 2.0], [0.0, 1.0]])
  y = jnp.array([1, 0])
  targets = jnp.array([[0.0, 0.0], [1.0, 0.0]])
  known = jnp.array([False, True])
  loss_of = lambda f: fedpac.alignment_loss(f, y, jnp.ones(2), targets, known)
  np.testing.assert_allclose(loss_of(z), 4.0 / (2 * 2))   # sample 0 only, over 2 x 2
  np.testing.assert_allclose(jax.grad(loss_of)(z), [[0.0, 4.0 / 4], [0.0, 0.0]])


def _features(params, x):
  layer = params["params"]["Dense_0"]
  return jax.nn.relu(x @ layer["kernel"] + layer["bias"])


def _ce(params, x, y):
  logits = _features(params, x) @ params["params"]["Dense_1"]["kernel"] \
      + params["params"]["Dense_1"]["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# missing_proto="own" (PFLlib's): class 1, which has no global prototype, is not pulled.
@pytest.mark.parametrize("missing_proto", ["local_mean", "own"])
def test_client_step_trains_the_head_then_the_body_towards_the_prototypes(missing_proto):
  data, clients = tiny_data([6], num_classes=3)
  model = tiny_model()                               # body Dense_0 (5 ReLU), head Dense_1
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)   # one full batch an epoch
  lam = 0.7
  algorithm = fedpac.fedpac(fedpac.FedPacConfig(lam=lam, head_epochs=1,
                                                missing_proto=missing_proto), trainer)
  params = init_params(model)
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)
  protos = jnp.arange(15.0).reshape(3, 5) / 10.0
  has_proto = jnp.array([True, False, True])         # class 1: the local prototype
  server = fedpac.FedPacServer(body={"params": {"Dense_0": params["params"]["Dense_0"]}},
                               protos=protos, has_proto=has_proto, combination=())
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  head = {"params": {"Dense_1": params["params"]["Dense_1"]}}
  out = jax.jit(algorithm.client_update)(head, server, splits, jax.random.key(0))

  z0 = _features(params, x)
  counts = np.bincount(np.asarray(y), minlength=3)
  means = np.stack([np.asarray(z0)[np.asarray(y) == k].mean(0) if counts[k] else np.zeros(5)
                    for k in range(3)])
  targets = jnp.where(has_proto[:, None], protos, means)
  # Epoch 1: the head alone on CE. Epoch 2: the body alone on CE + lam MSE(z, c_y).
  g = jax.grad(_ce)(params, x, y)
  p1 = {"params": {"Dense_0": params["params"]["Dense_0"], "Dense_1": jax.tree.map(
      lambda a, b: a - LR * b, params["params"]["Dense_1"], g["params"]["Dense_1"])}}
  pulled = (has_proto[y] if missing_proto == "own" else jnp.ones_like(y, bool))[:, None]
  assert missing_proto != "own" or 0 < int(pulled.sum()) < len(y)  # both kinds of sample
  body_loss = lambda p: _ce(p, x, y) + lam * jnp.mean(  # the mean over every sample
      jnp.where(pulled, jnp.square(_features(p, x) - targets[y]), 0.0))
  g = jax.grad(body_loss)(p1)
  p2 = {"params": {"Dense_0": jax.tree.map(lambda a, b: a - LR * b, p1["params"]["Dense_0"],
                                           g["params"]["Dense_0"]),
                   "Dense_1": p1["params"]["Dense_1"]}}
  chex.assert_trees_all_close(out.upload.head["params"], {"Dense_1": p2["params"]["Dense_1"]},
                              atol=1e-6)
  chex.assert_trees_all_close(out.upload.body["params"], {"Dense_0": p2["params"]["Dense_0"]},
                              atol=1e-6)
  # Statistics of the received body; prototype sums of the trained one.
  np.testing.assert_allclose(out.upload.bias, means * counts[:, None] / 6, atol=1e-6)
  np.testing.assert_allclose(out.upload.counts, counts)
  z2 = np.asarray(_features(p2, x))
  np.testing.assert_allclose(out.upload.proto_sums,
                             np.stack([z2[np.asarray(y) == k].sum(0) for k in range(3)]),
                             atol=1e-5)


def test_server_step_averages_sampled_clients_and_mixes_their_heads():
  trainer = tiny_trainer(tiny_model(), epochs=2)
  algorithm = fedpac.fedpac(fedpac.FedPacConfig(), trainer)
  head = lambda values: {"params": {"Dense_1": {"bias": jnp.asarray(values)[:, None]
                                               * jnp.ones((3, 2))}}}
  uploads = fedpac.FedPacUpload(
      body={"params": {"Dense_0": {"kernel": jnp.array([1.0, 2.0, 7.0])[:, None, None]
                                   * jnp.ones((3, 4, 5))}}},
      head=head([1.0, 3.0, 0.0]),
      proto_sums=jnp.array([[[2.0], [0.0]], [[6.0], [9.0]], [[0.0], [0.0]]]),
      counts=jnp.array([[1.0, 0.0], [2.0, 3.0], [0.0, 0.0]]),
      variance=jnp.array([1.0, 1.0, 0.0]),
      bias=jnp.array([0.0, 1.0, 0.0]).reshape(3, 1, 1))
  old_heads = head([10.0, 20.0, 30.0])
  weights = jnp.array([1.0, 3.0, 0.0])               # client 2 sat the round out
  state = algorithm.aggregate(None, old_heads, uploads, weights)
  np.testing.assert_allclose(state.server.body["params"]["Dense_0"]["kernel"],
                             np.full((4, 5), 1.75))
  np.testing.assert_allclose(state.server.protos, [[8 / 3], [3.0]])
  np.testing.assert_array_equal(state.server.has_proto, [True, True])
  np.testing.assert_allclose(state.server.combination,
                             [[2 / 3, 1 / 3, 0], [1 / 3, 2 / 3, 0], [0, 0, 0]], atol=1e-5)
  # Heads: alpha = (2/3, 1/3) and (1/3, 2/3) (see the closed-form test); client 2 keeps its.
  np.testing.assert_allclose(state.clients["params"]["Dense_1"]["bias"][:, 0],
                             [2 / 3 + 1, 1 / 3 + 2, 30.0], atol=1e-4)


@pytest.mark.parametrize("config, message", [
    (fedpac.FedPacConfig(head_epochs=2), "fedpac: head_epochs"),
    (fedpac.FedPacConfig(lam=-1.0), "fedpac: lam"),
    (fedpac.FedPacConfig(min_weight=1.0), "fedpac: min_weight"),
    (fedpac.FedPacConfig(phase_optimizer="each"), "fedpac: phase_optimizer"),
    (fedpac.FedPacConfig(proto_mean="uniform"), "fedpac: proto_mean"),
    (fedpac.FedPacConfig(missing_proto="none"), "fedpac: missing_proto"),
])
def test_bad_config_is_one_line_error(config, message):
  with pytest.raises(ConfigError, match=message):
    fedpac.fedpac(config, tiny_trainer(tiny_model(), epochs=2))
