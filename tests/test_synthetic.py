"""Synthetic(alpha, beta) (FedProx / LEAF): shapes, per-client determinism, the label
rule, and a 3-round FedAvg run on it."""

import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.data import datasets
from fedora_jax.data import synthetic
from fedora_jax.data.partitions import PartitionConfig
from fedora_jax.errors import ConfigError
from fedora_jax.models import build_model
from fedora_jax.simulation import TrainConfig, run_algorithm


def test_client_shapes_sizes_and_splits():
  config = synthetic.SyntheticConfig()
  for k in range(5):
    x, y = synthetic.client_samples(config, seed=3, k=k)
    assert x.shape == (len(y), 60) and x.dtype == np.float32 and y.dtype == np.int32
    assert len(y) >= synthetic.MIN_SIZE and y.min() >= 0 and y.max() < 10
    client = synthetic.split(x, y)
    n_test = int(round(len(y) * 0.1))
    assert len(client.y_test) == n_test and len(client.y_val) == n_test
    assert len(client.y_train) == len(y) - 2 * n_test
    np.testing.assert_array_equal(np.concatenate([client.x_train, client.x_val,
                                                  client.x_test]), x)


def test_sizes_follow_the_lognormal_floor_of_50():
  # size_sigma 0: every client has int(exp(mu)) + 50 samples.
  config = synthetic.SyntheticConfig(size_mu=np.log(10.5), size_sigma=0.0)
  assert {len(synthetic.client_samples(config, 0, k)[1]) for k in range(4)} == {60}


def test_a_client_depends_on_the_seed_and_its_id_only():
  config = synthetic.SyntheticConfig(alpha=0.5, beta=0.5)
  few = synthetic.make_clients(config, 3, seed=7)
  many = synthetic.make_clients(config, 20, seed=7)
  for a, b in zip(few, many):
    for field_a, field_b in zip(a, b):
      np.testing.assert_array_equal(field_a, field_b)
  other_seed = synthetic.make_client(config, 8, 0)
  assert not np.array_equal(other_seed.x_train[:5], few[0].x_train[:5])
  assert not np.array_equal(few[0].x_train[:5], few[1].x_train[:5])


def test_label_is_the_argmax_of_the_softmax_of_wx_plus_b():
  w = np.zeros((60, 10))
  w[0, 3], w[1, 7] = 1.0, 1.0
  b = np.zeros(10)
  b[5] = 0.5
  x = np.zeros((3, 60))
  x[0, 0] = 2.0   # logits: class 3 -> 2, class 5 -> 0.5
  x[1, 1] = 0.4   # class 7 -> 0.4 < class 5's 0.5
  x[2, 0], x[2, 1] = 1.0, 3.0  # class 7 -> 3
  np.testing.assert_array_equal(synthetic.labels(x, w, b), [3, 5, 7])


def test_features_have_the_generators_covariance():
  # beta 0, and with alpha 0 and many samples: x - v_k has variance j^-1.2 per feature.
  config = synthetic.SyntheticConfig(alpha=0.0, beta=0.0, size_mu=np.log(20000),
                                     size_sigma=0.0)
  x, _ = synthetic.client_samples(config, 0, 0)
  np.testing.assert_allclose(x.var(axis=0), np.arange(1, 61) ** -1.2, rtol=0.05)


def test_alpha_and_beta_skew_the_clients():
  # Larger beta: clients' feature means spread further apart.
  def mean_spread(beta):
    config = synthetic.SyntheticConfig(alpha=0.0, beta=beta, size_mu=0.0, size_sigma=0.0)
    means = [synthetic.client_samples(config, 0, k)[0].mean() for k in range(40)]
    return np.std(means)
  assert mean_spread(5.0) > 2 * mean_spread(0.0)


def test_registry_builds_any_number_of_clients_from_the_partition_flags():
  partition = datasets.default_partition("synthetic", synthetic_alpha=0.5,
                                         synthetic_beta=0.0)
  federated = datasets.build_federated_dataset(
      "synthetic", None, 6, "balanced", seed=1, partition_config=partition)
  assert federated.data.num_clients == 6 and federated.data.input_shape == (60,)
  assert federated.source.name == "Synthetic(0.5, 0)"
  expected = synthetic.make_client(synthetic.SyntheticConfig(0.5, 0.0), 1, 4)
  np.testing.assert_array_equal(federated.partition.clients[4].x_train, expected.x_train)
  with pytest.raises(ConfigError, match="synthetic_alpha"):
    datasets.build_federated_dataset(
        "synthetic", None, 2, "balanced", 0,
        partition_config=partition._replace(synthetic_alpha=-1.0))
  with pytest.raises(ConfigError, match="generated"):
    datasets.build_federated_dataset("synthetic", None, 2, "balanced", 0,
                                     partition_config=PartitionConfig(kind="iid"))


def test_three_rounds_of_fedavg_end_to_end():
  federated = datasets.build_federated_dataset("synthetic", None, 5, "balanced", seed=0)
  data = federated.data
  model = build_model(datasets.get_spec("synthetic").model, data.num_classes, (16,))
  train = TrainConfig(rounds=3, local_epochs=1, batch_size=16, lr=0.05, log_every=0)
  run = run_algorithm(algorithms.make("fedavg"), model, data, train, progress=None)
  assert run.history.test_score.shape == (3, 5)
  assert np.all(np.isfinite(run.history.val_loss))
  # Training lowers the clients' mean validation loss.
  assert run.history.val_loss[-1].mean() < run.history.val_loss[0].mean()
