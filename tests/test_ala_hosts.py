"""ALA on Per-FedAvg, pFedMe, FedPHP, FedRep and PartialFed (FedALA's "+ALA" table): one
client's round by hand.

Each client holds identical samples, so every batch's mean loss is that sample's whatever
the shuffle or ALA's s% sample: W's one step (a later round, s = 100 %, one full batch),
theta_hat, the host's training from theta_hat and the model ALA keeps as theta_i are all
written out below with jax.grad of the sample's loss.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.algorithms import ala, fedphp, fedrep, partialfed, perfedavg, pfedme
from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import Client, stack_clients
from tiny import init_params, mean_ce, tiny_model, tiny_trainer

ALA_CONFIG = ala.AlaConfig(s=100.0, p=1, eta=2.0, batch_size=8)


def _identical_sample_client(num_samples=4):
  rng = np.random.default_rng(3)
  x = np.repeat(rng.normal(size=(1, 4)).astype(np.float32), num_samples, axis=0)
  y = np.full(num_samples, 1, np.int32)
  extra = (rng.normal(size=(2, 4)).astype(np.float32), np.zeros(2, np.int32))
  data = stack_clients([Client(x, y, *extra, *extra)], num_classes=3)
  return jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0]), x, y


def _sgd(params, grads, lr):
  return jax.tree.map(lambda p, g: p - lr * g, params, grads)


class _Case:
  """theta_i (local), the received global model, W at 0.5 on the top layer (Dense_1), and
  theta_hat after W's one step, by hand."""

  def __init__(self):
    self.model = tiny_model()                      # Dense_0 (4 -> 5), Dense_1 (5 -> 3)
    self.splits, self.x, self.y = _identical_sample_client()
    self.local, self.global_ = init_params(self.model, seed=1), init_params(self.model)
    top = lambda p: p["params"]["Dense_1"]
    self.weights = {"params": {"Dense_1": jax.tree.map(lambda a: jnp.full_like(a, 0.5),
                                                       top(self.local))}}
    self.grad = jax.jit(jax.grad(lambda p: mean_ce(self.model, p, self.x, self.y)))

    def mixed(w):  # theta_hat(W): Dense_0 global, Dense_1 = local + (global - local) * W
      top_layer = jax.tree.map(lambda l, g, a: l + (g - l) * a, top(self.local),
                               top(self.global_), w)
      return {"params": {"Dense_0": self.global_["params"]["Dense_0"], "Dense_1": top_layer}}
    # W <- clip(W - eta * grad_theta L(theta_hat(W)) * (Theta - theta_i), 0, 1)
    grad_top = top(self.grad(mixed(self.weights["params"]["Dense_1"])))
    self.new_weights = jax.tree.map(
        lambda w, g, gl, lo: jnp.clip(w - ALA_CONFIG.eta * g * (gl - lo), 0.0, 1.0),
        self.weights["params"]["Dense_1"], grad_top, top(self.global_), top(self.local))
    self.theta_hat = mixed(self.new_weights)

  def client_update(self, host, host_state, trainer):
    wrapped = ala.with_ala(host, ALA_CONFIG, trainer)
    client = ala.AlaClient(host=host_state, local=self.local, weights=self.weights,
                           rounds=jnp.asarray(2, jnp.int32))   # a later round: one epoch
    out = jax.jit(wrapped.client_update)(client, self.global_, self.splits,
                                         jax.random.key(0))
    assert int(out.metrics["ala_epochs"]) == 1
    chex.assert_trees_all_close(out.state.weights["params"]["Dense_1"], self.new_weights,
                                atol=1e-6)
    stacked = jax.tree.map(lambda a: a[None], out.state)
    evaluated = jax.tree.map(lambda a: a[0], wrapped.personalized_params(None, stacked))
    return out, evaluated


