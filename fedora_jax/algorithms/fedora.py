"""FEDORA: personalized federated learning with parameter propagation.

Wu, Bao, Ainsworth, He. "Personalized Federated Learning with Parameter Propagation."
KDD 2023. https://doi.org/10.1145/3580305.3599464  (code: github.com/junwu6/FEDORA)

Each client uploads its data subspace U_k once; the server builds the client graph W from
their principal angles (or Table 4's `similarity`) and every round propagates the client
models, Theta_hat = (1 - kappa)(I - kappa D^-1 W)^-1 Theta. Client k sets lambda_k from its
validation losses of theta_k and theta_hat_k, trains its own theta_k pulled towards
theta_hat_k, and uploads it; it is scored with theta_k. FedoraConfig's field defaults are
the paper's equations (variant "paper"); the default run is variant "authors".

Departures: the "authors" variant is the public code's: exp(10 cos) weights with a zero
diagonal and top-2 neighbours, kappa 0.8, lambda_k = exp(diff / 2), a pull after each step
(pull="decoupled"); its validation loss stays the mean (the code's sum: val_loss="batch_sum").

Details (every option, the departures, measurements): docs/algorithms/fedora.md.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import propagation, similarity
from fedora_jax import tree
from fedora_jax.algorithms.base import (Algorithm, AlgorithmState, ClientOutput,
                                        InitContext, RoundCost, keep_states)
from fedora_jax.data.client_data import ClientData, FederatedData
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of


class FedoraConfig(NamedTuple):
  p: int = 1                     # singular vectors per client subspace
  alpha: float = 1.0             # propagation strength; kappa = alpha / (1 + alpha)
  weights: str = "cosine"        # "cosine": w = sum cos; "exp": w = exp(temperature * sum cos)
  temperature: float = 10.0      # only for weights="exp"
  zero_diagonal: bool = False    # drop self-similarity from W
  top_k: int = 0                 # keep each row's k largest weights; 0 keeps all
  lambda_rule: str = "paper"     # "paper": max(eps, diff); "authors": exp(diff/2) or 0;
                                 # "constant": lambda_value for every client (Table 5)
  lambda_eps: float = 1e-8
  lambda_value: float = 1.0      # only for lambda_rule="constant"
  pull: str = "prox"             # "prox": lambda ||theta - theta_hat||^2 in the loss;
                                 # "decoupled": the authors' post-step pull
  lr: float = 5e-3               # the client learning rate, used by the decoupled pull
  propagation_steps: int = 0     # 0: closed form; n > 0: n steps of the iterative form
  similarity: str = "principal_angles"  # or Table 4's "random", "parameters", "gradients"
  val_loss: str = "mean"         # Lval: "mean" over the validation set; "batch_sum": the
                                 # code's sum of the means of batches of val_batch_size
  val_batch_size: int = 64       # the code's loader batch (its --batch-size default)


SIMILARITIES = ("principal_angles", "random", "parameters", "gradients")
LAMBDA_RULES = ("paper", "authors", "constant")
VAL_LOSSES = ("mean", "batch_sum")


PRESETS = {
    "paper": {},  # the equations as printed: FedoraConfig's own defaults
    "authors": dict(alpha=4.0, weights="exp", temperature=10.0, zero_diagonal=True,
                    top_k=2, lambda_rule="authors", pull="decoupled"),
}


# The variant whose numbers the paper reports (docs/algorithms/fedora.md): the default run.
DEFAULT_VARIANT = "authors"

# Help of the --fedora_<field> flags; each flag's help also gives its value in every preset.
FLAG_HELP = {
    "alpha": "Propagation strength alpha, kappa = alpha / (1 + alpha)",
    "p": "Singular vectors per client subspace",
    "weights": "Graph weights: sum of cosines (paper) or exp(temperature * it) (code)",
    "temperature": "Temperature of exp weights",
    "zero_diagonal": "Drop self-similarity from W (code)",
    "top_k": "Keep each client's k strongest neighbours; 0 keeps all",
    "lambda_rule": "lambda = max(eps, diff) (paper) or exp(diff/2), 0 if diff < 0"
                   " (authors); constant: --fedora_lambda_value for every client (Table 5)",
    "lambda_eps": "The paper's lambda floor",
    "lambda_value": "lambda_k of every client with --fedora_lambda_rule=constant (Table 5:"
                    " 0.01, 0.1, 1, 10)",
    "similarity": "Client similarity W is built from: principal_angles of the data"
                  " subspaces (paper and code); Table 4's random (FedU), parameters (cosine"
                  " of the client models, FedAMP) or gradients (cosine of the client"
                  " updates, clustered FL), the last two recomputed every round",
    "pull": "Proximal term in the loss (paper) or a pull after each step (code)",
    "propagation_steps": "0: closed-form propagation; n > 0: n steps of the iterative form",
    "val_loss": "Validation loss in lambda's diff: mean over the validation set (paper,"
                " and both presets) or the sum over batches of --fedora_val_batch_size of"
                " the batch means (the code's; the same on rotated MNIST's 64 images, ~16x"
                " on CIFAR-10's ~1,000)",
    "val_batch_size": "Batch of the code's validation loss (--fedora_val_loss=batch_sum)",
}
PRESET_HELP = ("authors (default): the public code's graph, kappa, lambda rule and pull,"
               " whose numbers the paper reports; paper: the equations as printed, which"
               " end near LOCAL (docs/algorithms/fedora.md, docs/results.md)")
# A field that only acts when another holds a value (a flag given without it is refused).
ONLY_WITH = {"lambda_value": ("lambda_rule", "constant"), "temperature": ("weights", "exp"),
             "val_batch_size": ("val_loss", "batch_sum")}


def check_new_clients(config: FedoraConfig) -> None:
  """Algorithm 2 (clients held out of training, served by propagation) compares a new
  client's data subspace with the trained clients': principal angles only."""
  if config.similarity != "principal_angles":
    raise FieldError("experiment", "new_clients",
                     "compares a new client's data subspace with the trained clients';"
                     f" it has no {config.similarity} similarity to them (leave"
                     " FEDORA's similarity at principal_angles)")


def round_cost(config: FedoraConfig) -> RoundCost:
  """Beyond training and scoring: lambda's two validation passes over a trained client's
  data (theta_k, theta_hat_k), and propagation's K x K by K x P product, 2 K^2 P FLOPs,
  once (closed form) or once a step (propagation_steps)."""
  return RoundCost(extra_validation_passes=2,
                   server_pair_products=2 * max(config.propagation_steps, 1))


def config_for_variant(variant: str = DEFAULT_VARIANT, **overrides) -> FedoraConfig:
  """The authors' (default) or the printed equations' settings, overrides on top."""
  if variant not in PRESETS:
    raise ConfigError(f"unknown FEDORA variant {variant!r}; known: {', '.join(PRESETS)}")
  return validate(FedoraConfig(**{**PRESETS[variant], **overrides}))


def validate(config: FedoraConfig) -> FedoraConfig:
  if config.p < 1:
    raise FieldError("fedora", "p", f"must be >= 1, got {config.p}")
  if not config.alpha > 0:
    raise FieldError("fedora", "alpha", f"must be > 0, got {config.alpha}")
  if config.weights not in ("cosine", "exp"):
    raise FieldError("fedora", "weights", f"must be cosine or exp, got {config.weights!r}")
  check_one_of("fedora", config, "lambda_rule", LAMBDA_RULES)
  if not config.lambda_value >= 0:
    raise FieldError("fedora", "lambda_value", f"must be >= 0, got {config.lambda_value}")
  check_one_of("fedora", config, "similarity", SIMILARITIES)
  if config.pull not in ("prox", "decoupled"):
    raise FieldError("fedora", "pull", f"must be prox or decoupled, got {config.pull!r}")
  if config.top_k < 0:
    raise FieldError("fedora", "top_k", f"must be >= 0, got {config.top_k}")
  check_one_of("fedora", config, "val_loss", VAL_LOSSES)
  if config.val_batch_size < 1:
    raise FieldError("fedora", "val_batch_size", f"must be >= 1, got {config.val_batch_size}")
  if config.propagation_steps < 0:
    raise FieldError("fedora", "propagation_steps", f"must be >= 0, got {config.propagation_steps}")
  return config


class FedoraServer(NamedTuple):
  similarity: jax.Array   # [K, K] sum of principal-angle cosines (step 2), or Table 4's
  graph: jax.Array        # [K, K] the weights W propagation uses (after exp / top-k)
  propagation: jax.Array  # [K, K] P with Theta_hat = P Theta (closed form), else unused


def _edge_weights(cosine_similarity: jax.Array, config: FedoraConfig) -> jax.Array:
  if config.weights == "exp":
    return jnp.exp(config.temperature * cosine_similarity)
  # Weights must be >= 0; only Table 4's cosines can be negative (docs/algorithms/fedora.md).
  return jnp.maximum(cosine_similarity, 0.0)


def _keep_top_k(graph: jax.Array, k: int) -> jax.Array:
  """Zeroes all but each row's k largest weights (0 keeps all)."""
  if not k:
    return graph
  kth_largest = jax.lax.top_k(graph, k)[0][:, -1:]
  return jnp.where(graph >= kth_largest, graph, 0.0)


