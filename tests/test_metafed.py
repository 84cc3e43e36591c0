"""MetaFed: the personalisation's lambda, the feature MSE and the client's loss by hand;
the stages and the ring's teachers; a client's copy, distillation and flag; one round of
the ring passing the models one hop; bad values refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import metafed
from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


@pytest.mark.parametrize("teacher,own,expected", [
    (0.9, 0.5, 1.0),                      # 5 * 0.4 = 2, capped at 1: 10 / 10
    (0.6, 0.6, 0.1),                      # a tie above the floor: 10^0 / 10
    (0.4, 0.6, 0.0),                      # worse and below 0.5: no distillation
    (0.55, 0.6, 10 ** -0.25 / 10),        # worse but above the floor
    (0.4, 0.3, 10 ** 0.5 / 10),           # better, though below the floor
])
def test_personal_lambda_by_hand(teacher, own, expected):
  np.testing.assert_allclose(metafed.personal_lambda(jnp.float32(teacher), jnp.float32(own),
                                                     2.0, 0.5), 2.0 * expected, rtol=1e-5)


def test_feature_mse_by_hand():
  z = jnp.array([[1.0, 2.0], [0.0, 0.0], [9.0, 9.0]])
  zt = jnp.array([[0.0, 0.0], [1.0, 3.0], [0.0, 0.0]])
  w = jnp.array([1.0, 1.0, 0.0])   # the third sample is padding
  # (1 + 4) / 2 and (1 + 9) / 2, averaged over the two real samples.
  np.testing.assert_allclose(metafed.feature_mse(z, zt, w), (2.5 + 5.0) / 2, rtol=1e-6)


def _identity_params(scale=1.0):
  return {"params": {"Dense_0": {"kernel": scale * jnp.eye(2), "bias": jnp.zeros(2)},
                     "Dense_1": {"kernel": jnp.eye(2), "bias": jnp.zeros(2)}}}


def test_client_loss_by_hand():
  # x = (1, 2) through identity layers: z = (1, 2), logits (1, 2), y = 1. The teacher's
  # first layer is 2 I: z_T = (2, 4), so the MSE is (1 + 4) / 2.
  model = tiny_model(num_classes=2, hidden=(2,))
  x, y, w = jnp.array([[1.0, 2.0], [5.0, 5.0]]), jnp.array([1, 0]), jnp.array([1.0, 0.0])
  ce = math.log1p(math.exp(-1.0))
  for lam in (0.0, 0.3):
    loss = metafed.metafed_loss(model.apply, "Dense_1", _identity_params(2.0),
                                jnp.float32(lam))
    np.testing.assert_allclose(loss(_identity_params(), x, y, w), ce + lam * 2.5, rtol=1e-6)


@pytest.mark.parametrize("warmup_epochs,epochs,rounds,expected", [
    (30, 5, 20, 6), (30, 5, 3, 1), (30, 5, 2, 0), (30, 5, 1, 0), (0, 5, 20, 0),
    (7, 2, 100, 4)])
def test_warmup_rounds(warmup_epochs, epochs, rounds, expected):
  config = metafed.MetaFedConfig(warmup_epochs=warmup_epochs, rounds=rounds)
  assert metafed.warmup_rounds(config, epochs) == expected


def _algorithm(lr=0.1, **fields):
  model = tiny_model(num_classes=3, hidden=(4,))
  trainer = tiny_trainer(model, lr=lr, epochs=2, batch_size=4)
  return model, trainer, metafed.metafed(metafed.MetaFedConfig(**fields), trainer)


def test_broadcast_teachers_and_stages():
  # rounds=5, a warm-up of 2 rounds (4 epochs at 2 a round): rounds 0-1 warm-up (the flags
  # set after round 1), 2-3 accumulation, 4 personalisation.
  _, _, algorithm = _algorithm(warmup_epochs=4, rounds=5)
  clients = metafed.MetaFedClient(model={"w": jnp.array([0.0, 1.0, 2.0])},
                                  flag=jnp.zeros(3, bool))
  expected = {0: (False, False, False), 1: (False, False, True), 2: (True, False, True),
              3: (True, False, True), 4: (True, True, False)}
  for round_number, (has_teacher, personal, update_flag) in expected.items():
    message = algorithm.broadcast(metafed.MetaFedServer(jnp.int32(round_number)), clients)
    teacher = [2.0, 2.0, 2.0] if personal else [2.0, 0.0, 1.0]   # the last / predecessor
    np.testing.assert_array_equal(message.teacher["w"], teacher)
    np.testing.assert_array_equal(message.has_teacher, [has_teacher] * 3)
    np.testing.assert_array_equal(message.personal, [personal] * 3)
    np.testing.assert_array_equal(message.update_flag, [update_flag] * 3)


def _splits(seed=1, n=8):
  rng = np.random.default_rng(seed)

  def split():
    return ClientData(rng.normal(size=(n, 4)).astype(np.float32),
                      rng.integers(0, 3, n).astype(np.int32), np.ones(n, bool), np.int32(n))
  return ClientSplits(split(), split(), split())


def _message(teacher, has_teacher, personal, update_flag):
  return metafed.MetaFedMessage(teacher, jnp.array(has_teacher), jnp.array(personal),
                                jnp.array(update_flag))


def test_client_copies_distils_or_trains_alone():
  model, trainer, algorithm = _algorithm(threshold=0.0, lam=0.7)
  own = model.init(jax.random.key(0), jnp.zeros((1, 4)))
  teacher = model.init(jax.random.key(1), jnp.zeros((1, 4)))
  data, key = _splits(), jax.random.key(2)
  head = "Dense_1"

  def trained(start, lam):
    return trainer.train(start, data.train, key,
                         loss_fn=metafed.metafed_loss(model.apply, head, teacher,
                                                      jnp.float32(lam)))[0]

  cases = (  # (flag, has_teacher): the start and the distillation weight
      ((False, False), (own, 0.0)), ((True, False), (own, 0.0)),   # warm-up: alone
      ((False, True), (teacher, 0.0)),                           # copy, then CE
      ((True, True), (own, 0.7)))                                # distil
  for (flag, has_teacher), (start, lam) in cases:
    out = algorithm.client_update(metafed.MetaFedClient(own, jnp.array(flag)),
                                  _message(teacher, has_teacher, False, False), data, key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 out.state.model, trained(start, lam))
    assert bool(out.state.flag) == flag   # no update asked
    np.testing.assert_allclose(out.metrics["copied"], float(has_teacher and not flag))


def test_personalisation_lambda_and_flag_update():
  model, trainer, algorithm = _algorithm(threshold=0.0, lam=0.7, personal_threshold=0.5)
  own = model.init(jax.random.key(0), jnp.zeros((1, 4)))
  teacher = model.init(jax.random.key(1), jnp.zeros((1, 4)))
  data, key = _splits(), jax.random.key(2)
  out = algorithm.client_update(metafed.MetaFedClient(own, jnp.array(True)),
                                _message(teacher, True, True, False), data, key)
  lam = metafed.personal_lambda(trainer.evaluate(teacher, data.val).score,
                                trainer.evaluate(own, data.val).score, 0.7, 0.5)
  np.testing.assert_allclose(out.metrics["distil_lambda"], lam, rtol=1e-6)
  # The flag: set from the trained model's validation accuracy > threshold, when asked.
  for threshold in (0.0, 1.0):
    _, trainer, algorithm = _algorithm(threshold=threshold)
    out = algorithm.client_update(metafed.MetaFedClient(own, jnp.array(False)),
                                  _message(teacher, False, False, True), data, key)
    passed = float(trainer.evaluate(out.state.model, data.val).score) > threshold
    assert bool(out.state.flag) == passed


def test_one_round_hands_each_model_one_hop_round_the_ring():
  # lr 0: training moves nothing, so after an accumulation round of copies (no flag set:
  # threshold 1) client i holds client i-1's model; the server counts the round.
  model, _, algorithm = _algorithm(lr=0.0, warmup_epochs=0, threshold=1.0, rounds=3)
  one = model.init(jax.random.key(0), jnp.zeros((1, 4)))
  params = jax.tree.map(lambda a: jnp.stack([a, a + 1.0, a + 2.0]), one)
  state = algorithm.init(InitContext(params=params, data=None, trainer=None,
                                     key=jax.random.key(0)))
  data = jax.tree.map(lambda *a: np.stack(a), *(_splits(seed) for seed in range(3)))
  message = algorithm.broadcast(state.server, state.clients)
  out = jax.vmap(algorithm.client_update)(state.clients, message, data,
                                          jax.random.split(jax.random.key(3), 3))
  new = algorithm.aggregate(state.server, out.state, out.upload, jnp.ones(3))
  expected = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), params)
  jax.tree.map(np.testing.assert_array_equal, new.clients.model, expected)
  assert int(new.server.round) == 1
  np.testing.assert_array_equal(new.clients.flag, [False] * 3)
  jax.tree.map(np.testing.assert_array_equal,
               algorithm.personalized_params(new.server, new.clients), expected)
  assert tree.leading_size(new.clients.model) == 3


@pytest.mark.parametrize("field,value", [("lam", -1.0), ("lam", float("nan")),
                                         ("threshold", 1.5), ("personal_threshold", -0.1),
                                         ("warmup_epochs", -1), ("rounds", 0)])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"metafed: {field}"):
    metafed.metafed(metafed.MetaFedConfig()._replace(**{field: value}),
                    tiny_trainer(tiny_model(), epochs=2))


def test_one_client_is_refused():
  model, _, algorithm = _algorithm()
  params = jax.tree.map(lambda a: a[None], model.init(jax.random.key(0), jnp.zeros((1, 4))))
  with pytest.raises(ConfigError, match="at least 2 clients"):
    algorithm.init(InitContext(params=params, data=None, trainer=None,
                               key=jax.random.key(0)))