def test_perfedavg_meta_trains_and_adapts_theta_hat_and_keeps_the_meta_model():
  case = _Case()
  trainer = tiny_trainer(case.model, batch_size=2, epochs=1)  # 4 samples: one FO chunk
  config = perfedavg.PerFedAvgConfig(alpha=0.4, beta=0.3)
  out, evaluated = case.client_update(perfedavg.perfedavg(config, trainer), case.global_,
                                      trainer)
  grad = case.grad
  # FO meta step from theta_hat: w - beta grad f(w - alpha grad f(w)).
  meta = _sgd(case.theta_hat, grad(_sgd(case.theta_hat, grad(case.theta_hat), 0.4)), 0.3)
  chex.assert_trees_all_close(out.upload, meta, atol=2e-6)
  chex.assert_trees_all_close(out.state.local, meta, atol=2e-6)         # theta_i: meta model
  # Evaluated: theta_hat after one adaptation step (not the global model's).
  chex.assert_trees_all_close(evaluated, _sgd(case.theta_hat, grad(case.theta_hat), 0.4),
                              atol=1e-6)


def test_pfedme_starts_theta_and_w_from_theta_hat_and_keeps_w():
  case = _Case()
  trainer = tiny_trainer(case.model, batch_size=4, epochs=2)  # R = 2 iterations of 1 batch
  config = pfedme.PfedmeConfig(lam=3.0, k=2, personal_lr=0.2, eta=0.05)
  out, evaluated = case.client_update(pfedme.pfedme(config, trainer),
                                      pfedme.PfedmeClient(personal=case.global_), trainer)
  theta, local = case.theta_hat, case.theta_hat
  for _ in range(2):
    for _ in range(2):  # K steps on h_i toward w, warm-started
      theta = jax.tree.map(lambda t, g, w: t - 0.2 * (g + 3.0 * (t - w)), theta,
                           case.grad(theta), local)
    local = jax.tree.map(lambda w, t: w - 0.05 * 3.0 * (w - t), local, theta)
  chex.assert_trees_all_close(out.upload, local, atol=2e-6)
  chex.assert_trees_all_close(out.state.local, local, atol=2e-6)   # theta_i: w_{i,R}
  chex.assert_trees_all_close(evaluated, theta, atol=2e-6)         # the personalised theta


def test_fedphp_trains_from_theta_hat_against_the_hpm_and_keeps_the_trained_model():
  case = _Case()
  trainer = tiny_trainer(case.model, lr=0.1, batch_size=2, epochs=1)  # 2 SGD steps
  config = fedphp.FedPhpConfig()                                       # MMD, lambda 0.05
  hpm = init_params(case.model, seed=2)
  state = fedphp.FedPhpClient(hpm=hpm, local=(), participations=jnp.asarray(3, jnp.int32))
  out, evaluated = case.client_update(fedphp.fedphp(config, trainer), state, trainer)
  # (1 - lambda) CE + lambda MMD(features of w, of the HPM), from theta_hat.
  loss = fedphp.php_loss(trainer, fedphp.head_inputs(case.model.apply, "Dense_1"), config,
                         hpm)
  # A batch of 2 (MMD's bandwidth depends on the batch size, not on which samples).
  grad = jax.jit(jax.grad(lambda p: loss(p, case.x[:2], case.y[:2], jnp.ones(2))))
  trained = case.theta_hat
  for _ in range(2):
    trained = _sgd(trained, grad(trained), 0.1)
  chex.assert_trees_all_close(out.upload, trained, atol=2e-6)
  chex.assert_trees_all_close(out.state.local, trained, atol=2e-6)   # theta_i: trained w_k
  mu = 0.9 * 3 / 100                               # min(mu_max c_k / Q, mu_max)
  chex.assert_trees_all_close(
      evaluated, jax.tree.map(lambda v, w: mu * v + (1 - mu) * w, hpm, trained), atol=2e-6)


# FedRep and PartialFed: the host sends some layers, or starts from some of the received
# ones. Three layers (Dense_0 4 -> 5, Dense_1 5 -> 4, Dense_2 4 -> 3), W at 0.5.

