"""Model registry: name -> flax module constructor."""

from typing import Callable, Sequence

import flax.linen as nn
import jax
import numpy as np

from fedora_jax.errors import ConfigError
from fedora_jax.models.char_lstm import CharLSTM
from fedora_jax.models.cnn import CNN
from fedora_jax.models.fasttext import FastText
from fedora_jax.models.mlp import MLP
from fedora_jax.models.pfl_cnn import PflCNN
from fedora_jax.models.resnet import ResNet


def _mlp(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  return MLP(hidden=tuple(hidden), num_outputs=num_outputs)


def cnn_conv(platform: str) -> str:
  """The registered CNNs' convolution (models/cnn.py): banded matmuls on CPUs, where they
  beat im2col (docs/performance.md); im2col elsewhere, as measured on an H100."""
  return "banded" if platform == "cpu" else "im2col"


def _registered_cnn(num_outputs: int, **widths) -> nn.Module:
  """models/cnn.py's CNN with this platform's convolution."""
  return CNN(num_outputs=num_outputs, conv=cnn_conv(jax.default_backend()), **widths)


def _cnn(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  del hidden  # --hidden is the MLP's; the CNN is the authors' fixed LeNet-5 shape.
  return _registered_cnn(num_outputs)


def _coaching_cnn(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """The CNN of knowledge-aware parameter coaching (Zhi et al., AAAI 2024) for MNIST and
  Fashion-MNIST: "2 convolutional layers with 5x5 filters followed by 3 fully connected
  layers with 512 and 128 hidden neurons". The paper gives no channel counts or pooling;
  those are the common FedAvg CNN's (McMahan et al. 2017, as PFLlib's FedAvgCNN writes
  it: 32 and 64 kernels, VALID convolutions, ReLU and 2x2 max-pool after each), so on
  28x28x1 images: 28 -> 24 -> 12 -> 8 -> 4, 4*4*64 = 1024 features into
  Dense 512 -> Dense 128 -> Dense num_outputs (643,850 parameters for 10 classes).
  Same layer names as the CNN (Conv_0, Conv_1, Dense_0, Dense_1, Dense_2): body = all
  but Dense_2, whose input (the 128 features) is the representation."""
  del hidden  # --hidden is the MLP's
  return _registered_cnn(num_outputs, kernels=32, dense=(512, 128))


def _coaching_cnn_bn(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """coaching_cnn with a BatchNorm after each convolution and hidden dense layer, before
  its ReLU (models/cnn.py CNN.batch_norm), for FedBN's row in the coaching tables: FedBN
  keeps BatchNorm layers local and is FedAvg without them, while the paper's FedBN row
  differs from its FedAvg row by up to 30 points, so its CNN must have had some; the
  paper does not say where (the placement here is FedBN's own CNN's). 645,322
  parameters and 1,472 running averages for 10 classes."""
  del hidden  # --hidden is the MLP's
  return CNN(num_outputs=num_outputs, conv=cnn_conv(jax.default_backend()), kernels=32,
             dense=(512, 128), batch_norm=True)


def _fedavg_cnn(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """FedALA's 4-layer CNN (Zhang et al., AAAI 2023), PFLlib's FedAvgCNN: Conv 32 5x5,
  ReLU, 2x2 max-pool, Conv 64 5x5, ReLU, 2x2 max-pool, Dense 512, ReLU, Dense
  num_outputs (VALID convolutions: 1024 features on 28x28 images, 1600 on 32x32;
  582,026 parameters on MNIST, 878,538 on CIFAR-10). Inputs are standardised per channel
  as every registered CNN's are (PFLlib normalises with mean 0.5, std 0.5)."""
  del hidden  # --hidden is the MLP's
  return _registered_cnn(num_outputs, kernels=32, dense=(512,))


def _pfl_cnn(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """pfl-research's CIFAR-10 benchmark CNN, simple_cnn (models/pfl_cnn.py): Conv 32 3x3,
  Conv 64 3x3, 2x2 max-pool, Dense 128, Dense num_outputs; 1,626,442 parameters on
  CIFAR-10. Its dropout is not reproduced (the module docstring says why)."""
  del hidden  # --hidden is the MLP's
  return PflCNN(num_outputs=num_outputs, conv=cnn_conv(jax.default_backend()))


def _resnet18(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """ResNet-18, CIFAR variant, with BatchNorm (models/resnet.py): 11,173,962 parameters
  for 10 classes. Convolutions as im2col matmuls on CPUs, where XLA's convolutions inside
  the local-training scan take minutes a step (docs/resnet.md), lax.conv elsewhere."""
  del hidden  # --hidden is the MLP's
  return ResNet(num_outputs=num_outputs,
                conv="im2col" if jax.default_backend() == "cpu" else "xla")


def _fasttext(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """FedALA's AG News model as its code defines it (models/fasttext.py): embeddings of
  32 averaged over all 200 positions, Dense 32, Dense num_outputs, no activation."""
  del hidden  # --hidden is the MLP's; the authors' widths are fixed
  return FastText(num_outputs=num_outputs)


def _fasttext_bag(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """fasttext with EmbeddingBag's mean over the real tokens and a ReLU hidden layer."""
  del hidden
  return FastText(num_outputs=num_outputs, pooling="tokens", activation=True)


def _char_lstm(num_outputs: int, hidden: Sequence[int]) -> nn.Module:
  """FedAvg's and LEAF's Shakespeare model (models/char_lstm.py): Embed 8, LSTM 256,
  LSTM 256, Dense num_outputs on the last step."""
  del hidden  # --hidden is the MLP's; the papers' widths are fixed
  return CharLSTM(num_outputs=num_outputs)


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn,
                                               "fasttext": _fasttext,
                                               "fasttext_bag": _fasttext_bag,
                                               "coaching_cnn": _coaching_cnn,
                                               "coaching_cnn_bn": _coaching_cnn_bn,
                                               "fedavg_cnn": _fedavg_cnn,
                                               "pfl_cnn": _pfl_cnn,
                                               "resnet18": _resnet18,
                                               "char_lstm": _char_lstm}

# The samples each model reads: "images" ([H, W] or [H, W, C] pixels), "vectors" (flat
# numeric features; the MLP flattens images too) or "tokens" ([L] integer token ids,
# fedora_jax/data/agnews.py). `check_inputs` refuses a model the data does not fit
# before anything is built (a CNN on tokens would fail deep inside flax).
MODEL_INPUTS: dict[str, tuple[str, ...]] = {
    "mlp": ("images", "vectors"), "cnn": ("images",), "coaching_cnn": ("images",),
    "coaching_cnn_bn": ("images",), "fedavg_cnn": ("images",), "pfl_cnn": ("images",),
    "resnet18": ("images",),
    "fasttext": ("tokens",), "fasttext_bag": ("tokens",), "char_lstm": ("tokens",)}


def sample_kind(input_shape: Sequence[int], dtype) -> str:
  """What a dataset's samples are: "tokens" (integers other than uint8 pixels), "images"
  (two or three axes) or "vectors"."""
  if np.issubdtype(dtype, np.integer) and np.dtype(dtype) != np.uint8:
    return "tokens"
  return "images" if len(input_shape) in (2, 3) else "vectors"


def check_inputs(name: str, input_shape: Sequence[int], dtype, dataset: str) -> None:
  """A one-line ConfigError where model `name` cannot read `dataset`'s samples."""
  kind = sample_kind(input_shape, dtype)
  if kind in MODEL_INPUTS[name]:
    return
  fitting = [m for m in MODELS if kind in MODEL_INPUTS[m]]
  raise ConfigError(f"--model={name} reads {' or '.join(MODEL_INPUTS[name])}, but"
                    f" {dataset}'s samples are {kind} of shape {tuple(input_shape)}"
                    f" ({np.dtype(dtype).name}); models for them: {', '.join(fitting)}")


# The layers of a model, for the layer-wise methods (fedora_jax/algorithms/layers.py), are
# its top-level flax modules, which flax names <Type>_<n>, numbering each type in creation
# order. Every registered model creates all its convolutions before its dense layers, so
# (rank of the type here, n) orders any model's layers input to output: the CNN's are
# Conv_0, Conv_1, Dense_0, Dense_1, Dense_2; ResNet-18's ConvBN_0 (stem), BasicBlock_0-7,
# Dense_0 (a BatchNorm sits inside its convolution's module, so a layer holds both);
# coaching_cnn_bn's ConvBN_0, ConvBN_1, DenseBN_0, DenseBN_1, Dense_0.
# fasttext's Embed_0 comes before its Dense_0, Dense_1; char_lstm's Embed_0, LSTM_0,
# LSTM_1 before Dense_0.
# tests/test_split_layers.py checks this order against the forward pass of every
# registered model; a model with other module types adds them here in the order its
# forward pass meets them.
LAYER_TYPE_ORDER: tuple[str, ...] = ("Embed", "LSTM", "Conv", "ConvBN", "BasicBlock",
                                      "DenseBN", "Dense")

# Default --client_chunk per model on CPU devices (None: vmap over all clients). There a
# few clients at a time keep their weights, gradients and momentum in cache: vmapping all
# 36 MLP clients streams ~50 MB through memory every SGD step. Chosen by
# `python -m experiments.benchmark --client_chunks=1,2,3,4,6` and
# benchmarks/vmap_vs_map.py (the timings: docs/measurements/2026-11-26-performance.md).
# ResNet-18 one client at a time too: one convolution's im2col patches at batch 64 are
# 151 MB (64 x 32 x 32 x 576 floats), far past any cache already. Accelerators vmap.
CPU_CLIENT_BATCH: dict[str, int] = {"cnn": 1, "coaching_cnn": 1, "coaching_cnn_bn": 1,
                                    "fedavg_cnn": 1, "pfl_cnn": 1, "mlp": 2,
                                    "resnet18": 1}


def default_client_chunk(model: str, platform: str) -> int | None:
  """The --client_chunk a run uses unless told: None (vmap) off CPUs."""
  return CPU_CLIENT_BATCH.get(model) if platform == "cpu" else None


# Default --eval_batch_size: images (rows) a client's evaluation forwards at once. On CPUs
# the CNNs' convolution patches must stay near the caches: at 1,000 CIFAR-10 test images
# the LeNet-5's first im2col patches are 235 MB; chunks of 64 were about the fastest
# (docs/measurements/2026-11-26-cnn-round-profile.md). The MLP and accelerators take
# large ones.
EVAL_BATCH = 1024
CPU_EVAL_BATCH: dict[str, int] = {"cnn": 64, "coaching_cnn": 64, "coaching_cnn_bn": 64,
                                  "fedavg_cnn": 64, "pfl_cnn": 64, "resnet18": 64}


def default_eval_batch_size(model: str, platform: str) -> int:
  """The --eval_batch_size a run uses unless told."""
  return CPU_EVAL_BATCH.get(model, EVAL_BATCH) if platform == "cpu" else EVAL_BATCH


def build_model(name: str, num_outputs: int, hidden: Sequence[int] = (128, 128)) -> nn.Module:
  if name not in MODELS:
    raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
  return MODELS[name](num_outputs=num_outputs, hidden=hidden)
