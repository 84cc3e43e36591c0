"""One client's first-round local training in check (b) (verification/long.py: its split,
CNN, initial model and batches), step by step, in float32 and in float64: where the two
part, and the first dense layer's pre-activation nearest zero at that step. A step where
float32 rounds a pre-activation to the other side of ReLU's zero sends a gradient down
(or not) that exact arithmetic does not: a rounding event, not a formula's difference.

  python -m verification.step_probe --algorithm=feddyn --client=9

The loss is check (b)'s form of the algorithm in its first round: FedAvg's and FedProx's
(mu 0.1) cross-entropy and proximal term, FedDyn's (alpha 0.1, PFLlib's unsquared
penalty, g_k zero in round 1), through the algorithms' own regularisers; plain SGD at
the run's lr, as the engine steps. docs/log.md.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedora_jax.algorithms.feddyn import dynamic_regularizer
from fedora_jax.algorithms.fedprox import proximal_term
from fedora_jax.models import build_model
from fedora_jax.simulation import initial_model, root_keys
from verification import bridges, long

ALPHA = MU = 0.1  # check (a)'s and (b)'s FedDyn alpha and FedProx mu (one_round.py)


def regularizer(algorithm: str, anchor):
  if algorithm == "feddyn":
    return dynamic_regularizer(ALPHA, "norm", jax.tree.map(jnp.zeros_like, anchor), anchor)
  if algorithm == "fedprox":
    return proximal_term(MU, anchor)
  return lambda params: 0.0


def relative_errors(a, b) -> list[float]:
  return [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y)))
                / np.max(np.abs(np.asarray(y)))) for x, y in
          zip(jax.tree.leaves(a), jax.tree.leaves(b))]


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m verification.step_probe",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--algorithm", default="feddyn", choices=("fedavg", "fedprox",
                                                                 "feddyn"))
  parser.add_argument("--client", type=int, default=9)
  parser.add_argument("--data_dir", default="../shared/data")
  args = parser.parse_args(argv)
  # float64 beside float32 in one process; the float32 run keeps float32 arrays, its
  # products in full float32 as check (b)'s (long.prepare_jax).
  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_default_matmul_precision", "highest")
  setting = long.Setting()
  if not 0 <= args.client < setting.clients:
    parser.error(f"--client must be in [0, {setting.clients}), got {args.client}")
  split = long.build_split(setting, args.data_dir)
  model = build_model(long.MODEL, split.data.num_classes)
  keys = root_keys(setting.seed)
  start = initial_model(model, split.data, keys["init"])
  epoch = bridges.padded_client_batches(keys["train"], 0, split.data, 1,
                                        setting.batch_size)[args.client][0][0]
  client = split.clients[args.client]

  def run(dtype):
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), start)
    # The anchor an argument, as the engine's is a traced value (not a constant).
    loss = lambda p, x, y, anchor: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        model.apply(p, x), y)) + regularizer(args.algorithm, anchor)(p)
    grad = jax.jit(jax.grad(loss))
    steps = [params]
    for batch in epoch:
      g = grad(steps[-1], jnp.asarray(client.x_train[batch], dtype), client.y_train[batch],
               params)
      steps.append(jax.tree.map(lambda p, d: p - jnp.asarray(setting.lr, dtype) * d,
                                steps[-1], g))
    return steps

  single, double = run(jnp.float32), run(jnp.float64)
  names = [f"{layer}.{kind}" for layer in sorted(start["params"])
           for kind in sorted(start["params"][layer])]
  print(f"{args.algorithm}, client {args.client} ({len(client.y_train)} images), round 1:"
        f" max relative error of float32 against float64 after each step\n"
        f"step  {'  '.join(f'{n:>15s}' for n in names)}")
  parted = None
  for step, (a, b) in enumerate(zip(single[1:], double[1:]), 1):
    errors = relative_errors(a, b)
    print(f"{step:4d}  " + "  ".join(f"{e:15.1e}" for e in errors))
    if parted is None and max(errors) > 1e-5:
      parted = step
  if parted is None:
    print("float32 stays within 1e-5 of float64 through the epoch")
    return 0
  print(f"step {parted} parts them; at its batch, in float64 (relative to the layer's"
        " largest |value|):")
  for name, margin in near_ties(model, double[parted - 1],
                                jnp.asarray(client.x_train[epoch[parted - 1]], jnp.float64)):
    print(f"  {name}: {margin:.1e}")
  return 0


def near_ties(model, params, x) -> list[tuple[str, float]]:
  """Where rounding can turn a gradient's path: each ReLU's pre-activation nearest zero,
  and each 2x2 max-pool's smallest nonzero gap between its two largest (opened) inputs
  (exact ties, a blank background's, are ties in both precisions), over the batch,
  relative to the layer's largest |value|."""
  _, state = model.apply(params, x, capture_intermediates=True, mutable=["intermediates"])
  found = []
  for name, outputs in sorted(state["intermediates"].items()):
    if name.startswith("Dense_1") or "__call__" not in outputs:
      continue  # the logits: no ReLU after them
    z = np.asarray(outputs["__call__"][0])
    scale = np.max(np.abs(z))
    found.append((f"{name} pre-activation nearest 0", float(np.min(np.abs(z)) / scale)))
    if z.ndim == 4:  # a convolution, pooled 2x2 after its ReLU
      b, h, w, c = z.shape
      windows = np.maximum(z, 0)[:, :h // 2 * 2, :w // 2 * 2].reshape(
          b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 4)
      top = np.sort(windows, axis=1)[:, -2:]
      gaps = (top[:, 1] - top[:, 0])[(top[:, 1] > 0) & (top[:, 1] > top[:, 0])]
      found.append((f"{name} max-pool gap", float(np.min(gaps) / scale)))
  return found


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
