"""The library's batched linear algebra, many times over on two CPU devices at once
(tests/test_linalg.py runs this in a subprocess with a time limit).

Before fedora_jax/linalg.py every call here handed jaxlib's CPU LAPACK kernels a batch,
which they split over XLA's intra-op pool and wait for; two devices doing so at once on
a 2-thread pool hung the process forever within a few calls.

  python tests/linalg_stress.py [repeats]   # prints "ok <seconds>"
"""

import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The default CPU mesh of a 2-core machine, whatever the machine this runs on: the pool
# is sized from the cores, so two threads is the case that hangs.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from fedora_jax import propagation, similarity
from fedora_jax.algorithms import coaching
from fedora_jax.engine import sharding

LAYERS, CLIENTS = 16, 100   # coaching's Gram matrices [L, N, N] (the hang it reproduces)
PAIRS, DIM, P = 16, 64, 8   # principal angles of [K, D, p] subspaces


def server_steps(grams, subspaces, features, theta):
  """The server-side linear algebra of coaching and FEDORA, batched as they batch it."""
  config = coaching.CoachingConfig()
  steps = coaching.step_sizes(grams, config)                     # eigvalsh
  relation = coaching.relation_minimiser(grams, config.lam, config.beta)  # eigh
  cosines = similarity.principal_angle_cosines(subspaces)        # SVD of [K, K, p, p]
  client_subspaces = jax.vmap(lambda z: similarity.subspace_iteration(z, 2))(features)
  graph = similarity.principal_angle_similarity(client_subspaces)  # QR, SVD under vmap
  propagated = propagation.propagate(theta, graph)               # LU
  return (steps.sum() + relation.sum() + cosines.sum() + propagated.sum()
          + propagation.propagation_matrix(graph).sum())         # solve


def main(repeats: int) -> None:
  devices = jax.devices()
  assert len(devices) == 2, devices
  mesh = sharding.client_mesh(devices)
  split = NamedSharding(mesh, PartitionSpec(sharding.CLIENT_AXIS))
  keys = jax.random.split(jax.random.key(0), 4)
  a = jax.random.normal(keys[0], (LAYERS, CLIENTS, CLIENTS))
  grams = a @ jnp.swapaxes(a, -1, -2)
  subspaces = jnp.linalg.qr(jax.random.normal(keys[1], (PAIRS, DIM, P)))[0]
  features = jax.random.normal(keys[2], (PAIRS, 40, DIM))
  theta = jax.random.normal(keys[3], (PAIRS, 30))
  args = [jax.device_put(x, split) for x in (grams, subspaces, features, theta)]
  step = jax.jit(server_steps)
  start = time.perf_counter()
  for i in range(repeats):
    jax.block_until_ready(step(*[x + i for x in args]))
  print(f"ok {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
