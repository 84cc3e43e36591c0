"""The interface every algorithm implements: a NamedTuple of pure functions.

An algorithm keeps a `server` state (no client axis) and a `clients` state whose leaves
carry a leading client axis [K, ...]. A round is

  messages = broadcast(server, clients)                     # server side, stacked [K, ...]
  out_k = client_update(clients_k, messages_k, data_k, key_k)   # ONE client, a ClientOutput;
                                                                 # the engine vmaps it
  server, clients = aggregate(server, clients, uploads, weights)   # server side, stacked
  evaluated = personalized_params(server, clients)          # [K, ...] model each client uses
                                                            # (scored by `evaluate` if set)

`shared_model` and `uploads_unordered` (optional) let the engine skip [K, ...] copies that
FedAvg-like algorithms never need; results are the same up to summation order.
`ala_hooks`, `shared_part` and `upload_mean` (optional) declare what the plug-ins need to
wrap the algorithm (plugin_fields.py).

Algorithm files never loop over clients and never call `jit`; the engine does both
(vmapping `client_update` over each size bucket, jitting the whole round once).
"""

from typing import Any, Callable, NamedTuple

import jax

from fedora_jax.algorithms.plugin_fields import AlaHooks, SharedPart, UploadMean
from fedora_jax.data.client_data import ClientData, ClientSplits, FederatedData
from fedora_jax.engine.local_training import ClientTrainer, EvalStats, TrainStats

Params = Any
PyTree = Any


class AlgorithmState(NamedTuple):
  server: PyTree   # no client axis
  clients: PyTree  # leaves [K, ...]


class InitContext(NamedTuple):
  """What an algorithm may look at when it starts (once per run, outside the round)."""
  params: Params            # the shared initial model, stacked [K, ...]
  data: FederatedData       # client data, bucketed (FEDORA reads its subspaces from it)
  trainer: ClientTrainer
  key: jax.Array


class ClientOutput(NamedTuple):
  """What one client's update returns."""
  state: PyTree                 # the client's new state
  upload: PyTree                # what it sends to the server (() if nothing)
  train: TrainStats             # its local-training statistics
  metrics: dict[str, jax.Array] = {}  # algorithm-specific scalars, e.g. FEDORA's lambda


class Algorithm(NamedTuple):
  name: str
  init: Callable[[InitContext], AlgorithmState]
  broadcast: Callable[[PyTree, PyTree], PyTree]
  client_update: Callable[[PyTree, PyTree, ClientSplits, jax.Array], ClientOutput]
  aggregate: Callable[[PyTree, PyTree, PyTree, jax.Array], AlgorithmState]
  personalized_params: Callable[[PyTree, PyTree], Params]
  # Extra arrays worth saving with the results (e.g. FEDORA's similarity matrix).
  artifacts: Callable[[PyTree], dict[str, jax.Array]] = lambda server: {}
  # One client's evaluation of what personalized_params returns, where that is more than
  # a model of the run (FedCP's gated heads; built with trainer.evaluate_with).
  # None: trainer.evaluate.
  evaluate: Callable[[PyTree, ClientData], EvalStats] | None = None
  # Where scoring a client reads its other splits beside the one scored (kNN-Per: a
  # datastore of its training representations, its mixing weight picked on validation):
  # evaluate_splits(model, splits, names) -> one EvalStats per split name, in place of
  # `evaluate`.
  evaluate_splits: Callable[[PyTree, ClientSplits, tuple[str, ...]],
                            tuple[EvalStats, ...]] | None = None
  # Where every client's personalized model is one and the same (FedAvg's global model):
  # that model, from the server state. The engine then scores it on every client's data
  # without stacking K copies of it (what lets a run hold 10,000 clients in memory).
  shared_model: Callable[[PyTree], Params] | None = None
  # True where `aggregate` takes only weighted sums over the uploads, in any order, and
  # reads no client state beside them: at participation < 1 the engine then hands it the
  # sampled slots' uploads and weights [S, ...] (fillers weigh 0) in place of a [K, ...]
  # scatter that is zero for every client that sat the round out.
  uploads_unordered: bool = False
  # Where ALA (--ala) finds the global model the client receives; None: not an ALA host.
  ala_hooks: AlaHooks | None = None
  # Where ConFREE (--aggregation=confree) finds the server's shared part; None: not a
  # ConFREE host.
  shared_part: SharedPart | None = None
  # Where DP (--dp_*) finds the model the clients receive, in a host whose server reads
  # their uploads only through their mean; None: not a DP host.
  upload_mean: UploadMean | None = None
  # Where the server reads a client's state instead of (or besides) its upload (FEDORA's
  # and FedFomo's models, kept in the stacked client state): the part of ONE client's new
  # state it reads, counted as uploaded in the round's bytes (communication.py).
  state_upload: Callable[[PyTree], PyTree] | None = None
  # Where what a client receives depends on which clients the round samples (FedCross
  # deals its middleware models out among them): broadcast(server, clients, sampled),
  # sampled [K] bool, in place of `broadcast` in the round (`broadcast` is this with
  # every client sampled).
  sampled_broadcast: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None
  # Where every client trains every round and the server reads only the sampled ones'
  # uploads (pFedMe's Algorithm 1): at participation < 1 the round trains all K clients
  # (each keeps its new state) and aggregates the sampled ones alone (the others weigh
  # 0 and upload zeros). Not with `uploads_unordered`.
  trains_unsampled: bool = False
  # divergence_hint(extra, round) -> a line saying why a round whose loss went NaN/Inf
  # diverged, read from the round's [K] `extra` metrics (DP: its noise swamped the
  # model), or None: the run's error then says to lower --lr.
  divergence_hint: Callable[[dict, int], str | None] | None = None
  # Where a message carries samples every client holds from the start (a public set,
  # data/public.py, of which only indices would travel): that part of the [K, ...]
  # messages, left out of the round's bytes down (communication.py).
  preshared: Callable[[PyTree], PyTree] | None = None


class RoundCost(NamedTuple):
  """What a round computes beyond training the sampled clients and scoring every client
  once (benchmarks/measure.py counts FLOPs from it): validation passes over a trained
  client's data, and model-sized multiply-adds per ordered pair of clients on the server."""
  extra_validation_passes: int = 0
  server_pair_products: int = 0


def no_round_cost(config: Any) -> RoundCost:
  del config
  return RoundCost()


def no_broadcast(server, clients):
  """For algorithms whose server sends nothing (e.g. LOCAL)."""
  del server, clients
  return ()


def keep_states(server, clients, uploads, weights) -> AlgorithmState:
  """For algorithms whose server does nothing with the uploads."""
  del uploads, weights
  return AlgorithmState(server=server, clients=clients)
