"""FedPAC: a shared feature extractor aligned to global class prototypes, and per-client
classifier heads combined across clients with weights from a small quadratic program.

Xu, Tong, Huang. "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration." ICLR 2023. https://arxiv.org/abs/2306.11867
(code: github.com/JianXu95/FedPAC, methods/fedpac.py, running.py, tools.py; also
TsingZ0/PFLlib clientpac.py / serverpac.py)

Client i trains its head g_i (body frozen, `head_epochs` 1), then the shared body with its
features pulled to the global class prototypes (`lam` 1), and uploads body, head, prototypes
and feature statistics. The server averages bodies and prototypes and gives client i a mix
of the heads, weights from a QP on the simplex (FISTA, `qp_steps` 500, `min_weight` 1e-3).
Client i is scored with the new body under its head.

Departures: the run's optimizer for both phases, one state through both
(phase_optimizer=separate: the authors' fresh one), head epochs out of --local_epochs; the
QP by FISTA, not cvxpy. PFLlib's form: `proto_mean`, `missing_proto`, `renormalize`.

Details (every option, the departures, measurements): docs/algorithms/fedpac.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import BODY
from fedora_jax.algorithms.fedrep import (alternating_train, batch_size_of,
                                          check_phase_optimizer)
from fedora_jax.algorithms.layers import (apply_with_representation, head_layer, merge_layers,
                                          split_body_head, take_layers)
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError

Params = Any


class FedPacConfig(NamedTuple):
  lam: float = 1.0          # feature-alignment weight lambda (authors' --lam)
  head_epochs: int = 1      # epochs of head training (body frozen) before the body's
  qp_steps: int = 500       # FISTA iterations of the classifier-combination QP
  min_weight: float = 1e-3  # combination weights below this are zeroed (authors' eps)
  phase_optimizer: str = "shared"  # separate: a fresh optimizer state for the body's phase
  proto_mean: str = "counts"  # clients: c_k the plain mean of the clients' mu_ik (PFLlib's)
  missing_proto: str = "local_mean"  # own: no pull where class y has no c_y (PFLlib's)
  renormalize: bool = True  # false: the zeroed weights left summing below 1 (PFLlib's)


FLAG_HELP = {
    "lam": "FedPAC: weight lambda of the feature alignment MSE(f(x), c_y)",
    "head_epochs": "FedPAC: local epochs training the head (body frozen) before the body"
                   " trains with the alignment term for the remaining epochs",
    "qp_steps": "FedPAC: projected-gradient (FISTA) iterations of each client's"
                " classifier-combination quadratic program",
    "min_weight": "FedPAC: combination weights below this are zeroed, the rest"
                  " renormalised",
    "phase_optimizer": "FedPAC: shared (one optimizer state over both phases) or separate"
                       " (a fresh state when the body's phase begins, the authors')",
    "proto_mean": "FedPAC: global prototype c_k as the class-count weighted mean of the"
                  " sampled clients' class means (counts, the authors') or their plain"
                  " mean over the clients holding class k (clients, PFLlib's)",
    "missing_proto": "FedPAC: a sample of a class no sampled client held last round is"
                     " pulled to its client's class mean before training (local_mean, the"
                     " authors') or not at all (own: its own feature, PFLlib's)",
    "renormalize": "FedPAC: after zeroing the combination weights below min_weight, scale"
                   " the rest to sum 1 (the authors'); false leaves them (PFLlib's)",
}

PROTO_MEANS = ("counts", "clients")
MISSING_PROTOS = ("local_mean", "own")


class FedPacServer(NamedTuple):
  body: Params            # the global feature extractor {"params": {body layers}}
  protos: jax.Array       # [C, d] global class prototypes c_k
  has_proto: jax.Array    # [C] bool: some sampled client held class k last round
  # [K, K] the last round's alpha (rows of unsampled clients: 0); () in the broadcast
  combination: jax.Array | tuple[()]


class FeatureSums(NamedTuple):
  """One client's class-wise feature statistics over its training split."""
  counts: jax.Array       # [C] n_k
  sums: jax.Array         # [C, d] sum of z over class k
  sq_norms: jax.Array     # [] sum_s ||z_s||^2


