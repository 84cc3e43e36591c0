"""What a side-by-side run needs to hand a reference implementation exactly our inputs:
the same initial weights (flax <-> PyTorch), the same batches (the engine's own batch
indices), and the same split (our clients as PFLlib's dataset files).

Nothing here copies a reference's code: the references run from ../shared/references.
"""

import importlib.util
import os
import sys
import types
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from fedora_jax.algorithms import ala
from fedora_jax.data.client_data import Client, FederatedData
from fedora_jax.engine.local_training import epoch_batches
from fedora_jax.rounds import client_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCES = os.path.join(ROOT, "..", "shared", "references")


def reference_path(*parts: str) -> str:
  return os.path.normpath(os.path.join(REFERENCES, *parts))


# The PFLlib snapshots (../shared/references/README.md): its head, and the commit behind
# FedALA's table.
PFLLIB_SNAPSHOTS = ("PFLlib", "PFLlib-a41f7ba")
PFLLIB_PACKAGES = ("flcore", "utils")  # the top-level packages of their system/


# What a41f7ba imports and the rows never call: ujson (its text datasets), opacus (its DP).
A41F7BA_IMPORTS = ("ujson", "opacus", "opacus.dp_model_inspector")


class _Absent(types.ModuleType):
  """A module imported but not installed: each attribute a function that raises."""

  def __getattr__(self, attribute: str):
    if attribute.startswith("__"):
      raise AttributeError(attribute)

    def absent(*args, **kwargs):
      raise RuntimeError(f"{self.__name__}.{attribute}: not installed")
    return absent


def _under(module, folder: str) -> bool:
  """Whether `module` was imported from `folder` (a namespace package, without an
  __init__: by its __path__)."""
  places = [getattr(module, "__file__", None) or ""] + list(
      getattr(module, "__path__", None) or [])
  return any(os.path.abspath(place).startswith(folder + os.sep) for place in places)


def import_pfllib(snapshot: str = "PFLlib") -> str:
  """Puts the system/ folder (its library) of PFLlib's `snapshot` first on sys.path;
  returns it. Another snapshot's modules (flcore, utils: the same names) are dropped
  first, so rows of both run in one process, one after the other."""
  system = reference_path(snapshot, "system")
  for other in PFLLIB_SNAPSHOTS:
    other_system = reference_path(other, "system")
    if other == snapshot or other_system not in sys.path:
      continue
    sys.path.remove(other_system)
    stale = [name for name, module in list(sys.modules.items())
             if name.split(".")[0] in PFLLIB_PACKAGES and _under(module, other_system)]
    for name in stale:
      del sys.modules[name]
  if system in sys.path:
    sys.path.remove(system)
  sys.path.insert(0, system)
  for name in A41F7BA_IMPORTS:
    package = name.split(".")[0]
    if name not in sys.modules and (package in sys.modules and isinstance(
        sys.modules[package], _Absent) or importlib.util.find_spec(package) is None):
      sys.modules[name] = _Absent(name)
  return system


# ---------------------------------------------------------------- weights

def dense_stack_to_torch(params) -> list[tuple[np.ndarray, np.ndarray]]:
  """Our MLP's Dense layers in order as PyTorch nn.Linear (weight [out, in], bias)."""
  layers = params["params"]
  names = sorted(layers, key=lambda name: int(name.rsplit("_", 1)[1]))
  return [(np.asarray(layers[n]["kernel"]).T.copy(), np.asarray(layers[n]["bias"]).copy())
          for n in names]


def load_linear_layers(torch_model, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
  """Sets `torch_model`'s nn.Linear layers, in registration order, to `layers`."""
  import torch  # pylint: disable=import-outside-toplevel
  linears = [m for m in torch_model.modules() if isinstance(m, torch.nn.Linear)]
  assert len(linears) == len(layers), (len(linears), len(layers))
  with torch.no_grad():
    for linear, (weight, bias) in zip(linears, layers):
      linear.weight.copy_(torch.from_numpy(weight))
      linear.bias.copy_(torch.from_numpy(bias))


def torch_linear_layers(torch_model) -> list[tuple[np.ndarray, np.ndarray]]:
  import torch  # pylint: disable=import-outside-toplevel
  return [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy())
          for m in torch_model.modules() if isinstance(m, torch.nn.Linear)]


def cnn_to_torch(params) -> list[tuple[np.ndarray, np.ndarray]]:
  """Our CNN's layers (models/cnn.py: Conv_0, Conv_1, ..., then Dense_0, ...) in order as
  PyTorch's nn.Conv2d and nn.Linear hold them: a kernel HWIO -> OIHW; the first Dense
  layer's input rows from our NHWC flatten order (h, w, c) to PyTorch's NCHW one
  (c, h, w); every Dense kernel transposed to [out, in]."""
  layers = params["params"]
  named = lambda kind: sorted((n for n in layers if n.startswith(kind + "_")),
                              key=lambda n: int(n.rsplit("_", 1)[1]))
  converted = [(np.transpose(np.asarray(layers[n]["kernel"]), (3, 2, 0, 1)).copy(),
                np.asarray(layers[n]["bias"]).copy()) for n in named("Conv")]
  channels = converted[-1][0].shape[0]
  for i, name in enumerate(named("Dense")):
    kernel = np.asarray(layers[name]["kernel"])
    if i == 0:
      kernel = nhwc_rows_to_nchw(kernel, channels)
    converted.append((kernel.T.copy(), np.asarray(layers[name]["bias"]).copy()))
  return converted


