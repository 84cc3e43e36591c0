"""The algorithm matrix with the clients held on the host: every registered
algorithm either gives the device-held run's numbers over two rounds at partial
participation, or stops with one line naming what host-held clients do not keep."""

import dataclasses

import numpy as np
import pytest

from fedora_jax import algorithms
from fedora_jax.data import host_clients, synthetic
from fedora_jax.data.client_data import stack_clients
from fedora_jax.errors import ConfigError
from fedora_jax.host_simulation import run_host
from fedora_jax.models.mlp import MLP
from fedora_jax.simulation import TrainConfig, run_algorithm

K = 8
CONFIG = synthetic.SyntheticConfig(size_mu=0.0, size_sigma=0.0)
TRAIN = TrainConfig(rounds=2, local_epochs=5, batch_size=32, lr=0.05, participation=0.5,
                    log_every=10**6)
MODEL = MLP(hidden=(8,), num_outputs=synthetic.NUM_CLASSES)
# Five local epochs: FedRep and FedPAC train their heads for fewer (their defaults).
# One global model, no client state, a server that averages the sampled uploads (kNN-Per:
# FedAvg's, scored with each slot's training split beside; pFedFDA: the global Gaussians
# beside the model).
SERVED = ("ccvr", "fedavg", "fediir", "fedavgm", "fednova", "fedntd", "fedopt", "fedprox",
          "knnper", "pfedfda")


@pytest.mark.parametrize("name", sorted(algorithms.REGISTRY))
def test_host_held_equals_device_held_or_says_why_not(name):
  source = host_clients.generated_synthetic(CONFIG, K, seed=1)
  host_train = dataclasses.replace(TRAIN, client_data="host")
  if name not in SERVED:
    with pytest.raises(ConfigError, match="--client_data=host: ") as raised:
      run_host(algorithms.make(name), MODEL, source, host_train, progress=None)
    assert "\n" not in str(raised.value)
    return
  host = run_host(algorithms.make(name), MODEL, source, host_train, progress=None)
  device = run_algorithm(algorithms.make(name), MODEL,
                         stack_clients(source.take(range(K)), synthetic.NUM_CLASSES), TRAIN,
                         progress=None)
  for field in ("train_loss", "local_steps", "val_loss", "val_score", "test_score"):
    np.testing.assert_allclose(getattr(host.history, field), getattr(device.history, field),
                               rtol=2e-5, atol=1e-6, err_msg=field)