class FedPacUpload(NamedTuple):
  body: Params
  head: Params            # {"params": {head: ...}}, the trained head
  proto_sums: jax.Array   # [C, d] class feature sums of the trained model
  counts: jax.Array       # [C] n_ik
  variance: jax.Array     # [] V_i (before training)
  bias: jax.Array         # [C, d] h_i (before training)


def validate(config: FedPacConfig, trainer: ClientTrainer) -> FedPacConfig:
  if config.lam < 0:
    raise FieldError("fedpac", "lam", f"must be >= 0, got {config.lam}")
  if not 1 <= config.head_epochs < trainer.epochs:
    raise FieldError("fedpac", "head_epochs",
                     f"must be >= 1 and smaller than the local epochs ({trainer.epochs})"
                     f" so that the body trains, got {config.head_epochs}")
  if config.qp_steps < 1:
    raise FieldError("fedpac", "qp_steps", f"must be >= 1, got {config.qp_steps}")
  if not 0 <= config.min_weight < 1:
    raise FieldError("fedpac", "min_weight", f"must be in [0, 1), got {config.min_weight}")
  if trainer.task != "classification":
    raise ConfigError("fedpac needs a classification task (class prototypes)")
  check_phase_optimizer("fedpac", config.phase_optimizer)
  if config.proto_mean not in PROTO_MEANS:
    raise FieldError("fedpac", "proto_mean",
                     f"must be one of {', '.join(PROTO_MEANS)}, got {config.proto_mean!r}")
  if config.missing_proto not in MISSING_PROTOS:
    raise FieldError("fedpac", "missing_proto", f"must be one of {', '.join(MISSING_PROTOS)},"
                     f" got {config.missing_proto!r}")
  return config


def feature_sums(features: jax.Array, y: jax.Array, weights: jax.Array,
                 num_classes: int) -> FeatureSums:
  """Class counts, class feature sums and the total squared norm of the weighted samples."""
  one_hot = jax.nn.one_hot(y, num_classes) * weights[:, None]        # [B, C]
  return FeatureSums(counts=jnp.sum(one_hot, axis=0), sums=one_hot.T @ features,
                     sq_norms=jnp.sum(weights * jnp.sum(jnp.square(features), axis=-1)))


def statistics(sums: FeatureSums) -> tuple[jax.Array, jax.Array]:
  """(V_i, h_i) of step 1: h[k] = p_k mu_k = sums_k / n, V = (||z||^2 / n - ||h||^2) / n."""
  n = jnp.maximum(jnp.sum(sums.counts), 1.0)
  bias = sums.sums / n
  return (sums.sq_norms / n - jnp.sum(jnp.square(bias))) / n, bias


def class_means(sums: FeatureSums) -> jax.Array:
  """[C, d] mu_k (zero for absent classes)."""
  return sums.sums / jnp.maximum(sums.counts, 1.0)[:, None]


def global_prototypes(counts: jax.Array, sums: jax.Array, members: jax.Array,
                      proto_mean: str) -> tuple[jax.Array, jax.Array]:
  """([C, d] c_k, [C] has_proto) from the members' [K, C] class counts and [K, C, d]
  class feature sums: "counts" weighs client i's mean mu_ik by n_ik (the authors'
  protos_aggregation), "clients" weighs each client holding class k alike (PFLlib's
  proto_aggregation, FedProto's)."""
  holds = (counts > 0) & members[:, None]                              # [K, C]
  by_counts = proto_mean == "counts"
  # sums_ik = n_ik mu_ik: weight 1 gives the n_ik-weighted mean, 1 / n_ik the plain one.
  weight = jnp.where(holds, 1.0 if by_counts else 1.0 / jnp.maximum(counts, 1.0), 0.0)
  total = jnp.sum(jnp.where(holds, counts if by_counts else 1.0, 0.0), axis=0)
  has_proto = total > 0
  protos = jnp.einsum("kc,kcd->cd", weight, sums) / jnp.maximum(total, 1e-12)[:, None]
  return jnp.where(has_proto[:, None], protos, 0.0), has_proto


