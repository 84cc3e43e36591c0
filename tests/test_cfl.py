"""CFL: the cosine similarities, the clusters' update norms and both bipartitions against
hand values; a round that splits a cluster (and ones that may not) through aggregate;
bad values refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import cfl
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


def test_cosine_similarity_by_hand():
  u = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, -2.0]])
  s = cfl.cosine_similarity(u)
  r = 1 / np.sqrt(2.0)
  np.testing.assert_allclose(s, [[1, r, 0], [r, 1, -r], [0, -r, 1]], rtol=1e-6, atol=1e-7)


def test_cluster_norms_by_hand():
  updates = jnp.array([[3.0, 4.0], [9.0, 9.0], [1.0, 0.0], [0.0, 2.0]])
  assignment = jnp.array([0, 0, 1, 1])
  weights = jnp.array([1.0, 0.0, 1.0, 3.0])   # client 1 sat the round out
  mean, largest = cfl.cluster_norms(updates, assignment, weights, 3)
  # cluster 1: (1 (1, 0) + 3 (0, 2)) / 4 = (0.25, 1.5); cluster 2: nobody.
  np.testing.assert_allclose(mean, [5.0, np.sqrt(0.25 ** 2 + 1.5 ** 2), 0.0], rtol=1e-6)
  np.testing.assert_allclose(largest, [5.0, 2.0, 0.0], rtol=1e-6)


def test_bipartitions_by_hand():
  # Clients on a line at 0, 1, 2, 3, 4.5 (similarity minus the distance) and client 5,
  # not in the cluster. Single linkage chains 0-3 and leaves 4 (the bipartition whose
  # largest similarity across is smallest, -1.5: the paper's optimum); complete linkage
  # joins {0, 1} and {2, 3}, then {2, 3} with 4 (group distances 3 and 2.5).
  x = np.array([0.0, 1.0, 2.0, 3.0, 4.5, 0.5])
  similarity = jnp.asarray(-np.abs(x[:, None] - x[None, :]), jnp.float32)
  members = jnp.array([True] * 5 + [False])
  np.testing.assert_array_equal(cfl.bipartition(similarity, members, "optimal"),
                                [False, False, False, False, True, False])
  np.testing.assert_array_equal(cfl.bipartition(similarity, members, "complete"),
                                [False, False, True, True, True, False])


def _round(config, weights, round_=0):
  algorithm = cfl.cfl(config, tiny_trainer(tiny_model()))
  slots = config.max_clusters
  start = jnp.array([1.0, 1.0])
  server = cfl.CflServer(clusters={"w": jnp.broadcast_to(start, (slots, 2))},
                         assignment=jnp.zeros(4, jnp.int32), used=jnp.array(1),
                         similarity=jnp.zeros((4, 4)), round=jnp.array(round_))
  # Clients 0, 1 move along the first axis, clients 2, 3 along the second.
  uploads = {"w": start + jnp.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])}
  return algorithm.aggregate(server, jnp.zeros(4), uploads, jnp.asarray(weights)).server


def test_a_round_splits_the_cluster():
  # Mean update (0.5, 0.5): norm 0.707 < eps1 = 1; largest norm 1 > eps2 = 0.5.
  config = cfl.CflConfig(eps1=1.0, eps2=0.5, warmup_rounds=0, max_clusters=3)
  server = _round(config, [1.0, 1.0, 1.0, 1.0])
  np.testing.assert_array_equal(server.assignment, [0, 0, 1, 1])
  assert int(server.used) == 2 and int(server.round) == 1
  np.testing.assert_allclose(server.clusters["w"][:2], [[2.0, 1.0], [1.0, 2.0]])
  np.testing.assert_allclose(server.similarity[0], [1.0, 1.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("change", [dict(max_clusters=1), dict(warmup_rounds=5),
                                    dict(eps1=0.5), dict(eps2=1.0), dict(min_cluster_size=4)])
def test_no_split_without_every_criterion(change):
  config = cfl.CflConfig(eps1=1.0, eps2=0.5, warmup_rounds=0, max_clusters=3)._replace(
      **change)
  # Weights 1, 3, 1, 3: one cluster, its weighted mean update (0.5, 0.5).
  server = _round(config, [1.0, 3.0, 1.0, 3.0])
  np.testing.assert_array_equal(server.assignment, [0, 0, 0, 0])
  np.testing.assert_allclose(server.clusters["w"][0], [1.5, 1.5])


@pytest.mark.parametrize("field,value", [("eps1", -1.0), ("min_cluster_size", 1),
                                         ("max_clusters", 0), ("bipartition", "ward")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"cfl: {field}"):
    cfl.cfl(cfl.CflConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
