"""FedDistill (FD): the distillation term in both forms, a client's two steps with the
logits it records, and the server's per-class plain mean, against hand computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import feddistill
from fedora_jax.algorithms.feddistill import GlobalLogits, LocalLogits
from fedora_jax.errors import ConfigError
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

LR = 0.1
TEACHER = GlobalLogits(logits=jnp.array([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0], [0.3, 0.1, 3.0]]),
                       present=jnp.array([True, False, True]), received=jnp.array(True))


def _log_softmax(z):
  return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def test_distillation_in_both_forms():
  outputs = jnp.array([[1.0, 0.0, -1.0], [0.5, 0.5, 2.0], [0.0, 1.0, 0.0]])
  y = jnp.array([0, 1, 2])
  log_p = _log_softmax(np.asarray(outputs))
  soft = np.exp(_log_softmax(np.asarray(TEACHER.logits)))
  # softmax: samples 0 and 2 have a teacher; sample 1 adds nothing; mean over three.
  expected = -(soft[0] @ log_p[0] + soft[2] @ log_p[2]) / 3
  np.testing.assert_allclose(feddistill.distillation(outputs, y, jnp.ones(3), TEACHER,
                                                     "softmax"), expected, rtol=1e-6)
  # raw: the raw teacher rows as weights, sample 1 its own logits.
  teacher = np.asarray(TEACHER.logits)
  expected = -(teacher[0] @ log_p[0] + np.asarray(outputs[1]) @ log_p[1]
               + teacher[2] @ log_p[2]) / 3
  np.testing.assert_allclose(feddistill.distillation(outputs, y, jnp.ones(3), TEACHER,
                                                     "raw"), expected, rtol=1e-6)
  before = TEACHER._replace(received=jnp.array(False))
  assert feddistill.distillation(outputs, y, jnp.ones(3), before, "raw") == 0.0


def test_a_client_distils_and_records_its_logits_over_the_steps():
  data, clients = tiny_data([6, 6])
  model = tiny_model()
  trainer = tiny_trainer(model, lr=LR, batch_size=8, epochs=2)   # two full-batch steps
  algorithm = feddistill.feddistill(feddistill.FedDistillConfig(lam=0.7, target="raw"),
                                    trainer)
  params = init_params(model)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  out = algorithm.client_update(params, TEACHER, splits, jax.random.key(0))

  x, y = jnp.asarray(clients[0].x_train), jnp.asarray(clients[0].y_train)

  def loss(p):
    outputs = model.apply(p, x)
    log_p = jax.nn.log_softmax(outputs)
    ce = -jnp.mean(jnp.take_along_axis(log_p, y[:, None], 1))
    targets = jnp.where(TEACHER.present[y][:, None], TEACHER.logits[y],
                        jax.lax.stop_gradient(outputs))
    return ce + 0.7 * jnp.mean(-jnp.sum(targets * log_p, axis=-1))
  recorded = []
  for _ in range(2):
    recorded.append(model.apply(params, x))
    params = jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss)(params))
  chex.assert_trees_all_close(out.state, params, atol=1e-6)
  logits = jnp.concatenate(recorded)
  labels = jnp.concatenate([y, y])
  for c in range(3):
    held = bool((y == c).any())
    assert bool(out.upload.present[c]) == held
    if held:
      np.testing.assert_allclose(out.upload.logits[c], logits[labels == c].mean(0),
                                 rtol=1e-5, atol=1e-6)


def test_global_logits_are_the_plain_mean_over_the_sampled_holders():
  uploads = LocalLogits(logits=jnp.stack([jnp.full((3, 3), v) for v in (1.0, 5.0, 3.0)]),
                        present=jnp.array([[True, True, False], [True, True, True],
                                           [True, False, False]]))
  algorithm = feddistill.feddistill(feddistill.FedDistillConfig(),
                                    tiny_trainer(tiny_model()))
  new = algorithm.aggregate(TEACHER, {}, uploads, jnp.array([2.0, 0.0, 9.0])).server
  # Client 1 sat out: class 0 from clients 0 and 2 (unweighted), class 1 from client 0,
  # class 2 from nobody.
  np.testing.assert_allclose(new.logits[0], np.full(3, 2.0))
  np.testing.assert_allclose(new.logits[1], np.full(3, 1.0))
  np.testing.assert_array_equal(new.present, [True, True, False])
  assert bool(new.received)


@pytest.mark.parametrize("field,value", [("lam", -1.0), ("target", "probs")])
def test_bad_values_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"feddistill: {field}"):
    feddistill.feddistill(feddistill.FedDistillConfig()._replace(**{field: value}),
                          tiny_trainer(tiny_model()))
