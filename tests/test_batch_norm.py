"""BatchNorm statistics in the engine (fedora_jax/engine/batch_stats.py): folded into the
parameters, train mode in local training and inference mode elsewhere, running averages
set by hand-checkable EMA steps over the real samples only, untouched by padding, the
optimizer and regularisers, carried back through merges and mixtures, checkpointed;
Per-FedAvg's and pFedMe's own gradient loops in train mode, each pass moving the averages;
ALA's weight learning in train mode over the local model's averages; and ResNet-18
itself initialised and trained one step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import ala, layers, local, perfedavg, pfedhn, pfedme
from fedora_jax.checkpoint import Checkpointer
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import batch_stats
from fedora_jax.models import build_model, default_client_chunk
from fedora_jax.rounds import RoundMetrics
from tiny import (TinyBN, init_folded, init_params, run_rounds, tiny_data, tiny_model,
                  tiny_trainer)

EPS = 1e-5  # BatchNorm's epsilon (PyTorch's)


def _hidden(params, x):
  """The BatchNorm's input: the first dense layer of TinyBN."""
  dense = params["params"]["Dense_0"]
  return x @ dense["kernel"] + dense["bias"]


def _statistics(params):
  return params["params"]["BatchNorm_0"]["batch_stats"]


def test_fold_puts_the_statistics_beside_their_layer_and_unfold_undoes_it():
  variables = init_params(TinyBN())
  folded = batch_stats.fold(variables)
  assert list(folded) == ["params"]
  assert sorted(folded["params"]["BatchNorm_0"]) == ["batch_stats", "bias", "scale"]
  chex.assert_trees_all_equal(_statistics(folded), variables["batch_stats"]["BatchNorm_0"])
  chex.assert_trees_all_equal(batch_stats.unfold(folded), variables)
  assert batch_stats.unfold(variables) is variables
  assert batch_stats.has_statistics(folded)
  paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(folded)]
  assert [jax.tree_util.keystr(p) for p in paths if batch_stats.is_statistic(p)] == [
      "['params']['BatchNorm_0']['batch_stats']['mean']",
      "['params']['BatchNorm_0']['batch_stats']['var']"]
  assert sum(map(batch_stats.is_batch_norm, paths)) == 4  # + scale and bias
  mlp = init_params(tiny_model())
  assert batch_stats.fold(mlp) is mlp and not batch_stats.has_statistics(mlp)


def test_inference_mode_outside_training_and_train_mode_inside():
  model = TinyBN()
  params = init_folded(model)
  trainer = tiny_trainer(model)
  x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
  real = np.array([True] * 4 + [False] * 2)
  h = _hidden(params, x)
  # Inference: the running averages (mean 0, variance 1 at init).
  chex.assert_trees_all_close(trainer.apply(params, x),
                              model.apply(batch_stats.unfold(params), x))
  head = params["params"]["Dense_1"]
  chex.assert_trees_all_close(
      trainer.apply(params, x),
      jax.nn.relu(h / np.sqrt(1 + EPS)) @ head["kernel"] + head["bias"], atol=1e-5)
  # Train mode: the statistics of the real samples (biased variance).
  with batch_stats.training(jnp.asarray(real)):
    outputs = trainer.apply(params, x)
  mean, var = h[real].mean(0), h[real].var(0)
  want = jax.nn.relu((h - mean) / np.sqrt(var + EPS)) @ head["kernel"] + head["bias"]
  chex.assert_trees_all_close(outputs, want, atol=1e-5)
  assert not np.allclose(outputs, trainer.apply(params, x), atol=1e-3)
  # No gradient trains a running average in inference mode (pFedMe's own loop, say).
  grads = jax.grad(trainer.loss)(params, x, np.zeros(6, np.int32), real.astype(np.float32))
  chex.assert_trees_all_equal(_statistics(grads), jax.tree.map(jnp.zeros_like,
                                                               _statistics(params)))
  assert np.abs(grads["params"]["BatchNorm_0"]["scale"]).max() > 0
  # A negative running variance (a mixture with negative weights) normalises as zero.
  negative = jax.tree_util.tree_map_with_path(
      lambda path, a: -a if jax.tree_util.keystr(path).endswith("['var']") else a, params)
  zero = jax.tree_util.tree_map_with_path(
      lambda path, a: 0 * a if jax.tree_util.keystr(path).endswith("['var']") else a, params)
  chex.assert_trees_all_equal(trainer.apply(negative, x), trainer.apply(zero, x))