def propagation_graph(cosine_similarity: jax.Array, config: FedoraConfig) -> jax.Array:
  """Turns the client similarity [K, K] into the propagation weights W."""
  graph = _edge_weights(cosine_similarity, config)
  if config.zero_diagonal:
    graph = graph * (1.0 - jnp.eye(graph.shape[0], dtype=graph.dtype))
  return _keep_top_k(graph, min(config.top_k, graph.shape[1]))


def new_client_graph(cross_similarity: jax.Array, config: FedoraConfig) -> jax.Array:
  """Edges [N, K] from N new clients to the K trained ones, built as for W."""
  graph = _edge_weights(cross_similarity, config)
  return _keep_top_k(graph, min(config.top_k, graph.shape[1]))


def propagate_to_new_clients(new_graph: jax.Array, propagated_params):
  """Auxiliary models of clients that join after training (paper Algorithm 2).

  A new client has no model of its own, so Q's fidelity term is absent for it; with
  the trained clients' Theta_hat held fixed, minimising Q over theta_hat_new gives
  the weighted mean of its neighbours: theta_hat_new = D_new^-1 W_new Theta_hat.
  """
  return propagation.apply_to_clients(propagation.transition_matrix(new_graph),
                                      propagated_params)


# On accelerators, clients whose float32 Z matrices together stay under this are
# vmapped at once, larger ones (CIFAR-10: 41 MB a client) go in chunks of this size.
SUBSPACE_CHUNK_BYTES = 64 * 2**20


