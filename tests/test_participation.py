"""Partial participation: the sampled clients, and what the others keep."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedavg, fedavg_ft, local
from fedora_jax.algorithms.base import InitContext
from fedora_jax.engine import buckets
from fedora_jax.rounds import (RoundState, build_train_round, num_sampled_clients,
                                     sampled_clients)
from fedora_jax.errors import ConfigError
from tiny import TraceCounter, init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def _start(algorithm, trainer, data, params):
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape), params)
  context = InitContext(params=stacked, data=data, trainer=trainer, key=jax.random.key(0))
  return RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(context))


def test_num_sampled_clients():
  assert num_sampled_clients(0.1, 100) == 10
  assert num_sampled_clients(0.3, 36) == 11
  assert num_sampled_clients(0.01, 10) == 1  # never nobody
  assert num_sampled_clients(1.0, 7) == 7
  for bad in (0.0, -0.5, 1.5):
    with pytest.raises(ConfigError, match="participation"):
      num_sampled_clients(bad, 10)


def test_sampled_clients_are_exact_and_depend_only_on_the_round_key():
  key = jax.random.key(3)
  draws = [np.asarray(sampled_clients(jax.random.fold_in(key, r), 20, 4)) for r in range(6)]
  assert all(d.sum() == 4 for d in draws)
  np.testing.assert_array_equal(
      draws[2], np.asarray(sampled_clients(jax.random.fold_in(key, 2), 20, 4)))
  assert len({tuple(d) for d in draws}) > 1  # other rounds, other clients


def test_fedavg_averages_only_the_sampled_clients_and_the_others_keep_their_state():
  sizes = [2, 3, 5, 4]
  data, clients = tiny_data(sizes)
  model = tiny_model()
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # one full-batch step each
  params = init_params(model)
  key = jax.random.key(1)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  round_fn = jax.jit(build_train_round(algorithm, trainer, data, participation=0.5))
  state, metrics = round_fn(_start(algorithm, trainer, data, params), data.buckets, key)

  active = np.asarray(sampled_clients(jax.random.fold_in(key, 0), 4, 2))
  assert active.sum() == 2
  np.testing.assert_array_equal(metrics.local_steps, np.where(active, 1, 0))
  assert np.isnan(metrics.train_loss[~active]).all()
  assert np.isfinite(metrics.train_loss[active]).all()
  total = sum(n for n, a in zip(sizes, active) if a)
  expected = jax.tree.map(jnp.zeros_like, params)
  for n, c, a in zip(sizes, clients, active):
    if a:
      grads = jax.grad(lambda p, c=c: mean_ce(model, p, c.x_train, c.y_train))(params)
      expected = jax.tree.map(lambda e, p, g, n=n: e + n / total * (p - lr * g),
                              expected, params, grads)
  chex.assert_trees_all_close(state.algorithm.server, expected, atol=1e-6)


@pytest.mark.parametrize("name", ["fedavg", "fedavg_ft"])
def test_fedavg_slot_uploads_and_shared_model_match_the_stacked_path(name):
  # FedAvg aggregates the M slots' uploads and scores one shared model on every client;
  # the generic path (a [K, ...] scatter of the uploads, K stacked copies to evaluate)
  # must give the same run up to summation order. FedAvg-FT keeps the slot uploads.
  data, _ = tiny_data([2, 3, 5, 4, 9, 12])  # two size buckets
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  if name == "fedavg":
    fast = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
    assert fast.uploads_unordered and fast.shared_model is not None
  else:
    fast = fedavg_ft.fedavg_ft(fedavg_ft.FedAvgFTConfig(), trainer)
    assert fast.uploads_unordered and fast.shared_model is None
  stacked = fast._replace(uploads_unordered=False, shared_model=None)
  key = jax.random.key(2)
  runs = []
  for algorithm in (fast, stacked):
    round_fn = jax.jit(build_train_round(algorithm, trainer, data, participation=0.5))
    state = _start(algorithm, trainer, data, init_params(model))
    for _ in range(2):
      state, metrics = round_fn(state, data.buckets, key)
    runs.append((state.algorithm.server, metrics))
  chex.assert_trees_all_close(runs[0][0], runs[1][0], atol=1e-6)
  for field in ("val_loss", "val_score", "test_loss", "test_score", "local_steps"):
    np.testing.assert_allclose(getattr(runs[0][1], field), getattr(runs[1][1], field),
                               atol=1e-6)


def test_local_non_sampled_clients_are_untouched_and_nothing_retraces():
  data, _ = tiny_data([4, 4, 4, 4, 12])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  algorithm = local.local(local.LocalConfig(), trainer)
  counter = TraceCounter(build_train_round(algorithm, trainer, data, participation=0.4))
  round_fn = jax.jit(counter)
  key = jax.random.key(0)
  state = _start(algorithm, trainer, data, init_params(model))
  for r in range(3):
    before = state.algorithm.clients
    state, metrics = round_fn(state, data.buckets, key)
    active = np.asarray(sampled_clients(jax.random.fold_in(key, r), 5, 2))
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(state.algorithm.clients)):
      np.testing.assert_array_equal(np.asarray(new)[~active], np.asarray(old)[~active])
      assert not np.allclose(np.asarray(new)[active], np.asarray(old)[active])
    assert (metrics.local_steps > 0).sum() == 2
  assert counter.traces == 1


def test_sampled_clients_get_the_full_rounds_update():
  data, _ = tiny_data([4, 4, 4, 4, 12, 12])  # buckets of 4 and 2 clients
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  algorithm = local.local(local.LocalConfig(), trainer)
  key = jax.random.key(5)
  start = _start(algorithm, trainer, data, init_params(model))
  full, _ = jax.jit(build_train_round(algorithm, trainer, data))(start, data.buckets, key)
  partial, _ = jax.jit(build_train_round(algorithm, trainer, data, participation=0.5))(
      start, data.buckets, key)
  active = np.asarray(sampled_clients(jax.random.fold_in(key, 0), 6, 3))
  for f, p in zip(jax.tree.leaves(full.algorithm.clients),
                  jax.tree.leaves(partial.algorithm.clients)):
    np.testing.assert_allclose(np.asarray(p)[active], np.asarray(f)[active], rtol=1e-6)


def test_map_over_sampled_slots_and_scatter():
  data, clients = tiny_data([3, 3, 3, 3, 9])  # buckets of 4 clients and 1
  def fn(scale, splits):
    # The client's own data, whatever slot it runs in: its count and masked pixel sum.
    pixels = jnp.sum(splits.train.x.astype(jnp.float32)
                     * splits.train.mask.reshape((-1,) + (1,) * (splits.train.x.ndim - 1)))
    return scale * 10.0, splits.train.n, pixels

  def run(sampled):
    return buckets.map_over_sampled(fn, (jnp.arange(5.0),), data.buckets, data.client_ids,
                                    5, jnp.asarray(sampled), 3)
  # M = 3 slots: s = min(3, 5) - min(3, 1) = 2 in the small bucket, 1 in the large one,
  # filled largest bucket first, then in client order.
  (values, counts, pixels), slot_clients = run([False, True, False, True, True])
  np.testing.assert_array_equal(slot_clients, [4, 1, 3])
  np.testing.assert_allclose(values, [40.0, 10.0, 30.0])
  merged = buckets.scatter_to_clients(-jnp.ones(5), slot_clients, values)
  np.testing.assert_allclose(merged, [-1.0, 10.0, -1.0, 30.0, 40.0])
  # Three sampled small clients: client 0 runs in the large bucket's slot, its 3 images
  # padded to 9 and masked.
  (values, counts, pixels), slot_clients = run([True, True, True, False, False])
  np.testing.assert_array_equal(slot_clients, [0, 1, 2])
  np.testing.assert_array_equal(counts, [3, 3, 3])
  np.testing.assert_allclose(
      pixels, [np.sum(clients[k].x_train.astype(np.float32)) for k in (0, 1, 2)], atol=1e-5)
  assert buckets.sampled_slots([4, 1], 3) == [2, 1]
  assert buckets.sampled_slots([5, 3, 2], 4) == [0, 2, 2]
  assert buckets.sampled_slots([5, 3, 2], 10) == [5, 3, 2]
  assert buckets.sampled_slots([2, 2], 1) == [0, 1]
