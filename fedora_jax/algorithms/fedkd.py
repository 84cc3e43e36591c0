"""FedKD: each client's personal mentor and a shared mentee learn from each other by
adaptive mutual distillation; the mentee's update travels SVD-compressed, at an energy
threshold that rises over the run.

Wu, Wu, Lyu, Huang, Xie. "Communication-efficient federated learning via knowledge
distillation." Nature Communications 13, 2032 (2022).
https://doi.org/10.1038/s41467-022-29763-x
(code: the authors' github.com/wuch15/FedKD, run.py and model_bert.py, and PFLlib's
clientkd.py / serverkd.py, which the verification runs beside this module.)

A sampled client trains its mentor t_i (the run's model, what it is scored with), the mentee
s and a map W_i on CE_t + CE_s + (KL both ways + 2 MSE(h_t, h_s W_i)) / (CE_t + CE_s), and
uploads the mentee's change as rank-k SVDs at energy T, rising from t_start 0.95 to t_end
0.98; the server's mean (server_mean "uniform"), compressed again, moves the mentee.

Departures: the mentee has the mentor's architecture and the run's optimiser. PFLlib's form
is behind compress, energy_round, rank_rule, conv_svd, kl_reduction and clip_norm.

Details (every option, the departures, measurements): docs/algorithms/fedkd.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import linalg, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fml import clipped_gradient_surrogate, kl_divergence
from fedora_jax.algorithms.layers import (apply_with_representation,
                                          check_representation_trainer, head_layer)
from fedora_jax.engine import server_optimizer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

Params = Any
COMPRESSIONS = ("updates", "parameters")
ENERGY_ROUNDS = ("next", "current")
RANK_RULES = ("reach", "codes")
CONV_SVDS = ("matrix", "spatial")
KL_REDUCTIONS = ("batchmean", "mean")


class FedKdConfig(NamedTuple):
  t_start: float = 0.95            # the SVD energy threshold at the start of the run
  t_end: float = 0.98              # ... reached after `rounds` rounds
  rounds: int = 100                # the run's rounds (a train field)
  energy_round: str = "next"       # round r at (r + 1) / R (authors) or r / R (PFLlib)
  rank_rule: str = "reach"         # "reach" or "codes" (PFLlib's and the authors')
  compress: str = "updates"        # "updates" or "parameters" (PFLlib)
  conv_svd: str = "matrix"         # "matrix" or "spatial" (PFLlib)
  kl_reduction: str = "batchmean"  # "batchmean" (the KL) or "mean" (the codes: the KL / C)
  clip_norm: float = 0.0           # each part's gradient clipped to this norm (PFLlib 10)
  server_mean: str = "uniform"     # "uniform" (both codes) or "weighted" (the run's)


FLAG_HELP = {
    "t_start": "FedKD: energy threshold of the SVD compression at the start of the run",
    "t_end": "FedKD: the threshold reached at the run's last round (linear in between)",
    "energy_round": "FedKD: round r (0-based) compresses at t_start + (r + 1) / rounds"
                    " (t_end - t_start) (next, the authors' code) or at r / rounds"
                    " (current, PFLlib)",
    "rank_rule": "FedKD: keep the smallest rank whose squared singular values reach the"
                 " threshold (reach) or the codes' search, which sends a matrix as zero"
                 " when only its full rank passes (codes, PFLlib and the authors)",
    "compress": "FedKD: compress the mentee's change (updates, the authors' code) or the"
                " mentee itself (parameters, PFLlib)",
    "conv_svd": "FedKD: a conv kernel compressed as the matrix of its output channels"
                " (matrix) or as PFLlib's SVDs of its kh x kw filters at one rank (spatial)",
    "kl_reduction": "FedKD: the KL averaged over the batch (batchmean) or over the batch and"
                    " the classes (mean, nn.KLDivLoss's default in both codes)",
    "clip_norm": "FedKD: mentor, mentee and representation map each clipped to this"
                 " gradient norm before their step (0: none; PFLlib 10)",
    "server_mean": "FedKD: mean of the clients' uploads uniform over the sampled clients"
                   " (uniform, both codes) or with the run's client weights (weighted)",
}


class KdClient(NamedTuple):
  mentor: Params          # [K, ...] t_i
  projection: jax.Array   # [K, d, d] W_i, applied as h_s @ W_i


class KdServer(NamedTuple):
  mentee: Params          # s, as the clients receive it
  round: jax.Array        # [] int32 r


class KdTrained(NamedTuple):
  mentor: Params
  mentee: Params
  projection: jax.Array


def validate(config: FedKdConfig, trainer: ClientTrainer) -> FedKdConfig:
  for field in ("t_start", "t_end"):
    if not 0 < getattr(config, field) <= 1:
      raise FieldError("fedkd", field, f"must be in (0, 1], got {getattr(config, field)}")
  if config.rounds < 1:
    raise FieldError("fedkd", "rounds", f"must be >= 1, got {config.rounds}")
  if config.clip_norm < 0:
    raise FieldError("fedkd", "clip_norm", f"must be >= 0, got {config.clip_norm}")
  for field, allowed in (("energy_round", ENERGY_ROUNDS), ("rank_rule", RANK_RULES),
                         ("compress", COMPRESSIONS), ("conv_svd", CONV_SVDS),
                         ("kl_reduction", KL_REDUCTIONS),
                         ("server_mean", server_optimizer.SERVER_MEANS)):
    check_one_of("fedkd", config, field, allowed)
  check_representation_trainer("fedkd", trainer)
  return config


def energy_at(config: FedKdConfig, round_index: jax.Array) -> jax.Array:
  """The threshold T of round `round_index` (0-based)."""
  step = round_index + (1 if config.energy_round == "next" else 0)
  return config.t_start + step / config.rounds * (config.t_end - config.t_start)


def kept_rank(squares: jax.Array, energy: jax.Array, rule: str) -> jax.Array:
  """The rank k kept of a descending spectrum's squared singular values [n] at energy T."""
  total = jnp.sum(squares)
  cumulative = jnp.cumsum(squares)                    # the sums of the first 1 .. n
  if rule == "reach":
    reached = cumulative >= energy * total
    return jnp.where(jnp.any(reached), jnp.argmax(reached) + 1, squares.shape[0])
  passing = cumulative - squares > energy * total     # the first 0 .. n-1, exceeding T
  return jnp.where(jnp.any(passing), jnp.argmax(passing), 0)