def _subspace_client_chunk(data: FederatedData) -> int | None:
  """Clients per chunk of the init's lax.map (None: all at once, vmapped).

  On CPU one client at a time: it was faster than vmap, with fewer page faults
  (docs/measurements/2026-11-26-benchmark-method.md). (The QR and SVD inside go one
  matrix at a time on CPU either way: fedora_jax/linalg.py.)
  """
  if jax.default_backend() == "cpu":
    return 1
  rows = max(bucket.train.x.shape[1] for bucket in data.buckets)
  z_bytes = 4 * rows * (math.prod(data.buckets[0].train.x.shape[2:]) + data.num_classes)
  per_chunk = max(1, SUBSPACE_CHUNK_BYTES // z_bytes)
  return None if per_chunk >= data.num_clients else per_chunk


def client_subspaces(data: FederatedData, p: int, method: str = "iteration") -> jax.Array:
  """[K, D, p]: every client's top-p right singular vectors of [X_train, onehot(Y_train)].

  `method`: see `similarity.client_subspace` (both give the same U to float32 rounding).
  """
  def one_client(splits):
    z = similarity.client_features(splits.train.x, splits.train.y, data.num_classes)
    return similarity.client_subspace(z, p, splits.train.mask, method=method)
  return map_over_buckets(one_client, (), data.buckets, data.client_ids, data.num_clients,
                          client_chunk=_subspace_client_chunk(data))


def parameter_similarity(client_params) -> jax.Array:
  """[K, K] cosines of the client models, every parameter in one vector (Table 4)."""
  return similarity.cosine_similarity(tree.gram(client_params))


def gradient_similarity(updates, trained: jax.Array, previous: jax.Array) -> jax.Array:
  """[K, K] cosines of the client updates dtheta_k (Table 4), between the `trained` [K]
  clients; a pair with a client that did not train keeps its `previous` cosine."""
  both = trained[:, None] & trained[None, :]
  return jnp.where(both, similarity.cosine_similarity(tree.gram(updates)), previous)


def initial_similarity(context: InitContext, config: FedoraConfig) -> jax.Array:
  """W's similarity before the first round (step 2, or Table 4's measure)."""
  num_clients = context.data.num_clients
  if config.similarity == "principal_angles":
    return similarity.principal_angle_similarity(client_subspaces(context.data, config.p))
  if config.similarity == "random":
    return similarity.random_similarity(context.key, num_clients)
  if config.similarity == "parameters":
    return parameter_similarity(context.params)
  # No update yet; every client starts from the same model, which any W propagates as is.
  return jnp.ones((num_clients, num_clients), jnp.float32)


def as_is_where_identical(client_params, propagated):
  """`propagated`, or the clients' models themselves where they are all one model (the
  first round). P's rows sum to 1, so such models propagate as they are, but only to
  float32 rounding, which would give lambda's diff of exactly 0 a random sign (lambda 0
  for some clients under the authors' rule); the authors' code propagates nothing in
  round 1 (docs/measurements/2026-12-05-unlicensed-references-b.md)."""
  identical = jnp.all(jnp.stack([jnp.all(leaf == leaf[:1])
                                 for leaf in jax.tree.leaves(client_params)]))
  return jax.tree.map(lambda own, hat: jnp.where(identical, own, hat), client_params,
                      propagated)


def selective_lambda(val_loss_local: jax.Array, val_loss_propagated: jax.Array,
                     config: FedoraConfig) -> jax.Array:
  """lambda_k: how much the client trusts its propagated model (step 4)."""
  diff = val_loss_local - val_loss_propagated
  if config.lambda_rule == "paper":
    return jnp.maximum(config.lambda_eps, diff)
  if config.lambda_rule == "constant":  # Table 5: one lambda for every client
    return jnp.full_like(diff, config.lambda_value)
  return jnp.where(diff < 0, 0.0, jnp.exp(diff / 2.0))


def authors_val_loss(trainer: ClientTrainer, params, data: ClientData,
                     batch_size: int) -> jax.Array:
  """The FEDORA code's validation loss (ClientUpdate.get_loss): the sum, over the
  validation set cut in order into batches of `batch_size`, of each batch's mean loss.
  Batches holding only padding add 0."""
  size = data.mask.shape[0]
  num_batches = math.ceil(size / batch_size)
  pad = num_batches * batch_size - size

  def batched(a):
    a = jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) if pad else a
    return a.reshape((num_batches, batch_size) + a.shape[1:])
  batches = (batched(data.x), batched(data.y), batched(data.mask.astype(jnp.float32)))
  return jnp.sum(jax.lax.map(lambda b: trainer.loss(params, *b), batches))


