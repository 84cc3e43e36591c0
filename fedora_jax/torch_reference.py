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
on the same clients and the same propagation graph W, with the same model (the MLP, or
the LeNet-5-style CNN of fedora_jax.models.cnn: same layers, same input standardisation);
it is not bit-identical (PyTorch draws its own initial weights and batch orders). It runs
on the GPU when PyTorch sees one. torch is imported here only, so the rest of the project
never needs it.
"""

import math
import time
from typing import Any, NamedTuple, Sequence

import numpy as np

from fedora_jax.data.client_data import FederatedData
from fedora_jax.models.cnn import CHANNEL_STATS


class TorchClient(NamedTuple):
  x_train: Any
  y_train: Any
  x_val: Any
  y_val: Any
  x_test: Any
  y_test: Any


def _model_inputs(x: np.ndarray, model: str) -> np.ndarray:
  """What the JAX model computes from the stored pixels before its first layer: the MLP
  flattens [0, 1] pixels; the CNN standardises per channel (models.cnn), as NCHW."""
  n = x.shape[0]
  if model == "mlp":
    x = x.reshape(n, -1)
    return x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
  images = x if x.ndim == 4 else x[..., None]
  if images.dtype == np.uint8:
    images = images.astype(np.float32) / 255.0
    stats = CHANNEL_STATS.get(images.shape[-1])
    if stats is not None:
      images = (images - np.asarray(stats[0], np.float32)) / np.asarray(stats[1], np.float32)
  return np.ascontiguousarray(images.astype(np.float32).transpose(0, 3, 1, 2))


def _unpad(data: FederatedData, torch, model: str, device) -> list[TorchClient]:
  """Per-client float tensors on `device` in client order, padding dropped."""
  clients: list[Any] = [None] * data.num_clients
  for ids, bucket in zip(data.client_ids, data.buckets):
    for row, k in enumerate(ids):
      parts = []
      for split in (bucket.train, bucket.val, bucket.test):
        n = int(split.n[row])
        x = _model_inputs(np.asarray(split.x[row, :n]), model)
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
  """models.cnn.CNN in PyTorch: two VALID 5x5 convolutions, each ReLU and 2x2 max-pool,
  then dense layers; input [N, C, H, W]."""
  channels, height, width = input_shape
  nn = torch.nn
  layers = [nn.Conv2d(channels, kernels, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(kernels, 2 * kernels, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
  side_h, side_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
  features = 2 * kernels * side_h * side_w
  for h in dense:
    layers += [nn.Linear(features, h), nn.ReLU()]
    features = h
  layers.append(nn.Linear(features, num_outputs))
  return nn.Sequential(*layers)


class TorchFedora:
  """K PyTorch models and the sequential FEDORA round over them."""

  def __init__(self, data: FederatedData, graph: np.ndarray, hidden: Sequence[int],
               alpha: float, lambda_rule: str = "paper", lambda_eps: float = 1e-8,
               pull: str = "prox", local_epochs: int = 5, batch_size: int = 64,
               lr: float = 5e-3, momentum: float = 0.9, weight_decay: float = 5e-5,
               eval_batch_size: int = 1024, seed: int = 0, threads: int | None = None,
               model: str = "mlp"):
    import torch  # pylint: disable=import-outside-toplevel
    if model not in ("mlp", "cnn"):
      raise ValueError(f"the PyTorch loop has the mlp and the cnn, not {model!r}")
    self.torch = torch
    if threads:
      torch.set_num_threads(threads)
    torch.manual_seed(seed)
    self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    self.clients = _unpad(data, torch, model, self.device)
    shape = tuple(self.clients[0].x_train.shape[1:])

    def build():
      if model == "cnn":
        return make_cnn(torch, shape, data.num_classes).to(self.device)
      return make_mlp(torch, shape[0], hidden, data.num_classes).to(self.device)
    initial = build()
    # One initial model copied to every client, as in the authors' code.
    self.models = [build() for _ in range(data.num_clients)]
    for m in self.models:
      m.load_state_dict(initial.state_dict())
    self.propagated_model = build()
    w = torch.as_tensor(np.array(graph, np.float32), device=self.device)
    degree = w.sum(1, keepdim=True)
    transition = torch.where(degree > 0, w / torch.where(degree > 0, degree, 1.0), 0.0)
    self.kappa = alpha / (1.0 + alpha)
    self.system = torch.eye(len(w), device=self.device) - self.kappa * transition
    self.lambda_rule, self.lambda_eps, self.pull = lambda_rule, lambda_eps, pull
    self.local_epochs, self.batch_size, self.lr = local_epochs, batch_size, lr
    self.momentum, self.weight_decay = momentum, weight_decay
    self.eval_batch_size = eval_batch_size
    self.generator = torch.Generator(device=self.device).manual_seed(seed)
    self.server_seconds = 0.0

  def _synchronize(self):
    if self.device.type == "cuda":
      self.torch.cuda.synchronize()

  def _loss(self, model, x, y):
    torch = self.torch
    total = 0.0
    with torch.no_grad():
      for start in range(0, len(x), self.eval_batch_size):
        total += torch.nn.functional.cross_entropy(
            model(x[start:start + self.eval_batch_size]),
            y[start:start + self.eval_batch_size], reduction="sum").item()
    return total / max(len(x), 1)

  def _accuracy(self, model, x, y):
    torch = self.torch
    with torch.no_grad():
      correct = sum(int((model(x[s:s + self.eval_batch_size]).argmax(-1)
                         == y[s:s + self.eval_batch_size]).sum())
                    for s in range(0, len(x), self.eval_batch_size))
    return correct / max(len(x), 1)

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
    self._synchronize()
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
      order = torch.randperm(n, generator=self.generator, device=self.device)
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
    """One communication round; returns mean validation / test accuracy."""
    theta_hat = self.propagate()
    for k in range(len(self.models)):
      self.train_client(k, theta_hat[k])
    val = [self._accuracy(m, c.x_val, c.y_val) for m, c in zip(self.models, self.clients)]
    test = [self._accuracy(m, c.x_test, c.y_test) for m, c in zip(self.models, self.clients)]
    self._synchronize()
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