def test_training_sets_the_ema_of_the_real_samples_and_padding_changes_nothing():
  # Client 0: 3 samples in a bucket of 9, batch 3: one real step, then two of padding.
  data, clients = tiny_data([3, 9])
  bucket = tree.first(data.buckets[0].train)
  garbage = bucket._replace(x=np.where(bucket.mask[:, None], bucket.x, 1e3))
  model = TinyBN()
  params = init_folded(model)
  lr, decay, pull = 0.1, 0.5, 100.0
  trainer = tiny_trainer(model, lr=lr, momentum=0.9, weight_decay=decay, batch_size=3)
  # A strong proximal term, weight decay and momentum: none of them may touch the averages.
  regularizer = lambda p: pull * tree.squared_distance(p, jax.tree.map(jnp.zeros_like, p))
  key = jax.random.key(0)
  trained, stats = trainer.train(params, bucket, key, regularizer=regularizer)
  dirty, _ = trainer.train(params, garbage, key, regularizer=regularizer)
  assert int(stats.steps) == 1
  chex.assert_trees_all_close(dirty, trained)  # padding reaches neither BN nor the loss

  x, y = clients[0].x_train, clients[0].y_train
  h = _hidden(params, x)
  chex.assert_trees_all_close(_statistics(trained),
                              {"mean": 0.1 * h.mean(0), "var": 0.9 + 0.1 * h.var(0)},
                              atol=1e-6)
  # The other parameters: one SGD step on train-mode BatchNorm's loss (real samples only),
  # the regulariser and weight decay (momentum's first step is the gradient itself).
  def loss(weights):
    variables = {"params": weights, "batch_stats": batch_stats.unfold(params)["batch_stats"]}
    logits, _ = model.apply(variables, x, mutable=["batch_stats"])
    data_loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return data_loss + pull * tree.squared_distance(weights, jax.tree.map(jnp.zeros_like,
                                                                         weights))
  weights = batch_stats.unfold(params)["params"]
  want = jax.tree.map(lambda w, g: w - lr * (g + decay * w), weights, jax.grad(loss)(weights))
  chex.assert_trees_all_close(batch_stats.unfold(trained)["params"], want, atol=1e-6)


def test_statistics_ride_back_through_mixtures_and_constants_get_none():
  # The trained pytree holds two models; the loss runs their mixture a v + (1 - a) w beside
  # a fixed third model (MOON's global model, say).
  model = TinyBN()
  v, w, fixed = (init_folded(model, seed=s) for s in (0, 1, 2))
  v = jax.tree_util.tree_map_with_path(  # distinct running averages, to tell them apart
      lambda path, a: a + 0.5 if batch_stats.is_statistic(path) else a, v)
  trainer = tiny_trainer(model, lr=0.1, batch_size=8)
  a = 0.25

  def mixed_loss(p, x, y, weights):
    mixture = jax.tree.map(lambda s, t: a * s + (1 - a) * t, p["v"], p["w"])
    return (trainer.loss(mixture, x, y, weights)
            + 0.0 * jnp.sum(trainer.apply(fixed, x)))
  data, clients = tiny_data([6])
  trained, _ = trainer.train({"v": v, "w": w}, tree.first(data.buckets[0].train),
                             jax.random.key(0), loss_fn=mixed_loss)
  mixture = jax.tree.map(lambda s, t: a * s + (1 - a) * t, v, w)
  h = _hidden(mixture, clients[0].x_train)
  used = _statistics(mixture)
  step = {"mean": 0.1 * (used["mean"] - h.mean(0)), "var": 0.1 * (used["var"] - h.var(0))}
  # used - new = 0.1 (used - batch); each model moves by its share of it.
  for name, share, start in (("v", a, v), ("w", 1 - a, w)):
    want = jax.tree.map(lambda s, d, c=share: s - c * d, _statistics(start), step)
    chex.assert_trees_all_close(_statistics(trained[name]), want, atol=1e-6)


def test_a_loss_on_the_representation_alone_updates_the_statistics_too():
  # FedCP, FedPAC: the logits unused, only the body's output (the head's input).
  model = TinyBN()
  params = init_folded(model)
  trainer = tiny_trainer(model, lr=0.1, batch_size=8)

  def features_loss(p, x, y, weights):
    del y
    z = layers.apply_with_representation(trainer.apply, p, x, "Dense_1")[1]
    return jnp.sum(jnp.square(z) * weights[:, None]) / jnp.sum(weights)
  data, clients = tiny_data([6])
  trained, _ = trainer.train(params, tree.first(data.buckets[0].train), jax.random.key(0),
                             loss_fn=features_loss)
  h = _hidden(params, clients[0].x_train)
  chex.assert_trees_all_close(_statistics(trained),
                              {"mean": 0.1 * h.mean(0), "var": 0.9 + 0.1 * h.var(0)},
                              atol=1e-6)