def alignment_loss(features: jax.Array, y: jax.Array, weights: jax.Array,
                   targets: jax.Array, known: jax.Array | None = None) -> jax.Array:
  """MSE(f(x), c_y) over the real samples of the batch: mean over samples and feature dims
  (PyTorch's nn.MSELoss on [B, d]). With `known` [C], a sample whose class is not known
  is its own target (PFLlib's: no pull, still counted in the mean)."""
  target = targets[y]
  if known is not None:
    target = jnp.where(known[y][:, None], target, jax.lax.stop_gradient(features))
  sq = jnp.sum(jnp.square(features - target), axis=-1)
  return jnp.sum(sq * weights) / (jnp.maximum(jnp.sum(weights), 1.0) * features.shape[-1])


def project_to_simplex(u: jax.Array, mask: jax.Array) -> jax.Array:
  """argmin ||a - u|| over {a >= 0, sum a = 1, a_j = 0 off mask} (sort-based; Duchi,
  Shalev-Shwartz, Singer, Chandra, ICML 2008)."""
  order = jnp.argsort(-jnp.where(mask, u, -jnp.inf))
  sorted_mask = mask[order]
  sorted_u = jnp.where(sorted_mask, u[order], 0.0)
  cumulative = jnp.cumsum(sorted_u) - 1.0
  ranks = jnp.arange(1, u.shape[0] + 1)
  support = sorted_mask & (sorted_u - cumulative / ranks > 0)
  rho = jnp.maximum(jnp.max(jnp.where(support, ranks, 0)), 1)
  threshold = cumulative[rho - 1] / rho
  return jnp.where(mask, jnp.maximum(u - threshold, 0.0), 0.0)


def largest_eigenvalue(matrix: jax.Array, iterations: int = 100) -> jax.Array:
  """An upper estimate of the top eigenvalue of a symmetric PSD matrix with nonnegative
  entries: power iteration from the all-ones vector (never orthogonal to the Perron
  vector), its Rayleigh quotient times 1.1. Matmuls only: no LAPACK in the server step."""
  def step(v, _):
    w = matrix @ v
    return w / jnp.maximum(jnp.linalg.norm(w), 1e-30), None
  v, _ = jax.lax.scan(step, jnp.ones(matrix.shape[0]) / jnp.sqrt(matrix.shape[0]), None,
                      length=iterations)
  return 1.1 * jnp.maximum(v @ matrix @ v, 1e-12)


def combination_weights(variance: jax.Array, bias: jax.Array, members: jax.Array,
                        steps: int, min_weight: float = 0.0,
                        renormalize: bool = True) -> jax.Array:
  """[K, K]: row i = argmin_{alpha in simplex over members} sum_j alpha_j^2 V_j +
  ||h_i - sum_j alpha_j h_j||^2, for every client i at once (FISTA).

  variance [K] V_j, bias [K, ...] h_j, members [K] bool (the round's sampled clients).
  """
  num = variance.shape[0]
  flat = bias.reshape(num, -1)
  member = members.astype(flat.dtype)
  gram = (flat @ flat.T) * member[:, None] * member[None, :]         # G on members
  quad = jnp.diag(variance * member) + gram                          # diag(V) + G
  lipschitz = 2.0 * largest_eigenvalue(quad)
  project = jax.vmap(project_to_simplex, in_axes=(0, None))

  def grad(alpha):                                   # rows: 2 (Q alpha_i - G_i)
    return 2.0 * (alpha @ quad - gram)

  def step(carry, _):
    alpha, momentum_point, t = carry
    new = project(momentum_point - grad(momentum_point) / lipschitz, members)
    t_next = (1.0 + jnp.sqrt(1.0 + 4.0 * t * t)) / 2.0
    return (new, new + ((t - 1.0) / t_next) * (new - alpha), t_next), None

  start = project(jnp.zeros((num, num)), members)    # uniform over the members
  (alpha, _, _), _ = jax.lax.scan(step, (start, start, jnp.ones(())), None, length=steps)
  alpha = jnp.where(alpha < min_weight, 0.0, alpha)
  if not renormalize:
    return alpha
  return alpha / jnp.maximum(jnp.sum(alpha, axis=1, keepdims=True), 1e-12)


