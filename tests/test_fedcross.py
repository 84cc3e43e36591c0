"""FedCross: the deal of middleware models among the sampled clients, the similarities,
each collaborator rule and the server's cross-aggregation, against hand computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.algorithms import fedcross
from fedora_jax.errors import ConfigError
from tiny import run_rounds, tiny_data, tiny_model, tiny_trainer

SQRT_HALF = np.sqrt(0.5)


def flat(rows) -> dict:
  """One-layer models whose parameters are the given rows."""
  return {"params": {"Dense_0": {"kernel": jnp.asarray(rows, jnp.float32)}}}


def test_the_sampled_clients_get_the_first_slots_in_a_random_order():
  sampled = jnp.array([True, False, True, True, False])
  seen = set()
  for seed in range(20):
    slots = np.asarray(fedcross.deal_slots(jax.random.key(seed), sampled))
    assert sorted(slots[[0, 2, 3]]) == [0, 1, 2] and sorted(slots[[1, 4]]) == [3, 4]
    seen.add(tuple(slots[[0, 2, 3]]))
  assert len(seen) > 3


def test_cosine_and_per_layer_similarities():
  models = flat([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
  np.testing.assert_allclose(fedcross.similarities(models, "model"),
                             [[1, SQRT_HALF, 0], [SQRT_HALF, 1, SQRT_HALF],
                              [0, SQRT_HALF, 1]], atol=1e-6)
  # Two layers: cosines (1, 0) and (0, 1) -> the first's plus twice the second's.
  two = {"params": {"Dense_0": {"kernel": jnp.array([[1.0, 0.0], [1.0, 0.0]])},
                    "Dense_1": {"kernel": jnp.array([[0.0, 1.0], [1.0, 1.0]])}}}
  np.testing.assert_allclose(fedcross.similarities(two, "layers")[0, 1],
                             1.0 + 2 * SQRT_HALF, rtol=1e-6)
  np.testing.assert_allclose(fedcross.similarities(two, "model")[0, 1],
                             2.0 / np.sqrt(2.0 * 3.0), rtol=1e-6)


@pytest.mark.parametrize("kind, round_index, expected", [
    ("lowest", 0, [2, 0, 0, 3]),    # slot 1: a tie (0.71, 0.71) -> the lower slot
    ("highest", 0, [1, 0, 1, 3]),
    ("in_order", 0, [1, 2, 0, 3]),  # offset 0 mod 2 + 1
    ("in_order", 1, [2, 0, 1, 3]),  # offset 1 mod 2 + 1
])
def test_collaborators_among_the_dealt_slots(kind, round_index, expected):
  # Slot 3 is not dealt: nobody picks it and it keeps itself.
  models = flat([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.1]])
  similarity = fedcross.similarities(models, "model")
  partners = fedcross.collaborators(similarity, jnp.array(3), jnp.array(round_index), kind)
  np.testing.assert_array_equal(partners, expected)


def test_a_single_dealt_slot_is_its_own_collaborator():
  similarity = fedcross.similarities(flat([[1.0, 0.0], [0.0, 1.0]]), "model")
  for kind in fedcross.COLLABORATORS:
    np.testing.assert_array_equal(
        fedcross.collaborators(similarity, jnp.array(1), jnp.array(3), kind), [0, 1])


@pytest.mark.parametrize("global_model", ["middleware", "uploads"])
def test_the_server_cross_aggregates_the_trained_slots(global_model):
  config = fedcross.FedCrossConfig(alpha=0.9, global_model=global_model)
  algorithm = fedcross.fedcross(config, tiny_trainer(tiny_model()))
  # Four slots, three dealt; client 1 dropped (weight 0): its slot 2 keeps w_2.
  server = fedcross.CrossServer(models=flat([[9.0, 9.0], [9.0, 8.0], [0.0, 1.0], [5.0, 5.0]]),
                                global_model=flat([0.0, 0.0]),
                                key=jax.random.key_data(jax.random.key(0)),
                                round=jnp.array(4))
  uploads = fedcross.CrossMessage(model=flat([[1.0, 1.0], [7.0, 7.0], [1.0, 0.0], [3.0, 3.0]]),
                                  slot=jnp.array([1, 2, 0, 3]), dealt=jnp.full(4, 3))
  weights = jnp.array([1.0, 0.0, 3.0, 0.0])
  new = algorithm.aggregate(server, jnp.zeros(4), uploads, weights).server
  # Trained v: slot 0 (1, 0), slot 1 (1, 1), slot 2 (0, 1) kept, slot 3 not dealt.
  # Lowest similarity: 0 -> 2, 1 -> 0 (a tie), 2 -> 0.
  expected = [[0.9, 0.1], [1.0, 0.9], [0.1, 0.9], [5.0, 5.0]]
  np.testing.assert_allclose(new.models["params"]["Dense_0"]["kernel"], expected, atol=1e-6)
  generated = (np.mean(expected[:3], axis=0) if global_model == "middleware"
               else (1.0 * np.array([1.0, 1.0]) + 3.0 * np.array([1.0, 0.0])) / 4.0)
  np.testing.assert_allclose(new.global_model["params"]["Dense_0"]["kernel"], generated,
                             atol=1e-6)
  assert int(new.round) == 5


def test_the_first_stage_restarts_every_dealt_slot_from_the_global_model():
  config = fedcross.FedCrossConfig(first_stage_bound=2)
  algorithm = fedcross.fedcross(config, tiny_trainer(tiny_model()))
  server = fedcross.CrossServer(models=flat([[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]]),
                                global_model=flat([0.0, 0.0]),
                                key=jax.random.key_data(jax.random.key(0)), round=jnp.array(1))
  uploads = fedcross.CrossMessage(model=flat([[2.0, 0.0], [0.0, 4.0], [0.0, 0.0]]),
                                  slot=jnp.array([0, 1, 2]), dealt=jnp.full(3, 2))
  new = algorithm.aggregate(server, jnp.zeros(3), uploads, jnp.array([1.0, 1.0, 0.0])).server
  np.testing.assert_allclose(new.models["params"]["Dense_0"]["kernel"],
                             [[1.0, 2.0], [1.0, 2.0], [5.0, 5.0]], atol=1e-6)


def test_a_round_deals_to_the_sampled_clients_only():
  data, _ = tiny_data([5, 6, 9, 5, 8, 7])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4)
  algorithm = fedcross.fedcross(fedcross.FedCrossConfig(), trainer)
  state, metrics, _, _ = run_rounds(algorithm, trainer, data, model, rounds=2,
                                    participation=0.5)
  assert int((np.asarray(metrics.local_steps) > 0).sum()) == 3
  server = state.algorithm.server
  # Slots 3..5 were never dealt: they still hold the initial model.
  initial = jax.tree.map(lambda a: a[5], server.models)
  for slot in (3, 4):
    jax.tree.map(lambda a, b, s=slot: np.testing.assert_array_equal(a[s], b), server.models,
                 initial)
  assert np.isfinite(np.asarray(metrics.val_loss)).all()


def test_bad_configs_fail_in_one_line():
  trainer = algorithms.stand_in_trainer()
  for field, value in (("alpha", 1.5), ("collaborator", "random"), ("similarity", "l2"),
                       ("global_model", "best"), ("first_stage_bound", -1)):
    with pytest.raises(ConfigError, match=field):
      fedcross.fedcross(fedcross.FedCrossConfig()._replace(**{field: value}), trainer)
