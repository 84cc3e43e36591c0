"""Ditto's two models and APFL's joint step: w, v, alpha and the mixed model, by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import apfl, ditto
from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def _one_client_case():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  return data, model, splits, clients[0]


def _grad(model, params, client):
  return jax.grad(lambda p: mean_ce(model, p, client.x_train, client.y_train))(params)


def test_ditto_trains_a_fedavg_upload_and_a_regularised_personal_model():
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  global_params, personal = init_params(model, seed=0), init_params(model, seed=1)
  lam = 0.7
  algorithm = ditto.ditto(ditto.DittoConfig(lam=lam, lambda_selection="fixed"), trainer)
  out = algorithm.client_update(personal, global_params, splits, jax.random.key(0))

  expected_upload, expected_personal = global_params, personal
  for _ in range(2):
    expected_upload = jax.tree.map(lambda p, g: p - LR * g, expected_upload,
                                   _grad(model, expected_upload, client))
    # v -= lr (grad F(v) + lambda (v - w^t)), anchored at the received global model.
    expected_personal = jax.tree.map(lambda v, g, w: v - LR * (g + lam * (v - w)),
                                     expected_personal, _grad(model, expected_personal, client),
                                     global_params)
  chex.assert_trees_all_close(out.upload, expected_upload, atol=1e-6)
  chex.assert_trees_all_close(out.state, expected_personal, atol=1e-6)
  np.testing.assert_allclose(out.metrics["global_train_loss"],
                             mean_ce(model, global_params, client.x_train, client.y_train) / 2
                             + mean_ce(model, jax.tree.map(lambda p, g: p - LR * g, global_params,
                                                           _grad(model, global_params, client)),
                                       client.x_train, client.y_train) / 2, rtol=1e-5)


def test_ditto_server_averages_uploads_and_evaluates_personal_models():
  algorithm = ditto.ditto(ditto.DittoConfig(), tiny_trainer(tiny_model()))
  uploads = {"w": jnp.array([[1.0], [4.0]])}
  personal = {"w": jnp.array([[7.0], [9.0]])}
  state = algorithm.aggregate({"w": jnp.array([0.0])}, personal, uploads,
                              jnp.array([2.0, 1.0]))
  np.testing.assert_allclose(state.server["w"], [2.0])  # (2 * 1 + 1 * 4) / 3
  np.testing.assert_allclose(algorithm.personalized_params(state.server, state.clients)["w"],
                             personal["w"])


def _val_loss(model, params, client):
  return mean_ce(model, params, client.x_val, client.y_val)


def _fitted_to_validation(model, client, steps=10):
  """A global model that has seen the validation data: pulling towards it can pay."""
  params = init_params(model, seed=0)
  for _ in range(steps):
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params,
                          jax.grad(lambda p: _val_loss(model, p, client))(params))
  return params


def test_ditto_per_client_lambda_keeps_the_grid_model_best_on_validation():
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)  # two full-batch steps
  global_params, personal = _fitted_to_validation(model, client), init_params(model, seed=1)
  grid = (5.0, 0.5, 0.0)
  algorithm = ditto.ditto(ditto.DittoConfig(lam=1.0, lambda_selection="per_client",
                                            lambdas="5,0.5,0"), trainer)
  out = algorithm.client_update(personal, global_params, splits, jax.random.key(0))

  by_lambda = {}
  for lam in grid:
    v = personal
    for _ in range(2):
      v = jax.tree.map(lambda v, g, w, lam=lam: v - LR * (g + lam * (v - w)), v,
                       _grad(model, v, client), global_params)
    by_lambda[lam] = v
  val = {lam: float(_val_loss(model, v, client)) for lam, v in by_lambda.items()}
  best = min(val, key=val.get)
  assert len({round(v, 6) for v in val.values()}) == 3  # the choice is not a tie
  chex.assert_trees_all_close(out.state, by_lambda[best], atol=1e-6)
  np.testing.assert_allclose(out.metrics["lambda"], best)
  np.testing.assert_allclose(out.train.loss,
                             (mean_ce(model, personal, client.x_train, client.y_train)
                              + mean_ce(model, jax.tree.map(
                                  lambda v, g, w: v - LR * (g + best * (v - w)), personal,
                                  _grad(model, personal, client), global_params),
                                  client.x_train, client.y_train)) / 2, rtol=1e-5)


def test_ditto_per_client_lambda_falls_back_to_lam_without_validation_data():
  # Appendix C: fewer than 4 validation samples -> the fixed lambda (here not in the grid).
  rng = np.random.default_rng(0)
  def split(n):
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)
  client = Client(*split(6), *split(3), *split(6))
  data = stack_clients([client], 3, 2.0)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)  # one full-batch step
  global_params, personal = init_params(model, seed=0), init_params(model, seed=1)
  algorithm = ditto.ditto(ditto.DittoConfig(lam=0.7, lambda_selection="per_client"),
                          trainer)
  out = algorithm.client_update(personal, global_params, splits, jax.random.key(0))
  expected = jax.tree.map(lambda v, g, w: v - LR * (g + 0.7 * (v - w)), personal,
                          _grad(model, personal, client), global_params)
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)
  np.testing.assert_allclose(out.metrics["lambda"], 0.7, rtol=1e-6)


def test_ditto_per_step_lambda_chooses_every_step_as_the_authors_code():
  # dynamic_lam: one gradient g at v, candidates v - lr (g + lambda (v - w^t)), the best
  # on validation kept, at every step (plain SGD: exactly the code's update).
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=3)  # three full-batch steps
  global_params, personal = _fitted_to_validation(model, client), init_params(model, seed=1)
  grid = (0.1, 1.0, 20.0)
  algorithm = ditto.ditto(ditto.DittoConfig(lambda_selection="per_step", lambdas="0.1,1,20",
                                            lr=LR), trainer)
  out = algorithm.client_update(personal, global_params, splits, jax.random.key(0))

  v, chosen = personal, []
  for _ in range(3):
    g = _grad(model, v, client)
    steps = {lam: jax.tree.map(lambda v, g, w, lam=lam: v - LR * (g + lam * (v - w)), v, g,
                               global_params) for lam in grid}
    val = {lam: float(_val_loss(model, s, client)) for lam, s in steps.items()}
    chosen.append(min(val, key=val.get))
    v = steps[chosen[-1]]
  assert len(set(chosen)) > 1  # the case really changes lambda between steps
  chex.assert_trees_all_close(out.state, v, atol=1e-5)
  assert "lambda" not in out.metrics


def test_ditto_rejects_a_bad_lambda_grid_or_selection():
  trainer = tiny_trainer(tiny_model())
  with pytest.raises(ConfigError, match="ditto: lambdas"):
    ditto.ditto(ditto.DittoConfig(lambdas="0.1,x"), trainer)
  with pytest.raises(ConfigError, match="ditto: lambdas"):
    ditto.ditto(ditto.DittoConfig(lambdas="0.1,-1"), trainer)
  with pytest.raises(ConfigError, match="ditto: lambda_selection"):
    ditto.ditto(ditto.DittoConfig(lambda_selection="dynamic"), trainer)


def test_apfl_one_step_updates_w_v_and_alpha_as_the_paper():
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=1)  # one full-batch step
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  alpha = 0.3
  algorithm = apfl.apfl(apfl.ApflConfig(alpha=alpha, mixing="parameters",
                                        alpha_update="step"), trainer)
  state = apfl.ApflClient(local=local, alpha=jnp.asarray(alpha), own_global=global_params)
  out = algorithm.client_update(state, global_params, splits, jax.random.key(0))

  mixed = jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w, local, global_params)
  grad_mixed = _grad(model, mixed, client)
  expected_w = jax.tree.map(lambda w, g: w - LR * g, global_params,
                            _grad(model, global_params, client))
  expected_v = jax.tree.map(lambda v, g: v - LR * alpha * g, local, grad_mixed)
  # d f(alpha v + (1 - alpha) w) / d alpha = <v - w, grad f(v_bar)>.
  grad_alpha = sum(jnp.vdot(v - w, g) for v, w, g in zip(
      jax.tree.leaves(local), jax.tree.leaves(global_params), jax.tree.leaves(grad_mixed)))
  chex.assert_trees_all_close(out.upload, expected_w, atol=1e-6)
  chex.assert_trees_all_close(out.state.local, expected_v, atol=1e-6)
  np.testing.assert_allclose(out.state.alpha, np.clip(alpha - LR * grad_alpha, 0, 1),
                             atol=1e-6)
  assert abs(float(grad_alpha)) > 1e-3  # the case really moves alpha
  np.testing.assert_allclose(out.metrics["alpha"], out.state.alpha)
  np.testing.assert_allclose(out.train.loss,
                             mean_ce(model, global_params, client.x_train, client.y_train)
                             + mean_ce(model, mixed, client.x_train, client.y_train), rtol=1e-5)


def test_apfl_alpha_stays_in_the_unit_interval_or_fixed():
  _, model, splits, _ = _one_client_case()
  trainer = tiny_trainer(model, lr=1e3, batch_size=8)  # a huge step must be projected
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  state = apfl.ApflClient(local=local, alpha=jnp.asarray(0.5), own_global=global_params)
  adaptive = apfl.apfl(apfl.ApflConfig(alpha_update="step"), trainer)
  alpha = adaptive.client_update(state, global_params, splits, jax.random.key(0)).state.alpha
  assert float(alpha) in (0.0, 1.0)
  fixed = apfl.apfl(apfl.ApflConfig(adapt_alpha=False), trainer)
  np.testing.assert_allclose(
      fixed.client_update(state, global_params, splits, jax.random.key(0)).state.alpha, 0.5)
  with pytest.raises(ConfigError, match="apfl: alpha"):
    apfl.apfl(apfl.ApflConfig(alpha=1.5), trainer)


def test_apfl_evaluates_each_clients_mixture_with_the_new_global_model():
  data, model, _, _ = _one_client_case()
  trainer = tiny_trainer(model)
  algorithm = apfl.apfl(apfl.ApflConfig(alpha=0.25, mixing="parameters"), trainer)
  stacked = jax.vmap(lambda s: init_params(model, seed=s))(jnp.arange(2))
  state = algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                                     key=jax.random.key(0)))
  np.testing.assert_allclose(state.clients.alpha, [0.25, 0.25])
  clients = state.clients._replace(alpha=jnp.array([0.25, 1.0]))
  server = init_params(model, seed=5)
  mixed = algorithm.personalized_params(server, clients)
  for k, a in enumerate([0.25, 1.0]):
    expected = jax.tree.map(lambda v, w, a=a, k=k: a * v[k] + (1 - a) * w, clients.local, server)
    chex.assert_trees_all_close(jax.tree.map(lambda m, k=k: m[k], mixed), expected, atol=1e-6)


def test_apfl_output_mixing_step_and_evaluation_as_the_authors_code():
  # mixing="output": the personal loss is CE(alpha v(x) + (1 - alpha) w(x)), w frozen in it.
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=1)  # one full-batch step
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  alpha = 0.3
  algorithm = apfl.apfl(apfl.ApflConfig(alpha=alpha, alpha_update="step"), trainer)
  state = apfl.ApflClient(local=local, alpha=jnp.asarray(alpha), own_global=local)
  out = algorithm.client_update(state, global_params, splits, jax.random.key(0))

  x, y = jnp.asarray(client.x_train), jnp.asarray(client.y_train)
  def ce(logits):
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
  def personal_loss(v, a):
    return ce(a * model.apply(v, x) + (1 - a) * model.apply(global_params, x))
  grad_v, grad_alpha = jax.grad(personal_loss, argnums=(0, 1))(local, alpha)
  # d CE / d alpha = mean over samples of <v(x) - w(x), softmax - onehot>, by hand:
  logits = alpha * model.apply(local, x) + (1 - alpha) * model.apply(global_params, x)
  probs = jax.nn.softmax(logits)
  by_hand = jnp.mean(jnp.sum((model.apply(local, x) - model.apply(global_params, x))
                             * (probs - jax.nn.one_hot(y, probs.shape[-1])), -1))
  np.testing.assert_allclose(grad_alpha, by_hand, rtol=1e-5)
  expected_w = jax.tree.map(lambda w, g: w - LR * g, global_params,
                            _grad(model, global_params, client))
  chex.assert_trees_all_close(out.upload, expected_w, atol=1e-6)
  chex.assert_trees_all_close(out.state.own_global, expected_w, atol=1e-6)
  chex.assert_trees_all_close(out.state.local,
                              jax.tree.map(lambda v, g: v - LR * g, local, grad_v), atol=1e-6)
  np.testing.assert_allclose(out.state.alpha, np.clip(alpha - LR * by_hand, 0, 1), atol=1e-6)
  assert abs(float(by_hand)) > 1e-3  # the case really moves alpha

  # Evaluation: the mixture of outputs with the client's own w_k, not the new global model.
  personal = algorithm.personalized_params(init_params(model, seed=7), jax.tree.map(
      lambda a: a[None], out.state))
  one = jax.tree.map(lambda a: a[0], personal)
  mixed = (out.state.alpha * model.apply(out.state.local, x)
           + (1 - out.state.alpha) * model.apply(expected_w, x))
  stats = algorithm.evaluate(one, splits.train)
  np.testing.assert_allclose(stats.loss, ce(mixed), rtol=1e-5)
  np.testing.assert_allclose(stats.score, jnp.mean(jnp.argmax(mixed, -1) == y), rtol=1e-6)
  with pytest.raises(ConfigError, match="apfl: mixing"):
    apfl.apfl(apfl.ApflConfig(mixing="logits"), trainer)


def test_apfl_round_alpha_step_as_the_authors_code():
  # alpha_update="round": alpha <- clip(alpha - lr (dCE(mixture)/dalpha + 0.02 alpha)) once,
  # at the round's start, on the whole training split; the local steps keep it fixed.
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=1)  # one full-batch step
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  alpha, alpha_lr = 0.3, 5.0
  algorithm = apfl.apfl(apfl.ApflConfig(alpha=alpha, lr=alpha_lr), trainer)
  state = apfl.ApflClient(local=local, alpha=jnp.asarray(alpha), own_global=local)
  out = algorithm.client_update(state, global_params, splits, jax.random.key(0))

  x, y = jnp.asarray(client.x_train), jnp.asarray(client.y_train)
  v_out, w_out = model.apply(local, x), model.apply(global_params, x)
  probs = jax.nn.softmax(alpha * v_out + (1 - alpha) * w_out)
  grad_alpha = jnp.mean(jnp.sum((v_out - w_out) * (probs - jax.nn.one_hot(y, 3)), -1))
  new_alpha = np.clip(alpha - alpha_lr * (grad_alpha + 0.02 * alpha), 0, 1)
  assert abs(new_alpha - alpha) > 1e-3  # the case really moves alpha
  np.testing.assert_allclose(out.state.alpha, new_alpha, rtol=1e-5)
  # The round's step on v uses the new alpha, which the step itself leaves alone.
  def ce(v):
    logits = new_alpha * model.apply(v, x) + (1 - new_alpha) * w_out
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
  chex.assert_trees_all_close(
      out.state.local, jax.tree.map(lambda v, g: v - LR * g, local, jax.grad(ce)(local)),
      atol=1e-6)
  with pytest.raises(ConfigError, match="apfl: alpha_update"):
    apfl.apfl(apfl.ApflConfig(alpha_update="epoch"), trainer)


def test_apfl_pfllib_form_step_alpha_and_round_end_mixture():
  # mixing="pfllib" (PFLlib's clientapfl.py): w and v step on their own losses, then
  # alpha <- clip(alpha - lr (<v' - w', alpha g_v + (1 - alpha) g_w> + 0.02 alpha)) with the
  # stepped iterates; at the round's end v <- (1 - alpha) w' + alpha v', the personal model.
  _, model, splits, client = _one_client_case()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=1)  # one full-batch step
  global_params, local = init_params(model, seed=0), init_params(model, seed=1)
  alpha, alpha_lr = 0.6, LR
  algorithm = apfl.apfl(apfl.ApflConfig(alpha=alpha, mixing="pfllib", lr=alpha_lr), trainer)
  state = apfl.ApflClient(local=local, alpha=jnp.asarray(alpha), own_global=local)
  out = algorithm.client_update(state, global_params, splits, jax.random.key(0))

  grad_w, grad_v = _grad(model, global_params, client), _grad(model, local, client)
  new_w = jax.tree.map(lambda w, g: w - LR * g, global_params, grad_w)
  new_v = jax.tree.map(lambda v, g: v - LR * g, local, grad_v)
  grad_alpha = sum(jnp.vdot(v - w, alpha * gv + (1 - alpha) * gw) for v, w, gv, gw in zip(
      *map(jax.tree.leaves, (new_v, new_w, grad_v, grad_w)))) + 0.02 * alpha
  new_alpha = float(np.clip(alpha - alpha_lr * grad_alpha, 0, 1))
  assert abs(new_alpha - alpha) > 1e-3  # the case really moves alpha
  np.testing.assert_allclose(out.state.alpha, new_alpha, rtol=1e-5)
  chex.assert_trees_all_close(out.upload, new_w, atol=1e-6)
  mixed = jax.tree.map(lambda v, w: new_alpha * v + (1 - new_alpha) * w, new_v, new_w)
  chex.assert_trees_all_close(out.state.local, mixed, atol=1e-6)
  np.testing.assert_allclose(out.train.loss,
                             mean_ce(model, global_params, client.x_train, client.y_train)
                             + mean_ce(model, local, client.x_train, client.y_train), rtol=1e-5)
  # Evaluated: that mixture, whatever the new global model.
  stacked = jax.tree.map(lambda a: a[None], out.state)
  chex.assert_trees_all_close(
      algorithm.personalized_params(init_params(model, seed=7), stacked),
      jax.tree.map(lambda a: a[None], mixed), atol=1e-6)
  fixed = apfl.apfl(apfl.ApflConfig(alpha=alpha, mixing="pfllib", adapt_alpha=False), trainer)
  np.testing.assert_allclose(
      fixed.client_update(state, global_params, splits, jax.random.key(0)).state.alpha, alpha)
