"""Synthetic(alpha, beta): the federated dataset of FedProx (Li et al., "Federated
Optimization in Heterogeneous Networks", MLSys 2020, Section 5.1), as LEAF ships it.

Per client k (the FedProx generator's draws; its N(m, s) takes s as the standard
deviation, numpy's `scale`, and so do we):
  u_k ~ N(0, alpha), B_k ~ N(0, beta)              alpha: model skew, beta: feature skew
  W_k [60, 10] ~ N(u_k, 1), b_k [10] ~ N(u_k, 1)
  v_k [60] ~ N(B_k, 1), x ~ N(v_k, Sigma), Sigma diagonal, Sigma_jj = j^-1.2 (j from 1)
  y = argmax softmax(W_k^T x + b_k)                (= argmax of the logits)
  n_k = int(lognormal(size_mu, size_sigma)) + 50   (the generator's 4, 2: a power-law-like
                                                    tail of client sizes)
Unlike the generator, which draws all clients from one stream, client k's draws come
from a generator seeded with (seed, k) alone, so its data do not depend on how many
clients there are: any number of clients, generated on the spot, no download. Each
client's n_k samples are split 80 / 10 / 10 into training, validation and test (the
generator keeps 90 / 10 train / test; validation comes out of its training share).
"""

from typing import NamedTuple

import numpy as np

from fedora_jax.data.client_data import Client
from fedora_jax.errors import ConfigError

NUM_FEATURES, NUM_CLASSES = 60, 10
MIN_SIZE = 50  # the generator's floor on a client's sample count
VAL_FRACTION = TEST_FRACTION = 0.1
_STREAM = 0x5E7  # keeps these draws apart from other users of (seed, k)


class SyntheticConfig(NamedTuple):
  alpha: float = 1.0       # std of u_k: how much clients' labelling models differ
  beta: float = 1.0        # std of B_k: how much clients' feature means differ
  size_mu: float = 4.0     # lognormal mean of a client's size (before +50)
  size_sigma: float = 2.0  # lognormal sigma of a client's size


def check(config: SyntheticConfig) -> None:
  for name in ("alpha", "beta", "size_sigma"):
    if not getattr(config, name) >= 0:
      raise ConfigError(f"--synthetic_{name} must be >= 0, got {getattr(config, name)}")


def feature_scales() -> np.ndarray:
  """[60] standard deviations of x around v_k: sqrt(j^-1.2), j = 1..60."""
  return np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -0.6


def labels(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
  """[n] int32: argmax softmax(x W + b), the class of largest logit."""
  return np.argmax(x @ w + b, axis=1).astype(np.int32)


def client_size(config: SyntheticConfig, rng: np.random.Generator) -> int:
  return int(rng.lognormal(config.size_mu, config.size_sigma)) + MIN_SIZE


def client_samples(config: SyntheticConfig, seed: int, k: int
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Client k's samples: x [n_k, 60] float32 and y [n_k] int32, from (seed, k) only."""
  rng = np.random.default_rng([seed, k, _STREAM])
  n = client_size(config, rng)
  u, big_b = rng.normal(0.0, config.alpha), rng.normal(0.0, config.beta)
  w = rng.normal(u, 1.0, (NUM_FEATURES, NUM_CLASSES))
  b = rng.normal(u, 1.0, NUM_CLASSES)
  v = rng.normal(big_b, 1.0, NUM_FEATURES)
  x = v + rng.standard_normal((n, NUM_FEATURES)) * feature_scales()
  return x.astype(np.float32), labels(x, w, b)


def split(x: np.ndarray, y: np.ndarray) -> Client:
  """The first 80 % to train, then 10 % validation, the last 10 % test (samples are
  i.i.d. within a client, so their order is already random); at least one of each."""
  n = len(y)
  n_test = max(1, int(round(n * TEST_FRACTION)))
  n_val = max(1, int(round(n * VAL_FRACTION)))
  n_train = n - n_val - n_test
  return Client(x_train=x[:n_train], y_train=y[:n_train],
                x_val=x[n_train:n_train + n_val], y_val=y[n_train:n_train + n_val],
                x_test=x[n_train + n_val:], y_test=y[n_train + n_val:])


def make_client(config: SyntheticConfig, seed: int, k: int) -> Client:
  return split(*client_samples(config, seed, k))


def make_clients(config: SyntheticConfig, num_clients: int, seed: int) -> list[Client]:
  """Clients 0..num_clients-1; client k is the same whatever num_clients is."""
  check(config)
  return [make_client(config, seed, k) for k in range(num_clients)]


def expected_bytes(config: SyntheticConfig, num_clients: int) -> float:
  """The clients' features and labels in bytes, unpadded: K * E[n_k] * (60 * 4 + 4)."""
  mean_size = np.exp(config.size_mu + config.size_sigma ** 2 / 2) - 0.5 + MIN_SIZE
  return num_clients * mean_size * (NUM_FEATURES * 4 + 4)
