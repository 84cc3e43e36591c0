"""FedFomo's first-order weights, its federated update, sampling and affinity, by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.algorithms import fedfomo
from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import ClientData
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def _stack(models):
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *models)


def test_first_order_weights_by_hand():
  # Raw: max(0, (1 - 0.5) / 2) = 0.25, worse model 0, (1 - 0.8) / 0.5 = 0.4, zero distance 0.
  weights = fedfomo.first_order_weights(jnp.float32(1.0), jnp.array([0.5, 1.5, 0.8, 0.1]),
                                        jnp.array([2.0, 1.0, 0.5, 0.0]))
  np.testing.assert_allclose(weights, [0.25 / 0.65, 0.0, 0.4 / 0.65, 0.0], rtol=1e-6)
  no_help = fedfomo.first_order_weights(jnp.float32(1.0), jnp.array([1.2, 3.0]),
                                        jnp.array([1.0, 1.0]))
  np.testing.assert_array_equal(no_help, [0.0, 0.0])


def test_client_update_mixes_in_better_models_then_trains():
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch SGD step
  algorithm = fedfomo.fedfomo(fedfomo.FedFomoConfig(num_models=3), trainer)
  own = init_params(model, seed=0)
  others = [init_params(model, seed=s) for s in (1, 2, 3)]
  client = clients[0]

  def val_loss(p):
    return float(mean_ce(model, p, client.x_val, client.y_val))

  def distance(a, b):
    return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in
                             zip(jax.tree.leaves(a), jax.tree.leaves(b)))))
  raw = np.array([max(0.0, (val_loss(own) - val_loss(o)) / distance(o, own)) for o in others])
  assert raw.sum() > 0, "the case must have a model that helps"
  expected_weights = raw / raw.sum()

  message = fedfomo.FomoMessage(models=_stack(others), ids=jnp.array([1, 2, 4], jnp.int32))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(own, message, splits, jax.random.key(0))

  np.testing.assert_allclose(out.upload.weights, expected_weights, rtol=1e-4, atol=1e-7)
  np.testing.assert_array_equal(out.upload.ids, [1, 2, 4])
  mixed = jax.tree.map(
      lambda p, *os: p + sum(w * (o - p) for w, o in zip(expected_weights, os)), own, *others)
  grads = jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(mixed)
  chex.assert_trees_all_close(out.state, jax.tree.map(lambda p, g: p - lr * g, mixed, grads),
                              atol=1e-5)


def test_selection_is_greedy_by_affinity_or_random_never_self():
  affinity = jnp.array([[9.0, 1.0, 5.0, 3.0],
                        [0.0, 0.0, 2.0, 7.0],
                        [4.0, 6.0, 9.0, 0.0],
                        [1.0, 8.0, 8.5, 0.0]])
  greedy = fedfomo.select_models(affinity, jax.random.key(0), 2, jnp.float32(0.0))
  np.testing.assert_array_equal(greedy, [[2, 3], [3, 2], [1, 0], [2, 1]])
  for seed in range(5):
    explored = np.asarray(fedfomo.select_models(affinity, jax.random.key(seed), 3,
                                                jnp.float32(1.0)))
    for client, row in enumerate(explored):
      assert client not in row and len(set(row)) == 3


def test_broadcast_sends_m_models_and_aggregate_accumulates_affinity():
  trainer = tiny_trainer(tiny_model())
  algorithm = fedfomo.fedfomo(fedfomo.FedFomoConfig(num_models=2, epsilon=0.0), trainer)
  server = fedfomo.FedFomoServer(affinity=jnp.array([[0.0, 3.0, 1.0],
                                                     [2.0, 0.0, 1.0],
                                                     [1.0, 5.0, 0.0]]),
                                 round=jnp.int32(4), key=fedfomo.raw_key(jax.random.key(0)))
  params = {"w": jnp.array([[10.0], [20.0], [30.0]])}
  message = algorithm.broadcast(server, params)
  np.testing.assert_array_equal(message.ids, [[1, 2], [0, 2], [1, 0]])
  np.testing.assert_allclose(message.models["w"][..., 0], [[20, 30], [10, 30], [20, 10]])

  uploads = fedfomo.FomoUpload(ids=message.ids,
                               weights=jnp.array([[0.5, 0.5], [1.0, 0.0], [0.0, 0.0]]))
  state = algorithm.aggregate(server, params, uploads, jnp.ones(3))
  np.testing.assert_allclose(state.server.affinity, [[0.0, 3.5, 1.5],
                                                     [3.0, 0.0, 1.0],
                                                     [1.0, 5.0, 0.0]])
  assert int(state.server.round) == 5


def test_pfllib_weights_signed_with_distance_eps_by_hand():
  # (1 - 0.5) / (2 + 0.5) = 0.2, (1 - 1.5) / (1 + 0.5) = -1/3; the normalised keep 0.2 alone.
  raw = fedfomo.signed_weights(jnp.float32(1.0), jnp.array([0.5, 1.5]), jnp.array([2.0, 1.0]),
                               distance_eps=0.5)
  np.testing.assert_allclose(raw, [0.2, -1.0 / 3.0], rtol=1e-6)
  np.testing.assert_allclose(fedfomo.normalized_weights(raw), [1.0, 0.0])


def test_candidates_self_starts_from_identity_and_ranks_self():
  trainer = tiny_trainer(tiny_model())
  config = fedfomo.FedFomoConfig(num_models=2, epsilon=0.0, candidates="self")
  algorithm = fedfomo.fedfomo(config, trainer)
  server = fedfomo.FedFomoServer(affinity=jnp.eye(3) + jnp.array([[0.0, 0.0, 0.5],
                                                                  [2.0, 0.0, 0.0],
                                                                  [0.0, 0.0, 0.0]]),
                                 round=jnp.int32(0), key=fedfomo.raw_key(jax.random.key(0)))
  ids = np.asarray(algorithm.broadcast(server, {"w": jnp.zeros((3, 1))}).ids)
  np.testing.assert_array_equal(ids[:2], [[0, 2], [0, 1]])  # row 1: 2.0 beats its own 1.0
  assert ids[2, 0] == 2
  data, _ = tiny_data([6, 6, 6])
  state = algorithm.init(InitContext(params={"w": jnp.zeros((3, 1))}, data=data,
                                     trainer=trainer, key=jax.random.key(0)))
  np.testing.assert_array_equal(state.server.affinity, np.eye(3))


def test_train_tail_validates_on_the_last_fifth():
  data = ClientData(x=jnp.zeros((12, 1)), y=jnp.zeros(12, jnp.int32),
                    mask=jnp.arange(12) < 11, n=jnp.int32(11))
  train, val = fedfomo.train_tail(data)  # int(0.2 * 11) = 2 held out: samples 9 and 10
  np.testing.assert_array_equal(train.mask, np.arange(12) < 9)
  np.testing.assert_array_equal(val.mask, (np.arange(12) >= 9) & (np.arange(12) < 11))
  assert int(train.n) == 9 and int(val.n) == 2


def test_pfllib_form_client_update_by_hand():
  """baseline=previous, validation=train_tail, affinity_update=raw, distance_eps: the
  losses and distances from the model the last training started from, the validation
  the training data's last fifth, the raw weights uploaded, the mixture trained on the
  rest."""
  data, clients = tiny_data([10, 10, 10])
  model = tiny_model()
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch SGD step on 8
  config = fedfomo.FedFomoConfig(num_models=2, candidates="self", baseline="previous",
                                 validation="train_tail", affinity_update="raw",
                                 distance_eps=1e-3)
  algorithm = fedfomo.fedfomo(config, trainer)
  own, previous, other = (init_params(model, seed=s) for s in (0, 1, 2))
  client = clients[0]
  x_val, y_val = client.x_train[8:], client.y_train[8:]

  def distance(a, b):
    return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in
                             zip(jax.tree.leaves(a), jax.tree.leaves(b)))))
  base_loss = float(mean_ce(model, previous, x_val, y_val))
  raw = np.array([(base_loss - float(mean_ce(model, m, x_val, y_val)))
                  / (distance(m, previous) + 1e-3) for m in (own, other)])
  assert (raw > 0).any(), "the case must have a model that helps"
  positive = np.maximum(raw, 0.0)
  weights = positive / positive.sum()

  message = fedfomo.FomoMessage(models=_stack([own, other]), ids=jnp.array([0, 2], jnp.int32))
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(fedfomo.FomoClient(params=own, previous=previous), message,
                                splits, jax.random.key(0))
  np.testing.assert_allclose(out.upload.weights, raw, rtol=1e-4, atol=1e-7)
  mixed = jax.tree.map(lambda a, b: weights[0] * a + weights[1] * b, own, other)
  chex.assert_trees_all_close(out.state.previous, mixed, atol=1e-5)
  grads = jax.grad(lambda p: mean_ce(model, p, client.x_train[:8], client.y_train[:8]))(mixed)
  chex.assert_trees_all_close(out.state.params,
                              jax.tree.map(lambda p, g: p - lr * g, mixed, grads), atol=1e-5)
  assert algorithm.personalized_params(None, out.state) is out.state.params


def test_pick_slots_pops_the_next_unchosen_of_either_order_by_hand():
  # Client 1 is no candidate (sorted last in both orders); 3 slots of 4 may be filled.
  # Slot 0 exploits: 2; slot 1 explores: 0; slot 2 explores: 2 is taken, so 3; slot 3
  # is past the count: -1.
  ids = fedfomo.pick_slots(jnp.array([2, 0, 3, 1]), jnp.array([0, 2, 3, 1]),
                           jnp.array([False, True, True, False]),
                           jnp.array([True, False, True, True]), jnp.int32(3))
  np.testing.assert_array_equal(ids, [2, 0, 3, -1])
  # Every slot exploring takes the random order; exploiting, the greedy order.
  for explore, expected in ((True, [0, 3, 2]), (False, [2, 0, 3])):
    ids = fedfomo.pick_slots(jnp.array([2, 0, 3, 1]), jnp.array([0, 3, 2, 1]),
                             jnp.full(3, explore), jnp.array([True, False, True, True]),
                             jnp.int32(3))
    np.testing.assert_array_equal(ids, expected)


def test_per_slot_sampling_mixes_top_and_random_within_a_client():
  affinity = jnp.array([[0.0, 4.0, 3.0, 2.0, 1.0],
                        [4.0, 0.0, 3.0, 2.0, 1.0],
                        [4.0, 3.0, 0.0, 2.0, 1.0],
                        [4.0, 3.0, 2.0, 0.0, 1.0],
                        [4.0, 3.0, 2.0, 1.0, 0.0]])
  greedy = np.asarray(fedfomo.select_models(affinity, jax.random.key(0), 3, jnp.float32(0.0)))
  mixed = {"client": 0, "slot": 0}
  for seed in range(40):
    key = jax.random.key(seed)
    for sampling in mixed:
      ids = np.asarray(fedfomo.select_models(affinity, key, 3, jnp.float32(0.5),
                                             per_slot=sampling == "slot"))
      for client, row in enumerate(ids):
        assert client not in row and len(set(row)) == 3
      # A row that keeps the greedy head but leaves the greedy tail took both kinds.
      mixed[sampling] += int(np.sum((ids[:, 0] == greedy[:, 0])
                                    & np.any(ids != greedy, axis=1)))
  assert mixed["slot"] > 10, mixed
  # One draw a client: a row is the greedy one or a random one; a random one starts
  # with the greedy head only by chance (1 in 4), and then has 2 more to match.
  assert mixed["client"] < mixed["slot"], mixed
  np.testing.assert_array_equal(
      fedfomo.select_models(affinity, jax.random.key(3), 3, jnp.float32(0.0), per_slot=True),
      greedy)


def test_pools_of_last_rounds_uploaders_by_hand():
  trainer = tiny_trainer(tiny_model())
  affinity = jnp.array([[0.0, 9.0, 1.0, 5.0],
                        [3.0, 0.0, 2.0, 1.0],
                        [1.0, 8.0, 0.0, 7.0],
                        [6.0, 9.0, 2.0, 0.0]])
  params = {"w": jnp.array([[10.0], [20.0], [30.0], [40.0]])}
  server = fedfomo.FedFomoServer(affinity=affinity, round=jnp.int32(1),
                                 key=fedfomo.raw_key(jax.random.key(0)),
                                 uploaded=jnp.array([True, False, True, False]))
  expected = {  # candidates 0 and 2 only (the official code): one each for 0 and 2
      "uploaders": [[2, -1], [0, 2], [0, -1], [0, 2]],
      # any client, as many as last round's uploaders (PFLlib): 2 of the top
      "uploader_count": [[1, 3], [0, 2], [1, 3], [1, 0]],
      "all": [[1, 3], [0, 2], [1, 3], [1, 0]]}
  for pool, ids in expected.items():
    config = fedfomo.FedFomoConfig(num_models=2, epsilon=0.0, pool=pool)
    message = fedfomo.fedfomo(config, trainer).broadcast(server, params)
    np.testing.assert_array_equal(message.ids, ids, err_msg=pool)
  config = fedfomo.FedFomoConfig(num_models=2, epsilon=0.0, pool="uploader_count")
  algorithm = fedfomo.fedfomo(config, trainer)
  server = server._replace(uploaded=jnp.array([False, False, True, False]))  # one: M = 1
  np.testing.assert_array_equal(algorithm.broadcast(server, params).ids,
                                [[1, -1], [0, -1], [1, -1], [1, -1]])
  nobody = algorithm.broadcast(server._replace(uploaded=jnp.zeros(4, bool)), params)
  np.testing.assert_array_equal(nobody.ids, -np.ones((4, 2)))
  # The server records who uploaded (weight > 0); an empty slot adds nothing to P.
  uploads = fedfomo.FomoUpload(ids=jnp.array([[1, -1], [0, 2], [1, 3], [-1, -1]]),
                               weights=jnp.array([[0.5, 0.0], [1.0, 2.0], [0.0, 0.0],
                                                  [0.0, 0.0]]))
  state = algorithm.aggregate(server, params, uploads, jnp.array([3.0, 2.0, 0.0, 1.0]))
  np.testing.assert_array_equal(state.server.uploaded, [True, True, False, True])
  np.testing.assert_allclose(state.server.affinity,
                             affinity + jnp.array([[0.0, 0.5, 0.0, 0.0],
                                                   [1.0, 0.0, 2.0, 0.0],
                                                   [0.0, 0.0, 0.0, 0.0],
                                                   [0.0, 0.0, 0.0, 0.0]]))


def test_empty_slot_weighs_nothing():
  data, _ = tiny_data([6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=0.1, batch_size=8)
  algorithm = fedfomo.fedfomo(fedfomo.FedFomoConfig(num_models=2), trainer)
  own = init_params(model, seed=0)
  others = [init_params(model, seed=s) for s in (1, 2, 3)]
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  full = fedfomo.FomoMessage(models=_stack(others[:2]), ids=jnp.array([1, 2], jnp.int32))
  weights = algorithm.client_update(own, full, splits, jax.random.key(0)).upload.weights
  helping = int(np.argmax(weights))
  assert weights[helping] > 0, "the case must have a model that helps"
  ids = np.array([1, 2])
  ids[helping] = -1
  out = algorithm.client_update(own, full._replace(ids=jnp.asarray(ids, jnp.int32)), splits,
                                jax.random.key(0))
  assert float(out.upload.weights[helping]) == 0.0
