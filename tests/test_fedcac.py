"""FedCAC: critical parameters by sensitivity, the overlap threshold and the customised
models at partial participation, PFLlib's first round, each against hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import fedcac
from fedora_jax.errors import ConfigError
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1


def test_critical_parameters_are_the_top_tau_sensitivities():
  before = jnp.zeros(4)
  # |(after - before) * after| = [1, 4, 9, 0.25]: the top half is 9 and 4.
  mask = fedcac.critical_mask(before, jnp.array([1.0, 2.0, -3.0, 0.5]), 0.5)
  np.testing.assert_array_equal(mask, [False, True, True, False])
  # A zero threshold becomes the smallest non-zero sensitivity (0.3 * 1).
  mask = fedcac.critical_mask(jnp.array([1.0, 1.0, 1.0, 0.7]), jnp.ones(4), 0.5)
  np.testing.assert_array_equal(mask, [False, False, False, True])
  # int(0.2 * 4) = 0 parameters: none critical.
  assert not fedcac.critical_mask(before, jnp.ones(4), 0.2).any()


def test_client_trains_and_marks_its_critical_parameters():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8)    # one full-batch step
  algorithm = fedcac.fedcac(fedcac.FedCacConfig(tau=0.4), trainer)
  start = init_params(model)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  client = fedcac.CacClient(critical=jax.tree.map(lambda p: jnp.zeros(p.shape, bool), start),
                            customized=start)
  out = algorithm.client_update(client, start, splits, jax.random.key(0))
  grads = jax.grad(lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(start)
  trained = jax.tree.map(lambda p, g: p - LR * g, start, grads)
  chex.assert_trees_all_close(out.upload.model, trained, atol=1e-6)
  for before, after, mask in zip(jax.tree.leaves(start), jax.tree.leaves(trained),
                                 jax.tree.leaves(out.state.critical)):
    sensitivity = np.abs(np.asarray((after - before) * after)).ravel()
    count = int(0.4 * sensitivity.size)
    expected = sensitivity >= np.sort(sensitivity)[::-1][count - 1]
    np.testing.assert_array_equal(np.asarray(mask).ravel(), expected)


def _server_round(first_round="customized", round_index=0, weights=(1.0, 3.0, 2.0)):
  # Three clients, one 4-parameter model; masks c0 = c1 = [1, 1, 0, 0], c2 = [0, 0, 1, 1].
  algorithm = fedcac.fedcac(fedcac.FedCacConfig(beta=2.0, first_round=first_round),
                            tiny_trainer(tiny_model()))
  models = {"w": jnp.array([[1.0, 2.0, 3.0, 4.0], [3.0, 6.0, 5.0, 8.0],
                            [9.0, 7.0, 1.0, 2.0]])}
  masks = {"w": jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool)}
  old = {"w": jnp.full((3, 4), -1.0)}
  server = fedcac.CacServer(model={"w": jnp.zeros(4)}, round=jnp.array(round_index))
  state = algorithm.aggregate(server, fedcac.CacClient(critical=masks, customized=old),
                              fedcac.CacUpload(model=models, critical=masks),
                              jnp.array(weights))
  return algorithm, models, state


def test_customised_models_mean_the_clients_above_the_overlap_threshold():
  _, models, state = _server_round()
  # o_01 = o_10 = 1, the other four 0: mean 1/3, max 1; round 0, beta 2: threshold
  # 1/3 + (1/2)(2/3) = 2/3, so clients 0 and 1 collaborate and client 2 stays alone.
  w = models["w"]
  np.testing.assert_allclose(state.clients.customized["w"],
                             [(w[0] + w[1]) / 2, (w[0] + w[1]) / 2, w[2]])
  np.testing.assert_allclose(state.server.model["w"], (w[0] + 3 * w[1] + 2 * w[2]) / 6,
                             rtol=1e-6)
  assert int(state.server.round) == 1
  # In round 3 the threshold is past the max: every client alone.
  _, _, later = _server_round(round_index=3)
  np.testing.assert_allclose(later.clients.customized["w"], w)


def test_partial_participation_and_the_scored_model():
  algorithm, models, state = _server_round(weights=(1.0, 0.0, 2.0))
  # Client 1 sat out: pairs only between 0 and 2 (overlap 0 = mean = max, threshold 0):
  # they collaborate; client 1 keeps its customised model.
  w = models["w"]
  np.testing.assert_allclose(state.clients.customized["w"],
                             [(w[0] + w[2]) / 2, -np.ones(4), (w[0] + w[2]) / 2])
  global_model = (w[0] + 2 * w[2]) / 3
  scored = algorithm.personalized_params(state.server, state.clients)["w"]
  np.testing.assert_allclose(scored[0], [(w[0, 0] + w[2, 0]) / 2, (w[0, 1] + w[2, 1]) / 2,
                                         global_model[2], global_model[3]], rtol=1e-6)
  np.testing.assert_allclose(scored[1], [-1.0, -1.0, global_model[2], global_model[3]],
                             rtol=1e-6)


def test_pfllib_first_round_keeps_the_initial_customised_models():
  _, _, state = _server_round(first_round="initial")
  np.testing.assert_array_equal(state.clients.customized["w"], -np.ones((3, 4)))
  _, models, later = _server_round(first_round="initial", round_index=1)
  w = models["w"]
  np.testing.assert_allclose(later.clients.customized["w"][2], w[2])


@pytest.mark.parametrize("field,value", [("tau", 1.5), ("beta", 0.0),
                                         ("first_round", "never")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"fedcac: {field}"):
    fedcac.fedcac(fedcac.FedCacConfig()._replace(**{field: value}), tiny_trainer(tiny_model()))
