"""FedKD: the energy schedule, the rank kept at an energy threshold (both rules, on
matrices and PFLlib's conv filters), a client's step on the adaptive mutual distillation
loss with its compressed upload, and the server's compressed mean in both forms, against
hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax.algorithms import fedkd
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _orthonormal(rows, cols, seed):
  return np.linalg.qr(np.random.default_rng(seed).normal(size=(rows, cols)))[0]


def test_the_energy_rises_from_t_start_by_round():
  config = fedkd.FedKdConfig(t_start=0.9, t_end=0.98, rounds=4)
  # Round 1 of 4: the authors' (1 + 1) / 4 of the way, PFLlib's 1 / 4.
  np.testing.assert_allclose(fedkd.energy_at(config, jnp.array(1)), 0.9 + 0.5 * 0.08)
  np.testing.assert_allclose(
      fedkd.energy_at(config._replace(energy_round="current"), jnp.array(1)), 0.92)
  np.testing.assert_allclose(fedkd.energy_at(config, jnp.array(3)), 0.98)


@pytest.mark.parametrize("energy,reach,codes", [(0.5, 1, 1), (0.9, 2, 2), (0.95, 3, 0),
                                                (1.0, 3, 0)])
def test_the_rank_kept_at_an_energy(energy, reach, codes):
  # Singular values 3, 2, 1: squares 9, 4, 1 of 14; the sums of the first 1, 2, 3 are 9,
  # 13, 14 (reach: the first >= T 14) and of the first 0, 1, 2 are 0, 9, 13 (codes: the
  # first > T 14, else 0).
  squares = jnp.array([9.0, 4.0, 1.0])
  assert int(fedkd.kept_rank(squares, energy, "reach")) == reach
  assert int(fedkd.kept_rank(squares, energy, "codes")) == codes
  # A 6 x 3 matrix of exactly these three (a fourth, zero, would let the codes keep 3).
  u, v, s = _orthonormal(6, 3, 0), _orthonormal(3, 3, 1), np.array([3.0, 2.0, 1.0])
  matrix = jnp.asarray((u * s) @ v.T, jnp.float32)
  for rule, rank in (("reach", reach), ("codes", codes)):
    np.testing.assert_allclose(fedkd.truncated(matrix, energy, rule),
                               (u[:, :rank] * s[:rank]) @ v[:, :rank].T, atol=1e-5)
  np.testing.assert_array_equal(fedkd.truncated(jnp.zeros((3, 2)), 0.5), np.zeros((3, 2)))


@pytest.mark.parametrize("energy,rule,rank", [(0.9, "codes", 1), (0.9, "reach", 1),
                                              (0.95, "reach", 2), (0.95, "codes", 0)])
def test_pfllib_conv_filters_share_one_rank(energy, rule, rank):
  # Two 2 x 2 filters (in 1, out 2) with singular values (3, 1) and (2, 0): the squares
  # summed by position are 13 and 1 of 14, so T 0.9 keeps one triplet of each filter.
  values = [np.array([3.0, 1.0]), np.array([2.0, 0.0])]
  bases = [(_orthonormal(2, 2, 2 * i), _orthonormal(2, 2, 2 * i + 1)) for i in range(2)]
  filters = [(u * s) @ v.T for (u, v), s in zip(bases, values)]
  kernel = jnp.asarray(np.stack(filters, axis=-1)[:, :, None, :], jnp.float32)  # [2,2,1,2]
  config = fedkd.FedKdConfig(conv_svd="spatial", rank_rule=rule)
  got = fedkd.compressed({"kernel": kernel, "bias": jnp.ones(2)}, energy, config)
  for o, ((u, v), s) in enumerate(zip(bases, values)):
    np.testing.assert_allclose(got["kernel"][:, :, 0, o],
                               (u[:, :rank] * s[:rank]) @ v[:, :rank].T, atol=1e-5)
  np.testing.assert_array_equal(got["bias"], np.ones(2))


def _client_step(config):
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  algorithm = fedkd.fedkd(config, tiny_trainer(model, lr=LR, batch_size=8))  # one batch
  mentor, mentee = init_params(model, seed=0), init_params(model, seed=1)
  projection = jnp.asarray(np.random.default_rng(2).normal(size=(5, 5)) / 3, jnp.float32)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(fedkd.KdClient(mentor=mentor, projection=projection),
                                fedkd.KdServer(mentee=mentee, round=jnp.array(0)), splits,
                                jax.random.key(0))
  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)

  def features(p):
    layer = p["params"]["Dense_0"]
    return jax.nn.relu(x @ layer["kernel"] + layer["bias"])

  def kl(p_logits, q_logits):   # KL(softmax(p) || softmax(q)), a mean over the batch
    p = jax.nn.softmax(p_logits)
    return jnp.mean(jnp.sum(p * (jnp.log(p) - jax.nn.log_softmax(q_logits)), axis=-1))

  def loss(t, s, w):
    out_t, out_s = model.apply(t, x), model.apply(s, x)
    ce = optax.softmax_cross_entropy_with_integer_labels
    task = ce(out_t, y).mean() + ce(out_s, y).mean()
    hidden = jnp.mean((features(t) - features(s) @ w) ** 2)
    return task + (kl(out_s, out_t) + kl(out_t, out_s) + 2 * hidden) / task
  grads = jax.grad(loss, argnums=(0, 1, 2))(mentor, mentee, projection)
  step = lambda p, g: jax.tree.map(lambda a, b: a - LR * b, p, g)
  chex.assert_trees_all_close(out.state.mentor, step(mentor, grads[0]), atol=1e-6)
  chex.assert_trees_all_close(out.state.projection, step(projection, grads[2]), atol=1e-6)
  return out, mentee, step(mentee, grads[1])


def test_a_client_step_uploads_its_mentees_change():
  # Energy 1 under the reach rule keeps every rank: the change itself.
  out, mentee, trained = _client_step(fedkd.FedKdConfig(t_start=1.0, t_end=1.0))
  chex.assert_trees_all_close(out.upload, jax.tree.map(jnp.subtract, trained, mentee),
                              atol=1e-6)


def test_pfllibs_client_step_uploads_its_mentee_compressed():
  # PFLlib's form at energy 1: no rank below the full one passes, so every kernel of
  # more than one output goes as zero; the biases whole.
  config = fedkd.FedKdConfig(t_start=1.0, t_end=1.0, compress="parameters",
                             rank_rule="codes", energy_round="current")
  out, _, trained = _client_step(config)
  for layer, (fan_in, fan_out) in (("Dense_0", (4, 5)), ("Dense_1", (5, 3))):
    np.testing.assert_allclose(out.upload["params"][layer]["kernel"],
                               np.zeros((fan_in, fan_out)), atol=1e-6)
    np.testing.assert_allclose(out.upload["params"][layer]["bias"],
                               trained["params"][layer]["bias"], atol=1e-6)


@pytest.mark.parametrize("compress", ["updates", "parameters"])
def test_the_server_sends_its_compressed_mean(compress):
  config = fedkd.FedKdConfig(compress=compress, t_start=0.5, t_end=0.9, rounds=4)
  algorithm = fedkd.fedkd(config, tiny_trainer(tiny_model()))
  rng = np.random.default_rng(3)
  uploads = {"k": jnp.asarray(rng.normal(size=(3, 6, 4)), jnp.float32),
             "b": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
  old = {"k": jnp.ones((6, 4)), "b": jnp.ones(4)}
  server = fedkd.KdServer(mentee=old, round=jnp.array(1))
  new = algorithm.aggregate(server, None, uploads, jnp.array([5.0, 0.0, 1.0])).server
  mean = jax.tree.map(lambda u: (np.asarray(u[0]) + np.asarray(u[2])) / 2, uploads)
  energy = 0.5 + (1 + 1) / 4 * 0.4                      # round 1 of 4: 0.7
  u, s, vt = np.linalg.svd(mean["k"], full_matrices=False)
  rank = int(np.argmax(np.cumsum(s ** 2) >= energy * np.sum(s ** 2))) + 1
  sent = {"k": (u[:, :rank] * s[:rank]) @ vt[:rank], "b": mean["b"]}
  if compress == "updates":
    sent = jax.tree.map(np.add, old, sent)
  chex.assert_trees_all_close(new.mentee, sent, atol=1e-5)
  assert int(new.round) == 2


@pytest.mark.parametrize("field,value", [("t_start", 0.0), ("t_end", 1.5), ("rounds", 0),
                                         ("compress", "gradients"), ("clip_norm", -1.0),
                                         ("kl_reduction", "sum"), ("server_mean", "median"),
                                         ("energy_round", "last"), ("rank_rule", "any"),
                                         ("conv_svd", "tucker")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedkd: {field}"):
    fedkd.fedkd(fedkd.FedKdConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
