"""FedAvg + fine-tuning (FedAvg-FT): FedAvg's global model, fine-tuned by each client on its
own data to personalise it.

The global training is FedAvg's, unchanged: McMahan, Moore, Ramage, Hampson, Arcas.
"Communication-Efficient Learning of Deep Networks from Decentralized Data." AISTATS
2017. https://arxiv.org/abs/1602.05629 . Fine-tuning the global model locally is the
standard personalisation baseline evaluated e.g. by Wang, Mathews, Kiddon, Eichner,
Beaufays, Ramage, "Federated Evaluation of On-device Personalization", arXiv 2019,
https://arxiv.org/abs/1910.10252 , and a standard baseline of pFL comparisons.

The server trajectory is FedAvg's. Client k's model in round t is its local training of the
global model w^(t-1) it received (the run's E local epochs, its round key), the model it uploads
anyway, kept in the client state: "FedAvg for t - 1 rounds, then E epochs of fine-tuning",
computed alongside training. It is scored with it (before round 1, the initial model).
`with_fine_tuning` wraps any base method this way (fedprox_ft uses it too). No config fields.

Details (every option, the departures, measurements): docs/algorithms/fedavg_ft.md.
"""

from typing import Any, Callable, NamedTuple

import jax

from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import (Algorithm, AlgorithmState, ClientOutput,
                                        InitContext)
from fedora_jax.data.client_data import ClientSplits
from fedora_jax.engine.local_training import ClientTrainer

PyTree = Any
# fine_tune(message, data, key, base_output) -> the client's fine-tuned model.
FineTune = Callable[[PyTree, ClientSplits, jax.Array, ClientOutput], PyTree]


class FedAvgFTConfig(NamedTuple):
  pass


class FineTunedClients(NamedTuple):
  base: PyTree        # the base method's own client state, leaves [K, ...]
  fine_tuned: PyTree  # [K, ...] each client's fine-tuned copy of the global model


def plain_fine_tune(trainer: ClientTrainer) -> FineTune:
  """The received global model trained on the client's cross-entropy alone (E epochs)."""
  def fine_tune(global_params, data, key, base_output):
    del base_output
    return trainer.train(global_params, data.train, key)[0]
  return fine_tune


def with_fine_tuning(base: Algorithm, name: str, fine_tune: FineTune) -> Algorithm:
  """`base` with each client's fine-tuned model as its personalised model."""

  def init(context: InitContext) -> AlgorithmState:
    state = base.init(context)
    return AlgorithmState(server=state.server,
                          clients=FineTunedClients(base=state.clients,
                                                   fine_tuned=context.params))

  def broadcast(server, clients: FineTunedClients):
    return base.broadcast(server, clients.base)

  def client_update(clients_k: FineTunedClients, message, data, key):
    out = base.client_update(clients_k.base, message, data, key)
    return out._replace(state=FineTunedClients(
        base=out.state, fine_tuned=fine_tune(message, data, key, out)))

  def aggregate(server, clients: FineTunedClients, uploads, weights):
    state = base.aggregate(server, clients.base, uploads, weights)
    return AlgorithmState(server=state.server,
                          clients=clients._replace(base=state.clients))

  return Algorithm(name=name, init=init, broadcast=broadcast, client_update=client_update,
                   aggregate=aggregate,
                   personalized_params=lambda server, clients: clients.fine_tuned,
                   artifacts=base.artifacts,
                   # the base's aggregate sees the same uploads; the fine-tuned models
                   # differ per client, so no shared_model
                   uploads_unordered=base.uploads_unordered)


def upload_is_fine_tuned(global_params, data, key, base_output):
  """The client's upload, its locally trained model of the round, as its fine-tuned one."""
  del global_params, data, key
  return base_output.upload


def fedavg_ft(config: FedAvgFTConfig, trainer: ClientTrainer) -> Algorithm:
  del config
  # FedAvg's local update is plain SGD on the client's loss from the global model with
  # the round's key: the same computation as plain_fine_tune, so reuse its result.
  return with_fine_tuning(fedavg.fedavg(fedavg.FedAvgConfig(), trainer), "fedavg_ft",
                          upload_is_fine_tuned)