def test_checkpoint_restores_the_statistics(tmp_path):
  data, _ = tiny_data([4, 6])
  model = TinyBN()
  trainer = tiny_trainer(model, batch_size=2)
  state, metrics, stacked, _ = run_rounds(local.local(local.LocalConfig(), trainer), trainer,
                                          data, model, rounds=1)
  trained = _statistics(state.algorithm.clients)
  assert not np.allclose(trained["mean"], _statistics(stacked)["mean"])
  checkpointer = Checkpointer(str(tmp_path), every=1)
  checkpointer.save(state, [jax.tree.map(np.asarray, metrics)])
  restored = checkpointer.restore(jax.tree.map(jnp.zeros_like, state),
                                  jax.tree.map(np.asarray, metrics), total_rounds=2)
  chex.assert_trees_all_equal(_statistics(restored.state.algorithm.clients), trained)
  assert isinstance(restored.history, RoundMetrics)


def test_pfedhn_generates_the_initial_running_averages_at_first():
  target = init_folded(TinyBN())
  net = pfedhn.init_hypernetwork(jax.random.key(0), 3, 8, 1, target)
  for seed in (1, 2):
    generated = pfedhn.hypernetwork_apply(net, jax.random.normal(jax.random.key(seed), (3,)))
    chex.assert_trees_all_equal(_statistics(generated), _statistics(target))
    assert not np.allclose(generated["params"]["Dense_0"]["kernel"],
                           target["params"]["Dense_0"]["kernel"])


def test_resnet18_initialises_and_trains_one_client_step():
  model = build_model("resnet18", num_outputs=10)
  rng = np.random.default_rng(0)
  # 8x8 images (stages 8, 4, 2, 1 under the global pool): the same program as on 32x32
  # CIFAR images, a sixteenth of the arithmetic at the suite's low optimisation level.
  x = rng.integers(0, 256, (2, 8, 8, 3)).astype(np.uint8)
  params = batch_stats.fold(model.init(jax.random.key(0), x[:1]))
  data = ClientData(x=x, y=np.array([3, 7], np.int32), mask=np.ones(2, bool),
                    n=np.int32(2))
  trainer = tiny_trainer(model, lr=0.01, momentum=0.9, batch_size=2)
  trained, stats = jax.jit(trainer.train)(params, data, jax.random.key(1))
  assert int(stats.steps) == 1 and np.isfinite(stats.loss)
  stem = trained["params"]["ConvBN_0"]["BatchNorm_0"]["batch_stats"]
  assert np.abs(stem["mean"]).max() > 0 and not np.allclose(stem["var"], 1.0)
  assert default_client_chunk("resnet18", "cpu") == 1
  assert default_client_chunk("resnet18", "gpu") is None


