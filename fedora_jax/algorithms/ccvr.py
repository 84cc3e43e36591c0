"""CCVR: FedAvg, then the global classifier recalibrated on virtual representations drawn
from the clients' per-class feature Gaussians.

Luo, Chen, Hu, Zhang, Liang, Feng. "No Fear of Heterogeneity: Classifier Calibration for
Federated Learning with Non-IID Data." NeurIPS 2021. https://arxiv.org/abs/2106.05001
(code read, not run or copied: FL-bench's src/server/ccvr.py and src/client/ccvr.py,
KarhouTam/FL-bench, GPL. The authors released no code. The paper's full text is not on
disk; its Sec. 4 formulas and its M_c below are as a reader's notes on it quote them
(found through the search tools) and as FL-bench and fluke's ccvr.py implement them, so
this module names no equation numbers. PFLlib has no CCVR, so there is no verification
row: the unit tests check the statistics, the global Gaussians and the calibration step
by hand.)

Training is FedAvg; a calibrating client uploads its classes' feature means, covariances and
counts, and the server trains the classifier alone on samples_per_class (100) draws from the
pooled class Gaussians; scored: the global model. calibrate "last" (default) or "every".

Departures: it recalibrates the round's starting model; only sampled clients send statistics.
Details (every option, the departures, measurements): docs/algorithms/ccvr.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import linalg, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.fedgh import header_loss
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.algorithms.layers import (check_representation_trainer, head_layer,
                                          representations, take_layers)
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import (ClientTrainer, make_client_trainer,
                                              make_optimizer)
from fedora_jax.errors import FieldError, check_one_of

Params = Any
CALIBRATIONS = ("last", "every")
COVARIANCES = ("unbiased", "biased")
SAMPLE_COUNTS = ("equal", "proportional")


class CcvrConfig(NamedTuple):
  calibrate: str = "last"              # "last" (paper: post-hoc) or "every" (FL-bench)
  samples_per_class: int = 100         # M_c (the paper's CIFAR-10 value; FL-bench 200)
  sample_counts: str = "equal"         # M_c = M each (paper's runs) or by N_c / N
  covariance: str = "unbiased"         # clients' 1/(N-1) (paper) or 1/N ("biased")
  calibration_epochs: int = 1          # SGD passes over the virtual set (FL-bench: 1)
  lr: float = 5e-3                     # the calibration SGD's lr: the run's (train field)
  rounds: int = 100                    # the run's rounds (train field): "last" calibrates


FLAG_HELP = {
    "calibrate": "CCVR: calibrate the classifier once after the last round (last, the"
                 " paper's post-hoc step) or before every evaluation (every, FL-bench)",
    "samples_per_class": "CCVR: virtual representations per class M_c (the paper: 100 on"
                         " CIFAR-10, 500 on CIFAR-100, 1000 on CINIC-10; FL-bench 200)",
    "sample_counts": "CCVR: M_c to each class (equal, the paper's runs) or the M_c x C"
                     " virtual representations dealt by the classes' shares N_c / N"
                     " (proportional, the paper's other reading)",
    "covariance": "CCVR: the clients' class covariances with 1/(N - 1) (unbiased, the"
                  " paper's) or 1/N (biased, FL-bench)",
    "calibration_epochs": "CCVR: SGD epochs of the classifier over the virtual"
                          " representations",
}


class FeatureStats(NamedTuple):
  means: jax.Array   # [..., C, d]
  covs: jax.Array    # [..., C, d, d]
  counts: jax.Array  # [..., C]


class CcvrUpload(NamedTuple):
  params: Params          # the client's trained model
  stats: FeatureStats     # of the global model it received


class CcvrServer(NamedTuple):
  model: Params        # the global model FedAvg trains
  scored: Params       # the model scored: the last calibrated one, else `model`
  key: jax.Array       # raw key data of the virtual samples and the shuffles
  round: jax.Array     # [] int32, rounds aggregated so far


def validate(config: CcvrConfig, trainer: ClientTrainer) -> CcvrConfig:
  check_one_of("ccvr", config, "calibrate", CALIBRATIONS)
  check_one_of("ccvr", config, "covariance", COVARIANCES)
  check_one_of("ccvr", config, "sample_counts", SAMPLE_COUNTS)
  for field in ("samples_per_class", "calibration_epochs", "rounds"):
    if getattr(config, field) < 1:
      raise FieldError("ccvr", field, f"must be >= 1, got {getattr(config, field)}")
  if not config.lr > 0:
    raise FieldError("ccvr", "lr", f"must be > 0, got {config.lr}")
  check_representation_trainer("ccvr", trainer)
  return config


def class_feature_stats(z: jax.Array, y: jax.Array, mask: jax.Array, num_classes: int,
                        covariance: str = "unbiased") -> FeatureStats:
  """Per-class mean [C, d], covariance [C, d, d] (0 where a class has < 2 samples, or none
  for "biased") and count [C] of the real samples' features z [N, d]."""
  one_hot = jax.nn.one_hot(y, num_classes) * mask[:, None]        # [N, C]
  counts = jnp.sum(one_hot, axis=0)
  means = (one_hot.T @ z) / jnp.maximum(counts, 1.0)[:, None]
  centered = z - means[y]                    # each sample against its own class's mean
  scatter = jnp.einsum("nc,nd,ne->cde", one_hot, centered, centered)
  divisor = counts - 1.0 if covariance == "unbiased" else counts
  return FeatureStats(means=means, covs=scatter / jnp.maximum(divisor, 1.0)[:, None, None],
                      counts=counts)


