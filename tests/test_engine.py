"""The round engine: local SGD, buckets, FedAvg by hand, no retrace, determinism."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms, tree
from fedora_jax.algorithms import fedavg, local
from fedora_jax.algorithms.base import InitContext
from fedora_jax.rounds import RoundMetrics, RoundState, build_train_round
from fedora_jax.errors import ConfigError, TrainingDivergedError
from fedora_jax.simulation import check_finite
from fedora_jax.engine import buckets, sharding
from fedora_jax.models import default_client_chunk, default_eval_batch_size
from tiny import TraceCounter, init_params, mean_ce, tiny_data, tiny_model, tiny_trainer


def _stacked(params, k):
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (k,) + a.shape), params)


def _start(algorithm, trainer, data, params):
  context = InitContext(params=_stacked(params, data.num_clients), data=data,
                        trainer=trainer, key=jax.random.key(0))
  return RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(context))


def test_fedavg_one_full_batch_step_is_the_weighted_mean_by_hand():
  sizes = [2, 3, 5]  # two size buckets: [2, 3] and [5]
  data, clients = tiny_data(sizes)
  assert len(data.buckets) == 2
  model = tiny_model()
  lr = 0.1
  trainer = tiny_trainer(model, lr=lr, batch_size=8)  # batch >= n: one full-batch step
  params = init_params(model)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  round_fn = jax.jit(build_train_round(algorithm, trainer, data))
  state, metrics = round_fn(_start(algorithm, trainer, data, params), data.buckets,
                            jax.random.key(1))

  expected = jax.tree.map(jnp.zeros_like, params)
  for n, c in zip(sizes, clients):
    grads = jax.grad(lambda p, c=c: mean_ce(model, p, c.x_train, c.y_train))(params)
    expected = jax.tree.map(lambda e, p, g, n=n: e + n / sum(sizes) * (p - lr * g),
                            expected, params, grads)
  chex.assert_trees_all_close(state.algorithm.server, expected, atol=1e-6)
  np.testing.assert_array_equal(metrics.local_steps, [1, 1, 1])


def test_round_compiles_once_and_reports_per_client_metrics():
  data, _ = tiny_data([4, 4, 4, 20])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, epochs=2)
  algorithm = local.local(local.LocalConfig(), trainer)
  counter = TraceCounter(build_train_round(algorithm, trainer, data))
  round_fn = jax.jit(counter, donate_argnums=0)
  state = _start(algorithm, trainer, data, init_params(model))
  for _ in range(3):
    state, metrics = round_fn(state, data.buckets, jax.random.key(0))
  assert int(state.round) == 3
  assert counter.traces == 1
  for field in ("train_loss", "val_loss", "val_score", "test_loss", "test_score"):
    chex.assert_shape(getattr(metrics, field), (4,))
    chex.assert_tree_all_finite(getattr(metrics, field))
  # ceil(n / batch) steps per epoch, two epochs, whatever the bucket's padding.
  np.testing.assert_array_equal(metrics.local_steps, [4, 4, 4, 20])


def test_padding_content_never_reaches_the_model():
  data, _ = tiny_data([3, 5])  # client 0 is padded from 3 to 5 samples
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, epochs=3, momentum=0.9)
  bucket = data.buckets[0].train
  garbage = bucket._replace(x=np.where(bucket.mask[..., None], bucket.x, 1e3),
                            y=np.where(bucket.mask, bucket.y, 2))
  params = init_params(model)
  key = jax.random.key(3)
  one_client = lambda d: tree.first(d)
  clean, clean_stats = trainer.train(params, one_client(bucket), key)
  dirty, dirty_stats = trainer.train(params, one_client(garbage), key)
  chex.assert_trees_all_close(clean, dirty)
  assert int(clean_stats.steps) == 3 * 2 == int(dirty_stats.steps)
  np.testing.assert_allclose(trainer.evaluate(params, one_client(bucket)).loss,
                             trainer.evaluate(params, one_client(garbage)).loss)


def test_evaluation_matches_a_plain_computation():
  data, clients = tiny_data([7])
  model = tiny_model()
  trainer = tiny_trainer(model)
  params = init_params(model)
  test = jax.tree.map(lambda a: a[0], data.buckets[0].test)
  stats = trainer.evaluate(params, test)
  logits = model.apply(params, clients[0].x_test)
  np.testing.assert_allclose(stats.loss, mean_ce(model, params, clients[0].x_test,
                                                  clients[0].y_test), rtol=1e-6)
  np.testing.assert_allclose(stats.score,
                             np.mean(np.argmax(logits, -1) == clients[0].y_test))


def test_same_seed_same_numbers():
  data, _ = tiny_data([4, 6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, epochs=2, momentum=0.9)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  round_fn = jax.jit(build_train_round(algorithm, trainer, data))

  def two_rounds(seed):
    state = _start(algorithm, trainer, data, init_params(model))
    for _ in range(2):
      state, metrics = round_fn(state, data.buckets, jax.random.key(seed))
    return metrics
  a, b, c = two_rounds(0), two_rounds(0), two_rounds(1)
  np.testing.assert_array_equal(a.test_loss, b.test_loss)
  assert not np.array_equal(a.train_loss, c.train_loss)


def test_nan_stops_the_run_naming_round_and_clients():
  finite = np.ones(5, np.float32)
  metrics = RoundMetrics(train_loss=np.array([1.0, np.nan, 1.0, 1.0, np.inf], np.float32),
                         local_steps=finite, val_loss=finite, val_score=finite,
                         test_loss=finite, test_score=finite, extra={})
  with pytest.raises(TrainingDivergedError, match=r"round 7 at client\(s\) 1, 4 \(2 of 5\)"):
    check_finite(metrics, round_number=7)
  check_finite(metrics._replace(train_loss=finite), round_number=7)


def test_client_chunks_give_the_vmapped_round():
  """lax.map over chunks of clients (the single-CPU default) computes what vmap does,
  with a chunk that does not divide a bucket (7 = 3 + 3 + 1), two buckets, and one
  client at a time (whose padded steps are skipped, not computed)."""
  data, _ = tiny_data([2, 4, 4, 4, 4, 4, 4, 12, 12])  # client 0: a padded step an epoch
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, momentum=0.9, weight_decay=1e-3)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  outputs = {}
  for client_chunk in (None, 3, 1):
    round_fn = jax.jit(build_train_round(algorithm, trainer, data, client_chunk))
    state = _start(algorithm, trainer, data, init_params(model))
    for _ in range(2):
      state, metrics = round_fn(state, data.buckets, jax.random.key(1))
    outputs[client_chunk] = (state, metrics)
  chex.assert_trees_all_close(outputs[3], outputs[None], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(outputs[1], outputs[None], rtol=1e-5, atol=1e-6)


def _primitives(jaxpr) -> set[str]:
  """Every primitive in a jaxpr, the bodies of its loops and branches included."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for inner in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          names |= _primitives(inner)
  return names