def _train_mode_loss(model, statistics):
  """The train-mode loss of weights (folded-out params) on (x, y), written without the
  engine: BatchNorm normalises with the batch, whatever the running averages."""
  def loss(weights, x, y):
    variables = {"params": weights, "batch_stats": statistics}
    logits, _ = model.apply(variables, x, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss


def _ema(statistics, weights, x):
  """flax's running-average step (momentum 0.9, biased variance) over the batch x."""
  h = _hidden({"params": weights}, x)
  return {"mean": 0.9 * statistics["mean"] + 0.1 * h.mean(0),
          "var": 0.9 * statistics["var"] + 0.1 * h.var(0)}


def _batches(count, size=6):
  rng = np.random.default_rng(3)
  return [(rng.normal(size=(size, 4)).astype(np.float32), rng.integers(0, 3, size),
           np.ones(size, np.float32)) for _ in range(count)]


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_trains_in_train_mode_and_each_pass_moves_the_averages(variant):
  model = TinyBN()
  params = init_folded(model)
  trainer = tiny_trainer(model)
  config = perfedavg.PerFedAvgConfig(alpha=0.1, beta=0.05, variant=variant)
  batches = _batches(3 if variant == "hf" else 2)
  new, _ = perfedavg.meta_step(trainer.loss, params, tuple(batches), config)

  unfolded = batch_stats.unfold(params)
  weights, start = unfolded["params"], unfolded["batch_stats"]["BatchNorm_0"]
  loss = _train_mode_loss(model, unfolded["batch_stats"])
  grad = jax.grad(loss)
  adapted = jax.tree.map(lambda w, g: w - 0.1 * g, weights, grad(weights, *batches[0][:2]))
  outer = grad(adapted, *batches[1][:2])
  averages = _ema(_ema(start, weights, batches[0][0]), adapted, batches[1][0])
  if variant == "hf":
    hessian_vector = jax.jvp(lambda w: grad(w, *batches[2][:2]), (weights,), (outer,))[1]
    outer = jax.tree.map(lambda v, hv: v - 0.1 * hv, outer, hessian_vector)
    averages = _ema(averages, weights, batches[2][0])
  want = jax.tree.map(lambda w, g: w - 0.05 * g, weights, outer)
  got = batch_stats.unfold(new)
  chex.assert_trees_all_close(got["params"], want, atol=1e-6)
  chex.assert_trees_all_close(got["batch_stats"]["BatchNorm_0"], averages, atol=1e-6)


def test_pfedme_solves_in_train_mode_and_w_takes_thetas_averages():
  model = TinyBN()
  params = init_folded(model)
  trainer = tiny_trainer(model)
  config = pfedme.PfedmeConfig(k=2, personal_lr=0.1, lam=15.0, eta=0.005)
  x, y, w = _batches(1)[0]
  theta, _ = pfedme.solve_personal(trainer.loss, config, params, params, x, y, w)
  local = pfedme.local_update(params, theta, config)

  unfolded = batch_stats.unfold(params)
  weights, averages = unfolded["params"], unfolded["batch_stats"]["BatchNorm_0"]
  grad = jax.grad(_train_mode_loss(model, unfolded["batch_stats"]))
  solved = weights
  for _ in range(2):
    averages = _ema(averages, solved, x)
    solved = jax.tree.map(lambda t, g, w0: t - 0.1 * (g + 15.0 * (t - w0)), solved,
                          grad(solved, x, y), weights)
  got = batch_stats.unfold(theta)
  chex.assert_trees_all_close(got["params"], solved, atol=1e-6)
  chex.assert_trees_all_close(got["batch_stats"]["BatchNorm_0"], averages, atol=1e-6)
  rate = 0.005 * 15.0
  chex.assert_trees_all_close(
      batch_stats.unfold(local)["params"],
      jax.tree.map(lambda w0, t: w0 - rate * (w0 - t), weights, solved), atol=1e-6)
  chex.assert_trees_all_equal(_statistics(local), _statistics(theta))


def _tiny_bn_pair():
  """A TinyBN local model with moved running averages, and a global model equal to it
  but for its first dense layer, doubled, and its own running averages."""
  model = TinyBN()
  local_params = init_folded(model, seed=0)
  stats = _statistics(local_params)
  local_params["params"]["BatchNorm_0"]["batch_stats"] = {
      "mean": stats["mean"] + 0.3, "var": stats["var"] * 2.0}
  global_params = jax.tree.map(lambda a: a, local_params)
  global_params["params"]["Dense_0"] = jax.tree.map(lambda a: 2.0 * a,
                                                    local_params["params"]["Dense_0"])
  global_params["params"]["BatchNorm_0"]["batch_stats"] = {
      "mean": stats["mean"] - 1.0, "var": stats["var"] * 5.0}
  return model, local_params, global_params


def test_ala_keeps_the_local_running_averages_and_learns_in_train_mode():
  model, local_params, global_params = _tiny_bn_pair()
  weights = jax.tree.map(lambda a: jnp.full_like(a, 0.5), local_params)  # p = every layer
  theta_hat = ala.aggregate_locally(local_params, global_params, weights)
  # Parameters mixed, running averages the local model's (the authors' buffers).
  chex.assert_trees_all_close(theta_hat["params"]["Dense_0"], jax.tree.map(
      lambda a: 1.5 * a, local_params["params"]["Dense_0"]))
  chex.assert_trees_all_equal(_statistics(theta_hat), _statistics(local_params))

  data, _ = tiny_data([6, 6])
  train = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0].train)
  eta = 1e-3
  config = ala.AlaConfig(s=100.0, eta=eta, batch_size=8)  # one full batch, a later round
  trainer = tiny_trainer(model)
  learned, _, _ = ala.learn_weights(trainer.loss, config, local_params, global_params,
                                    weights, jnp.asarray(5), train, jax.random.key(0))
  step = jax.tree.map(lambda w, new: (w - new) / eta, weights, learned)  # eta x gradient
  # Train mode: the batch's statistics undo a rescaling of BatchNorm's input, and
  # theta_hat's first layer is (1 + W) x the local one, so the gradient along all of
  # its weights at once is 0 (up to BatchNorm's epsilon).
  along = sum(jnp.sum(g) for g in jax.tree.leaves(step["params"]["Dense_0"]))
  assert abs(float(along)) < 1e-3
  # Inference mode (the running averages) would not undo it.
  inference = jax.grad(lambda w: trainer.loss(
      ala.aggregate_locally(local_params, global_params, w), train.x, train.y,
      train.mask.astype(jnp.float32)))(weights)
  assert abs(float(sum(jnp.sum(g) for g in jax.tree.leaves(
      inference["params"]["Dense_0"])))) > 100 * abs(float(along))
  # W's entries at the running averages take no step.
  chex.assert_trees_all_equal(_statistics(learned), _statistics(weights))
