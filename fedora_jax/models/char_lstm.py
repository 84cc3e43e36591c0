"""The Shakespeare next-character model of FedAvg (McMahan et al., AISTATS 2017) and LEAF
(Caldas et al., 2018): a stacked character LSTM.

McMahan et al.: "a stacked character-level LSTM language model, which after reading each
character in a line, predicts the next character. The model takes a series of characters
as input and embeds each of these into a learned 8 dimensional space. The embedded
characters are then processed through 2 LSTM layers, each with 256 nodes. Finally the
output of the second LSTM layer is sent to a softmax output layer with one node per
character." LEAF's model (models/shakespeare/stacked_lstm.py) is the same, predicting
the character after an 80-character snippet from the last LSTM output; so is this one:

  Embed(vocab_size, 8) -> LSTM 256 -> LSTM 256 -> last step -> Dense num_outputs

Inputs are fedora_jax/data/natural.py's ids: 1..80 LEAF's alphabet, 0 any other
character or an id past the alphabet (not masked: the snippets are never padded). Weights and biases start
U(-1/sqrt(256), 1/sqrt(256)), PyTorch's LSTM default (flax's cell has one bias per gate
where PyTorch sums two). The body's output, the representation, is the last LSTM
output (tanh-bounded: no ReLU).
"""

from typing import Sequence, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.mlp import torch_dense

VOCAB_SIZE = 81  # natural.SHAKESPEARE_LETTERS (80) and the id 0


def _torch_uniform(hidden: int):
  bound = 1.0 / hidden ** 0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


class LSTM(nn.Module):
  """One LSTM layer over a sequence [B, T, D] -> [B, T, features]: its own module, so a
  layer is one top-level name (LSTM_<n>) for the layer-wise methods."""
  features: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = _torch_uniform(self.features)
    cell = nn.OptimizedLSTMCell(self.features, kernel_init=init, recurrent_kernel_init=init,
                                bias_init=init)
    return cast(jax.Array, nn.RNN(cell)(x))  # the outputs (no carry asked for)


class CharLSTM(nn.Module):
  """Embedding -> stacked LSTMs -> the last step's output -> Dense num_outputs."""
  num_outputs: int = 80
  vocab_size: int = VOCAB_SIZE
  embed_dim: int = 8
  hidden: Sequence[int] = (256, 256)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    ids = x.astype(jnp.int32)
    # An id past the alphabet is "any other character", 0: flax's lookup would give NaN.
    ids = jnp.where((ids >= 0) & (ids < self.vocab_size), ids, 0)
    h = nn.Embed(self.vocab_size, self.embed_dim,
                 embedding_init=nn.initializers.normal(1.0))(ids)
    for width in self.hidden:
      h = LSTM(width)(h)
    return torch_dense(self.num_outputs, self.hidden[-1])(h[:, -1])