def fedpac(config: FedPacConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply = trainer.apply
  if apply is None:
    raise ConfigError("fedpac needs the trainer's model forward (make_client_trainer)")
  batch_size = batch_size_of(trainer)

  def parts(params: Params) -> tuple[list[str], str]:
    head = head_layer(params, "fedpac")
    return split_body_head(params, 1, "fedpac")[0], head

  def training_sums(params: Params, head: str, data: ClientData, num_classes: int):
    """FeatureSums of the model's features over the client's whole training split."""
    x, y, mask = jnp.asarray(data.x), jnp.asarray(data.y), jnp.asarray(data.mask)
    _, features = apply_with_representation(apply, params, x, head)
    return feature_sums(features, y, mask.astype(jnp.float32), num_classes)

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    body_names, head = parts(first)
    dim, num_classes = first["params"][head]["kernel"].shape
    num_clients = tree.leading_size(context.params)
    server = FedPacServer(body=take_layers(first, body_names),
                          protos=jnp.zeros((num_classes, dim), jnp.float32),
                          has_proto=jnp.zeros((num_classes,), bool),
                          combination=jnp.zeros((num_clients, num_clients), jnp.float32))
    return AlgorithmState(server=server, clients=take_layers(context.params, [head]))

  def broadcast(server: FedPacServer, heads):
    return tree.broadcast_to_clients(server._replace(combination=()),
                                     tree.leading_size(heads))

  def client_update(head_params, server: FedPacServer, data, key):
    params = merge_layers(server.body, head_params)
    body_names, head = parts(params)
    num_classes = server.protos.shape[0]
    before = training_sums(params, head, data.train, num_classes)
    variance, bias = statistics(before)
    targets = jnp.where(server.has_proto[:, None], server.protos, class_means(before))
    align = config.lam * jnp.any(server.has_proto)  # no global prototypes yet: no alignment
    known = server.has_proto if config.missing_proto == "own" else None

    def loss(p, x, y, weights):
      logits, features = apply_with_representation(apply, p, x, head)
      return (masked_cross_entropy(logits, y, weights)
              + align * alignment_loss(features, y, weights, targets, known))

    steps_per_epoch = (data.train.n + batch_size - 1) // batch_size
    head_steps = (config.head_epochs * steps_per_epoch).astype(jnp.float32)
    params, stats = alternating_train(trainer, params, [head], head_steps, data.train, key,
                                      loss_fn=loss, phase_optimizer=config.phase_optimizer)
    after = training_sums(params, head, data.train, num_classes)
    upload = FedPacUpload(body=take_layers(params, body_names),
                          head=take_layers(params, [head]), proto_sums=after.sums,
                          counts=after.counts, variance=variance, bias=bias)
    return ClientOutput(state=upload.head, upload=upload, train=stats)

  def aggregate(server: FedPacServer, heads, uploads: FedPacUpload, weights):
    members = weights > 0
    protos, has_proto = global_prototypes(uploads.counts, uploads.proto_sums, members,
                                          config.proto_mean)
    alpha = combination_weights(uploads.variance, uploads.bias, members, config.qp_steps,
                                config.min_weight, config.renormalize)
    mixed = tree.mix(alpha, uploads.head)
    new_heads = jax.tree.map(
        lambda m, old: jnp.where(members.reshape((-1,) + (1,) * (old.ndim - 1)), m, old),
        mixed, heads)
    server = FedPacServer(body=tree.weighted_mean(uploads.body, weights), protos=protos,
                          has_proto=has_proto,
                          combination=jnp.where(members[:, None], alpha, 0.0))
    return AlgorithmState(server=server, clients=new_heads)

  def personalized_params(server: FedPacServer, heads):
    return merge_layers(tree.broadcast_to_clients(server.body, tree.leading_size(heads)),
                        heads)

  return Algorithm(name="fedpac", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   artifacts=lambda server: {"combination_weights": server.combination},
                   shared_part=BODY)  # FedPacServer.body: the feature extractor
