import functools
import os

# As experiments/__init__.py does: LAPACK (FEDORA's subspaces) through multi-threaded
# OpenBLAS crawls on a busy machine (a 12-client subspace test: 18 s against 0.7 s).
# Set before anything loads it; an explicit OPENBLAS_NUM_THREADS wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # pylint: disable=wrong-import-position

from fedora_jax.data.sources import load_mnist  # pylint: disable=wrong-import-position

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


@pytest.fixture(scope="session", autouse=True)
def _empty_offline_data_root(tmp_path_factory):
  """Tests never touch ~/.cache or the network: an empty data root, downloads off
  (tests/test_download.py lifts that for its loopback server). Subprocesses inherit it."""
  os.environ["FEDORA_JAX_DATA"] = str(tmp_path_factory.mktemp("data_root"))
  os.environ["FEDORA_JAX_OFFLINE"] = "1"
  os.environ.pop("FEDORA_JAX_MIRROR", None)


@functools.lru_cache(maxsize=None)
def _mnist():
  return load_mnist()


@pytest.fixture(scope="session")
def mnist():
  """The real MNIST files shipped with the package."""
  return _mnist()
