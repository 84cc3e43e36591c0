"""IFCA's lowest-loss cluster choice and FeSEM's distance-based E/M steps, by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import fesem, ifca
from fedora_jax.algorithms.base import InitContext
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def _stack(models):
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *models)


def _first_client(data):
  return jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])


def test_ifca_client_trains_the_cluster_with_the_lowest_training_loss():
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  candidates = [init_params(model, seed=s) for s in range(3)]
  losses = [float(mean_ce(model, p, clients[0].x_train, clients[0].y_train))
            for p in candidates]
  # Put the best model last, so choosing it is not the argmin's default index 0.
  order = np.argsort(losses)[::-1]
  clusters = _stack([candidates[i] for i in order])
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch SGD step
  algorithm = ifca.ifca(ifca.IfcaConfig(num_clusters=3), trainer)
  out = algorithm.client_update(ifca.IfcaClients(cluster=jnp.int32(0)), clusters,
                                _first_client(data), jax.random.key(0))

  assert int(out.state.cluster) == 2
  np.testing.assert_allclose(out.metrics["cluster_loss"], min(losses), rtol=1e-5)
  best = candidates[order[2]]
  grads = jax.grad(lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(best)
  chex.assert_trees_all_close(out.upload, jax.tree.map(lambda p, g: p - lr * g, best, grads),
                              atol=1e-6)


def test_ifca_averages_each_cluster_over_the_clients_that_chose_it():
  algorithm = ifca.ifca(ifca.IfcaConfig(num_clusters=3), tiny_trainer(tiny_model()))
  server = ifca.IfcaServer(clusters={"w": jnp.array([[10.0], [20.0], [30.0]])})
  clients = ifca.IfcaClients(cluster=jnp.array([0, 2, 0, 2], jnp.int32))
  uploads = {"w": jnp.array([[1.0], [3.0], [5.0], [8.0]])}
  # Unequal sample counts: the paper's cluster mean ignores them.
  state = algorithm.aggregate(server, clients, uploads, jnp.array([1.0, 9.0, 1.0, 1.0]))
  # Cluster 0: (1 + 5) / 2; cluster 1: nobody chose it, kept; cluster 2: (3 + 8) / 2.
  np.testing.assert_allclose(state.server.clusters["w"], [[3.0], [20.0], [5.5]])
  np.testing.assert_allclose(
      algorithm.personalized_params(state.server, state.clients)["w"],
      [[3.0], [5.5], [3.0], [5.5]])


def test_ifca_pick_draw_takes_the_first_draw_where_every_cluster_is_chosen():
  # 5 clients, 3 draws of 2 clusters. Counts per draw: [5, 0], [1, 4], [2, 3].
  choices = jnp.array([[0, 0, 1], [0, 1, 1], [0, 1, 0], [0, 1, 0], [0, 1, 1]])
  assert int(ifca.pick_draw(choices, 2, min_clients=1)) == 1
  assert int(ifca.pick_draw(choices, 2, min_clients=2)) == 2
  # Nobody reaches 3: the draw whose smallest cluster is largest (2 clients).
  assert int(ifca.pick_draw(choices, 2, min_clients=3)) == 2


def test_ifca_first_choices_are_each_clients_lowest_loss_model_of_every_draw():
  data, clients = tiny_data([6, 6, 20])  # two size buckets: client 2 sits in its own
  assert len(data.buckets) == 2
  model = tiny_model()
  trainer = tiny_trainer(model)
  models = [init_params(model, seed=s) for s in range(6)]
  draws = _stack([_stack(models[:3]), _stack(models[3:])])  # [2 draws, 3 clusters]
  choices = ifca.first_choices(trainer, draws, data)
  for k, client in enumerate(clients):
    for d in range(2):
      losses = [float(mean_ce(model, m, client.x_train, client.y_train))
                for m in models[3 * d:3 * d + 3]]
      assert int(choices[k, d]) == int(np.argmin(losses))


def test_ifca_init_redraws_until_no_cluster_is_left_empty():
  data, _ = tiny_data([6, 6, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model)
  stacked = _stack([init_params(model, seed=0)] * 4)
  key = jax.random.key(3)
  single = ifca.ifca(ifca.IfcaConfig(num_clusters=3, init_draws=1), trainer).init(
      InitContext(params=stacked, data=data, trainer=trainer, key=key))
  # init_draws=1: the single draw, cluster 0 the shared initial model (the paper's start).
  chex.assert_trees_all_close(single.server.clusters,
                              tree.initial_centers(stacked, key, 3))
  config = ifca.IfcaConfig(num_clusters=3, init_draws=8)
  state = ifca.ifca(config, trainer).init(
      InitContext(params=stacked, data=data, trainer=trainer, key=key))
  # The draws, by hand: draw 0 from `key`, draw d from fold_in(key, d).
  draws = _stack([tree.initial_centers(stacked, k, 3) for k in
                  [key] + [jax.random.fold_in(key, d) for d in range(1, 8)]])
  choices = np.asarray(ifca.first_choices(trainer, draws, data))
  counts = np.stack([np.bincount(choices[:, d], minlength=3) for d in range(8)])
  full = np.flatnonzero(counts.min(axis=1) >= 1)
  assert counts[0].min() == 0 and len(full) > 0  # the case really redraws
  chex.assert_trees_all_close(state.server.clusters, tree.take(draws, int(full[0])))


def test_ifca_rejects_bad_init_settings():
  trainer = tiny_trainer(tiny_model())
  with pytest.raises(ConfigError, match="ifca: init_draws"):
    ifca.ifca(ifca.IfcaConfig(init_draws=0), trainer)
  with pytest.raises(ConfigError, match="ifca: min_share"):
    ifca.ifca(ifca.IfcaConfig(num_clusters=4, min_share=0.3), trainer)


def test_random_centers_are_distinct_redraws_of_the_initial_model():
  params = init_params(tiny_model())
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (5,) + a.shape), params)
  centers = tree.initial_centers(stacked, jax.random.key(0), 3)
  chex.assert_trees_all_close(tree.take(centers, 0), params)
  for leaf, original in zip(jax.tree.leaves(centers), jax.tree.leaves(params)):
    assert not np.allclose(leaf[1], leaf[2])
    for c in (1, 2):  # the same values, shuffled
      np.testing.assert_allclose(np.sort(leaf[c].ravel()), np.sort(original.ravel()))


def test_fesem_assigns_each_client_to_the_nearest_center_and_averages():
  algorithm = fesem.fesem(fesem.FesemConfig(num_clusters=3), tiny_trainer(tiny_model()))
  centers = {"w": jnp.array([[0.0, 0.0], [4.0, 4.0], [-9.0, 9.0]])}
  models = {"w": jnp.array([[1.0, 0.0], [3.0, 3.0], [1.0, 2.0], [5.0, 4.0]])}
  # Squared distances to centers 0 / 1: 1 / 25, 18 / 2, 5 / 13, 41 / 1.
  np.testing.assert_array_equal(fesem.e_step(models, centers), [0, 1, 0, 1])
  clients = fesem.FesemClients(params=models, cluster=jnp.array([2, 2, 2, 2], jnp.int32))
  state = algorithm.aggregate(fesem.FesemServer(centers=centers,
                                                 warmup_left=jnp.asarray(0, jnp.int32)),
                              clients, (), jnp.ones(4))
  np.testing.assert_array_equal(state.clients.cluster, [0, 1, 0, 1])
  np.testing.assert_allclose(state.server.centers["w"],
                             [[1.0, 1.0], [4.0, 3.5], [-9.0, 9.0]])  # center 2 kept
  np.testing.assert_allclose(algorithm.personalized_params(state.server, state.clients)["w"],
                             [[1.0, 1.0], [4.0, 3.5], [1.0, 1.0], [4.0, 3.5]])


def test_fesem_m_step_over_the_round_uploaders_by_their_weights_by_hand():
  # The E-step as above reassigns every client: [0, 1, 0, 1]. Clients 0, 1 and 3 uploaded
  # with 2, 3 and 1 samples, client 2 sat out (weight 0): center 0 = client 0's model
  # alone, center 1 = (3 * [3, 3] + 1 * [5, 4]) / 4 (the authors' code's weighted mean of
  # the round's); center 2, with no uploader, keeps its value.
  centers = {"w": jnp.array([[0.0, 0.0], [4.0, 4.0], [-9.0, 9.0]])}
  models = {"w": jnp.array([[1.0, 0.0], [3.0, 3.0], [1.0, 2.0], [5.0, 4.0]])}
  clients = fesem.FesemClients(params=models, cluster=jnp.array([2, 2, 2, 2], jnp.int32))
  server = fesem.FesemServer(centers=centers, warmup_left=jnp.asarray(0, jnp.int32))
  weights = jnp.array([2.0, 3.0, 0.0, 1.0])
  algorithm = fesem.fesem(fesem.FesemConfig(num_clusters=3, m_step="uploaders"),
                          tiny_trainer(tiny_model()))
  state = algorithm.aggregate(server, clients, (), weights)
  np.testing.assert_array_equal(state.clients.cluster, [0, 1, 0, 1])
  np.testing.assert_allclose(state.server.centers["w"],
                             [[1.0, 0.0], [3.5, 3.25], [-9.0, 9.0]], rtol=1e-6)
  # The default: every client's model, stale client 2's too, unweighted.
  default = fesem.fesem(fesem.FesemConfig(num_clusters=3), tiny_trainer(tiny_model()))
  np.testing.assert_allclose(default.aggregate(server, clients, (), weights).server.centers["w"],
                             [[1.0, 1.0], [4.0, 3.5], [-9.0, 9.0]], rtol=1e-6)
  # A cluster whose clients all sat out keeps its center.
  idle = algorithm.aggregate(server, clients, (), jnp.array([0.0, 3.0, 0.0, 1.0]))
  np.testing.assert_allclose(idle.server.centers["w"][0], [0.0, 0.0])


def test_fesem_rejects_an_unknown_m_step():
  with pytest.raises(ConfigError, match="fesem: m_step"):
    fesem.fesem(fesem.FesemConfig(m_step="weighted"), tiny_trainer(tiny_model()))


def test_fesem_clients_train_from_their_center():
  data, clients = tiny_data([6, 6, 6])
  model = tiny_model()
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)
  algorithm = fesem.fesem(fesem.FesemConfig(num_clusters=2, init="random"), trainer)
  stacked = _stack([init_params(model, seed=s) for s in range(3)])
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  messages = algorithm.broadcast(state.server, state.clients)
  chex.assert_trees_all_close(
      messages, tree.take(state.server.centers, state.clients.cluster))
  client0 = tree.first(state.clients)
  center = tree.take(messages, 0)
  out = algorithm.client_update(client0, center, _first_client(data), jax.random.key(0))
  grads = jax.grad(lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(center)
  chex.assert_trees_all_close(out.state.params,
                              jax.tree.map(lambda p, g: p - lr * g, center, grads), atol=1e-6)
  assert int(out.state.cluster) == int(state.clients.cluster[0])


def test_fesem_kmeans_start_clusters_the_first_round_models_by_hand():
  # Two groups on a line: {0, 1, 2} and {10, 12}. Farthest-first: row sums of the squared
  # distances are 249, 204, 169, 249, 369, so the first seed is model 4 (12) and the
  # second the model farthest from it, model 0 (0). Lloyd then gives the group means.
  models = {"w": jnp.array([[0.0], [1.0], [2.0], [10.0], [12.0]])}
  pairwise = tree.pairwise_squared_distances(models)
  np.testing.assert_array_equal(fesem.farthest_first_seeds(pairwise, 2), [4, 0])
  algorithm = fesem.fesem(fesem.FesemConfig(num_clusters=2, warmup_rounds=1),
                          tiny_trainer(tiny_model()))
  # init="kmeans": round 1 sends every client its own model, the shared initial one.
  start = {"w": jnp.full((5, 1), 7.0)}
  state = algorithm.init(InitContext(params=start, data=None, trainer=None,
                                     key=jax.random.key(0)))
  assert int(state.server.warmup_left) == 1
  np.testing.assert_allclose(algorithm.broadcast(state.server, state.clients)["w"], start["w"])
  # After round 1 (models trained to `models`), aggregate runs k-means, not one E/M step
  # against the (all equal) starting centers, which would put everyone in cluster 0.
  after = algorithm.aggregate(state.server, state.clients._replace(params=models), (),
                              jnp.ones(5))
  np.testing.assert_allclose(after.server.centers["w"], [[11.0], [1.0]])
  np.testing.assert_array_equal(after.clients.cluster, [1, 1, 1, 0, 0])
  assert int(after.server.warmup_left) == 0
  np.testing.assert_allclose(algorithm.broadcast(after.server, after.clients)["w"],
                             [[1.0], [1.0], [1.0], [11.0], [11.0]])
  # From round 2 on, ordinary E/M steps: model 2 moved to 8 is now nearer center 0 (11).
  moved = {"w": jnp.array([[0.0], [1.0], [8.0], [10.0], [12.0]])}
  again = algorithm.aggregate(after.server, after.clients._replace(params=moved), (),
                              jnp.ones(5))
  np.testing.assert_array_equal(again.clients.cluster, [1, 1, 0, 0, 0])
  np.testing.assert_allclose(again.server.centers["w"], [[10.0], [0.5]])


def test_fesem_warms_up_on_local_models_before_its_kmeans():
  algorithm = fesem.fesem(fesem.FesemConfig(num_clusters=2, warmup_rounds=2),
                          tiny_trainer(tiny_model()))
  start = {"w": jnp.full((5, 1), 7.0)}
  state = algorithm.init(InitContext(params=start, data=None, trainer=None,
                                     key=jax.random.key(0)))
  round1 = {"w": jnp.array([[6.0], [7.0], [8.0], [9.0], [5.0]])}
  state = algorithm.aggregate(state.server, state.clients._replace(params=round1), (),
                              jnp.ones(5))
  # Still warming up: centers untouched, each client keeps training (and is scored on)
  # its own local model.
  assert int(state.server.warmup_left) == 1
  np.testing.assert_allclose(state.server.centers["w"], [[7.0], [7.0]])
  np.testing.assert_allclose(algorithm.broadcast(state.server, state.clients)["w"], round1["w"])
  np.testing.assert_allclose(
      algorithm.personalized_params(state.server, state.clients)["w"], round1["w"])
  models = {"w": jnp.array([[0.0], [1.0], [2.0], [10.0], [12.0]])}
  state = algorithm.aggregate(state.server, state.clients._replace(params=models), (),
                              jnp.ones(5))
  np.testing.assert_allclose(state.server.centers["w"], [[11.0], [1.0]])
  assert int(state.server.warmup_left) == 0


def test_fesem_rejects_an_unknown_init():
  with pytest.raises(ConfigError, match="fesem: init"):
    fesem.fesem(fesem.FesemConfig(init="spectral"), tiny_trainer(tiny_model()))
