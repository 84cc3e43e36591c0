"""Why FedAvg with user-level DP at epsilon 2 on FedALA's MNIST pathological setting
(results/dp/run.sh, pat_fedavg_eps2) stops with a NaN loss in round 2: the run's own
config, its first round, then its second round's local training replayed step by step
on one client. Printed: the noise multiplier against the accountant's closed form, the
released model's norm against the initial model's and against the noise's expected norm,
the logits and loss of the released model, and round 2's loss and parameter norm step
by step until it is no longer finite.

  python scripts/dp_divergence_probe.py --data_dir=../shared/data [--target_epsilon=2]
"""

import argparse
import math
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
from fedora_jax import accounting, settings, simulation, train  # noqa: E402
from fedora_jax.engine import local_training  # noqa: E402

# results/dp/run.sh's pathological() flags (FedALA's mnist_pat column).
PATHOLOGICAL = dict(dataset="mnist", partition="pathological", classes_per_client=2,
                    model="fedavg_cnn", val_fraction=0.125, num_clients=20,
                    participation=1.0, local_epochs=1, batch_size=10, lr=0.005, momentum=0.0,
                    weight_decay=0.0, rounds=6, seed=0, algorithm="fedavg",
                    dp_clip_norm=0.7, dp_delta=1e-5, checkpoint_every=0)


def rdp_epsilon(z: float, rounds: int, delta: float) -> float:
  """Closed form of the accountant's epsilon for every client every round under
  replace-one adjacency: T Gaussian releases of sensitivity 2C and std zC have RDP
  alpha T 2 / z^2 at order alpha; converted with dp-accounting's (Canonne et al.'s)
  bound eps = rdp + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)."""
  orders = np.linspace(1.01, 512, 200_000)
  rdp = orders * rounds * 2.0 / z ** 2
  eps = rdp + np.log((orders - 1) / orders) - (np.log(delta) + np.log(orders)) / (orders - 1)
  return float(np.min(eps))


def norm(params) -> float:
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(params))))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--target_epsilon", type=float, default=2.0)
  parser.add_argument("--client", type=int, default=0)
  args = parser.parse_args()
  config = settings.from_settings({**PATHOLOGICAL, "data_dir": args.data_dir,
                                   "dp_target_epsilon": args.target_epsilon})
  run = train.prepare_run(config, tempfile.mkdtemp(prefix="dp_probe_"))
  dp = run.config.algorithm.dp
  rounds, m, clip = run.config.train.rounds, dp.expected_clients, dp.clip_norm
  z = dp.noise_multiplier
  print(f"resolved: z = {z:.4f}, C = {clip}, m = {m:g}, q = {dp.sampling_rate}, T = {rounds}")
  print(f"epsilon after {rounds} rounds: accountant {run.epsilons[-1]:.4f}, closed-form RDP"
        f" {rdp_epsilon(z, rounds, dp.delta):.4f}; fixed cohort in the accountant:"
        f" {accounting.RoundSampling(dp.sampling, 20, m)}")

  data = run.federated.data
  prepared = simulation.prepare_run(train.algorithm_of(run), run.model, data,
                                    train.engine_train(run))
  initial = simulation.initial_model(run.model, data, prepared.keys["init"])
  count = sum(x.size for x in jax.tree.leaves(initial))
  per_coordinate = z * clip / m
  print(f"model: {count} parameters; noise on the mean: std z C / m = {per_coordinate:.4f}"
        f" per coordinate, expected norm {per_coordinate * math.sqrt(count):.1f}")
  state, metrics = prepared.compiled(prepared.state, prepared.buckets, prepared.keys["train"])
  metrics = simulation.to_host(metrics)
  released = state.algorithm.server.host  # FedAvg's server: the released global model
  step = jax.tree.map(jnp.subtract, released, initial)
  print(f"round 1: initial model norm {norm(initial):.2f}, released model norm"
        f" {norm(released):.1f}, release - initial {norm(step):.1f}; clients' update norms"
        f" (before clipping) median {np.median(metrics.extra['dp_update_norm']):.3f};"
        f" val loss mean {np.mean(metrics.val_loss):.1f}")
  for path, leaf in jax.tree_util.tree_leaves_with_path(step):
    print(f"  {jax.tree_util.keystr(path)}: {leaf.shape}, std of release - initial"
          f" {float(jnp.std(leaf)):.4f}")

  # Round 2 on one client, replayed: the run's SGD (lr, batch) from the released model,
  # on a shuffle of its own.
  bucket = data.buckets[0]
  client = jax.tree.map(lambda x: jnp.asarray(x[args.client]), bucket.train)
  apply_fn = prepared.trainer.apply
  x, y = client.x[:64], client.y[:64]
  logits = apply_fn(released, x)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  # The same logits in float64 (numpy: JAX computes in float32 here).
  wide = np.asarray(logits, np.float64)
  top = wide.max(-1)
  exact = (top + np.log(np.exp(wide - top[:, None]).sum(-1))
           - wide[np.arange(len(wide)), np.asarray(y)])
  print(f"released model on 64 of client {args.client}'s images: max |logit|"
        f" {float(jnp.max(jnp.abs(logits))):.4g}, mean loss float32 {float(jnp.mean(loss)):.4g},"
        f" float64 {float(np.mean(exact)):.4g}")
  optimizer = local_training.make_optimizer(run.config.train.lr, 0.0, 0.0)
  loss_fn = prepared.trainer.loss
  params, opt_state = released, optimizer.init(released)
  batch = run.config.train.batch_size
  order = np.random.default_rng(0).permutation(int(client.n))
  for i in range(int(client.n) // batch):
    idx = order[i * batch:(i + 1) * batch]
    weights = jnp.ones((batch,), jnp.float32)
    value, grads = jax.value_and_grad(loss_fn)(params, client.x[idx], client.y[idx], weights)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if i < 5 or i % 10 == 0 or not math.isfinite(float(value)):
      print(f"round 2, step {i + 1}: loss {float(value):.4g}, gradient norm"
            f" {norm(grads):.4g}, model norm {norm(params):.4g}")
    if not (math.isfinite(float(value)) and math.isfinite(norm(params))):
      print(f"round 2 not finite after {i + 1} steps (of {int(client.n) // batch})")
      break


if __name__ == "__main__":
  main()
