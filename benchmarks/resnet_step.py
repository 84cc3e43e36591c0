"""Times ResNet-18's local SGD steps and evaluation for one client (docs/resnet.md).

  python -m benchmarks.resnet_step                  # im2col convolutions (the CPU default)
  python -m benchmarks.resnet_step --conv=xla       # lax.conv (the default off CPUs)

Runs the engine's own local training (`make_client_trainer(...).train`, BatchNorm in
train mode, SGD with momentum and weight decay) on random uint8 CIFAR-shaped images, one
client, `--steps` full batches, and its evaluation of `--eval_images` images; prints the
compile time and each timed call's seconds per step and per evaluated image.
"""

import time

from absl import app, flags
import jax
import numpy as np

from benchmarks.measure import random_cifar_client
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.models.resnet import ResNet

_CONV = flags.DEFINE_enum("conv", "im2col", ["im2col", "xla"], "Convolution implementation.")
_STEPS = flags.DEFINE_integer("steps", 2, "SGD steps per timed call.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Local batch size.")
_EVAL = flags.DEFINE_integer("eval_images", 256, "Images evaluated per timed call.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls of each.")


def main(argv) -> None:
  del argv
  rng = np.random.default_rng(0)
  model = ResNet(num_outputs=10, conv=_CONV.value)
  train_data = random_cifar_client(rng, _STEPS.value * _BATCH.value)
  params = batch_stats.fold(model.init(jax.random.key(0), train_data.x[:1]))
  trainer = make_client_trainer(model.apply, make_optimizer(0.01, 0.9, 5e-4), 1,
                                _BATCH.value)
  start = time.perf_counter()
  train = jax.jit(trainer.train).lower(params, train_data, jax.random.key(1)).compile()
  print(f"{_CONV.value}: train compile {time.perf_counter() - start:.1f} s", flush=True)
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    trained, _ = jax.block_until_ready(train(params, train_data, jax.random.key(1)))
    seconds = time.perf_counter() - start
    print(f"{_CONV.value}: {_STEPS.value} steps of batch {_BATCH.value} {seconds:.2f} s"
          f" = {seconds / _STEPS.value:.2f} s/step", flush=True)
  eval_data = random_cifar_client(rng, _EVAL.value)
  evaluate = jax.jit(trainer.evaluate).lower(trained, eval_data).compile()
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(evaluate(trained, eval_data))
    seconds = time.perf_counter() - start
    print(f"{_CONV.value}: evaluate {_EVAL.value} images {seconds:.2f} s"
          f" = {1000 * seconds / _EVAL.value:.1f} ms/image", flush=True)


if __name__ == "__main__":
  app.run(main)
