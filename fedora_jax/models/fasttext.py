"""FedALA's text model for AG News: a fastText-style embedding bag (Joulin et al., EACL
2017: the average of the words' embeddings feeds a linear classifier).

FedALA (Zhang et al., AAAI 2023) runs AG News with its code's `fastText`
(github.com/TsingZ0/FedALA, system/flcore/trainmodel/models.py; main.py: vocab_size
98,635, hidden_dim 32):

  Embedding(vocab_size, 32, padding_idx=0) -> mean over all max_len positions
  -> Linear(32, 32) -> Linear(32, num_classes)     (no activation in between)

with PyTorch's N(0, 1) embedding initialisation and the padding row fixed at zero (no
gradient), which we get by masking id 0 (fedora_jax/data/agnews.py's padding). Two
choices, both registered (fedora_jax/models/__init__.py):
  - `fasttext` (default for --dataset=agnews): the authors' model as above, to compare
    with their table. Its mean divides by max_len whatever the article's length.
  - `fasttext_bag`: torch's EmbeddingBag(mode="mean") mean over the article's real
    (non-padding) tokens, and a ReLU after the hidden layer, so the representation is
    a nonlinear feature like every other registered body's.
Token ids must be below vocab_size (the loader's vocab_size, same default).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedora_jax.models.mlp import torch_dense

VOCAB_SIZE = 98_635  # FedALA's main.py; fedora_jax/data/agnews.py VOCAB_SIZE
PAD = 0


class FastText(nn.Module):
  """Embedding bag -> Dense hidden -> Dense num_outputs; see the module docstring."""
  num_outputs: int = 4
  vocab_size: int = VOCAB_SIZE
  embed_dim: int = 32
  hidden: int = 32
  pooling: str = "padded"   # "padded": mean over all positions; "tokens": real tokens
  activation: bool = False  # ReLU after the hidden layer

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    tokens = x.astype(jnp.int32)
    real = (tokens != PAD)[..., None].astype(jnp.float32)
    embedded = nn.Embed(self.vocab_size, self.embed_dim,
                        embedding_init=nn.initializers.normal(1.0))(tokens) * real
    if self.pooling == "padded":
      pooled = embedded.mean(axis=1)
    elif self.pooling == "tokens":
      pooled = embedded.sum(axis=1) / jnp.maximum(real.sum(axis=1), 1.0)
    else:
      raise ValueError(f"unknown pooling {self.pooling!r}")
    h = torch_dense(self.hidden, self.embed_dim)(pooled)
    if self.activation:
      h = nn.relu(h)
    return torch_dense(self.num_outputs, self.hidden)(h)
