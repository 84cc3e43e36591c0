"""Times one round of local training over clients: jax.vmap against jax.lax.map.

  python -m benchmarks.vmap_vs_map                      # the CNN on CIFAR-10 shapes
  python -m benchmarks.vmap_vs_map --model=mlp --clients=36 --samples=128

Vmapping a convolution over clients (each with its own kernels) lowers to a grouped
convolution; XLA's CPU backend may run that slower than a sequential loop over clients
or small groups of them (`lax.map(..., batch_size=n)`). This runs the engine's own local
training (`make_client_trainer(...).train`) on random uint8 data of the dataset's shape
through `fedora_jax.engine.buckets.over_clients` with each `client_chunk` and prints the
median wall time per call, after compilation. Results are identical across modes; the
script checks that too.
"""

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.buckets import over_clients
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.models import build_model

_MODEL = flags.DEFINE_string("model", "cnn", "Model name in fedora_jax.models.MODELS.")
_CLIENTS = flags.DEFINE_integer("clients", 10, "Clients K.")
_SAMPLES = flags.DEFINE_integer("samples", 256, "Training samples per client.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Local epochs.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Local batch size.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per mode.")
_CLIENT_CHUNKS = flags.DEFINE_list("client_chunks", ["vmap", "1", "2", "5"],
                                    "Modes: 'vmap' or a lax.map batch size.")


def benchmark(model_name: str = "cnn", clients: int = 10, samples: int = 256,
              epochs: int = 1, batch_size: int = 64, repeats: int = 3,
              client_chunks=("vmap", "1", "2", "5"),
              image_shape=(32, 32, 3)) -> dict[str, float]:
  """Median seconds of one local-training call over all clients, per mode."""
  model = build_model(model_name, 10)
  trainer = make_client_trainer(model.apply, make_optimizer(5e-3, 0.9, 5e-5), epochs,
                                batch_size)
  rng = np.random.default_rng(0)
  data = ClientData(
      x=rng.integers(0, 256, (clients, samples) + tuple(image_shape), np.uint8),
      y=rng.integers(0, 10, (clients, samples)).astype(np.int32),
      mask=np.ones((clients, samples), bool), n=np.full(clients, samples, np.int32))
  data = jax.device_put(data)
  params = model.init(jax.random.key(0), data.x[0, :1])
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (clients,) + a.shape), params)
  keys = jax.random.split(jax.random.key(1), clients)

  def one_client(p, d, k):
    new_params, stats = trainer.train(p, d, k)
    return new_params, stats.loss

  times, reference = {}, None
  for mode in client_chunks:
    client_chunk = None if mode == "vmap" else int(mode)
    fn = jax.jit(over_clients(one_client, client_chunk))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(params, data, keys))
    compile_and_first = time.perf_counter() - start
    durations = []
    for _ in range(repeats):
      tic = time.perf_counter()
      jax.block_until_ready(fn(params, data, keys))
      durations.append(time.perf_counter() - tic)
    times[mode] = float(np.median(durations))
    if reference is None:
      reference = out
    else:
      np.testing.assert_allclose(out[1], reference[1], rtol=2e-4, atol=1e-5)
    print(f"{model_name} K={clients} n={samples} epochs={epochs} batch={batch_size}"
          f" {'vmap' if client_chunk is None else f'lax.map(batch_size={client_chunk})':>24}:"
          f" {times[mode]:.3f} s per call (first call incl. compile {compile_and_first:.1f} s)",
          flush=True)
  return times


def main(argv):
  del argv
  shape = (32, 32, 3) if _MODEL.value == "cnn" else (28, 28)
  benchmark(_MODEL.value, _CLIENTS.value, _SAMPLES.value, _EPOCHS.value, _BATCH.value,
            _REPEATS.value, tuple(_CLIENT_CHUNKS.value), shape)


if __name__ == "__main__":
  app.run(main)
