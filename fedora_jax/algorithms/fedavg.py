"""FedAvg: clients train the broadcast global model; the server averages their models
weighted by their number of training samples.

McMahan, Moore, Ramage, Hampson, Arcas. "Communication-Efficient Learning of Deep
Networks from Decentralized Data." AISTATS 2017. https://arxiv.org/abs/1602.05629
"""

from typing import NamedTuple

import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.plugin_fields import SERVER_MODEL, WHOLE_SERVER, model_message
from fedora_jax.engine.local_training import ClientTrainer


class FedAvgConfig(NamedTuple):
  pass


def fedavg(config: FedAvgConfig, trainer: ClientTrainer) -> Algorithm:
  del config

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    global_params = tree.first(context.params)
    # FedAvg clients hold no state of their own; an empty pytree keeps the K axis implicit.
    return AlgorithmState(server=global_params, clients=jnp.zeros((num_clients,)))

  def broadcast(global_params, clients):
    return tree.broadcast_to_clients(global_params, tree.leading_size(clients))

  def client_update(client_state, global_params, data, key):
    params, stats = trainer.train(global_params, data.train, key)
    return ClientOutput(state=client_state, upload=params, train=stats)

  def aggregate(server, clients, uploads, weights):
    del server
    return AlgorithmState(server=tree.weighted_mean(uploads, weights), clients=clients)

  def personalized_params(global_params, clients):
    return tree.broadcast_to_clients(global_params, tree.leading_size(clients))

  return Algorithm(name="fedavg", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda global_params: global_params, uploads_unordered=True,
                   # ALA takes the place of the client's copy of the global model.
                   ala_hooks=model_message(personal_is_local=True),
                   shared_part=WHOLE_SERVER, upload_mean=SERVER_MODEL)