def _three_layers():
  model = tiny_model(hidden=(5, 4))
  splits, x, y = _identical_sample_client()
  local, global_ = init_params(model, seed=1), init_params(model)
  grad = jax.jit(jax.grad(lambda p: mean_ce(model, p, x, y)))
  return model, splits, local, global_, grad


def _half(params, names):
  return {"params": {n: jax.tree.map(lambda a: jnp.full_like(a, 0.5), params["params"][n])
                     for n in names}}


def _mix(local, global_, weights):
  """theta_i + (Theta - theta_i) * W on W's layers."""
  return {n: jax.tree.map(lambda l, g, w: l + (g - l) * w, local["params"][n],
                          global_["params"][n], weights[n]) for n in weights}


def _w_step(weights, grads, local, global_, names):
  """W <- clip(W - eta * dL/dtheta * (Theta - theta_i), 0, 1) on the layers `names`."""
  return {n: jax.tree.map(lambda w, g, gl, lo: jnp.clip(w - ALA_CONFIG.eta * g * (gl - lo),
                                                        0.0, 1.0),
                          weights[n], grads["params"][n], global_["params"][n],
                          local["params"][n]) if n in names else weights[n]
          for n in weights}


def _one_round(wrapped, host_state, local, weights, message, splits, key=jax.random.key(0)):
  client = ala.AlaClient(host=host_state, local=local, weights=weights,
                         rounds=jnp.asarray(2, jnp.int32))   # a later round: one epoch
  out = jax.jit(wrapped.client_update)(client, message, splits, key)
  assert int(out.metrics["ala_epochs"]) == 1
  stacked = jax.tree.map(lambda a: a[None], out.state)
  return out, jax.tree.map(lambda a: a[0], wrapped.personalized_params(None, stacked))


def test_fedrep_mixes_the_top_layer_of_the_received_body_under_the_clients_head():
  model, splits, local, global_, grad = _three_layers()
  trainer = tiny_trainer(model, batch_size=4, epochs=2)   # head step, then body step
  host = fedrep.fedrep(fedrep.FedRepConfig(head_epochs=1, head_layers=1), trainer)
  wrapped = ala.with_ala(host, ALA_CONFIG, trainer)
  # W covers the top layer of what FedRep sends, the body's (Dense_1), not the head.
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), local)
  init = wrapped.init(InitContext(params=stacked, data=None, trainer=trainer,
                                  key=jax.random.key(0)))
  assert list(init.clients.weights["params"]) == ["Dense_1"]
  body = {"params": {n: global_["params"][n] for n in ("Dense_0", "Dense_1")}}
  weights = _half(local, ["Dense_1"])

  def start(w):  # global Dense_0, mixed Dense_1, the client's own head
    return {"params": {"Dense_0": global_["params"]["Dense_0"],
                       **_mix(local, global_, w), "Dense_2": local["params"]["Dense_2"]}}
  new_weights = _w_step(weights["params"], grad(start(weights["params"])), local, global_,
                        ["Dense_1"])
  out, evaluated = _one_round(wrapped, local, local, weights, body, splits)
  chex.assert_trees_all_close(out.state.weights["params"], new_weights, atol=1e-6)
  # FedRep from theta_hat: one SGD step on the head, then one on the body.
  trained = start(new_weights)
  head_step = _sgd(trained, grad(trained), 0.1)
  trained = {"params": {**trained["params"], "Dense_2": head_step["params"]["Dense_2"]}}
  body_step = _sgd(trained, grad(trained), 0.1)
  trained = {"params": {**body_step["params"], "Dense_2": trained["params"]["Dense_2"]}}
  chex.assert_trees_all_close(out.upload, {"params": {n: trained["params"][n] for n in
                                                      ("Dense_0", "Dense_1")}}, atol=2e-6)
  chex.assert_trees_all_close(out.state.local, trained, atol=2e-6)   # theta_i: whole model
  chex.assert_trees_all_close(evaluated, trained, atol=2e-6)