def fedora(config: FedoraConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  kappa = propagation.kappa_from_alpha(config.alpha)

  def server_for(client_similarity: jax.Array) -> FedoraServer:
    graph = propagation_graph(client_similarity, config)
    return FedoraServer(similarity=client_similarity, graph=graph,
                        propagation=propagation.propagation_matrix(graph, kappa=kappa))

  def init(context: InitContext) -> AlgorithmState:
    return AlgorithmState(server=server_for(initial_similarity(context, config)),
                          clients=context.params)

  def broadcast(server: FedoraServer, client_params):
    """Theta_hat = P Theta from the clients' current models (step 3)."""
    if config.propagation_steps == 0:
      propagated = propagation.apply_to_clients(server.propagation, client_params)
    else:
      num_clients = server.graph.shape[0]
      propagated = jax.tree.map(
          lambda leaf: propagation.propagate_iterative(
              leaf.reshape(num_clients, -1), server.graph, kappa=kappa,
              num_steps=config.propagation_steps).reshape(leaf.shape),
          client_params)
    return as_is_where_identical(client_params, propagated)

  def val_loss(model, val: ClientData) -> jax.Array:
    if config.val_loss == "batch_sum":
      return authors_val_loss(trainer, model, val, config.val_batch_size)
    return trainer.evaluate(model, val).loss

  def client_update(params, propagated, data, key):
    val_loss_local = val_loss(params, data.val)
    val_loss_propagated = val_loss(propagated, data.val)
    lam = selective_lambda(val_loss_local, val_loss_propagated, config)
    if config.pull == "prox":
      new_params, stats = trainer.train(
          params, data.train, key,
          regularizer=lambda p: lam * tree.squared_distance(p, propagated))
    else:
      def pull(new_params, old_params):
        return jax.tree.map(lambda new, old, hat: new - config.lr * lam * (old - hat),
                            new_params, old_params, propagated)
      new_params, stats = trainer.train(params, data.train, key, post_step=pull)
    # The server reads the uploaded models straight from the stacked client state; only
    # the gradient similarity needs the update as well.
    upload = (jax.tree.map(jnp.subtract, new_params, params)
              if config.similarity == "gradients" else ())
    return ClientOutput(state=new_params, upload=upload, train=stats,
                        metrics={"lambda": lam, "val_loss_propagated": val_loss_propagated})

  def aggregate(server: FedoraServer, client_params, updates, weights) -> AlgorithmState:
    """Table 4's per-round similarities, from the models the next round propagates."""
    if config.similarity == "parameters":
      server = server_for(parameter_similarity(client_params))
    elif config.similarity == "gradients":
      # Clients that did not train this round carry zero weight (and upload zeros).
      server = server_for(gradient_similarity(updates, weights > 0, server.similarity))
    return AlgorithmState(server=server, clients=client_params)

  return Algorithm(
      name="fedora", init=init, broadcast=broadcast, client_update=client_update,
      aggregate=aggregate if config.similarity in ("parameters", "gradients") else keep_states,
      personalized_params=lambda server, clients: clients,
      artifacts=lambda server: {"similarity": server.similarity, "graph": server.graph},
      state_upload=lambda params: params)  # the propagation reads the trained models
