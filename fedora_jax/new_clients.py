"""Clients that join after training: FEDORA's Algorithm 2 (paper section 4.3).

Wu, Bao, Ainsworth, He. "Personalized Federated Learning with Parameter Propagation."
KDD 2023. https://doi.org/10.1145/3580305.3599464

A new client uploads only its subspace U_new. The server compares it with the trained
clients' subspaces, builds the new client's edges as it built W, and returns its
auxiliary model theta_hat_new = D_new^-1 W_new Theta_hat (see
`fedora.propagate_to_new_clients`). Without labels the client uses theta_hat_new as is;
with labels it runs FEDORA's regularised client update from theta_hat_new for
`--new_client_epochs` epochs. The baseline is FedAvg's global model trained on the same
clients: as is, and fine-tuned (cross-entropy) for the same epochs.
"""

from typing import Any, NamedTuple

import jax
import numpy as np

from fedora_jax import similarity
from fedora_jax.algorithms import fedora
from fedora_jax.algorithms.base import AlgorithmState
from fedora_jax.tree import broadcast_to_clients
from fedora_jax.data.client_data import ClientSplits, FederatedData
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.rounds import client_keys


class NewClientAccuracy(NamedTuple):
  """Per-new-client test accuracy [N] of each way to serve it."""
  fedora_without_labels: np.ndarray
  fedora_with_labels: np.ndarray
  fedavg_without_labels: np.ndarray
  fedavg_with_labels: np.ndarray


def evaluate_new_clients(config: fedora.FedoraConfig, finetune_trainer: ClientTrainer,
                         trained: FederatedData, fedora_state: AlgorithmState,
                         new: FederatedData, fedavg_global: Any,
                         key: jax.Array) -> NewClientAccuracy:
  """Serves the held-out clients from a trained FEDORA run and a trained FedAvg run."""
  finetune = fedora.fedora(config, finetune_trainer)

  @jax.jit
  def run(fedora_state, trained_buckets, new_buckets, fedavg_global, key):
    trained_data = trained._replace(buckets=trained_buckets)
    new_data = new._replace(buckets=new_buckets)
    cross = similarity.principal_angle_similarity(
        fedora.client_subspaces(new_data, config.p),
        fedora.client_subspaces(trained_data, config.p))
    propagated = finetune.broadcast(fedora_state.server, fedora_state.clients)
    auxiliary = fedora.propagate_to_new_clients(
        fedora.new_client_graph(cross, config), propagated)
    global_models = broadcast_to_clients(fedavg_global, new.num_clients)

    def serve(theta_hat, global_params, key, splits: ClientSplits):
      fedora_key, fedavg_key = jax.random.split(key)
      # Step 4-5 with the client's own model = its auxiliary model.
      tuned = finetune.client_update(theta_hat, theta_hat, splits, fedora_key).state
      global_tuned, _ = finetune_trainer.train(global_params, splits.train, fedavg_key)
      test = lambda params: finetune_trainer.evaluate(params, splits.test).score
      return (test(theta_hat), test(tuned), test(global_params), test(global_tuned))

    return map_over_buckets(serve, (auxiliary, global_models,
                                    client_keys(key, new.num_clients)),
                            new_buckets, new.client_ids, new.num_clients)

  # A few clients, once: on one device. (The trained state comes back replicated over the
  # run's mesh; a jit over those CPU devices hung in the SVDs of this step.)
  fedora_state, fedavg_global = jax.device_get((fedora_state, fedavg_global))
  accuracies = run(fedora_state, trained.buckets, new.buckets, fedavg_global, key)
  return NewClientAccuracy(*(np.asarray(a) for a in accuracies))
