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


# Three tiers, so that each command fits its budget on 2 cores from a cold compilation
# cache (docs/log.md):
# - `make test-quick`, the first check after a change (about 2 minutes): the modules in
#   QUICK_MODULES (the engine, FEDORA and its linear algebra, the methods of its Table 1
#   and FedALA's ALA, the data layer, the results and the command line's units) and the
#   one end-to-end run marked quick;
# - `make test` (under 10 minutes) adds every algorithm's, plug-in's and feature's tests
#   and the end-to-end commands (marked slow), but for HEAVY_MODULES;
# - `make test-slow`: HEAVY_MODULES (marked heavy), whole programs run many times: every
#   algorithm on every engine path, several devices and processes, killed and resumed
#   runs, byte-identical results, sweeps, tables and the benchmark, the BatchNorm CNN's
#   FedBN runs. CI runs `make test`, then `make test-slow`.
QUICK_MODULES = frozenset((
    "test_engine", "test_fedora", "test_propagation", "test_similarity", "test_linalg",
    "test_client_weights", "test_eval_every", "test_precision", "test_progress",
    "test_data", "test_partitions", "test_synthetic", "test_official_formats",
    "test_authors_split", "test_authors_cifar_split", "test_tfds_source",
    "test_natural_data", "test_regression", "test_metrics", "test_docs_rendered",
    "test_verification", "test_fedprox", "test_ditto_apfl", "test_fedu_fedamp",
    "test_clustering", "test_fedfomo", "test_pfedhn", "test_fedala"))
HEAVY_MODULES = frozenset((
    "test_algorithm_matrix", "test_host_matrix", "test_sharding", "test_checkpoint",
    "test_golden_results", "test_dp_run", "test_batch", "test_sweep", "test_sweep_batch",
    "test_watchdog", "test_reproduce", "test_paper_tables", "test_benchmark", "test_plots",
    "test_fedbn"))
# Started first, so that two workers end together (each takes minutes).
LONGEST = ("test_algorithm_matrix.py", "test_main.py", "test_fedbn.py")


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    module = item.module.__name__
    if module in HEAVY_MODULES:
      item.add_marker(pytest.mark.heavy)
    if module not in QUICK_MODULES and not item.get_closest_marker("quick"):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: item.nodeid.split("::")[0].rsplit("/", 1)[-1] not in LONGEST)
