"""A check (a) row under PFLlib's upload orders: for each seed of Python's `random` (the
order `receive_models` takes the uploads in, so the order its server sums them), the
row's max relative error beside ours, and the smallest |pre-activation| / max of every
ReLU the reference's training met. A row that parts by far more than rounding after
some orders, at a pre-activation below float32's rounding (about 6e-8), meets a tie
(docs/verification.md, "Ties, and one number a run").

  python -m verification.tie_probe --algorithm=fedbabu_uniform --seed=0 --orders=12
"""

import argparse
import random
import sys

from verification import one_round


def probe(name: str, seed: int, orders: int) -> list[tuple[int, float, float]]:
  """[(order seed, max relative error, smallest |pre-activation| / max)] of row `name`."""
  import torch  # pylint: disable=import-outside-toplevel
  reference = one_round.REFERENCES[name]
  setting = one_round.Setting(seed=seed)
  clients = (reference.clients or one_round.real_clients)(setting)
  _, initial, batches, compared = one_round._our_round(  # pylint: disable=protected-access
      name, setting, clients, reference)
  twin = reference.twin or one_round._MLP  # pylint: disable=protected-access
  built = one_round._built_batches(reference, setting, clients)  # pylint: disable=protected-access
  relu, seed_random, margins = torch.relu, random.seed, []

  def recording_relu(x):
    if x.requires_grad:  # training, not scoring
      values = x.detach().abs()
      margins.append(float(values.min() / values.max().clamp_min(1e-30)))
    return relu(x)
  rows = []
  for order in range(orders):
    margins.clear()
    torch.relu, random.seed = recording_relu, lambda _, order=order: seed_random(order)
    try:
      _, scored, _ = one_round._pfllib_round(  # pylint: disable=protected-access
          reference, setting, clients, twin.to_torch(initial), batches, built)
    finally:
      torch.relu, random.seed = relu, seed_random
    error = max(one_round.relative_error(one_round._flat(a), one_round._flat(b))  # pylint: disable=protected-access
                for a, b in zip(compared, scored))
    rows.append((order, error, min(margins)))
  return rows


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m verification.tie_probe",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--algorithm", required=True, choices=sorted(one_round.REFERENCES))
  parser.add_argument("--seed", type=int, default=0, help="the row's setting seed")
  parser.add_argument("--orders", type=int, default=12, help="upload-order seeds 0..N-1")
  args = parser.parse_args(argv)
  print("| order seed | max relative error | smallest pre-activation / max |\n|---|---|---|")
  for order, error, margin in probe(args.algorithm, args.seed, args.orders):
    print(f"| {order} | {error:.1e} | {margin:.1e} |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