def _partialfed_case(config, logits, key):
  """One PartialFed+ALA round (p = 2: W on Dense_1 and Dense_2) and its hand value for
  the loading A the host draws from its key (with_ala's split)."""
  model, splits, local, global_, grad = _three_layers()
  trainer = tiny_trainer(model, batch_size=4, epochs=1)   # one SGD step
  host = partialfed.partialfed(config, trainer)
  wrapped = ala.with_ala(host, ALA_CONFIG._replace(p=2), trainer)
  names = ["Dense_0", "Dense_1", "Dense_2"]
  load, noise, _ = partialfed.draw_loading(config, names, logits, jax.random.split(key)[1])
  load = [bool(a) for a in np.asarray(load)]
  weights = _half(local, ["Dense_1", "Dense_2"])

  def theta_hat(w):  # ALA over the received model: global Dense_0, the top two mixed
    return {"params": {"Dense_0": global_["params"]["Dense_0"], **_mix(local, global_, w)}}

  def start(w):  # PartialFed loads theta_hat's layers where A loads, keeps its own elsewhere
    return {"params": {n: (theta_hat(w) if a else local)["params"][n]
                       for n, a in zip(names, load)}}
  new_weights = _w_step(weights["params"], grad(start(weights["params"])), local, global_,
                        [n for n, a in zip(names, load) if a])
  state = partialfed.PartialFedClient(local=local, logits=logits)
  out, evaluated = _one_round(wrapped, state, local, weights, global_, splits, key)
  chex.assert_trees_all_close(out.state.weights["params"], new_weights, atol=1e-6)
  trained = _sgd(start(new_weights), grad(start(new_weights)), 0.1)
  chex.assert_trees_all_close(out.upload, trained, atol=2e-6)
  chex.assert_trees_all_close(out.state.local, trained, atol=2e-6)   # theta_i: trained
  chex.assert_trees_all_close(evaluated, trained, atol=2e-6)
  np.testing.assert_allclose(out.metrics["loaded_layers"], np.mean(load))
  return out, load, noise, grad(start(new_weights)), theta_hat(new_weights), local


def test_partialfed_fix_mixes_only_the_loaded_layers_and_w_of_a_kept_layer_stays():
  out, load, _, _, _, _ = _partialfed_case(partialfed.PartialFedConfig(),  # Dense_2 kept
                                           jnp.zeros(3), jax.random.key(0))
  assert load == [True, True, False]
  np.testing.assert_array_equal(out.state.weights["params"]["Dense_2"]["kernel"], 0.5)
  assert not np.allclose(out.state.weights["params"]["Dense_1"]["kernel"], 0.5)


def test_partialfed_adaptive_draws_one_strategy_for_alas_weights_and_its_own_loading():
  config = partialfed.PartialFedConfig(strategy="adaptive")
  logits = jnp.array([0.7, -0.4, 0.3])
  seen = set()
  for seed in range(4):
    out, load, noise, grads, theta_hat, local = _partialfed_case(config, logits,
                                                                 jax.random.key(seed))
    seen.add(tuple(load[1:]))
    # The strategy's straight-through step compares theta_hat's layer with the client's:
    # pi_l <- pi_l - lr * sigmoid'(z_l) / T * <grad_l L, theta_hat_l - theta_i_l>.
    z = logits + noise
    slope = jax.nn.sigmoid(z) * (1 - jax.nn.sigmoid(z))
    inner = jnp.array([sum(jnp.vdot(g, a - b) for g, a, b in zip(
        jax.tree.leaves(grads["params"][n]), jax.tree.leaves(theta_hat["params"][n]),
        jax.tree.leaves(local["params"][n]))) for n in ("Dense_0", "Dense_1", "Dense_2")])
    np.testing.assert_allclose(out.state.host.logits, logits - 0.1 * slope * inner,
                               rtol=1e-5, atol=1e-7)
  assert len(seen) > 1, seen   # the top layers' loading differs between the draws
