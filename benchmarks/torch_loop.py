"""FEDORA's round as a plain sequential PyTorch loop over clients: the baseline we time.

This is how PFLlib and the FEDORA authors' code (github.com/junwu6/FEDORA) run a round:
the server propagates the stacked client parameters, then each client, one after
another, scores its own and its propagated model on its validation split (lambda_k),
re-creates its SGD-with-momentum optimizer and trains E local epochs of shuffled
mini-batches; then every client's model is evaluated on validation and test. Data is
pre-converted to float tensors once (no DataLoader), so the loop is a strong baseline:
the authors' own code with its DataLoaders is slower than this.

Same math as `fedora_jax.algorithms.fedora` (both the paper's proximal term
`lambda_k ||theta - theta_hat_k||^2` and the authors' decoupled pull, both lambda rules),
on the same clients and the same propagation graph W, with the same model: the MLP
(`--hidden`) or the LeNet-5-style CNN of `fedora_jax.models.cnn` (same layers, same
per-channel input standardisation, NCHW as PyTorch wants). It is not bit-identical
(PyTorch draws its own initial weights and batch orders). It runs on the GPU when
PyTorch sees one (`device="auto"`), else on the CPU. torch is imported here only, so
the rest of the project never needs it.
"""

import math
import time
from typing import Any, NamedTuple, Sequence

import numpy as np

from fedora_jax.data.client_data import FederatedData
from fedora_jax.errors import ConfigError
from fedora_jax.models.cnn import CHANNEL_STATS


class TorchClient(NamedTuple):
  x_train: Any
  y_train: Any
  x_val: Any
  y_val: Any
  x_test: Any
  y_test: Any


def _inputs(x: np.ndarray, model: str) -> np.ndarray:
  """One client's inputs as the model takes them: float32, pixels scaled to [0, 1].

  The MLP sees flat rows; the CNN [n, C, H, W] images standardised per channel as
  `fedora_jax.models.cnn.standardize_images` does.
  """
  if model == "mlp":
    x = x.reshape(len(x), -1)
    return x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
  images = x[..., None] if x.ndim == 3 else x  # [n, H, W, C]
  if images.dtype != np.uint8:
    return np.ascontiguousarray(images.astype(np.float32).transpose(0, 3, 1, 2))
  images = images.astype(np.float32) / 255.0
  stats = CHANNEL_STATS.get(images.shape[-1])
  if stats is not None:
    mean, std = (np.asarray(v, np.float32) for v in stats)
    images = (images - mean) / std
  return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def _unpad(data: FederatedData, torch, model: str = "mlp",
           device: str = "cpu") -> list[TorchClient]:
  """Per-client float tensors in client order, padding dropped, on `device`."""
  clients: list[Any] = [None] * data.num_clients
  for ids, bucket in zip(data.client_ids, data.buckets):
    for row, k in enumerate(ids):
      parts = []
      for split in (bucket.train, bucket.val, bucket.test):
        n = int(split.n[row])
        x = _inputs(np.asarray(split.x[row, :n]), model)
        parts += [torch.from_numpy(x).to(device),
                  torch.from_numpy(np.asarray(split.y[row, :n], np.int64)).to(device)]
      clients[int(k)] = TorchClient(*parts)
  return clients


def make_mlp(torch, num_inputs: int, hidden: Sequence[int], num_outputs: int):
  layers, width = [], num_inputs
  for h in hidden:
    layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
    width = h
  layers.append(torch.nn.Linear(width, num_outputs))
  return torch.nn.Sequential(*layers)


