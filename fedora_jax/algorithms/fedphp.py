"""FedPHP: each client keeps a historical personalised model (HPM) that inherits the
models it trained, and distils it into its local training of the global model.

Li, Zhan, Shao, Li, Song. "FedPHP: Federated Personalization with Inherited Private
Models." ECML PKDD 2021. https://doi.org/10.1007/978-3-030-86486-6_36
We follow the authors' code, github.com/lxcnju/FedRepo, algorithms/fedphp.py and
tools.py (mmd_rbf_noaccelerate); differences from PFLlib (TsingZ0/PFLlib clientphp.py)
are noted.

A sampled client k trains the received global model w^t by the run's local SGD on
(1 - lam) CE + lam R(w, v_k) (lam 0.05), R the transfer from its HPM v_k (reg "mmd" on
penultimate features, or "kd" on logits at temperature 4.0), sets v_k <- mu_k v_k +
(1 - mu_k) w_k (mu_k ramps to mu_max 0.9 over mu_participations 100) and uploads w_k;
the server averages (FedAvg). Each client is scored with v_k (personal_model "hpm").

Departures: FedRepo's gradient clipping is not taken. PFLlib's forms: personal_model
"local", mmd_kernel "pfllib", teacher "global" (its a41f7ba FedPHP: the global teacher).

Details (every option, the departures, measurements): docs/algorithms/fedphp.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import model_message
from fedora_jax.algorithms.layers import apply_with_representation, split_body_head
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any

REGULARIZERS = ("mmd", "kd")
PERSONAL_MODELS = ("hpm", "local")
MMD_KERNELS = ("fedrepo", "pfllib")
TEACHERS = ("hpm", "global")  # FedRepo's and PFLlib's head; PFLlib a41f7ba's
# PFLlib's MMD(x, y, 'rbf'): fixed bandwidths a, kernels exp(-d / (2 a)).
PFLLIB_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
# FedRepo's guassian_kernel: kernel_mul 2, kernel_num 5.
KERNEL_MUL, KERNEL_NUM = 2.0, 5


class FedPhpConfig(NamedTuple):
  lam: float = 0.05             # (1 - lambda) CE + lambda R
  reg: str = "mmd"              # R: "mmd" on penultimate features, or "kd" on logits
  mu_max: float = 0.9           # cap of the HPM's moving-average weight
  mu_participations: int = 100  # Q: participations over which mu ramps from 0 to mu_max
  temperature: float = 4.0      # kd: the HPM's logits are divided by T
  personal_model: str = "hpm"   # evaluated: "hpm" (FedRepo) or "local" (PFLlib)
  mmd_kernel: str = "fedrepo"   # mmd's kernels: "fedrepo" (data-driven) or "pfllib" (fixed)
  teacher: str = "hpm"          # "hpm", or "global": PFLlib a41f7ba's FedPHP


FLAG_HELP = {
    "lam": "FedPHP: local loss (1 - lambda) CE + lambda R(model, HPM)",
    "reg": "FedPHP: knowledge transfer R, mmd (MMD of penultimate features) or kd"
           " (distillation of the HPM's logits)",
    "mu_max": "FedPHP: largest moving-average weight mu of the HPM update",
    "mu_participations": "FedPHP: mu = mu_max * (own past participations) / this, capped",
    "temperature": "FedPHP: kd temperature T of the HPM's logits",
    "personal_model": "FedPHP: evaluated model, hpm (the authors') or local (the trained"
                      " local model, PFLlib's)",
    "mmd_kernel": "FedPHP: mmd's Gaussian kernels, fedrepo (5 bandwidths scaled by the"
                  " batch's mean squared distance, the authors') or pfllib (fixed"
                  " bandwidths 10, 15, 20, 50)",
    "teacher": "FedPHP: hpm (the HPM teaches, the authors' and PFLlib's) or global"
               " (PFLlib a41f7ba's: the received global model teaches, the client starts"
               " from (1 - mu) global + mu its last model, mu ramped over the rounds)",
}


class FedPhpClient(NamedTuple):
  hpm: Params            # [K, ...] v_k, the historical personalised model
  local: Params          # [K, ...] w_k as last trained (personal_model="local"), else ()
  participations: jax.Array  # [K] int32 rounds the client has taken part in


def validate(config: FedPhpConfig) -> FedPhpConfig:
  if not 0.0 <= config.lam <= 1.0:
    raise FieldError("fedphp", "lam", f"must be in [0, 1], got {config.lam}")
  check_one_of("fedphp", config, "reg", REGULARIZERS)
  if not 0.0 <= config.mu_max < 1.0:
    raise FieldError("fedphp", "mu_max", f"must be in [0, 1), got {config.mu_max}")
  if config.mu_participations < 1:
    raise FieldError("fedphp", "mu_participations", f"must be >= 1, got"
                                                    f" {config.mu_participations}")
  if not config.temperature > 0:
    raise FieldError("fedphp", "temperature", f"must be > 0, got {config.temperature}")
  check_one_of("fedphp", config, "personal_model", PERSONAL_MODELS)
  check_one_of("fedphp", config, "mmd_kernel", MMD_KERNELS)
  check_one_of("fedphp", config, "teacher", TEACHERS)
  return config


def head_inputs(apply_fn, head: str):
  """features(params, x) -> (input of the top layer `head`, model outputs)."""
  def features(params, x):
    outputs, representation = apply_with_representation(apply_fn, params, x, head)
    return representation, outputs
  return features


def gaussian_kernels(a: jax.Array, b: jax.Array, bandwidth: jax.Array) -> jax.Array:
  """[Na, Nb]: sum_j exp(-||a - b||^2 / (bandwidth 2^j)), j over FedRepo's 5 scales."""
  distances = jnp.sum(jnp.square(a[:, None] - b[None]), axis=-1)
  scales = bandwidth * KERNEL_MUL ** (jnp.arange(KERNEL_NUM) - KERNEL_NUM // 2)
  return jnp.sum(jnp.exp(-distances[..., None] / scales), axis=-1)


def fixed_gaussian_kernels(a: jax.Array, b: jax.Array) -> jax.Array:
  """[Na, Nb]: PFLlib's sum over its bandwidths s of exp(-||a - b||^2 / (2 s))."""
  distances = jnp.sum(jnp.square(a[:, None] - b[None]), axis=-1)
  return jnp.asarray(sum(jnp.exp(-0.5 * distances / s) for s in PFLLIB_BANDWIDTHS))


def mmd(source: jax.Array, target: jax.Array, weights: jax.Array,
        kernel: str = "fedrepo") -> jax.Array:
  """FedRepo's mmd_rbf_noaccelerate over the real samples (weights 1) of a batch; with
  kernel "pfllib", the same estimate with PFLlib's fixed kernels."""
  pooled = jnp.concatenate([source, target])
  pooled_weights = jnp.concatenate([weights, weights])
  pair_weights = pooled_weights[:, None] * pooled_weights[None]
  distances = jnp.sum(jnp.square(pooled[:, None] - pooled[None]), axis=-1)
  count = jnp.sum(pooled_weights)
  # The mean squared distance of distinct pooled samples, a constant (torch's .data).
  bandwidth = jax.lax.stop_gradient(
      jnp.sum(distances * pair_weights) / jnp.maximum(count * count - count, 1.0))
  bandwidth = bandwidth + 1e-8

  def kernels(a, b):
    if kernel == "pfllib":
      return fixed_gaussian_kernels(a, b)
    return gaussian_kernels(a, b, bandwidth)

  def block(a, b):
    pairs = weights[:, None] * weights[None]
    return jnp.sum(kernels(a, b) * pairs)
  total = block(source, source) + block(target, target) - 2.0 * block(source, target)
  return total / jnp.maximum(jnp.square(jnp.sum(weights)), 1.0)


def distillation(student_logits: jax.Array, teacher_logits: jax.Array, weights: jax.Array,
                 temperature: float) -> jax.Array:
  """-sum_c softmax(teacher / T) log softmax(student), averaged over real samples."""
  soft = jax.nn.softmax(teacher_logits / temperature, axis=-1)
  per_sample = -jnp.sum(soft * jax.nn.log_softmax(student_logits, axis=-1), axis=-1)
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def php_loss(trainer: ClientTrainer, features, config: FedPhpConfig, hpm: Params):
  """loss_fn(w, x, y, weights) = (1 - lambda) CE(w) + lambda R(w, HPM)."""
  def loss(params, x, y, weights):
    data_loss = trainer.loss(params, x, y, weights)
    student_features, student_logits = features(params, x)
    teacher_features, teacher_logits = jax.lax.stop_gradient(features(hpm, x))
    if config.reg == "mmd":
      transfer = mmd(student_features, teacher_features, weights, config.mmd_kernel)
    else:
      transfer = distillation(student_logits, teacher_logits, weights, config.temperature)
    return (1.0 - config.lam) * data_loss + config.lam * transfer
  return loss


def hpm_weight(participations: jax.Array, config: FedPhpConfig) -> jax.Array:
  """mu_k = min(mu_max * c_k / Q, mu_max), c_k the client's earlier participations."""
  return jnp.minimum(config.mu_max * participations / config.mu_participations,
                     config.mu_max)


def update_hpm(hpm: Params, trained: Params, mu: jax.Array) -> Params:
  """v_k <- mu v_k + (1 - mu) w_k."""
  return jax.tree.map(lambda v, w: mu * v + (1.0 - mu) * w, hpm, trained)


def fedphp(config: FedPhpConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  if trainer.apply is None:
    raise ConfigError("fedphp needs the model's forward pass (ClientTrainer.apply)")
  if config.reg == "kd" and trainer.task != "classification":
    raise FieldError("fedphp", "reg", "kd distils class probabilities; use mmd for regression")
  if config.teacher == "global":
    return _global_teacher(config, trainer)
  keep_local = config.personal_model == "local"

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    split_body_head(tree.first(context.params), 1, "fedphp's head")  # a model with a head
    return AlgorithmState(server=tree.first(context.params), clients=FedPhpClient(
        hpm=context.params, local=context.params if keep_local else (),
        participations=jnp.zeros((num_clients,), jnp.int32)))

  def broadcast(global_params, clients: FedPhpClient):
    return tree.broadcast_to_clients(global_params, clients.participations.shape[0])

  def client_update(client: FedPhpClient, global_params, data, key):
    head = split_body_head(global_params, 1, "fedphp's head")[1][0]
    loss_fn = php_loss(trainer, head_inputs(trainer.apply, head), config, client.hpm)
    trained, stats = trainer.train(global_params, data.train, key, loss_fn=loss_fn)
    mu = hpm_weight(client.participations, config)
    state = FedPhpClient(hpm=update_hpm(client.hpm, trained, mu),
                         local=trained if keep_local else (),
                         participations=client.participations + 1)
    return ClientOutput(state=state, upload=trained, train=stats, metrics={"hpm_mu": mu})

  def aggregate(server, clients, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(server, clients: FedPhpClient):
    del server
    return clients.local if keep_local else clients.hpm

  return Algorithm(name="fedphp", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   # theta_hat is where the local model's training starts; theta_i is the
                   # trained w_k (the upload); ALA leaves the HPM alone (clientphp.py).
                   ala_hooks=model_message(personal_is_local=False))


class GlobalTeacherServer(NamedTuple):
  model: Params       # w^t
  round: jax.Array    # [] int32, rounds aggregated so far


class GlobalTeacherMessage(NamedTuple):
  model: Params       # [K, ...] w^t, the teacher
  mu: jax.Array       # [K] the round's mu_t


def round_weight(rounds: jax.Array, config: FedPhpConfig) -> jax.Array:
  """mu_t = min(mu_max t / Q, mu_max), t the rounds aggregated so far."""
  return jnp.minimum(config.mu_max * rounds / config.mu_participations, config.mu_max)


def mix(global_params: Params, own: Params, mu: jax.Array) -> Params:
  """(1 - mu) w^t + mu w_k."""
  return jax.tree.map(lambda g, w: (1.0 - mu) * g + mu * w, global_params, own)


def _global_teacher(config: FedPhpConfig, trainer: ClientTrainer) -> Algorithm:
  """PFLlib a41f7ba's FedPHP (docs/algorithms/fedphp.md). A client's state keeps w_k in its
  `hpm` field."""

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    split_body_head(tree.first(context.params), 1, "fedphp's head")  # a model with a head
    return AlgorithmState(
        server=GlobalTeacherServer(model=tree.first(context.params),
                                   round=jnp.zeros((), jnp.int32)),
        clients=FedPhpClient(hpm=context.params, local=(),
                             participations=jnp.zeros((num_clients,), jnp.int32)))

  def broadcast(server: GlobalTeacherServer, clients: FedPhpClient):
    num_clients = clients.participations.shape[0]
    return GlobalTeacherMessage(
        model=tree.broadcast_to_clients(server.model, num_clients),
        mu=jnp.full((num_clients,), round_weight(server.round, config)))

  def client_update(client: FedPhpClient, message: GlobalTeacherMessage, data, key):
    head = split_body_head(message.model, 1, "fedphp's head")[1][0]
    loss_fn = php_loss(trainer, head_inputs(trainer.apply, head), config, message.model)
    start = mix(message.model, client.hpm, message.mu)
    trained, stats = trainer.train(start, data.train, key, loss_fn=loss_fn)
    state = FedPhpClient(hpm=trained, local=(), participations=client.participations + 1)
    return ClientOutput(state=state, upload=trained, train=stats,
                        metrics={"start_mu": message.mu})

  def aggregate(server: GlobalTeacherServer, clients, uploads, weights):
    return AlgorithmState(
        server=GlobalTeacherServer(model=tree.weighted_mean(uploads, weights),
                                   round=server.round + 1),
        clients=clients)

  def personalized_params(server: GlobalTeacherServer, clients: FedPhpClient):
    # The model each client starts the next round from: PFLlib's next evaluation.
    message = broadcast(server, clients)
    return jax.vmap(mix)(message.model, clients.hpm, message.mu)

  return Algorithm(name="fedphp", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