def truncated(matrix: jax.Array, energy: jax.Array, rule: str = "reach") -> jax.Array:
  """The matrix [m, n] at its SVD's kept rank (`kept_rank`); itself where every singular
  value is zero."""
  u, s, vt = linalg.svd(matrix)
  rank = kept_rank(jnp.square(s), energy, rule)
  kept = jnp.where(jnp.arange(s.shape[0]) < rank, s, 0.0)
  return jnp.where(jnp.sum(jnp.square(s)) == 0, matrix, (u * kept) @ vt)


def spatially_truncated(kernel: jax.Array, energy: jax.Array, rule: str) -> jax.Array:
  """PFLlib's conv compression of a kernel [kh, kw, in, out]: each kh x kw filter at its
  SVD's first k triplets, k from the squared singular values summed over all filters."""
  kh, kw, fan_in, fan_out = kernel.shape
  filters = jnp.transpose(kernel, (2, 3, 0, 1)).reshape(fan_in * fan_out, kh, kw)
  u, s, vt = linalg.svd(filters)
  rank = kept_rank(jnp.sum(jnp.square(s), axis=0), energy, rule)
  kept = jnp.where(jnp.arange(s.shape[-1]) < rank, s, 0.0)
  rebuilt = jnp.einsum("nik,nk,nkj->nij", u, kept, vt)
  rebuilt = jnp.transpose(rebuilt.reshape(fan_in, fan_out, kh, kw), (2, 3, 0, 1))
  return jnp.where(jnp.sum(jnp.square(s)) == 0, kernel, rebuilt)


