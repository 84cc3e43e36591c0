"""pFedFDA: a shared feature extractor trained under a generative (LDA) classifier whose
class Gaussians each client interpolates between its own and the global estimates.

McLaughlin, Wang, Wang, Ma, Lin. "Personalized Federated Learning via Feature
Distribution Adaptation." NeurIPS 2024. https://arxiv.org/abs/2411.00329
(code followed: the authors' cj-mclaughlin/pFedFDA, clients/client_fedfda.py and
servers/server_fedfda.py; FL-bench's src/client/pfedfda.py, KarhouTam/FL-bench, GPL: both
read, not run or copied)

A sampled client trains the extractor under the frozen LDA head of the global Gaussians,
fits its own Gaussians on the trained features, interpolates them with the global ones by
betas chosen by folds-fold cross-validation, and uploads extractor and Gaussians to the
server's mean; it is scored with its interpolated LDA head. Defaults: betas "two", folds 2.

Departures: beta minimises the cross-validation loss over `grid` values (the codes: L-BFGS
from 0.5); the statistics come from the trained extractor's features.

Details (every option, the departures, measurements): docs/algorithms/pfedfda.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import linalg, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedbabu import train_layers
from fedora_jax.algorithms.layers import (check_representation_trainer, head_layer,
                                          representations, split_body_head)
from fedora_jax.data.client_data import ClientData, ClientSplits
from fedora_jax.engine.local_training import ClientTrainer, EvalStats
from fedora_jax.errors import FieldError, check_one_of

Params = Any
BETAS = ("two", "single", "local")


class PfedFdaConfig(NamedTuple):
  betas: str = "two"      # beta_mu and beta_Sigma (authors' default), one, or local only
  folds: int = 2          # the authors' num_cv_folds (also the fewest samples of a mean)
  grid: int = 11          # beta values tried in [0, 1] (the codes: L-BFGS from 0.5)
  eps: float = 1e-4       # the authors' eps: priors, covariance and LDA shrinkage


FLAG_HELP = {
    "betas": "pFedFDA: interpolation weights chosen by cross-validation: two (one for the"
             " means, one for the covariance: the authors' default), single (one for"
             " both) or local (beta 1: the client's own Gaussians)",
    "folds": "pFedFDA: cross-validation folds of the client's features (the authors' 2)",
    "grid": "pFedFDA: beta values tried, evenly spaced over [0, 1]",
    "eps": "pFedFDA: added to the priors and the covariance, the LDA's shrinkage",
}


class Gaussians(NamedTuple):
  means: jax.Array   # [..., C, d]
  cov: jax.Array     # [..., d, d], shared by the classes


class PfedFdaServer(NamedTuple):
  model: Params
  gaussians: Gaussians


class PfedFdaModel(NamedTuple):
  """What a client is scored with: the global model and the global Gaussians."""
  model: Params
  gaussians: Gaussians


class PfedFdaUpload(NamedTuple):
  params: Params
  gaussians: Gaussians   # the client's interpolated ones


def validate(config: PfedFdaConfig, trainer: ClientTrainer) -> PfedFdaConfig:
  check_one_of("pfedfda", config, "betas", BETAS)
  if config.folds < 2:
    raise FieldError("pfedfda", "folds", f"must be >= 2, got {config.folds}")
  if config.grid < 2:
    raise FieldError("pfedfda", "grid", f"must be >= 2, got {config.grid}")
  if not 0.0 < config.eps < 1.0:
    raise FieldError("pfedfda", "eps", f"must be in (0, 1), got {config.eps}")
  check_representation_trainer("pfedfda", trainer)
  return config


def priors_of(y: jax.Array, mask: jax.Array, num_classes: int, eps: float) -> jax.Array:
  """[C] label shares of the real samples, + eps, renormalised (the authors' priors)."""
  counts = jnp.sum(jax.nn.one_hot(y, num_classes) * mask[:, None], axis=0)
  shares = counts / jnp.maximum(jnp.sum(counts), 1.0) + eps
  return shares / jnp.sum(shares)


def lda_head(gaussians: Gaussians, priors: jax.Array, eps: float) -> dict[str, jax.Array]:
  """The Dense head {kernel [d, C], bias [C]} of the LDA classifier of the Gaussians."""
  cov, means = gaussians.cov, gaussians.means
  dim = cov.shape[-1]
  shrunk = (1.0 - eps) * cov + eps * jnp.trace(cov) / dim * jnp.eye(dim, dtype=cov.dtype)
  kernel = linalg.solve(shrunk, means.T)
  bias = -0.5 * jnp.sum(means * kernel.T, axis=-1) + jnp.log(priors)
  return {"kernel": kernel, "bias": bias}


def local_gaussians(z: jax.Array, y: jax.Array, mask: jax.Array, fallback: jax.Array,
                    min_count: int, eps: float) -> Gaussians:
  """The client's Gaussians from its features z [N, d] (real where mask): class means
  where a class has more than min_count samples (else `fallback`'s), the pooled
  covariance / (N - 1) + eps (every entry) + I."""
  num_classes, dim = fallback.shape
  one_hot = jax.nn.one_hot(y, num_classes) * mask[:, None]
  counts = jnp.sum(one_hot, axis=0)
  means = (one_hot.T @ z) / jnp.maximum(counts, 1.0)[:, None]
  means = jnp.where((counts > min_count)[:, None], means, fallback)
  centered = (z - means[y]) * mask[:, None]
  total = jnp.sum(counts)
  cov = centered.T @ centered / jnp.maximum(total - 1.0, 1.0) + eps + jnp.eye(dim)
  return Gaussians(means=means, cov=cov)


def interpolate(beta_mean, beta_cov, local: Gaussians, global_: Gaussians) -> Gaussians:
  return Gaussians(means=beta_mean * local.means + (1.0 - beta_mean) * global_.means,
                   cov=beta_cov * local.cov + (1.0 - beta_cov) * global_.cov)


def fold_of(y: jax.Array, mask: jax.Array, num_classes: int, folds: int,
            key: jax.Array) -> jax.Array:
  """[N] fold of each sample: a class's real samples, in a random order, dealt to the
  folds in turn; -1 for padding and for classes with fewer than `folds` samples."""
  one_hot = jax.nn.one_hot(y, num_classes) * mask[:, None]
  order = jax.random.permutation(key, y.shape[0])
  rank_in_order = jnp.cumsum(one_hot[order], axis=0) - one_hot[order]    # earlier peers
  rank = jnp.zeros_like(rank_in_order).at[order].set(rank_in_order)
  within = jnp.sum(rank * one_hot, axis=-1).astype(jnp.int32)
  counts = jnp.sum(one_hot, axis=0)
  usable = mask & (counts[y] >= folds)
  return jnp.where(usable, within % folds, -1)


def cv_losses(z: jax.Array, y: jax.Array, fold: jax.Array, global_: Gaussians,
              priors: jax.Array, betas: jax.Array, folds: int, eps: float) -> jax.Array:
  """[G_mu, G_Sigma] summed fold-mean cross-entropy of the interpolated LDA classifier
  at each pair of betas (means, covariance), each fold scored by the Gaussians of the
  other folds; and whether any sample was scored (an empty fold adds 0)."""
  def one_fold(f):
    train = (fold >= 0) & (fold != f)
    local = local_gaussians(z, y, train, global_.means, folds, eps)

    def at_cov_beta(beta_cov):
      mixed = interpolate(0.0, beta_cov, local, global_)   # the covariance alone
      heads = [lda_head(Gaussians(means, mixed.cov), priors, eps)
               for means in (local.means, global_.means)]

      def at_mean_beta(beta_mean):
        means = beta_mean * local.means + (1.0 - beta_mean) * global_.means
        kernel = beta_mean * heads[0]["kernel"] + (1.0 - beta_mean) * heads[1]["kernel"]
        bias = -0.5 * jnp.sum(means * kernel.T, axis=-1) + jnp.log(priors)
        losses = optax.softmax_cross_entropy_with_integer_labels(z @ kernel + bias, y)
        test = (fold == f).astype(z.dtype)
        return jnp.sum(losses * test) / jnp.maximum(jnp.sum(test), 1.0)
      return jax.vmap(at_mean_beta)(betas)
    return jax.lax.map(at_cov_beta, betas).T                # [G_mu, G_Sigma]
  return sum(one_fold(f) for f in range(folds))


def choose_betas(config: PfedFdaConfig, z, y, mask, global_: Gaussians, priors, key):
  """(beta_mu, beta_Sigma): the cross-validation's minimum over the grid (the first one),
  both 1 for betas="local", both 0 where no class has `folds` samples."""
  if config.betas == "local":
    return jnp.ones(()), jnp.ones(())
  num_classes = global_.means.shape[0]
  fold = fold_of(y, mask, num_classes, config.folds, key)
  grid = jnp.linspace(0.0, 1.0, config.grid)
  losses = cv_losses(z, y, fold, global_, priors, grid, config.folds, config.eps)
  if config.betas == "single":
    best = jnp.argmin(jnp.diagonal(losses))
    mean_index, cov_index = best, best
  else:
    mean_index, cov_index = jnp.unravel_index(jnp.argmin(losses), losses.shape)
  scored = jnp.any(fold >= 0)
  return (jnp.where(scored, grid[mean_index], 0.0), jnp.where(scored, grid[cov_index], 0.0))


def adapted_gaussians(config: PfedFdaConfig, z, data: ClientData, global_: Gaussians,
                      priors, key) -> Gaussians:
  """Steps 3 and 4: the client's Gaussians interpolated with the global ones."""
  y, mask = jnp.asarray(data.y), jnp.asarray(data.mask)
  beta_mean, beta_cov = choose_betas(config, z, y, mask, global_, priors, key)
  local = local_gaussians(z, y, mask, global_.means, config.folds, config.eps)
  return interpolate(beta_mean, beta_cov, local, global_)


def with_head(model: Params, head: str, head_params) -> Params:
  return {**model, "params": {**model["params"], head: head_params}}


def pfedfda(config: PfedFdaConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None

  def num_classes_of(model: Params) -> int:
    return model["params"][head_layer(model, "pfedfda")]["kernel"].shape[-1]

  def fitted_head(model: Params, global_: Gaussians, train: ClientData, key: jax.Array):
    """The LDA head of the client's interpolated Gaussians over `model`'s features."""
    head = head_layer(model, "pfedfda")
    priors = priors_of(jnp.asarray(train.y), jnp.asarray(train.mask),
                       num_classes_of(model), config.eps)
    z = representations(apply_fn, model, jnp.asarray(train.x), head)
    adapted = adapted_gaussians(config, z, train, global_, priors, key)
    return adapted, lda_head(adapted, priors, config.eps)

  def init(context: InitContext) -> AlgorithmState:
    model = tree.first(context.params)
    head = head_layer(model, "pfedfda")
    dim, num_classes = model["params"][head]["kernel"].shape
    means = jax.random.uniform(context.key, (num_classes, dim))
    server = PfedFdaServer(model=model, gaussians=Gaussians(means, jnp.eye(dim)))
    return AlgorithmState(server=server,
                          clients=jnp.zeros((tree.leading_size(context.params),)))

  def broadcast(server: PfedFdaServer, clients):
    return tree.broadcast_to_clients(PfedFdaModel(server.model, server.gaussians),
                                     tree.leading_size(clients))

  def client_update(client, received: PfedFdaModel, data: ClientSplits, key):
    model, global_ = received
    head = head_layer(model, "pfedfda")
    priors = priors_of(jnp.asarray(data.train.y), jnp.asarray(data.train.mask),
                       num_classes_of(model), config.eps)
    start = with_head(model, head, lda_head(global_, priors, config.eps))
    train_key, fold_key = jax.random.split(key)
    body = split_body_head(start, 1, "pfedfda")[0]
    params, stats = train_layers(trainer, start, body, data.train, train_key)
    adapted, _ = fitted_head(params, global_, data.train, fold_key)
    return ClientOutput(state=client, upload=PfedFdaUpload(params, adapted), train=stats)

  def aggregate(server: PfedFdaServer, clients, uploads: PfedFdaUpload, weights):
    return AlgorithmState(
        server=PfedFdaServer(model=tree.weighted_mean(uploads.params, weights),
                             gaussians=tree.weighted_mean(uploads.gaussians, weights)),
        clients=clients)

  def evaluate_splits(scored: PfedFdaModel, splits: ClientSplits,
                      names: tuple[str, ...]) -> tuple[EvalStats, ...]:
    head = head_layer(scored.model, "pfedfda")
    train = jax.tree.map(jnp.asarray, splits.train)
    # The folds of scoring: one fixed key, so a client's score is a function of the model.
    _, fitted = fitted_head(scored.model, scored.gaussians, train, jax.random.key(0))
    personal = with_head(scored.model, head, fitted)
    return tuple(trainer.evaluate(personal, getattr(splits, name)) for name in names)

  def shared_model(server: PfedFdaServer) -> PfedFdaModel:
    return PfedFdaModel(server.model, server.gaussians)

  def personalized_params(server: PfedFdaServer, clients):
    return tree.broadcast_to_clients(shared_model(server), tree.leading_size(clients))

  return Algorithm(name="pfedfda", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, evaluate_splits=evaluate_splits,
                   shared_model=shared_model, uploads_unordered=True)
