"""Why FedRep ends near chance on rotated MNIST at the defaults: a probe.

  python scripts/fedrep_head_probe.py > results/dp/fedrep_head_probe.md

One client's 128 MNIST training images (unrotated; 2,000 held-out test images), the
default MLP (PyTorch's init), FedRep's local schedule at the defaults (batch 64, 5 local
epochs, head_epochs 4: 8 head steps a round, lr 0.005, momentum 0.9 from a fresh state
each round, weight decay 5e-5), 50 rounds, the body never trained (FedRep's averaged body
moves by 0.004 a round). It prints the body's output scale (the head's input) and the
head-only accuracy on that body and on the same body plus Gaussian noise of the std DP's
noise accumulates in 50 rounds at epsilon 8 (z C / 36 = 9.02 * 0.05 / 36 a round and a
coordinate, times sqrt(50)), beside all layers trained for LOCAL's 10 steps a round.
"""

import gzip
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedora_jax.models.mlp import MLP, normalize_inputs  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
BODY = ("Dense_0", "Dense_1")
DP_STD = 9.01802215066611 * 0.05 / 36 * np.sqrt(50)  # results/dp/fedrep_eps8/run_config.json


def idx(name: str, offset: int) -> np.ndarray:
  return np.frombuffer(gzip.open(DATA / name).read(), np.uint8, offset=offset)


images = idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28, 1).astype(np.float32) / 255
labels = idx("train-labels-idx1-ubyte.gz", 8).astype(np.int32)
rng = np.random.default_rng(0)
train = rng.choice(len(labels), 128, replace=False)
test = rng.choice(np.setdiff1d(np.arange(len(labels)), train), 2000, replace=False)
model = MLP()


def loss(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def accuracy(params) -> float:
  return float((model.apply(params, images[test]).argmax(-1) == labels[test]).mean())


def body_rms(params) -> float:
  """Root mean square of the body's output (the head's input) on the training images."""
  h = normalize_inputs(images[train]).reshape(len(train), -1)
  for name in BODY:
    h = jnp.maximum(h @ params["params"][name]["kernel"] + params["params"][name]["bias"], 0)
  return float(jnp.sqrt(jnp.mean(h ** 2)))


def train_layers(params, layers, steps: int, rounds: int = 50, lr: float = 0.005):
  optimizer = optax.chain(optax.add_decayed_weights(5e-5), optax.sgd(lr, momentum=0.9))
  grad = jax.jit(jax.grad(loss))
  order = np.random.default_rng(1)
  for _ in range(rounds):
    state = optimizer.init(params)  # fresh each round, as the engine's local SGD
    for step in range(steps):
      if step % 2 == 0:
        perm = order.permutation(len(train))
      batch = train[perm[(step % 2) * 64:(step % 2 + 1) * 64]]
      g = grad(params, images[batch], labels[batch])
      g = {"params": {n: v if n in layers else jax.tree.map(jnp.zeros_like, v)
                      for n, v in g["params"].items()}}
      updates, state = optimizer.update(g, state, params)
      params = optax.apply_updates(params, updates)
  return params


initial = model.init(jax.random.key(0), images[:1])
noisy = {"params": {n: jax.tree.map(
    lambda a, i=i: a + DP_STD * jax.random.normal(jax.random.key(i), a.shape), v)
    if n in BODY else v for i, (n, v) in enumerate(initial["params"].items())}}
print(f"body output rms: initial {body_rms(initial):.4f}, plus DP-sized noise {body_rms(noisy):.4f}")
for name, params in (("initial body", initial), ("body plus DP-sized noise", noisy)):
  trained = train_layers(params, ["Dense_2"], steps=8)
  print(f"{name}, head only (8 steps a round, 50 rounds): test acc {accuracy(trained):.4f}")
trained = train_layers(initial, ["Dense_0", "Dense_1", "Dense_2"], steps=10)
print(f"initial model, all layers (10 steps a round, 50 rounds): test acc {accuracy(trained):.4f}")