def nhwc_rows_to_nchw(kernel: np.ndarray, channels: int) -> np.ndarray:
  """A Dense kernel [H*W*C, out] over a square NHWC feature map flattened, reordered to
  read the same map flattened NCHW (PyTorch's torch.flatten of [B, C, H, W])."""
  side = int(round((kernel.shape[0] // channels) ** 0.5))
  assert side * side * channels == kernel.shape[0], (kernel.shape, channels)
  return (kernel.reshape(side, side, channels, -1).transpose(2, 0, 1, 3)
          .reshape(kernel.shape[0], -1))


def load_torch_layers(torch_model, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
  """Sets `torch_model`'s nn.Conv2d and nn.Linear layers, in registration order, to
  `layers` (cnn_to_torch's)."""
  import torch  # pylint: disable=import-outside-toplevel
  modules = [m for m in torch_model.modules()
             if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
  assert len(modules) == len(layers), (len(modules), len(layers))
  with torch.no_grad():
    for module, (weight, bias) in zip(modules, layers):
      assert tuple(module.weight.shape) == weight.shape, (module.weight.shape, weight.shape)
      module.weight.copy_(torch.from_numpy(weight))
      module.bias.copy_(torch.from_numpy(bias))


def torch_layers(torch_model) -> list[tuple[np.ndarray, np.ndarray]]:
  """`torch_model`'s nn.Conv2d and nn.Linear layers in registration order (cnn_to_torch's
  layout), copied to the host."""
  import torch  # pylint: disable=import-outside-toplevel
  return [(m.weight.detach().cpu().numpy().copy(), m.bias.detach().cpu().numpy().copy())
          for m in torch_model.modules()
          if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]


# ---------------------------------------------------------------- batches

def client_batches(train_key: jax.Array, round_index: int, data: FederatedData,
                   epochs: int, batch_size: int,
                   trainings: Callable[[jax.Array], list[jax.Array]] = lambda key: [key]
                   ) -> list[list[list[np.ndarray]]]:
  """[client][training][epoch] -> [num_batches, B] sample indices into the client's
  training set, as the engine draws them in round `round_index` (0-based): the round key
  fold_in(train key, round), client k's fold_in(round key, k); `trainings(client key)`
  the keys of the client's trainer.train calls, in the order the reference trains (FedAvg:
  the client key itself); each split over the epochs, each epoch a shuffle cut into
  batches (local_training.epoch_batches). Every client must hold a multiple of
  `batch_size` samples (no partial batch: PFLlib drops it, the engine keeps it)."""
  return client_loads(train_key, round_index, data,
                      lambda key, n: [shuffled_epochs(training_key, n, epochs, batch_size)
                                      for training_key in trainings(key)])


def shuffled_epochs(key: jax.Array, n: int, epochs: int, batch_size: int
                    ) -> list[np.ndarray]:
  """The epochs of one trainer.train call from `key` on n samples: each a shuffle cut
  into [n // batch_size, batch_size] indices (local_training.epoch_batches)."""
  return [shuffle(epoch_key, n, batch_size) for epoch_key in jax.random.split(key, epochs)]


def shuffle(key: jax.Array, n: int, batch_size: int) -> np.ndarray:
  """One shuffle of n samples from `key` itself, cut into [n // batch_size, batch_size]
  indices (local_training.epoch_batches)."""
  assert n % batch_size == 0, f"{n} samples, batch {batch_size}"
  return np.asarray(epoch_batches(key, np.ones(n, bool), n, batch_size, n // batch_size)[0])


def leading_epochs(key: jax.Array, n: int, kept: int, epochs: int, batch_size: int
                   ) -> list[np.ndarray]:
  """The epochs of one trainer.train call from `key` on the first `kept` of n samples
  (the others masked off, as fedfomo.train_tail masks them): each a shuffle of those,
  cut into [kept // batch_size, batch_size] indices (local_training.epoch_batches)."""
  assert kept % batch_size == 0, f"{kept} samples, batch {batch_size}"
  mask = np.arange(n) < kept
  return [np.asarray(epoch_batches(k, mask, kept, batch_size, -(-n // batch_size))[0])
          [:kept // batch_size] for k in jax.random.split(key, epochs)]


def client_loads(train_key: jax.Array, round_index: int, data: FederatedData,
                 loads: Callable[[jax.Array, int], list[list[np.ndarray]]]
                 ) -> list[list[list[np.ndarray]]]:
  """[client][load][epoch] -> batch indices, in round `round_index` (0-based): `loads(
  client key, n)` gives the epochs of each data loader the reference's client asks for,
  in order, drawn from the key the engine hands client k (fold_in(round key, k))."""
  keys = client_keys(jax.random.fold_in(train_key, round_index), data.num_clients)
  sizes = data.split_sizes("train")
  return [loads(keys[k], int(sizes[k])) for k in range(data.num_clients)]


def padded_sizes(data: FederatedData, split: str = "train") -> np.ndarray:
  """[K] the size each client's `split` is padded to in its size bucket: the engine's
  shuffles draw a rank for every slot of it (local_training.epoch_batches)."""
  sizes = np.zeros(data.num_clients, np.int64)
  for ids, bucket in zip(data.client_ids, data.buckets):
    sizes[ids] = getattr(bucket, split).mask.shape[1]
  return sizes


def padded_client_batches(train_key: jax.Array, round_index: int, data: FederatedData,
                          epochs: int, batch_size: int,
                          trainings: Callable[[jax.Array], list[jax.Array]] = lambda key: [key]
                          ) -> list[list[list[np.ndarray]]]:
  """client_batches for clients of different sizes, padded in their bucket: client k's
  epochs drawn over its padded size, its real samples first (leading_epochs), as the
  engine draws them. The same as client_batches where no client is padded."""
  keys = client_keys(jax.random.fold_in(train_key, round_index), data.num_clients)
  sizes, padded = data.split_sizes("train"), padded_sizes(data)
  return [[leading_epochs(training_key, int(padded[k]), int(sizes[k]), epochs, batch_size)
           for training_key in trainings(keys[k])] for k in range(data.num_clients)]


class EpochLoader:
  """Stands in for a PyTorch DataLoader: its e-th iteration yields epoch e's batches."""

  def __init__(self, x: np.ndarray, y: np.ndarray, epochs: list[np.ndarray]):
    self.x, self.y, self.epochs, self.count = x, y, epochs, 0

  def __iter__(self) -> Iterator:
    import torch  # pylint: disable=import-outside-toplevel
    indices = self.epochs[self.count]
    self.count += 1
    for batch in indices:
      yield torch.from_numpy(self.x[batch]), torch.from_numpy(self.y[batch])

  def __len__(self) -> int:
    return len(self.epochs[0])


# ---------------------------------------------------------------- ALA's sample

def ala_slice_start(train_key: jax.Array, round_index: int, data: FederatedData,
                    client: int, s: float) -> int:
  """The first sample of the slice our ALA (sample="slice") learns client k's W on in
  round `round_index` (0-based): from the client's key of the round, split as
  ala.with_ala splits it (ALA's key first) and ala.learn_weights splits that (the
  sample's key first)."""
  key = client_keys(jax.random.fold_in(train_key, round_index), data.num_clients)[client]
  n = int(data.split_sizes("train")[client])
  sample_key = jax.random.split(jax.random.split(key)[0])[0]
  return int(ala.slice_start(sample_key, n, ala.sample_size(s, n)))


class SliceAt:
  """Stands in for the training data the authors' ALA slices (`train_data[rand_idx:
  rand_idx + rand_num]`, rand_idx from Python's random): its i-th slicing returns the
  slice of the same length at start(i), our ALA's start in round i."""

  def __init__(self, data: Sequence, start: Callable[[int], int], size: int):
    self.data, self.start, self.size, self.count = data, start, size, 0

  def __len__(self) -> int:
    return len(self.data)

  def __getitem__(self, index: slice) -> list:
    m = index.stop - index.start
    assert m == self.size, f"their sample holds {m}, ours {self.size}"
    start = self.start(self.count)
    self.count += 1
    return self.data[start:start + m]


# ---------------------------------------------------------------- split

def model_inputs(x: np.ndarray) -> np.ndarray:
  """What our models compute on: uint8 pixels / 255 as float32 (models.mlp)."""
  return (x.astype(np.float32) / 255.0) if x.dtype == np.uint8 else x.astype(np.float32)


def pfllib_pixels(x: np.ndarray) -> np.ndarray:
  """uint8 images as PFLlib's dataset generators write them (ToTensor, then
  Normalize(0.5, 0.5)): (x / 255 - 0.5) / 0.5 in float32."""
  return ((x.astype(np.float32) / 255.0 - 0.5) / 0.5).astype(np.float32)


def write_pfllib_split(clients: Sequence[Client], folder: str, name: str,
                       inputs: Callable[[np.ndarray], np.ndarray] = model_inputs) -> str:
  """Our clients as PFLlib's dataset files, <folder>/dataset/<name>/{train,test}/<k>.npz
  ({"data": {"x", "y"}}, x as `inputs` makes it: the MLP's pixels / 255 by default);
  returns <folder>/system, the working directory PFLlib's '../dataset' paths need."""
  for split, pick in (("train", lambda c: (c.x_train, c.y_train)),
                      ("test", lambda c: (c.x_test, c.y_test))):
    directory = os.path.join(folder, "dataset", name, split)
    os.makedirs(directory, exist_ok=True)
    for k, client in enumerate(clients):
      x, y = pick(client)
      np.savez(os.path.join(directory, f"{k}.npz"),
               data={"x": inputs(x), "y": y.astype(np.int64)})
  system = os.path.join(folder, "system")
  os.makedirs(system, exist_ok=True)
  return system
