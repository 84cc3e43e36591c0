import functools
import os
import tempfile

# As experiments/__init__.py does: LAPACK (FEDORA's subspaces) through multi-threaded
# OpenBLAS crawls on a busy machine (a 12-client subspace test: 18 s against 0.7 s).
# Set before anything loads it; an explicit OPENBLAS_NUM_THREADS wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The suite is compile-bound (tiny models, tiny data): XLA's cheapest CPU optimisation
# level, and JAX's persistent compilation cache for the programs several tests compile
# alike (the LOCAL reference of every end-to-end run, say). The subprocesses the
# end-to-end tests start inherit both.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"fedora_jax_test_compilation_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # pylint: disable=wrong-import-position

from fedora_jax.data.sources import load_mnist  # pylint: disable=wrong-import-position

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def needs_shared(folder: str) -> str:
  """A skip reason for a test of the real files in SHARED_DATA/`folder`."""
  return (f"needs the real {folder} files in {os.path.normpath(os.path.join(SHARED_DATA, folder))}:"
          " they come with the project's shared/ folder, laid beside this checkout")


NEEDS_TORCH = ("needs PyTorch, the bench extra: pip install -e '.[bench]' (CPU-only wheels:"
               " docs/performance.md)")


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


# The quick tier (`make test-quick`) leaves out the tests marked slow: these modules'
# end-to-end commands, several devices and processes, and the algorithm matrix, but for
# the one end-to-end run marked quick.
SLOW_MODULES = frozenset((
    "test_algorithm_matrix", "test_sharding", "test_golden_results", "test_reproduce",
    "test_paper_tables", "test_checkpoint", "test_watchdog", "test_notebook",
    "test_benchmark", "test_main", "test_plots", "test_download", "test_loaders_fixtures",
    "test_dp_run", "test_sweep", "test_sweep_batch", "test_host_matrix",
    # The run axis, partial participation, plug-in hosts and the runner API end to end:
    # engine paths the matrix also crosses; each compiles whole rounds.
    "test_batch", "test_participation", "test_runner_api", "test_verification_long",
    # The CNN, ResNet and BatchNorm models' tests: compiling them is most of a cold run.
    "test_batch_norm", "test_fedbn", "test_cifar", "test_layerwise_cnn", "test_split_layers"))
# Started first, so that two workers end together (each takes minutes).
LONGEST = ("test_algorithm_matrix.py", "test_sharding.py")


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.module.__name__ in SLOW_MODULES and not item.get_closest_marker("quick"):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: item.nodeid.split("::")[0].rsplit("/", 1)[-1] not in LONGEST)