def global_gaussians(stats: FeatureStats, sampled: jax.Array) -> FeatureStats:
  """The global (mu_c, Sigma_c, N_c) from the sampled clients' stats [K, C, ...]; Sigma_c
  is 0 where N_c < 2."""
  counts = stats.counts * sampled[:, None]                          # [K, C]
  total = jnp.sum(counts, axis=0)                                   # [C]
  means = jnp.einsum("kc,kcd->cd", counts, stats.means) / jnp.maximum(total, 1.0)[:, None]
  within = jnp.einsum("kc,kcde->cde", jnp.maximum(counts - 1.0, 0.0), stats.covs)
  between = jnp.einsum("kc,kcd,kce->cde", counts, stats.means, stats.means)
  pooled = within + between - total[:, None, None] * jnp.einsum("cd,ce->cde", means, means)
  covs = pooled / jnp.maximum(total - 1.0, 1.0)[:, None, None]
  return FeatureStats(means=means, covs=jnp.where((total >= 2)[:, None, None], covs, 0.0),
                      counts=total)


def virtual_labels(counts: jax.Array, per_class: int, sample_counts: str):
  """(labels [M C], real [M C]) of the virtual set: M to each class with N_c >= 2
  ("equal"), or M C slots dealt by N_c / N over those classes ("proportional")."""
  num_classes = counts.shape[0]
  usable = jnp.where(counts >= 2, counts, 0.0)
  slots = per_class * num_classes
  if sample_counts == "equal":
    labels = jnp.repeat(jnp.arange(num_classes), per_class)
    return labels, usable[labels] > 0
  # Slot s goes to the class whose share of [0, slots) holds s + 1/2: counts within one
  # of slots N_c / N, in class order.
  bounds = jnp.cumsum(usable) / jnp.maximum(jnp.sum(usable), 1.0) * slots
  labels = jnp.searchsorted(bounds, jnp.arange(slots) + 0.5, side="right")
  labels = jnp.minimum(labels, num_classes - 1)
  return labels, usable[labels] > 0


def sample_virtual(gaussians: FeatureStats, key: jax.Array, per_class: int,
                   sample_counts: str) -> ClientData:
  """The virtual representations z ~ N(mu_y, Sigma_y) as one dataset (Sigma_y's square
  root by eigendecomposition, negative rounding-error eigenvalues taken as 0)."""
  labels, real = virtual_labels(gaussians.counts, per_class, sample_counts)
  covs = 0.5 * (gaussians.covs + jnp.swapaxes(gaussians.covs, -1, -2))
  values, vectors = linalg.eigh(covs)
  roots = vectors * jnp.sqrt(jnp.maximum(values, 0.0))[:, None, :]   # Sigma = R R^T
  noise = jax.random.normal(key, labels.shape + gaussians.means.shape[-1:])
  z = gaussians.means[labels] + jnp.einsum("nde,ne->nd", roots[labels], noise)
  return ClientData(x=z, y=labels.astype(jnp.int32), mask=real,
                    n=jnp.sum(real).astype(jnp.int32))


def calibrate_head(model: Params, head: str, virtual: ClientData, key: jax.Array,
                   head_trainer: ClientTrainer) -> Params:
  """`model` with its classifier `head` trained on the virtual set."""
  trained, _ = head_trainer.train(take_layers(model, [head]), virtual, key,
                                  loss_fn=header_loss(head))
  return {"params": {**model["params"], head: trained["params"][head]}}


def ccvr(config: CcvrConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  head_trainer = make_client_trainer(lambda params, x: x, make_optimizer(config.lr, 0.0),
                                     config.calibration_epochs, batch_size_of(trainer))

  def init(context: InitContext) -> AlgorithmState:
    model = tree.first(context.params)
    head_layer(model, "ccvr")  # a Dense classifier on top, or a one-line error
    server = CcvrServer(model=model, scored=model, key=raw_key(context.key),
                        round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server,
                          clients=jnp.zeros((tree.leading_size(context.params),)))

  def broadcast(server: CcvrServer, clients):
    return tree.broadcast_to_clients(server.model, tree.leading_size(clients))

  def client_update(client, model, data, key):
    head = head_layer(model, "ccvr")
    num_classes = model["params"][head]["kernel"].shape[-1]
    features = representations(trainer.apply, model, data.train.x, head)
    stats = class_feature_stats(features, data.train.y, data.train.mask, num_classes,
                                config.covariance)
    params, train_stats = trainer.train(model, data.train, key)
    return ClientOutput(state=client, upload=CcvrUpload(params=params, stats=stats),
                        train=train_stats)

  def calibrated(server: CcvrServer, stats: FeatureStats, sampled: jax.Array) -> Params:
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
    sample_key, shuffle_key = jax.random.split(key)
    virtual = sample_virtual(global_gaussians(stats, sampled), sample_key,
                             config.samples_per_class, config.sample_counts)
    return calibrate_head(server.model, head_layer(server.model, "ccvr"), virtual,
                          shuffle_key, head_trainer)

  def aggregate(server: CcvrServer, clients, uploads: CcvrUpload, weights):
    model = tree.weighted_mean(uploads.params, weights)
    now = (jnp.bool_(True) if config.calibrate == "every"
           else server.round == config.rounds - 1)
    # A round that does not calibrate scores FedAvg's new model, as FedAvg does.
    scored = jax.lax.cond(now, lambda: calibrated(server, uploads.stats, weights > 0),
                          lambda: model)
    return AlgorithmState(server=server._replace(model=model, scored=scored,
                                                 round=server.round + 1),
                          clients=clients)

  def personalized_params(server: CcvrServer, clients):
    return tree.broadcast_to_clients(server.scored, tree.leading_size(clients))

  return Algorithm(name="ccvr", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.scored, uploads_unordered=True)
