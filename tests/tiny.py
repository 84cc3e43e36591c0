"""Tiny synthetic federations for fast engine tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedora_jax.algorithms.base import InitContext
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.data.public import PublicData
from fedora_jax.rounds import RoundState, build_train_round
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.engine import batch_stats
from fedora_jax.models.cnn import CNN
from fedora_jax.models.mlp import MLP
from fedora_jax.models.norm import batch_norm
from fedora_jax.models.resnet import ResNet


def tiny_data(sizes, num_features=4, num_classes=3, seed=0, max_pad_ratio=2.0,
              x_shape=None):
  """Clients with `sizes` training samples; x [n, num_features], or [n, *x_shape]."""
  rng = np.random.default_rng(seed)
  shape = (num_features,) if x_shape is None else tuple(x_shape)

  def split(n):
    return (rng.normal(size=(n, *shape)).astype(np.float32),
            rng.integers(0, num_classes, n).astype(np.int32))
  clients = [Client(*split(n), *split(4), *split(6)) for n in sizes]
  return stack_clients(clients, num_classes, max_pad_ratio), clients


def tiny_model(num_classes=3, hidden=(5,)):
  return MLP(hidden=hidden, num_outputs=num_classes)


def tiny_trainer(model, lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=8):
  return make_client_trainer(model.apply, make_optimizer(lr, momentum, weight_decay),
                             epochs, batch_size)


# The smallest images the CNN takes: 16 -> conv 12 -> pool 6 -> conv 2 -> pool 1.
CNN_X_SHAPE = (16, 16, 1)


def tiny_cnn(num_classes=3, conv="im2col"):
  """The registered CNN's layers (Conv_0, Conv_1, Dense_0..2) at toy widths."""
  return CNN(num_outputs=num_classes, kernels=2, dense=(6, 5), conv=conv)


class TinyBN(nn.Module):
  """Dense -> BatchNorm -> ReLU -> Dense: the smallest model with running averages."""
  num_outputs: int = 3
  hidden: int = 5

  @nn.compact
  def __call__(self, x, mask=None):
    h = nn.Dense(self.hidden)(x)
    h = batch_norm(h, mask, self.is_mutable_collection("batch_stats"))
    return nn.Dense(self.num_outputs)(nn.relu(h))


# The tiny ResNet's images: its layers are ResNet-18's kinds (ConvBN_0, BasicBlock_0,
# Dense_0), at toy widths.
RESNET_X_SHAPE = (6, 6, 2)


def tiny_resnet(num_classes=3):
  return ResNet(num_outputs=num_classes, blocks=(1,), widths=(3,), conv="im2col")


def init_folded(model, num_features=4, seed=0, x_shape=None):
  """init_params with the BatchNorm statistics folded in, as the engine holds them."""
  return batch_stats.fold(init_params(model, num_features, seed, x_shape))


def init_params(model, num_features=4, seed=0, x_shape=None):
  shape = (num_features,) if x_shape is None else tuple(x_shape)
  return model.init(jax.random.key(seed), np.zeros((1, *shape), np.float32))


def mean_ce(model, params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


class TraceCounter:
  """Wraps a function to count how often JAX traces it (a Python side effect)."""

  def __init__(self, fn):
    self.fn, self.traces = fn, 0

  def __call__(self, *args):
    self.traces += 1
    return self.fn(*args)


def run_rounds(algorithm, trainer, data, model, rounds=2, x_shape=None, **round_options):
  """Starts `algorithm` from one shared initial model and runs `rounds` jitted rounds
  (`round_options`: build_train_round's keywords).

  Returns (state, metrics of the last round, stacked initial params, traces)."""
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape),
                         init_folded(model, x_shape=x_shape))
  state = RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(
      InitContext(params=stacked, data=data, trainer=trainer, key=jax.random.key(0))))
  counter = TraceCounter(build_train_round(algorithm, trainer, data, **round_options))
  round_fn = jax.jit(counter)
  for _ in range(rounds):
    state, metrics = round_fn(state, data.buckets, jax.random.key(1))
  return state, metrics, stacked, counter.traces


def default_config(name: str):
  """The algorithm's default config, fitted to tiny trainers' 1-2 local epochs (FedRep's
  default 4 head epochs would leave no epoch for the body)."""
  from fedora_jax import algorithms  # pylint: disable=import-outside-toplevel
  config = algorithms.get(name).config_class()
  if name == "fedmd":  # a public set of 8, 6 of them a round (its default: 5000)
    return config._replace(public_size=8, alignment_size=6)
  return config._replace(head_epochs=1) if name == "fedrep" else config


def with_public(data, size, x_shape=None, num_features=4, seed=1):
  """`data` with a public set of `size` random samples (None: unchanged), as the data
  layer gives one to an algorithm that declares it (data/public.py)."""
  if not size:
    return data
  rng = np.random.default_rng(seed)
  shape = (num_features,) if x_shape is None else tuple(x_shape)
  return data._replace(public=PublicData(
      x=rng.normal(size=(size, *shape)).astype(np.float32),
      y=rng.integers(0, data.num_classes, size).astype(np.int32)))
