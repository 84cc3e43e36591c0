"""Times one client's LeNet-5 SGD steps: the engine's local training against PyTorch, paired.

  python -m benchmarks.cnn_step                     # both with their default threads
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 \\
      python -m benchmarks.cnn_step --torch_threads=1   # one core each

The engine's round trains one client per CPU device (one per core by default), so what
bounds its speed against the sequential PyTorch loop of `experiments.benchmark` is one
core's SGD step: the second command compares XLA's step with PyTorch's (oneDNN) on the
same core. Both sides run the same work: E epochs of shuffled batches of random
CIFAR-shaped images through FEDORA's LeNet-5 (`models/cnn.py`;
`benchmarks/torch_loop.make_cnn`), SGD with momentum and weight decay. The calls
alternate, and the speed is the median of the per-pair ratios, so both see the same load.
"""

import time

from absl import app, flags
import jax
import numpy as np

from benchmarks.measure import random_cifar_client
from benchmarks.torch_loop import make_cnn
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.models import cnn_conv
from fedora_jax.models.cnn import CNN, CONVS

_SAMPLES = flags.DEFINE_integer("samples", 512, "Training images of the client.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Local batch size.")
_REPEATS = flags.DEFINE_integer("repeats", 11, "Timed pairs.")
_CONV = flags.DEFINE_enum("conv", None, list(CONVS), "Convolution formulation (default:"
                          " the registry's for this platform).")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", None, "PyTorch's threads (default:"
                                      " its own, all cores).")

LR, MOMENTUM, WEIGHT_DECAY = 5e-3, 0.9, 5e-5


def jax_epoch(samples: int, batch_size: int, conv: str):
  """A no-argument call that runs one epoch of the engine's local training, blocking."""
  model = CNN(num_outputs=10, conv=conv)
  trainer = make_client_trainer(model.apply, make_optimizer(LR, MOMENTUM, WEIGHT_DECAY), 1,
                                batch_size)
  data = jax.device_put(random_cifar_client(np.random.default_rng(0), samples))
  params = model.init(jax.random.key(0), data.x[:1])
  train = jax.jit(trainer.train)
  keys = iter(jax.random.split(jax.random.key(1), 10_000))
  return lambda: jax.block_until_ready(train(params, data, next(keys)))


def torch_epoch(samples: int, batch_size: int):
  import torch  # pylint: disable=import-outside-toplevel  (checked in main)
  net = make_cnn(torch, (3, 32, 32), 10)
  optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM,
                              weight_decay=WEIGHT_DECAY)
  x = torch.randn(samples, 3, 32, 32)
  y = torch.randint(0, 10, (samples,))

  def epoch():
    order = torch.randperm(samples)
    for start in range(0, samples, batch_size):
      batch = order[start:start + batch_size]
      optimizer.zero_grad()
      torch.nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
      optimizer.step()
  return epoch


def model_conv() -> str:
  return _CONV.value or cnn_conv(jax.default_backend())


def main(argv):
  del argv
  try:
    import torch  # optional: pip install -e '.[bench]'
  except ImportError:
    raise SystemExit("error: benchmarks.cnn_step needs PyTorch: pip install -e '.[bench]'"
                     " (CPU wheels: see docs/performance.md)") from None
  if _TORCH_THREADS.value is not None:
    torch.set_num_threads(_TORCH_THREADS.value)
  steps = -(-_SAMPLES.value // _BATCH.value)
  sides = {"XLA": jax_epoch(_SAMPLES.value, _BATCH.value, model_conv()),
           "PyTorch": torch_epoch(_SAMPLES.value, _BATCH.value)}
  for run in sides.values():  # compilation, first-touch allocations
    run()
  seconds = {name: [] for name in sides}
  for _ in range(_REPEATS.value):
    for name, run in sides.items():
      start = time.perf_counter()
      run()
      seconds[name].append(time.perf_counter() - start)
  ms = {name: 1e3 * np.asarray(s) / steps for name, s in seconds.items()}
  speed = ms["PyTorch"] / ms["XLA"]
  print(f"{jax.devices()[0].device_kind}, {model_conv()} convolutions, PyTorch "
        f"{torch.get_num_threads()} thread(s), {steps} steps of batch {_BATCH.value} a "
        f"call, {_REPEATS.value} pairs")
  for name, values in ms.items():
    print(f"  {name}: {np.median(values):.1f} ms a step (median)")
  print(f"  XLA's speed against PyTorch's: {np.median(speed):.2f}x (median of the pairs;"
        f" range {speed.min():.2f}-{speed.max():.2f})")


if __name__ == "__main__":
  app.run(main)
