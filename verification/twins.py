"""PyTorch twins of our models where no reference holds one, and their weight bridges.

PFLlib has no model with BatchNorm on MNIST (its FedAvgCNN has none), so FedBN's row runs
on a PyTorch twin of our coaching_cnn_bn (models/cnn.py CNN with batch_norm=True: Conv
32 5x5, BN, ReLU, pool; Conv 64 5x5, BN, ReLU, pool; Dense 512, BN, ReLU; Dense 128, BN,
ReLU; Dense 10), its BatchNorm modules named with "bn", as PFLlib's clientbn.py finds
them. Layers here are tuples in the twin's registration order: (weight, bias) for a
convolution or a dense layer, (weight, bias, running_mean, running_var) for a BatchNorm.
"""

from typing import Any, Callable, NamedTuple

import numpy as np

from verification import bridges


class Twin(NamedTuple):
  """One of our registered models beside its PyTorch twin, and their weight bridges."""
  model: str                              # our registry name
  build: Callable[[Any], Any] | None      # (torch) -> the twin; None: the row's own
  to_torch: Callable[[Any], list]         # our variables -> the twin's layers
  load: Callable[[Any, list], None]       # (twin, layers) -> None: sets them
  read: Callable[[Any], list]             # twin -> its layers

# MNIST's pixel statistics, as models/cnn.py standardises single-channel images.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
BN_MODULES = ("ConvBN_0", "ConvBN_1", "DenseBN_0", "DenseBN_1")


def coaching_cnn_bn_twin(torch, unbiased_variance: bool = True):
  """coaching_cnn_bn in PyTorch (NCHW), on PFLlib's inputs (our model_inputs: pixels /
  255), standardised in its forward as ours. With `unbiased_variance=False` its BatchNorm
  layers record the biased batch variance in their running variance, as flax's do
  (nn.BatchNorm2d/1d record the unbiased one; docs/verification.md)."""
  nn = torch.nn

  def batch_norm(kind, features):
    module = kind(features)  # PyTorch's defaults: momentum 0.1, epsilon 1e-5
    if not unbiased_variance:
      module.register_forward_hook(_biased_running_variance)
    return module

  class CoachingCnnBn(nn.Module):
    def __init__(self):
      super().__init__()
      self.conv1, self.bn1 = nn.Conv2d(1, 32, 5), batch_norm(nn.BatchNorm2d, 32)
      self.conv2, self.bn2 = nn.Conv2d(32, 64, 5), batch_norm(nn.BatchNorm2d, 64)
      self.fc1, self.bn3 = nn.Linear(1024, 512), batch_norm(nn.BatchNorm1d, 512)
      self.fc2, self.bn4 = nn.Linear(512, 128), batch_norm(nn.BatchNorm1d, 128)
      self.fc = nn.Linear(128, 10)

    def forward(self, x):
      x = ((x - MNIST_MEAN) / MNIST_STD).reshape(x.shape[0], 1, 28, 28)
      pool = lambda h: torch.nn.functional.max_pool2d(h, 2)
      x = pool(torch.relu(self.bn1(self.conv1(x))))
      x = pool(torch.relu(self.bn2(self.conv2(x))))
      x = torch.relu(self.bn3(self.fc1(torch.flatten(x, 1))))
      return self.fc(torch.relu(self.bn4(self.fc2(x))))
  return CoachingCnnBn()


def _biased_running_variance(module, inputs, output) -> None:
  """After a train-mode pass: the running variance as if the pass had recorded the biased
  batch variance, (n - 1) / n of the unbiased one PyTorch recorded."""
  del output
  if not module.training:
    return
  import torch  # pylint: disable=import-outside-toplevel
  x = inputs[0]
  n = x.numel() // x.shape[1]
  dims = [d for d in range(x.dim()) if d != 1]
  with torch.no_grad():
    unbiased = x.var(dim=dims, unbiased=True)
    # 0.1 (v_u - v_b) = 0.1 v_u / n; a new tensor, since autograd holds the old one.
    module.running_var = module.running_var - module.momentum * unbiased / n


def bn_cnn_to_torch(params) -> list[tuple[np.ndarray, ...]]:
  """coaching_cnn_bn's variables (folded, engine/batch_stats.py) as the twin's layers."""
  layers, converted = params["params"], []
  for name in BN_MODULES:
    inner = layers[name]["Conv_0" if name.startswith("Conv") else "Dense_0"]
    kernel = np.asarray(inner["kernel"])
    if name.startswith("Conv"):
      weight = np.transpose(kernel, (3, 2, 0, 1))
    else:
      # The first dense layer reads our NHWC flatten order, PyTorch's NCHW one.
      weight = (bridges.nhwc_rows_to_nchw(kernel, 64) if name == "DenseBN_0" else kernel).T
    norm = layers[name]["BatchNorm_0"]
    converted += [(weight.copy(), np.asarray(inner["bias"]).copy()),
                  tuple(np.asarray(a).copy() for a in (
                      norm["scale"], norm["bias"], norm["batch_stats"]["mean"],
                      norm["batch_stats"]["var"]))]
  head = layers["Dense_0"]
  converted.append((np.asarray(head["kernel"]).T.copy(), np.asarray(head["bias"]).copy()))
  return converted


def _modules(torch, torch_model) -> list:
  kinds = (torch.nn.Conv2d, torch.nn.Linear, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)
  return [m for m in torch_model.modules() if isinstance(m, kinds)]


def _tensors(torch, module) -> list:
  if isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
    return [module.weight, module.bias, module.running_mean, module.running_var]
  return [module.weight, module.bias]


def load_layers(torch_model, layers) -> None:
  """Sets the twin's convolutions, dense layers and BatchNorm parameters and buffers."""
  import torch  # pylint: disable=import-outside-toplevel
  modules = _modules(torch, torch_model)
  assert len(modules) == len(layers), (len(modules), len(layers))
  with torch.no_grad():
    for module, arrays in zip(modules, layers):
      for tensor, array in zip(_tensors(torch, module), arrays, strict=True):
        assert tuple(tensor.shape) == array.shape, (tensor.shape, array.shape)
        tensor.copy_(torch.from_numpy(array))


def torch_layers(torch_model) -> list[tuple[np.ndarray, ...]]:
  """The twin's layers, BatchNorm buffers included (bn_cnn_to_torch's layout)."""
  import torch  # pylint: disable=import-outside-toplevel
  return [tuple(t.detach().cpu().numpy().copy() for t in _tensors(torch, m))
          for m in _modules(torch, torch_model)]


COACHING_CNN_BN = Twin("coaching_cnn_bn", coaching_cnn_bn_twin, bn_cnn_to_torch, load_layers,
                       torch_layers)
# Its BatchNorm recording the biased batch variance, as ours (flax's) does.
COACHING_CNN_BN_BIASED = COACHING_CNN_BN._replace(
    build=lambda torch: coaching_cnn_bn_twin(torch, unbiased_variance=False))