def make_cnn(torch, input_shape: Sequence[int], num_outputs: int, kernels: int = 16,
             dense: Sequence[int] = (120, 84)):
  """fedora_jax.models.cnn.CNN in PyTorch: two 5x5 VALID convolutions (16, 32 kernels),
  each with ReLU and 2x2 max-pooling, then dense 120 -> 84 -> num_outputs. PyTorch's
  default initialisation is the U(-1/sqrt(fan_in), 1/sqrt(fan_in)) ours copies."""
  channels, height, width = input_shape
  layers, size = [], (height, width)
  for features in (kernels, 2 * kernels):
    layers += [torch.nn.Conv2d(channels, features, 5), torch.nn.ReLU(),
               torch.nn.MaxPool2d(2)]
    channels, size = features, ((size[0] - 4) // 2, (size[1] - 4) // 2)
  layers.append(torch.nn.Flatten())
  fan_in = channels * size[0] * size[1]
  for h in dense:
    layers += [torch.nn.Linear(fan_in, h), torch.nn.ReLU()]
    fan_in = h
  layers.append(torch.nn.Linear(fan_in, num_outputs))
  return torch.nn.Sequential(*layers)


def pick_device(torch, device: str = "auto") -> str:
  """"auto": the GPU when PyTorch sees one (CUDA), else the CPU."""
  if device == "auto":
    return "cuda" if torch.cuda.is_available() else "cpu"
  return device


class TorchFedora:
  """K PyTorch models and the sequential FEDORA round over them."""

  def __init__(self, data: FederatedData, graph: np.ndarray, hidden: Sequence[int],
               alpha: float, lambda_rule: str = "paper", lambda_eps: float = 1e-8,
               pull: str = "prox", local_epochs: int = 5, batch_size: int = 64,
               lr: float = 5e-3, momentum: float = 0.9, weight_decay: float = 5e-5,
               eval_batch_size: int = 1024, seed: int = 0, threads: int | None = None,
               model: str = "mlp", device: str = "auto", participation: float = 1.0):
    import torch  # pylint: disable=import-outside-toplevel
    if model not in ("mlp", "cnn"):
      raise ConfigError(f"the PyTorch baseline has an mlp and a cnn, not {model!r}")
    self.torch = torch
    if threads:
      torch.set_num_threads(threads)
    torch.manual_seed(seed)
    self.device = pick_device(torch, device)
    self.clients = _unpad(data, torch, model, self.device)
    input_shape = tuple(self.clients[0].x_train.shape[1:])
    if model == "cnn":
      make = lambda: make_cnn(torch, input_shape, data.num_classes)
    else:
      make = lambda: make_mlp(torch, input_shape[0], hidden, data.num_classes)
    initial = make()
    # One initial model copied to every client, as in the authors' code.
    self.models = [make().to(self.device) for _ in range(data.num_clients)]
    for m in self.models:
      m.load_state_dict(initial.state_dict())
    self.propagated_model = make().to(self.device)
    w = torch.as_tensor(np.array(graph, np.float32))
    degree = w.sum(1, keepdim=True)
    transition = torch.where(degree > 0, w / torch.where(degree > 0, degree, 1.0), 0.0)
    self.kappa = alpha / (1.0 + alpha)
    self.system = (torch.eye(len(w)) - self.kappa * transition).to(self.device)
    self.lambda_rule, self.lambda_eps, self.pull = lambda_rule, lambda_eps, pull
    self.local_epochs, self.batch_size, self.lr = local_epochs, batch_size, lr
    self.momentum, self.weight_decay = momentum, weight_decay
    self.eval_batch_size = eval_batch_size
    # As the engine: round(f K) clients (at least 1) train each round, drawn uniformly.
    self.num_trained = max(1, min(data.num_clients, round(participation * data.num_clients)))
    self.generator = torch.Generator().manual_seed(seed)
    self.server_seconds = 0.0

  def synchronize(self):
    """Waits for the GPU's queued work (a no-op on the CPU), so that wall times are true."""
    if self.device.startswith("cuda"):
      self.torch.cuda.synchronize()

  def _loss(self, model, x, y):
    torch = self.torch
    total = torch.zeros((), device=self.device)
    with torch.no_grad():
      for start in range(0, len(x), self.eval_batch_size):
        total += torch.nn.functional.cross_entropy(
            model(x[start:start + self.eval_batch_size]),
            y[start:start + self.eval_batch_size], reduction="sum")
    return total.item() / max(len(x), 1)

  def _accuracy(self, model, x, y):
    torch = self.torch
    correct = torch.zeros((), dtype=torch.int64, device=self.device)
    with torch.no_grad():
      for s in range(0, len(x), self.eval_batch_size):
        correct += (model(x[s:s + self.eval_batch_size]).argmax(-1)
                    == y[s:s + self.eval_batch_size]).sum()
    return correct.item() / max(len(x), 1)

  def _lambda(self, diff: float) -> float:
    if self.lambda_rule == "paper":
      return max(self.lambda_eps, diff)
    return 0.0 if diff < 0 else math.exp(diff / 2.0)

  def propagate(self):
    """Theta_hat = (1 - kappa)(I - kappa D^-1 W)^-1 Theta, solved on the K x d matrix."""
    torch = self.torch
    tic = time.perf_counter()
    with torch.no_grad():
      theta = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters())
                           for m in self.models])
      theta_hat = torch.linalg.solve(self.system, (1.0 - self.kappa) * theta)
    self.synchronize()
    self.server_seconds += time.perf_counter() - tic
    return theta_hat

  def train_client(self, k: int, theta_hat_k):
    torch = self.torch
    model, data = self.models[k], self.clients[k]
    torch.nn.utils.vector_to_parameters(theta_hat_k, self.propagated_model.parameters())
    diff = (self._loss(model, data.x_val, data.y_val)
            - self._loss(self.propagated_model, data.x_val, data.y_val))
    lam = self._lambda(diff)
    targets = [p.detach() for p in self.propagated_model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum,
                                weight_decay=self.weight_decay)
    n = len(data.x_train)
    for _ in range(self.local_epochs):
      order = torch.randperm(n, generator=self.generator).to(self.device)
      for start in range(0, n, self.batch_size):
        idx = order[start:start + self.batch_size]
        loss = torch.nn.functional.cross_entropy(model(data.x_train[idx]),
                                                 data.y_train[idx])
        if self.pull == "prox":
          loss = loss + lam * sum(torch.sum((p - t) ** 2)
                                  for p, t in zip(model.parameters(), targets))
        else:
          before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if self.pull != "prox":
          with torch.no_grad():
            for p, old, t in zip(model.parameters(), before, targets):
              p.sub_(self.lr * lam * (old - t))

  def round(self) -> dict[str, float]:
    """One communication round (the sampled clients train, every client is evaluated);
    returns mean validation / test accuracy."""
    theta_hat = self.propagate()
    trained = range(len(self.models))
    if self.num_trained < len(self.models):
      trained = sorted(self.torch.randperm(len(self.models), generator=self.generator)
                       [:self.num_trained].tolist())
    for k in trained:
      self.train_client(k, theta_hat[k])
    val = [self._accuracy(m, c.x_val, c.y_val) for m, c in zip(self.models, self.clients)]
    test = [self._accuracy(m, c.x_test, c.y_test) for m, c in zip(self.models, self.clients)]
    self.synchronize()
    return {"val_acc": float(np.mean(val)), "test_acc": float(np.mean(test))}


def time_torch_fedora(reference: TorchFedora, repeats: int, warmup: int = 1):
  """Median-able wall times of `repeats` rounds after `warmup`, and the server's share."""
  for _ in range(warmup):
    reference.round()
  reference.server_seconds = 0.0
  durations = []
  for _ in range(repeats):
    tic = time.perf_counter()
    reference.round()
    durations.append(time.perf_counter() - tic)
  return durations, reference.server_seconds / max(repeats, 1)