def test_one_client_at_a_time_branches_over_padded_steps():
  """With --client_chunk=1 a padded SGD step or evaluation chunk is a real branch (a
  `cond`, skipped at run time); vmapped, the branch becomes a select of both."""
  data, _ = tiny_data([3, 5])  # one bucket: client 0 padded from 3 to 5 samples
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  stacked = _stacked(init_params(model), 2)
  bucket = data.buckets[0]
  keys = jax.random.split(jax.random.key(0), 2)

  def train_and_test(params, split, key):
    params, _ = trainer.train(params, split.train, key)
    return trainer.evaluate(params, split.test)

  for chunk, branches in ((1, True), (None, False)):
    jaxpr = jax.make_jaxpr(buckets.over_clients(train_and_test, chunk))(stacked, bucket, keys)
    assert ("cond" in _primitives(jaxpr.jaxpr)) == branches, chunk


def test_default_client_chunk_on_cpus_only():
  assert default_client_chunk("mlp", "cpu") == 2
  assert default_client_chunk("cnn", "cpu") == 1
  assert default_client_chunk("mlp", "gpu") is None
  assert default_client_chunk("cnn", "tpu") is None


def test_default_eval_batch_is_small_for_the_cnns_on_cpus_only():
  assert default_eval_batch_size("mlp", "cpu") == 1024
  for model in ("cnn", "coaching_cnn", "coaching_cnn_bn", "fedavg_cnn", "resnet18"):
    assert default_eval_batch_size(model, "cpu") == 64
    assert default_eval_batch_size(model, "gpu") == 1024


def test_default_mesh_spans_no_more_cpu_devices_than_the_smallest_bucket():
  assert sharding.default_mesh([36]).size == 1  # this process has one CPU device
  assert sharding.default_mesh([35, 1]).size == 1


def test_algorithm_names_are_taken_in_any_case():
  assert algorithms.canonical_name("FedAvg") == "fedavg"
  assert algorithms.get("PFEDME") is algorithms.REGISTRY["pfedme"]
  with pytest.raises(ConfigError, match="unknown algorithm 'FedNope'"):
    algorithms.canonical_name("FedNope")


def test_observe_sums_over_the_real_steps_at_each_steps_starting_params():
  """train(observe=...): summed over the real steps only (a client padded from 3 to 5
  samples skips its padded step), each read before its step."""
  data, _ = tiny_data([3, 5])
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2, epochs=2)
  params = init_params(model)
  split = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0]).train
  seen_samples = lambda p, x, y, w: jnp.sum(w)
  trained, stats, samples = trainer.train(params, split, jax.random.key(0),
                                          observe=seen_samples)
  assert float(samples) == 6.0 and int(stats.steps) == 4
  plain, _ = trainer.train(params, split, jax.random.key(0))
  chex.assert_trees_all_close(plain, trained)
  # Full batches, two epochs: the bias at the start plus the bias after one step.
  full = tiny_trainer(model, batch_size=8, epochs=2)
  bias = lambda p, x, y, w: p["params"]["Dense_1"]["bias"]
  _, _, biases = full.train(params, split, jax.random.key(0), observe=bias)
  one_step, _ = full.train(params, split, jax.random.key(0), epochs=1)
  np.testing.assert_allclose(biases, params["params"]["Dense_1"]["bias"]
                             + one_step["params"]["Dense_1"]["bias"], atol=1e-6)
