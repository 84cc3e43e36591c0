"""--client_weights: the clients' weights in the server's averages, n_k or uniform."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import algorithms, tree
from fedora_jax.algorithms import fedavg, local
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.simulation import TrainConfig, run_algorithm
from fedora_jax.config import AlgorithmConfig, ExperimentConfig, identity
from fedora_jax.train import _train_info, check_config
from tiny import run_rounds, tiny_data, tiny_model, tiny_trainer


def _round_one(algorithm_fn, sizes, **options):
  data, _ = tiny_data(sizes)
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=2)
  state, _, _, _ = run_rounds(algorithm_fn(trainer), trainer, data, model, rounds=1,
                              **options)
  return state.algorithm


def test_fedavg_averages_by_samples_or_uniformly_by_hand():
  sizes = [2, 3, 7]
  # Round 1 trains every client from the shared initial model with the same keys, so
  # LOCAL's clients are the uploads FedAvg averages.
  trained = _round_one(lambda t: local.local(local.LocalConfig(), t), sizes).clients
  by_samples = _round_one(lambda t: fedavg.fedavg(fedavg.FedAvgConfig(), t), sizes).server
  uniform = _round_one(lambda t: fedavg.fedavg(fedavg.FedAvgConfig(), t), sizes,
                       client_weights="uniform").server
  chex.assert_trees_all_close(by_samples, tree.weighted_mean(trained, jnp.array([2., 3., 7.])),
                              atol=1e-6)
  chex.assert_trees_all_close(uniform, tree.weighted_mean(trained, jnp.ones(3)), atol=1e-6)
  kernel = lambda p: np.asarray(p["params"]["Dense_0"]["kernel"])
  # The uniform mean by hand: (k_1 + k_2 + k_3) / 3.
  np.testing.assert_allclose(kernel(uniform), kernel(trained).sum(0) / 3, atol=1e-6)
  assert not np.allclose(kernel(uniform), kernel(by_samples))


def test_equal_clients_give_the_same_run_either_way():
  data, _ = tiny_data([4, 4, 4])
  train = TrainConfig(rounds=2, local_epochs=1, batch_size=2, lr=0.1, log_every=0)
  runs = [run_algorithm(algorithms.make("fedavg"), tiny_model(), data,
                        dataclasses.replace(train, client_weights=weights))
          for weights in ("samples", "uniform")]
  chex.assert_trees_all_close(runs[0].history.test_score, runs[1].history.test_score)


def test_uniform_weights_are_over_the_round_s_sampled_clients():
  data, _ = tiny_data([2, 3, 7, 5])
  train = TrainConfig(rounds=1, local_epochs=1, batch_size=2, lr=0.1, log_every=0,
                      participation=0.5)
  run = lambda name, weights: run_algorithm(
      algorithms.make(name), tiny_model(), data,
      dataclasses.replace(train, client_weights=weights))
  trained = run("local", "uniform")
  sampled = np.asarray(trained.history.local_steps[0]) > 0
  assert sampled.sum() == 2
  server = run("fedavg", "uniform").final_state.algorithm.server
  clients = trained.final_state.algorithm.clients
  chex.assert_trees_all_close(
      server, tree.weighted_mean(clients, jnp.asarray(sampled, jnp.float32)), atol=1e-6)


def test_results_record_client_weights_only_when_uniform_and_bad_values_are_refused():
  assert "client_weights" not in _train_info(TrainConfig())
  assert _train_info(TrainConfig(client_weights="uniform"))["client_weights"] == "uniform"
  config = ExperimentConfig(algorithm=AlgorithmConfig("fedavg"),
                            train=TrainConfig(client_weights="uniform"))
  assert identity(config)["train"]["client_weights"] == "uniform"
  assert identity(dataclasses.replace(config, train=TrainConfig()))["train"][
      "client_weights"] == "samples"
  # LOCAL averages nothing: one run serves either weighting.
  local = dataclasses.replace(config, algorithm=AlgorithmConfig("local"))
  assert identity(local) == identity(dataclasses.replace(local, train=TrainConfig()))
  with pytest.raises(FieldError, match="client_weights must be one of samples, uniform"):
    check_config(dataclasses.replace(config, train=TrainConfig(client_weights="size")))


def test_a_training_field_an_algorithm_repeats_has_one_source():
  """Ditto's config repeats the client lr: built without the run's TrainConfig, a
  different value is an error, not silently Ditto's own."""
  train = TrainConfig(lr=0.01)
  conflicting = ExperimentConfig(
      algorithm=AlgorithmConfig("ditto", algorithms.default_config("ditto")), train=train)
  with pytest.raises(ConfigError, match=r"ditto config's lr=0.005 differs from train.lr=0.01"):
    check_config(conflicting)
  check_config(dataclasses.replace(
      conflicting, algorithm=AlgorithmConfig("ditto", algorithms.default_config("ditto", train))))
  check_config(dataclasses.replace(conflicting, algorithm=AlgorithmConfig("ditto")))  # default
