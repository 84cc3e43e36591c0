"""Ditto: a FedAvg global model plus, on every client, a personal model regularised towards it.

Li, Hu, Beirami, Smith. "Ditto: Fair and Robust Federated Learning Through
Personalization." ICML 2021. https://arxiv.org/abs/2012.04221
(code: github.com/litian96/ditto)

Ditto solves, per client k,  min_v  F_k(v) + lambda/2 ||v - w*||^2  with w* the global
FedAvg solution (the paper's Eq. 2). Its solver (Algorithm 1), every round t:
  1. the server sends w^t;
  2. client k updates the global model as FedAvg's local solver would (here the run's
     local SGD from w^t) and uploads the result;
  3. client k updates its personal model v_k with SGD on
     F_k(v) + lambda/2 ||v - w^t||^2, i.e. steps v -= lr (grad F_k(v) + lambda (v - w^t)),
     anchored at the w^t it received (not at its own update of it);
  4. the server averages the uploads (weighted by training-set size) into w^(t+1).
v_k lives in the stacked client state and is the personalised model. It trains for the
run's local epochs, like the global update (the paper's s local personal iterations;
its experiments use equal budgets). Round metrics report the personal model's training;
`global_train_loss` is the global update's.

lambda: the paper tunes it per dataset; the authors' released runs (run_fashion_clean_
ditto_lam1.sh, run_vehicle_clean_ditto_lam1.sh, run_helper.txt: --lam=1) use lambda = 1,
the default here.
"""

from typing import NamedTuple

import jax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedprox import proximal_term
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError


class DittoConfig(NamedTuple):
  lam: float = 1.0  # pull of the personal model towards the global one (authors' runs)


FLAG_HELP = {"lam": "Ditto lambda: personal loss + lambda/2 ||v - w_global||^2"}


def validate(config: DittoConfig) -> DittoConfig:
  if config.lam < 0:
    raise FieldError("ditto", "lam", f"must be >= 0, got {config.lam}")
  return config


def ditto(config: DittoConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    # Every personal model starts from the shared initial model, as the global one does.
    global_params = tree.first(context.params)
    return AlgorithmState(server=global_params, clients=context.params)

  def broadcast(global_params, personal_params):
    return tree.broadcast_to_clients(global_params,
                                       tree.leading_size(personal_params))

  def client_update(personal_params, global_params, data, key):
    global_key, personal_key = jax.random.split(key)
    uploaded, global_stats = trainer.train(global_params, data.train, global_key)
    personal_params, personal_stats = trainer.train(
        personal_params, data.train, personal_key,
        regularizer=proximal_term(config.lam, global_params))
    return ClientOutput(state=personal_params, upload=uploaded, train=personal_stats,
                        metrics={"global_train_loss": global_stats.loss})

  def aggregate(server, personal_params, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights),
                          clients=personal_params)

  return Algorithm(name="ditto", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, personal_params: personal_params)
