"""The run axis (fedora_jax/batch.py): S runs as one program, each equal to the run alone.

Equal to float tolerance, not bit for bit: the batched program adds in another order
(XLA batches the runs' matrix products); on this CPU the differences after a few rounds
are ~1e-7 relative, and every client's accuracy is the same."""

import dataclasses

import numpy as np
import pytest

from fedora_jax import algorithms, batch
from fedora_jax.errors import ConfigError
from fedora_jax.simulation import TrainConfig, run_algorithm
from tiny import tiny_data, tiny_model

TRAIN = TrainConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.1, momentum=0.9,
                    log_every=0)
SIZES = (5, 6, 9, 5, 8, 7)


def registered(name: str, **fixed):
  """build(values, trainer) for a registered algorithm whose config fields take `values`."""
  def build(values, trainer):
    config = algorithms.default_config(name, **fixed)
    own = {k: v for k, v in values.items() if k not in batch.TRAIN_VALUES}
    return algorithms.build(name, config._replace(**own), trainer)
  return build


def alone(name: str, data, train: TrainConfig, **fields):
  config = algorithms.default_config(name, **fields)
  return run_algorithm(algorithms.make(name, config), tiny_model(), data, train,
                       progress=None)


def assert_same_run(batched, single, rtol=1e-5, atol=1e-6):
  np.testing.assert_allclose(batched.history.val_score, single.history.val_score)
  np.testing.assert_allclose(batched.history.test_score, single.history.test_score)
  np.testing.assert_allclose(batched.history.train_loss, single.history.train_loss,
                             rtol=rtol, atol=atol)
  for got, want in zip(np.asarray(batched.final_state.round, float).ravel(),
                       np.asarray(single.final_state.round, float).ravel()):
    assert got == want
  import jax  # pylint: disable=import-outside-toplevel
  for got, want in zip(jax.tree.leaves(batched.final_state.algorithm),
                       jax.tree.leaves(single.final_state.algorithm)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


def test_three_seeds_in_one_program_equal_three_runs():
  data, _ = tiny_data(SIZES)
  seeds = (0, 1, 2)
  # All three vmapped as one step (an accelerator's default; on a CPU one at a time).
  results = batch.run_batch(registered("fedavg"), tiny_model(), data, TRAIN, seeds,
                            progress=None, runs_per_step=3)
  for seed, result in zip(seeds, results):
    assert not isinstance(result, batch.RunFailed)
    assert_same_run(result, alone("fedavg", data, dataclasses.replace(TRAIN, seed=seed)))


def test_runs_a_chunk_at_a_time_equal_the_runs_alone():
  data, _ = tiny_data(SIZES)
  seeds = (0, 1, 2)
  results = batch.run_batch(registered("fedavg"), tiny_model(), data, TRAIN, seeds,
                            progress=None, runs_per_step=2)
  for seed, result in zip(seeds, results):
    assert_same_run(result, alone("fedavg", data, dataclasses.replace(TRAIN, seed=seed)))


def test_a_hyperparameter_and_the_learning_rate_vary_across_the_runs():
  data, _ = tiny_data(SIZES)
  mus, lrs = (0.01, 0.1, 1.0), (0.1, 0.05, 0.1)
  results = batch.run_batch(registered("fedprox"), tiny_model(), data, TRAIN, (0, 0, 0),
                            values={"mu": mus, "lr": lrs}, progress=None)
  for mu, lr, result in zip(mus, lrs, results):
    train = dataclasses.replace(TRAIN, lr=lr)
    assert_same_run(result, alone("fedprox", data, train, mu=mu))


def test_each_run_its_own_data_where_the_layouts_match():
  datas = [tiny_data(SIZES, seed=s)[0] for s in (3, 4)]
  results = batch.run_batch(registered("ditto"), tiny_model(), datas,
                            dataclasses.replace(TRAIN, participation=0.5), (0, 1),
                            progress=None)
  for seed, data, result in zip((0, 1), datas, results):
    train = dataclasses.replace(TRAIN, seed=seed, participation=0.5)
    assert_same_run(result, alone("ditto", data, train))


def test_test_scores_only_in_the_rounds_each_run_is_due():
  data, _ = tiny_data(SIZES)
  train = dataclasses.replace(TRAIN, rounds=4, eval_every=3)
  results = batch.run_batch(registered("fedavg"), tiny_model(), data, train, (0, 5),
                            progress=None)
  for seed, result in zip((0, 5), results):
    single = alone("fedavg", data, dataclasses.replace(train, seed=seed))
    np.testing.assert_array_equal(np.isnan(result.history.test_score),
                                  np.isnan(single.history.test_score))
    assert_same_run(result, single)


def test_a_value_read_as_a_python_number_stops_with_one_line():
  data, _ = tiny_data(SIZES)
  with pytest.raises(batch.BatchError, match="run these separately"):
    batch.run_batch(registered("fedavg"), tiny_model(), data, TRAIN, (0, 1),
                    values={"momentum": (0.0, 0.9)}, progress=None)
  # FedAMP reads sigma as a Python number (its checks): refused, never run wrongly.
  with pytest.raises(batch.BatchError, match="fedamp: a value .* Python number"):
    batch.run_batch(registered("fedamp"), tiny_model(), data, TRAIN, (0, 1),
                    values={"sigma": (1.0, 2.0)}, progress=None)


def test_bad_batches_stop_with_one_line():
  data, _ = tiny_data(SIZES)
  other, _ = tiny_data((5, 6, 9, 5, 8, 30))
  with pytest.raises(ConfigError, match="3 values"):
    batch.run_batch(registered("fedavg"), tiny_model(), data, TRAIN, (0, 1, 2),
                    values={"lr": (0.1, 0.2)}, progress=None)
  with pytest.raises(batch.BatchError, match="laid out unlike"):
    batch.run_batch(registered("fedavg"), tiny_model(), [data, other], TRAIN, (0, 1),
                    progress=None)


@pytest.mark.slow
@pytest.mark.parametrize("name,field,values,fixed", [
    ("apfl", "alpha", (0.25, 0.75), {}), ("moon", "mu", (0.5, 2.0), {}),
    ("feddyn", "alpha", (0.01, 0.1), {}), ("ditto", "lam", (0.1, 1.0),
                                              {"lambda_selection": "fixed"})])
def test_each_algorithm_hyperparameter_the_run_axis_takes(name, field, values, fixed):
  data, _ = tiny_data(SIZES)
  results = batch.run_batch(registered(name, **fixed), tiny_model(), data, TRAIN, (0, 0),
                            values={field: values}, progress=None)
  for value, result in zip(values, results):
    assert_same_run(result, alone(name, data, TRAIN, **fixed, **{field: value}))
