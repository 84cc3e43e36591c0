"""Two probes behind docs/robustness.md's choices and readings, on the default rotated-MNIST
run (36 clients, the MLP, TrainConfig's defaults, seed 0), printed round by round:

  python scripts/byzantine_probe.py --probe=norms --rounds=4
      the minimum, median and maximum over the uploaders of ||theta_i - theta||, theta
      the server's shared part before the round: the scale a robust rule's radius is set
      against (centered clipping's tau, norm bounding's M);
  python scripts/byzantine_probe.py --probe=krum --attack=alie --rounds=5
      FedAvg under Krum (f = 20 % of the uploads) with 20 % attackers: the attackers and
      the client whose upload Krum selects.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
from fedora_jax import algorithms  # noqa: E402
from fedora_jax.algorithms import byzantine, robust  # noqa: E402
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


def with_printed_krum_pick(attacked):
  """An attacked host under Krum printing the round's attackers and Krum's pick."""
  inner = attacked.aggregate

  def aggregate(server, clients, uploads, weights):
    jax.debug.print("attackers {a}", a=jnp.nonzero(clients.attacker, size=clients.attacker.size,
                                                   fill_value=-1)[0])
    return inner(server, clients, uploads, weights)
  return attacked._replace(aggregate=aggregate)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--probe", choices=("norms", "krum"), default="norms")
  parser.add_argument("--attack", choices=byzantine.ATTACKS, default="alie")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--data_dir", default=None)
  args = parser.parse_args()
  federated = datasets.build_federated_dataset("rmnist", args.data_dir, 36, "balanced", 0)
  model = build_model("mlp", federated.data.num_classes, (128, 128))
  if args.probe == "krum":
    select = robust.krum

    def krum(updates, weights, fraction):
      jax.debug.print("Krum selects client {i}",
                      i=jnp.argmin(robust.krum_scores(updates, weights, fraction)))
      return select(updates, weights, fraction)
    robust.krum = krum  # read when the rule runs, inside the round

  def make(trainer):
    if args.probe == "norms":
      return with_printed_norms(algorithms.build("fedavg", algorithms.default_config("fedavg"),
                                                 trainer))
    return with_printed_krum_pick(algorithms.build(
        "fedavg", algorithms.default_config("fedavg"), trainer,
        aggregation=robust.RobustConfig(rule="krum", byzantine=0.2),
        attack=byzantine.AttackConfig(attack=args.attack, fraction=0.2)))
  run_algorithm(make, model, federated.data, TrainConfig(rounds=args.rounds, log_every=0))


if __name__ == "__main__":
  main()