def compressed(params: Params, energy: jax.Array, config: FedKdConfig) -> Params:
  """Every kernel of more than one output truncated (`truncated`, or
  `spatially_truncated` for a conv kernel with conv_svd="spatial"); biases whole."""
  def one(leaf):
    if leaf.ndim < 2 or leaf.shape[-1] <= 1:
      return leaf
    if leaf.ndim == 4 and config.conv_svd == "spatial":
      return spatially_truncated(leaf, energy, config.rank_rule)
    matrix = leaf.reshape(-1, leaf.shape[-1])
    return truncated(matrix, energy, config.rank_rule).reshape(leaf.shape)
  return jax.tree.map(one, params)


def fedkd_loss(apply_fn, head: str, config: FedKdConfig):
  """loss_fn(KdTrained, x, y, weights): the mentor's and the mentee's losses summed."""
  def loss(p: KdTrained, x, y, weights):
    out_t, h_t = apply_with_representation(apply_fn, p.mentor, x, head)
    out_s, h_s = apply_with_representation(apply_fn, p.mentee, x, head)
    mean = lambda v: jnp.sum(v * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    ce = optax.softmax_cross_entropy_with_integer_labels
    task = mean(ce(out_t, y)) + mean(ce(out_s, y))
    distill = (kl_divergence(out_s, out_t, weights, config.kl_reduction)
               + kl_divergence(out_t, out_s, weights, config.kl_reduction))
    hidden = mean(jnp.mean(jnp.square(h_t - h_s @ p.projection), axis=-1))
    return task + (distill + 2.0 * hidden) / task
  if config.clip_norm > 0:
    return clipped_gradient_surrogate(loss, config.clip_norm)
  return loss


def initial_projections(key: jax.Array, num_clients: int, dim: int) -> jax.Array:
  """[K, d, d]: each client's W_i as PyTorch's Linear(d, d, bias=False) draws its weight,
  U(-1/sqrt(d), 1/sqrt(d))."""
  bound = 1.0 / jnp.sqrt(dim)
  return jax.random.uniform(key, (num_clients, dim, dim), jnp.float32, -bound, bound)


def fedkd(config: FedKdConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply = trainer.apply
  assert apply is not None  # validate() checked it

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    dim = first["params"][head_layer(first, "fedkd")]["kernel"].shape[0]
    projections = initial_projections(context.key, tree.leading_size(context.params), dim)
    return AlgorithmState(server=KdServer(mentee=first, round=jnp.zeros((), jnp.int32)),
                          clients=KdClient(mentor=context.params, projection=projections))

  def broadcast(server: KdServer, clients: KdClient):
    return tree.broadcast_to_clients(server, clients.projection.shape[0])

  def client_update(client: KdClient, server: KdServer, data, key):
    head = head_layer(client.mentor, "fedkd")
    start = KdTrained(mentor=client.mentor, mentee=server.mentee,
                      projection=client.projection)
    trained, stats = trainer.train(start, data.train, key,
                                   loss_fn=fedkd_loss(apply, head, config))
    sent = trained.mentee
    if config.compress == "updates":
      sent = jax.tree.map(jnp.subtract, trained.mentee, server.mentee)
    return ClientOutput(state=KdClient(mentor=trained.mentor, projection=trained.projection),
                        upload=compressed(sent, energy_at(config, server.round), config),
                        train=stats)

  def aggregate(server: KdServer, clients: KdClient, uploads, weights):
    mean = tree.weighted_mean(uploads, server_optimizer.sampled_weights(
        weights, config.server_mean))
    sent = compressed(mean, energy_at(config, server.round), config)
    if config.compress == "updates":
      sent = jax.tree.map(jnp.add, server.mentee, sent)
    return AlgorithmState(server=KdServer(mentee=sent, round=server.round + 1),
                          clients=clients)

  def personalized_params(server: KdServer, clients: KdClient):
    del server
    return clients.mentor

  return Algorithm(name="fedkd", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, uploads_unordered=True)
