"""Ditto: a FedAvg global model plus, on every client, a personal model regularised towards it.

Li, Hu, Beirami, Smith. "Ditto: Fair and Robust Federated Learning Through
Personalization." ICML 2021. https://arxiv.org/abs/2012.04221
(code: github.com/litian96/ditto, HEAD 26d9b29; flearn/trainers_MTL/ditto.py)

Each round a sampled client trains the global model w^t by the run's local SGD and uploads it
(the server averages the uploads, weighted by training-set size), and trains its personal
model v_k on F_k(v) + lambda/2 ||v - w^t||^2 for the same epochs; it is scored with v_k.
lambda_selection "per_client" (default) takes, each round, the lambda of lambdas "0.1,1,2"
with the lowest validation loss; "fixed" uses lam (1); "per_step" chooses at every step.

Departures: the default is the paper's per-client lambda, not the authors' released lam=1
("fixed"); validation on the client's own split (the code: the last 10% of training); each
model draws its own batches; per_step adds the proximal step after the run's optimizer step.

Details (every option, the departures, measurements): docs/algorithms/ditto.md.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, model_message
from fedora_jax.algorithms.fedprox import proximal_term
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of, traced

SELECTIONS = ("fixed", "per_client", "per_step")
# Appendix C: a device with "very few validation samples (less than 4)" keeps a fixed lambda.
MIN_VAL_SAMPLES = 4


class DittoConfig(NamedTuple):
  lam: float = 1.0  # pull of the personal model towards the global one (authors' runs)
  lambda_selection: str = "per_client"  # fixed | per_client | per_step (docs/algorithms/ditto.md)
  lambdas: str = "0.1,1,2"  # the candidate grid (Appendix C, and the code's dynamic_lam)
  lr: float = 5e-3  # per_step's proximal step size: the run's client lr (train field)


FLAG_HELP = {
    "lam": "Ditto lambda: personal loss + lambda/2 ||v - w_global||^2 (lambda_selection="
           "fixed, and clients with fewer than 4 validation samples)",
    "lambda_selection": "fixed: lam for every client; per_client: each client picks,"
                        " every round, the lambda of the grid whose personal model has"
                        " the lowest validation loss (the paper's Appendix C); per_step:"
                        " the same choice at every SGD step (the authors' --dynamic_lam)",
    "lambdas": "Comma-separated candidate lambdas of per_client and per_step"}


def candidate_lambdas(config: DittoConfig) -> tuple[float, ...]:
  try:
    values = tuple(float(v) for v in config.lambdas.split(","))
  except ValueError:
    raise FieldError("ditto", "lambdas",
                     f"must be comma-separated numbers, got {config.lambdas!r}") from None
  if any(v < 0 for v in values):
    raise FieldError("ditto", "lambdas", f"must all be >= 0, got {config.lambdas!r}")
  return values


def validate(config: DittoConfig) -> DittoConfig:
  if not traced(config.lam) and config.lam < 0:
    raise FieldError("ditto", "lam", f"must be >= 0, got {config.lam}")
  check_one_of("ditto", config, "lambda_selection", SELECTIONS)
  candidate_lambdas(config)
  return config


def validation_losses(trainer: ClientTrainer, candidates, val_data) -> jax.Array:
  """[n] each stacked candidate model's validation loss on the client's data."""
  return jax.vmap(lambda params: trainer.evaluate(params, val_data).loss)(candidates)


def select_on_validation(trainer: ClientTrainer, candidates, num_grid: int, val_data,
                         fallback: int) -> jax.Array:
  """[] int32: the candidate model with the lowest validation loss among the first
  `num_grid` (the grid), or `fallback` (the fixed lambda's) where the client has fewer
  than MIN_VAL_SAMPLES validation samples."""
  losses = validation_losses(trainer, candidates, val_data)
  losses = jnp.where(jnp.arange(losses.shape[0]) < num_grid, losses, jnp.inf)
  return jnp.where(val_data.n >= MIN_VAL_SAMPLES, jnp.argmin(losses), fallback).astype(
      jnp.int32)


def proximal_step_chooser(trainer: ClientTrainer, lambdas: jax.Array, lr: float,
                          global_params, val_data):
  """post_step of the authors' dynamic lambda: to the data step `stepped` taken from
  `old`, add each candidate's proximal step -lr lambda (old - w^t); keep the candidate
  with the lowest validation loss."""
  def choose(stepped, old):
    candidates = jax.vmap(lambda lam: jax.tree.map(
        lambda s, o, w: s - lr * lam * (o - w), stepped, old, global_params))(lambdas)
    return tree.take(candidates, jnp.argmin(validation_losses(trainer, candidates, val_data)))
  return choose


def ditto(config: DittoConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  grid = candidate_lambdas(config)

  def init(context: InitContext) -> AlgorithmState:
    # Every personal model starts from the shared initial model, as the global one does.
    global_params = tree.first(context.params)
    return AlgorithmState(server=global_params, clients=context.params)

  def broadcast(global_params, personal_params):
    return tree.broadcast_to_clients(global_params,
                                       tree.leading_size(personal_params))

  def train_personal(personal_params, global_params, data, key):
    """(v_k after this round, its training statistics, metrics)."""
    def with_lambda(lam):
      return trainer.train(personal_params, data.train, key,
                           regularizer=proximal_term(lam, global_params))

    if config.lambda_selection == "fixed":
      params, stats = with_lambda(config.lam)
      return params, stats, {}
    if config.lambda_selection == "per_client":
      # The grid, plus the fixed lambda (for clients with too little validation data)
      # unless it is in the grid already.
      trained = grid + (() if config.lam in grid else (config.lam,))
      trained_lambdas = jnp.asarray(trained, jnp.float32)
      candidates, stats = jax.vmap(with_lambda)(trained_lambdas)
      best = select_on_validation(trainer, candidates, len(grid), data.val,
                                  trained.index(config.lam))
      return (tree.take(candidates, best), tree.take(stats, best),
              {"lambda": trained_lambdas[best]})
    params, stats = trainer.train(personal_params, data.train, key,
                                  post_step=proximal_step_chooser(
                                      trainer, jnp.asarray(grid, jnp.float32), config.lr,
                                      global_params, data.val))
    return params, stats, {}

  def client_update(personal_params, global_params, data, key):
    global_key, personal_key = jax.random.split(key)
    uploaded, global_stats = trainer.train(global_params, data.train, global_key)
    personal_params, personal_stats, metrics = train_personal(
        personal_params, global_params, data, personal_key)
    return ClientOutput(state=personal_params, upload=uploaded, train=personal_stats,
                        metrics={"global_train_loss": global_stats.loss, **metrics})

  def aggregate(server, personal_params, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights),
                          clients=personal_params)

  return Algorithm(name="ditto", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, personal_params: personal_params,
                   # theta_hat takes the received global model's place; v_i is Ditto's own.
                   ala_hooks=model_message(personal_is_local=False),
                   # the server averages the uploaded global updates; v_k stays local
                   upload_mean=SERVER_MODEL)
