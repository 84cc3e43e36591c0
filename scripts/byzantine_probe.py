"""The norms of the clients' updates of the shared part, round by round: the scale a
robust rule's radius is set against (centered clipping's tau, norm bounding's M;
docs/robustness.md).

  python scripts/update_norms.py --algorithm=fedavg --rounds=4

trains the algorithm with the default rotated-MNIST run's settings (36 clients, the MLP,
TrainConfig's defaults) and prints, each round, the minimum, median and maximum over the
uploaders of ||theta_i - theta||, theta the server's shared part before the round.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
from fedora_jax import algorithms  # noqa: E402
from fedora_jax.data import datasets  # noqa: E402
from fedora_jax.models import build_model  # noqa: E402
from fedora_jax.simulation import TrainConfig, run_algorithm  # noqa: E402


def with_printed_norms(host):
  """`host` printing its uploaders' update norms before it aggregates."""
  shared = host.shared_part

  def aggregate(server, clients, uploads, weights):
    theta, mine = shared.of_server(server), shared.of_uploads(uploads)
    norms = jnp.sqrt(sum(jnp.sum(jnp.square((u - t[None]).reshape(u.shape[0], -1)), axis=1)
                         for u, t in zip(jax.tree.leaves(mine), jax.tree.leaves(theta))))
    uploaded = weights > 0
    jax.debug.print("update norms: min {a:.4f}, median {b:.4f}, max {c:.4f}",
                    a=jnp.min(jnp.where(uploaded, norms, jnp.inf)),
                    b=jnp.nanmedian(jnp.where(uploaded, norms, jnp.nan)),
                    c=jnp.max(jnp.where(uploaded, norms, -jnp.inf)))
    return host.aggregate(server, clients, uploads, weights)
  return host._replace(aggregate=aggregate)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--algorithm", default="fedavg",
                      help=f"one of {', '.join(algorithms.confree_hosts())}")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--data_dir", default=None)
  args = parser.parse_args()
  federated = datasets.build_federated_dataset("rmnist", args.data_dir, 36, "balanced", 0)
  model = build_model("mlp", federated.data.num_classes, (128, 128))

  def make(trainer):
    name = algorithms.canonical_name(args.algorithm)
    return with_printed_norms(algorithms.build(name, algorithms.default_config(name),
                                               trainer))
  run_algorithm(make, model, federated.data, TrainConfig(rounds=args.rounds, log_every=0))


if __name__ == "__main__":
  main()
