"""Check (a) of the verification: one round of an algorithm here and in PFLlib (two where
the first cannot show it), from the same initial model and the same batches, on a small
real split; the server's model and every client's scored model compared, and each
client's test accuracy.

The split: K MNIST clients of `train_size` training images (a multiple of the batch size:
PFLlib drops a last partial batch, the engine does not), disjoint slices of the official
training set, each with its own test slice. The model: our MLP with one hidden layer of
100, PFLlib's DNN (784-100-10; its log_softmax before the cross-entropy changes neither
the loss nor the gradient). Client SGD without momentum or weight decay, PFLlib's.
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import itertools
import os
import random
import tempfile
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax import algorithms
from fedora_jax.algorithms import ala, fedcp, perfedavg
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.data.sources import load_mnist
from fedora_jax.algorithms import fedas
from fedora_jax.algorithms import fedfomo
from fedora_jax.engine.local_training import (epoch_batches, make_client_trainer,
                                              make_optimizer)
from fedora_jax.models import build_model
from fedora_jax.rounds import client_keys, num_sampled_clients, sampled_clients
from fedora_jax.simulation import (TrainConfig, initial_model, jitted_init, root_keys,
                                   run_algorithm)
from verification import ala_hosts, bridges, pfedla_driver, twins

HIDDEN = 100


class Setting(NamedTuple):
  clients: int = 4
  train_size: int = 200
  test_size: int = 100
  batch_size: int = 10
  local_epochs: int = 1
  lr: float = 0.05
  seed: int = 0


class Comparison(NamedTuple):
  algorithm: str
  reference: str               # the reference's classes, repository@commit
  rounds: int
  max_relative_error: float    # over every compared tensor: max |ours - ref| / max |ref|
  accuracy_gap: float          # max over clients of |our test accuracy - the reference's|
  ours_accuracy: list[float]
  reference_accuracy: list[float]
  seed: int = 0                # the seed it ran at (Reference.seed, else the setting's)


def real_clients(setting: Setting) -> list[Client]:
  """Disjoint slices of MNIST's official training and test sets, one per client."""
  mnist = load_mnist()
  x_train, y_train, x_test, y_test = mnist.x_train, mnist.y_train, mnist.x_test, mnist.y_test
  validation = setting.clients * setting.train_size  # 20 more training images a client
  clients = []
  for k in range(setting.clients):
    train = slice(k * setting.train_size, (k + 1) * setting.train_size)
    val = slice(validation + 20 * k, validation + 20 * (k + 1))
    test = slice(k * setting.test_size, (k + 1) * setting.test_size)
    clients.append(Client(x_train[train], y_train[train], x_train[val], y_train[val],
                          x_test[test], y_test[test]))
  return clients


def relative_error(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
  return max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
             for a, b in zip(ours, theirs))


def _pfllib_args(setting: Setting, algorithm: str, torch_model, **extra) -> argparse.Namespace:
  """The attributes PFLlib's server and clients read (its main.py's defaults where the
  check does not set them)."""
  values = dict(
      goal="verify", device="cpu", device_id="0", dataset="verify", num_classes=10,
      model=torch_model, batch_size=setting.batch_size,
      local_learning_rate=setting.lr, learning_rate_decay=False,
      learning_rate_decay_gamma=0.99, global_rounds=1, top_cnt=100,
      local_epochs=setting.local_epochs, algorithm=algorithm, join_ratio=1.0,
      random_join_ratio=False, num_clients=setting.clients, prev=0, times=1, eval_gap=1,
      save_folder_name="items", auto_break=False, dlg_eval=False, dlg_gap=100,
      batch_num_per_client=2, num_new_clients=0, fine_tuning_epoch_new=0,
      feature_dim=512, vocab_size=80, max_len=200, few_shot=0, client_drop_rate=0.0,
      train_slow_rate=0.0, send_slow_rate=0.0, time_select=False, time_threthold=10000,
      mu=0.0,
      # PFLlib a41f7ba's names: its local_steps are epochs; its DP switch.
      local_steps=setting.local_epochs, privacy=False, dp_sigma=0.0)
  values.update(extra)
  return argparse.Namespace(**values)


@contextlib.contextmanager
def _working_directory(path: str):
  previous = os.getcwd()
  os.chdir(path)
  try:
    yield
  finally:
    os.chdir(previous)


def _torch_accuracy(torch_model, client: Client) -> float:
  import torch  # pylint: disable=import-outside-toplevel
  torch_model.eval()  # BatchNorm on its running averages, as PFLlib's test_metrics
  with torch.no_grad():
    logits = torch_model(torch.from_numpy(bridges.model_inputs(client.x_test)))
  return float(np.mean(logits.argmax(1).numpy() == client.y_test))


# pFedLA's row runs KarhouTam/pFedLA's server and client (verification/pfedla_driver.py),
# not a PFLlib server: its Reference.server.
PFEDLA = "pFedLA"
PFEDLA_COMMIT = "c8b505c"


class Reference(NamedTuple):
  """How one algorithm runs in PFLlib, and which of our settings matches it."""
  server: str                  # module.Class under flcore/servers/
  client_file: str             # its client's file under flcore/clients/
  # The client's methods a round calls, in order; a function (client) -> None where a
  # step is more than one call (Per-FedAvg's scoring: adapt a copy, keep it, restore).
  steps: tuple[str | Callable[[Any], None], ...]
  # The keys of our client's trainer.train calls, in the order the steps train.
  trainings: Callable[[jax.Array], list[jax.Array]]
  aggregates: bool             # whether the server averages uploaded models
  # The client's attribute holding its scored model, or a function (client) -> the
  # scored model where none holds it (FedRoD: generic head plus personal head).
  personal: str | Callable[[Any], Any] | None
  config: dict                 # our algorithm's config fields
  args: dict                   # PFLlib's arguments
  # PyTorch's model split as PFLlib's main.py splits it for this algorithm: its last
  # layer the head (BaseHeadSplit), the rest the base.
  split: bool = False
  # Whether the server's model is compared: not where it holds only a part (the scored
  # models hold that part too).
  compare_server: bool = True
  # Rounds compared: more than one where the first cannot show the algorithm (APFL's
  # two models are equal through its first round, so alpha changes nothing there).
  rounds: int = 1
  # Our local epochs where they count differently from PFLlib's (FedRep: ours include
  # the head's, PFLlib's --local_epochs are the body's alone); None: the setting's.
  our_epochs: int | None = None
  # Whether the client's model is read after the next send_models, where PFLlib's
  # evaluation reads it; False: right after its training (see pFedMe).
  scored_after_send: bool = True
  # Where the client's data loaders differ from one per training (another batch size,
  # one loader an epoch): (client key, n, our epochs, batch size) -> the epochs of each
  # loader the steps ask for, in order. None: `trainings`, each the setting's batches.
  loads: Callable[[jax.Array, int, int, int], list[list[np.ndarray]]] | None = None
  # Another model each client holds, compared too: (ours from our algorithm and its
  # final state, [K, ...]; the reference's from its client) (FedAMP's cloud models).
  also: tuple[Callable[[Any, Any], Any], Callable[[Any], Any]] | None = None
  # Whether the server's send_models takes the round index (FedPHP's: its mu ramp).
  send_takes_round: bool = False
  # The global model in our server's state (SCAFFOLD's and FedDyn's hold more).
  server_model: Callable[[Any], Any] = lambda server: server
  # The server's methods a round calls after receive_models, in order (FedDyn's train()
  # updates its state h first); a function (server) -> None where a step is more than
  # one call (FedProto's: receive, aggregate and send prototypes).
  server_steps: tuple[str | Callable[[Any], None], ...] = ("aggregate_parameters",)
  # Whether a round starts with the server's send_models: not where the server sends
  # no model (FedProto's sends prototypes, in its server_steps).
  sends: bool = True
  # The reference's own scoring, (client, its data) -> test accuracy, where its scored
  # model is not a classifier's forward (FedProto: the nearest global prototype).
  accuracy: Callable[[Any, Client], float] | None = None
  # Our registry name where the row's differs (FedALA's other rows).
  algorithm: str | None = None
  # (the reference's server, the setting, the clients) -> None, once the server is
  # built: what its clients draw beside the batches, fed ours (FedALA: ALA's slice).
  prepare: Callable[[Any, Any, list[Client]], None] | None = None
  # Whether `also`'s first function takes our state a round earlier too, (algorithm,
  # state, earlier state) (FedALA's theta_hat, built from the last round's models).
  also_previous: bool = False
  # Where the server trains its clients while it is built (FedDBE's initialization
  # period): (client k's key from our algorithm key, n, our epochs, batch size) -> the
  # epochs of each loader the client asks for then, in order (ours: algorithm.init's).
  built_loads: Callable[[jax.Array, int, int, int], list[list[np.ndarray]]] | None = None
  # (the reference's server, our state after init) -> None: puts into the reference what
  # our init draws beside the model (GPFL's category embeddings and valve); None: nothing.
  load_initial: Callable[[Any, Any], None] | None = None
  # The model in our personalized_params that `personal` is compared with, where they
  # hold more than a model (GPFL: its valve and conditional input beside it).
  our_personal: Callable[[Any], Any] = lambda personal: personal
  # The clients of the check where the algorithm needs others than real_clients' (FedGC:
  # clients that lack classes): setting -> clients.
  clients: Callable[[Setting], list[Client]] | None = None
  # Our model and its PyTorch twin where the row runs on another model than the MLP
  # (FedBN: BatchNorm); None: the MLP (PFLlib's DNN, or _mlp_twin where split).
  twin: twins.Twin | None = None
  # Our run's --client_weights: "samples" (PFLlib's n_k) or "uniform" (1 a client).
  client_weights: str = "samples"
  # The share of clients a round trains (our --participation); PFLlib's selected clients
  # set to ours each round (rounds.sampled_clients). 1: every client.
  participation: float = 1.0
  # Where the reference scores EVERY client through a step of its own after its last
  # send_models (Per-FedAvg's evaluate_one_step: every client adapts the latest global
  # model): that step, (client) -> None, and (our final state, the setting, the
  # clients) -> [client][load][epoch] the batches it reads (ours). None: no such step.
  final_step: Callable[[Any], None] | None = None
  final_loads: Callable[[Any, Setting, list[Client]], list] | None = None
  # The split final_loads index and final_step reads (its client's load_<split>_data):
  # "train", or "test" (PFLlib a41f7ba's Per-FedAvg adapts on test batches).
  final_split: str = "train"
  # The PFLlib snapshot the row runs (bridges.PFLLIB_SNAPSHOTS): its head, or the commit
  # behind FedALA's table.
  snapshot: str = "PFLlib"
  # The seed (initial model, batches) where the row's would meet a tie: a pre-activation
  # within float32's rounding of ReLU's zero, on whose side the two codes' rounding
  # decides. None: the setting's.
  seed: int | None = None
  # ALA's config (ala.AlaConfig's fields) where the row runs its algorithm under --ala (ALA
  # on its hosts); None: no plug-in.
  ala: dict | None = None


_MLP = twins.Twin("mlp", None, bridges.dense_stack_to_torch, bridges.load_linear_layers,
                  bridges.torch_linear_layers)


def _own_key(key: jax.Array) -> list[jax.Array]:
  return [key]


def _ditto_keys(key: jax.Array) -> list[jax.Array]:
  """Ours splits (global, personal); PFLlib trains the personal model first."""
  global_key, personal_key = jax.random.split(key)
  return [personal_key, global_key]


def _rod_personalized(client):
  """PFLlib's FedRoD scores the generic head's logits plus the personal head's: on a
  linear head, one model whose head is their sum."""
  import torch  # pylint: disable=import-outside-toplevel
  model = copy.deepcopy(client.model)
  with torch.no_grad():
    for summed, personal in zip(model.head.parameters(), client.head.parameters()):
      summed.add_(personal)
  return model


def _peravg_loads(key: jax.Array, n: int, epochs: int, batch_size: int
                  ) -> list[list[np.ndarray]]:
  """Per-FedAvg's loaders: the scoring's batch of B (our adaptation's), then one loader
  an epoch (PFLlib's server calls train() once an epoch) of batches of 2B, each its D
  followed by its D' (ours deals a chunk of 2B in turn to D and D'; PFLlib cuts a batch
  of 2B in halves)."""
  train_key, adapt_key = jax.random.split(key)
  meta = bridges.shuffled_epochs(train_key, n, epochs, 2 * batch_size)
  return [[bridges.shuffle(adapt_key, n, batch_size)]] + [
      [np.concatenate([chunks[:, 0::2], chunks[:, 1::2]], axis=1)] for chunks in meta]


def _peravg_score(client) -> None:
  """PFLlib's evaluate_one_step for one client: one step from the received model on a
  training batch, that adapted copy kept as the scored model, the model restored."""
  received = copy.deepcopy(client.model)
  client.train_one_step()
  client.adapted = copy.deepcopy(client.model)
  client.clone_model(received, client.model)


def _peravg_latest_loads(key: jax.Array, n: int, epochs: int, batch_size: int
                         ) -> list[list[np.ndarray]]:
  """Per-FedAvg scored as PFLlib scores it (our evaluation latest): one loader an epoch
  of batches of 2B as _peravg_loads, no scoring batch in the round (the client key
  trains alone; every client is scored after the last send_models)."""
  return [[np.concatenate([chunks[:, 0::2], chunks[:, 1::2]], axis=1)]
          for chunks in bridges.shuffled_epochs(key, n, epochs, 2 * batch_size)]


def _peravg_final_loads(state, setting: Setting, clients: list[Client]) -> list:
  """Each client's adaptation batch of our final state (perfedavg.adaptation_keys): the
  one loader PFLlib's evaluate_one_step reads."""
  keys = perfedavg.adaptation_keys(state.server, jnp.arange(len(clients)))
  return [[[bridges.shuffle(keys[k], len(c.x_train), setting.batch_size)]]
          for k, c in enumerate(clients)]


def _peravg_row_data(split: str):
  """(setting, trainer, the [K] stacked `split`) of the Per-FedAvg rows: the row's clients
  (real_clients of the default Setting) and the MLP, as our runs of the rows train them."""
  setting = Setting()
  data = stack_clients(real_clients(setting), num_classes=10)
  model = build_model("mlp", 10, (HIDDEN,))
  trainer = make_client_trainer(model.apply, make_optimizer(setting.lr, 0.0, 0.0), 1,
                                setting.batch_size)
  return setting, trainer, jax.tree.map(jnp.asarray, getattr(data.buckets[0], split))


def _peravg_ours_adapted(personal: perfedavg.Adaptable):
  """Our scored models under evaluation latest: each client's step from the latest
  global model on its adaptation batch (what its evaluate_splits scores)."""
  setting, trainer, bucket = _peravg_row_data("train")
  alpha = REFERENCES["perfedavg_sampled"].config["alpha"]
  adapt = jax.vmap(lambda model_k, train_k, key_k: perfedavg.adapt(
      trainer.loss, alpha, model_k, train_k, key_k, setting.batch_size))
  return adapt(personal.model, bucket, personal.key)


def _peravg_final_test_loads(state, setting: Setting, clients: list[Client]) -> list:
  """PFLlib a41f7ba's scoring batches: each client's two test batches of our final state
  (perfedavg.adapt_on_test's draw), the one test loader its train_one_step reads."""
  keys = perfedavg.adaptation_keys(state.server, jnp.arange(len(clients)))
  return [[[np.asarray(epoch_batches(keys[k], np.ones(len(c.x_test), bool), len(c.x_test),
                                     setting.batch_size, 2)[0])]]
          for k, c in enumerate(clients)]


def _peravg_ours_tested(personal: perfedavg.Adaptable):
  """Our scored models under evaluation test: each client's two steps from the latest
  global model on its test batches (as _peravg_ours_adapted)."""
  setting, trainer, bucket = _peravg_row_data("test")
  config = perfedavg.PerFedAvgConfig(**REFERENCES["perfedavg_a41f7ba"].config)
  adapt = jax.vmap(lambda model_k, test_k, key_k: perfedavg.adapt_on_test(
      trainer.loss, config, model_k, test_k, key_k, setting.batch_size))
  return adapt(personal.model, bucket, personal.key)


def _amp_ours_cloud(algorithm, state):
  """Our FedAMP's cloud models u_i as its next broadcast sends them."""
  return algorithm.broadcast(state.server, state.clients).cloud_model


def _amp_cloud(client):
  return client.client_u


def _global_params(server):
  return server.params


def _php_ours_hpm(algorithm, state):
  del algorithm
  return state.clients.hpm


def _php_hpm(client):
  return client.model_p


def _proto_server_step(server) -> None:
  """FedProto's server after its clients train (serverproto.py's train()): receive the
  prototypes, average them, send them."""
  import flcore.servers.serverproto as serverproto  # pylint: disable=import-outside-toplevel
  server.receive_protos()
  server.global_protos = serverproto.proto_aggregation(server.uploaded_protos)
  server.send_protos()


def _proto_personalized(client):
  """The client's model with the nearest-prototype classifier ours scores with: kernel
  2 C^T, bias -||C_c||^2 from the global prototypes it received (fedproto.prototype_head)."""
  import torch  # pylint: disable=import-outside-toplevel
  model = copy.deepcopy(client.model)
  with torch.no_grad():
    for label, prototype in client.global_protos.items():
      model.head.weight[label] = 2.0 * prototype
      model.head.bias[label] = -torch.sum(prototype * prototype)
  return model


def _pfllib_accuracy(client, data: Client) -> float:
  """The client's own PFLlib scoring (its test_metrics: FedProto's and GPFL's by
  prototypes, FedGC's over the client's classes) on the client's test set."""
  import torch  # pylint: disable=import-outside-toplevel
  client.load_test_data = lambda batch_size=None: [
      (torch.from_numpy(bridges.model_inputs(data.x_test)),
       torch.from_numpy(data.y_test.astype(np.int64)))]
  correct, count, _ = client.test_metrics()
  return correct / count


def _proto_ours_model(algorithm, state):
  del algorithm
  return state.clients.params


def _proto_model(client):
  return client.model


def _dbe_built_loads(key: jax.Array, n: int, epochs: int, batch_size: int
                     ) -> list[list[np.ndarray]]:
  """FedDBE's client while built: a loader it reads one batch of (the representation's
  shape), then the initialization period's training (ours: trainer.train from its key)."""
  training = bridges.shuffled_epochs(key, n, epochs, batch_size)
  return [training, training]


def _dbe_personalized(client):
  """PFLlib's FedDBE scores head(base(x) + client_mean): on a linear head, one model whose
  head bias is b + W client_mean (feddbe.shifted_head)."""
  import torch  # pylint: disable=import-outside-toplevel
  model = copy.deepcopy(client.model)
  with torch.no_grad():
    model.head.bias.add_(model.head.weight @ client.client_mean)
  return model


def _dbe_server_model(server):
  return server.model


def _gpfl_load_initial(server, state) -> None:
  """Our initial category embeddings and valve into every PFLlib client (its GCE, the
  GCE_frozen copy, its CoV)."""
  import torch  # pylint: disable=import-outside-toplevel
  valve = jax.tree.map(lambda a: torch.from_numpy(np.asarray(a).copy()), state.server.valve)
  embeddings = torch.from_numpy(np.asarray(state.server.embeddings).copy())
  with torch.no_grad():
    for client in server.clients:
      for gce in (client.GCE, client.GCE_frozen):
        gce.embedding.weight.copy_(embeddings)
      for branch, ours in ((client.CoV.Conditional_gamma, valve["gamma"]),
                           (client.CoV.Conditional_beta, valve["beta"])):
        branch[0].weight.copy_(ours["kernel"].T)
        branch[0].bias.copy_(ours["bias"])
        branch[2].weight.copy_(ours["scale"])
        branch[2].bias.copy_(ours["offset"])


def _gpfl_ours_valve(algorithm, state):
  """Our valve's two Linear layers, every client's copy (the global one)."""
  del algorithm
  valve = state.server.valve
  layers = {"params": {f"Dense_{i}": {"kernel": valve[b]["kernel"], "bias": valve[b]["bias"]}
                       for i, b in enumerate(("gamma", "beta"))}}
  return jax.tree.map(lambda a: np.broadcast_to(a, (len(state.clients.class_shares),)
                                                + a.shape), layers)


def _gpfl_valve(client):
  return client.CoV


def _gpfl_server_model(server):
  return server.body


def _cac_server_step(server) -> None:
  """FedCAC's server after its clients train: its round counter (train() sets it), the
  FedAvg, then send_models, which builds the customised models from round 1 on."""
  server.epoch += 1
  server.aggregate_parameters()
  server.send_models()


def _cac_server_model(server):
  return server.model


def _as_loads(key: jax.Array, n: int, epochs: int, batch_size: int
              ) -> list[list[np.ndarray]]:
  """FedAS's loaders: set_parameters' (its prototypes from one batch of every sample,
  then the alignment's epoch of 16s, the last partial as ours), train's, the Fisher
  trace's epoch (fedas.client_update's keys)."""
  align_key, train_key, fisher_key = jax.random.split(key, 3)
  align_batch = fedas.FedAsConfig().align_batch_size
  indices, weights = epoch_batches(jax.random.split(align_key, 1)[0], np.ones(n, bool), n,
                                   align_batch, -(-n // align_batch))
  align = [i[w > 0] for i, w in zip(np.asarray(indices), np.asarray(weights))]
  return [[[np.arange(n)], align], bridges.shuffled_epochs(train_key, n, epochs, batch_size),
          [bridges.shuffle(fisher_key, n, batch_size)]]


def _as_attach_server(server, state) -> None:
  """Each PFLlib client reaches its server's global model (our steps receive it)."""
  del state
  for client in server.clients:
    client.fedas_server = server


def _as_receive(client) -> None:
  """FedAS's send_selected_models for one client: the global model aligned, its base
  taken."""
  client.set_parameters(copy.deepcopy(client.fedas_server.global_model), 0.0)


def _as_train(client) -> None:
  client.train(True)


def _gh_loads(key: jax.Array, n: int, epochs: int, batch_size: int
              ) -> list[list[np.ndarray]]:
  """FedGH's loaders: train's, then collect_protos' (any batches: class means)."""
  return [bridges.shuffled_epochs(key, n, epochs, batch_size),
          [np.arange(n).reshape(-1, batch_size)]]


def _da_loads(key: jax.Array, n: int, epochs: int, batch_size: int
              ) -> list[list[np.ndarray]]:
  """PFL-DA's one loader: the head phase's epochs, then the extractor phase's
  (pflda.client_update's two keys)."""
  head_key, body_key = jax.random.split(key)
  return [bridges.shuffled_epochs(head_key, n, epochs, batch_size)
          + bridges.shuffled_epochs(body_key, n, epochs, batch_size)]


def _fd_server_step(server) -> None:
  """FD's server after its clients train: receive, average and send the logits."""
  import flcore.servers.serverfd as serverfd  # pylint: disable=import-outside-toplevel
  server.receive_logits()
  server.global_logits = serverfd.proto_aggregation(server.uploaded_logits)
  server.send_logits()


def _gh_attach_key(server, state) -> None:
  """Our server's shuffle key, for the batches of its header training."""
  server.gh_key = np.asarray(state.server.key)


def _gh_server_step(server) -> None:
  """FedGH's receive_protos, then train_head's epoch of SGD on the (prototype, class)
  pairs in our batches: slot i C + c for client i's class c, shuffled as
  fedgh.aggregate shuffles them (its server key folded with the round)."""
  import torch  # pylint: disable=import-outside-toplevel
  server.receive_protos()
  round_index = getattr(server, "gh_round", 0)
  server.gh_round = round_index + 1
  num_classes = server.num_classes
  slots = {client.id * num_classes + label: (proto, label)
           for client in server.selected_clients for label, proto in client.protos.items()}
  mask = np.zeros(len(server.clients) * num_classes, bool)
  mask[list(slots)] = True
  key = jax.random.fold_in(jax.random.wrap_key_data(server.gh_key), round_index)
  indices, weights = epoch_batches(jax.random.split(key, 1)[0], mask, int(mask.sum()),
                                   server.batch_size, -(-mask.size // server.batch_size))
  for batch, real in zip(np.asarray(indices), np.asarray(weights) > 0):
    if not real.any():
      continue
    protos = torch.stack([slots[int(i)][0] for i in batch[real]])
    labels = torch.tensor([slots[int(i)][1] for i in batch[real]], dtype=torch.int64)
    loss = server.CEloss(server.head(protos), labels)
    server.opt_h.zero_grad()
    loss.backward()
    server.opt_h.step()


# FedALA's ALA in the authors' form: s 80, their layer_idx 2 (the head's weight and bias:
# our p 1), eta 1, threshold 0.1 over 10 losses, W learned on a contiguous slice in
# stored order with the last batch's loss (ala.py: sample, epoch_loss), batches of the
# setting's batch size (PFLlib's ALA takes its client's).
ALA_CONFIG = {"s": 80.0, "p": 1, "eta": 1.0, "batch_size": 10, "sample": "slice",
              "epoch_loss": "last"}
ALA_ARGS = {"rand_percent": 80, "layer_idx": 2, "eta": 1.0}


def ala_host_key(key: jax.Array) -> jax.Array:
  """ala.with_ala hands its host the second of its client key's two halves."""
  return jax.random.split(key)[1]


def _ala_keys(key: jax.Array) -> list[jax.Array]:
  """The keys of a client's trainings under ALA: its host's (ala_host_key)."""
  return [ala_host_key(key)]


def _ala_prepare(server, setting: Setting, clients: list[Client], threshold: float = 0.1
                 ) -> None:
  """Each PFLlib client's ALA slices our slice each round (bridges.SliceAt), its print
  of the epochs W trained kept in `ala_printed`, not shown; its threshold set (PFLlib's
  client passes none: its ALA's default 0.1)."""
  data = stack_clients(clients, num_classes=10)
  train_key, s = root_keys(setting.seed)["train"], ALA_CONFIG["s"]
  for client in server.clients:
    size = int(ala.sample_size(s, len(client.ALA.train_data)))
    client.ALA.train_data = bridges.SliceAt(
        client.ALA.train_data,
        lambda r, k=client.id: bridges.ala_slice_start(train_key, r, data, k, s), size)
    client.ALA.threshold = threshold
    client.ala_printed = []

    def quiet(model, client=client, original=client.local_initialization):
      with contextlib.redirect_stdout(io.StringIO()) as printed:
        original(model)
      client.ala_printed.append(printed.getvalue())
    client.local_initialization = quiet


def _ala_keep(client) -> None:
  """theta_hat (the model ALA leaves the client) and W, kept before it trains."""
  client.theta_hat = copy.deepcopy(client.model)
  client.ala_weights = [w.clone() for w in client.ALA.weights or ()]


def _ala_ours(algorithm, state, earlier):
  """Each client's theta_hat as ala.with_ala builds it (from the last round's local and
  global models and this round's W), then W as one more layer."""
  del algorithm
  theta_hat = jax.vmap(ala.aggregate_locally, in_axes=(0, None, 0))(
      earlier.clients.local, earlier.server, state.clients.weights)
  return {"params": {**theta_hat["params"],
                     "Dense_2": state.clients.weights["params"]["Dense_1"]}}


def _ala_theirs(client):
  """theta_hat's layers, then W (over the layer layer_idx 2 names) as one more Linear."""
  import torch  # pylint: disable=import-outside-toplevel
  out_features, in_features = client.ala_weights[0].shape
  weights = torch.nn.Linear(in_features, out_features)
  with torch.no_grad():
    weights.weight.copy_(client.ala_weights[0])
    weights.bias.copy_(client.ala_weights[1])
  return torch.nn.ModuleList([client.theta_hat, weights])



class _OurGumbel:
  """Stands in for torch.nn.functional in PFLlib's servercp, whose ConditionalSelection
  draws F.gumbel_softmax: within a client's training, step s's noise is ours
  (`noise(client, round, s, shape)`); outside training, none (ours scores the policy
  without noise). The softmax of (logits + noise) / tau is torch's gumbel_softmax."""

  def __init__(self, functional, noise: Callable[[int, int, int, tuple], np.ndarray]):
    self.functional, self.noise = functional, noise
    self.source, self.step = None, 0

  def __getattr__(self, name: str):
    return getattr(self.functional, name)

  def gumbel_softmax(self, logits, dim=-1, tau=1.0, hard=False):
    import torch  # pylint: disable=import-outside-toplevel
    assert not hard and dim == 1, (hard, dim)
    noise = 0.0
    if self.source is not None:
      noise = torch.from_numpy(self.noise(*self.source, self.step, tuple(logits.shape)))
      self.step += 1
    return torch.softmax((logits + noise) / tau, dim)


def _cp_keys(key: jax.Array) -> list[jax.Array]:
  """fedcp's client_update splits its key into the noise's and the training's."""
  return [jax.random.split(key)[1]]


def _cp_prepare(server, setting: Setting, clients: list[Client]) -> None:
  """PFLlib's FedCP drawing our Gumbel noise (_OurGumbel: fedcp.step_noise from the key
  our client k gets in round r, split as fedcp's client_update splits it, the noise's
  first), each client's train_cs_model marking whose steps run (its print not shown)."""
  import torch  # pylint: disable=import-outside-toplevel
  from flcore.servers import servercp  # pylint: disable=import-outside-toplevel
  train_key = root_keys(setting.seed)["train"]

  def noise(k: int, r: int, step: int, shape: tuple) -> np.ndarray:
    key = client_keys(jax.random.fold_in(train_key, r), len(clients))[k]
    return np.array(fedcp.step_noise(jax.random.split(key)[0], jnp.float32(step), shape))
  gumbel = _OurGumbel(torch.nn.functional, noise)
  servercp.F = gumbel
  for client in server.clients:
    client.rounds_trained = 0

    def train(client=client, original=client.train_cs_model):
      gumbel.source, gumbel.step = (client.id, client.rounds_trained), 0
      with contextlib.redirect_stdout(io.StringIO()):
        original()
      gumbel.source = None
      client.rounds_trained += 1
    client.train_cs_model = train


def _cp_load_initial(server, state) -> None:
  """Our initial CPN (Linear and LayerNorm) and each client's context c_i into PFLlib's
  clients (theirs: torch's init and torch.rand)."""
  import torch  # pylint: disable=import-outside-toplevel
  policy = jax.tree.map(lambda a: torch.from_numpy(np.asarray(a).copy()), state.server.policy)
  with torch.no_grad():
    for client in server.clients:
      linear, norm = client.model.gate.cs.fc[0], client.model.gate.cs.fc[1]
      linear.weight.copy_(policy["kernel"].T)
      linear.bias.copy_(policy["bias"])
      norm.weight.copy_(policy["scale"])
      norm.bias.copy_(policy["offset"])
      client.context = torch.from_numpy(np.asarray(state.clients.context[client.id])[None].copy())


def _cp_ours_more(algorithm, state):
  """Each client's h_g, CPN Linear, LayerNorm (scale as a [1, 2d] kernel) and c_i (a
  [1, d] kernel), as Dense layers in that order."""
  del algorithm
  clients = state.clients
  head = list(clients.global_head["params"])[0]
  policy = clients.policy
  return {"params": {
      "Dense_0": clients.global_head["params"][head],
      "Dense_1": {"kernel": policy["kernel"], "bias": policy["bias"]},
      "Dense_2": {"kernel": policy["scale"][:, None, :], "bias": policy["offset"]},
      "Dense_3": {"kernel": clients.context[:, None, :],
                  "bias": jnp.zeros_like(clients.context)}}}


def _cp_theirs_more(client):
  """The same of PFLlib's client: head_g, its cs's Linear, LayerNorm and context."""
  import torch  # pylint: disable=import-outside-toplevel
  norm = client.model.gate.cs.fc[1]
  scale = torch.nn.Linear(1, norm.weight.shape[0])
  context = torch.nn.Linear(1, client.context.shape[1])
  with torch.no_grad():
    scale.weight.copy_(norm.weight[:, None])
    scale.bias.copy_(norm.bias)
    context.weight.copy_(client.context.T)
    context.bias.zero_()
  return torch.nn.ModuleList([client.model.head_g, client.model.gate.cs.fc[0], scale,
                              context])


def _fomo_loads(key: jax.Array, n: int, epochs: int, batch_size: int
                ) -> list[list[np.ndarray]]:
  """FedFomo's training loader in PFLlib's form (--fedfomo_validation=train_tail): our
  trainer's epochs over the first n - n // 5 samples (fedfomo.train_tail's mask; n is
  the padded size here, every client holding the same count)."""
  return [bridges.leading_epochs(key, n, n - n // 5, epochs, batch_size)]


def _fomo_train(client) -> None:
  """clientFomo.train with the harness's training loader and, as its validation loader,
  the last 20 % of the client's training data in order (clientfomo.load_train_data)."""
  import torch  # pylint: disable=import-outside-toplevel
  train = client.load_train_data()
  held = len(train.y) - int(client.val_ratio * len(train.y))
  val = [(torch.from_numpy(train.x[i:i + client.batch_size]),
          torch.from_numpy(train.y[i:i + client.batch_size]))
         for i in range(held, len(train.y), client.batch_size)]
  client.load_train_data = lambda batch_size=None: (train, val)
  client.train()


class _TopkTiesOurs:
  """PFLlib's torch for serverfomo's send_models, its topk's ties broken by our noise:
  the clients by P's row (descending), then by our selection's noise (ascending), as our
  greedy selection sorts them; checked to be a top-k of the row as torch.topk's is."""

  def __init__(self, torch, noise: np.ndarray):
    self._torch, self._noise = torch, noise

  def __getattr__(self, name):
    return getattr(self._torch, name)

  def topk(self, row, k):
    values = row.detach().cpu().numpy()
    client = row.storage_offset() // values.shape[0]  # the row P[client.id] of K x K
    ours = np.lexsort((self._noise[client], -values))[:k]
    theirs = self._torch.topk(row, k).values.cpu().numpy()
    assert np.array_equal(np.sort(values[ours]), np.sort(theirs)), (values, ours, theirs)
    return argparse.Namespace(indices=self._torch.as_tensor(ours))


def _fomo_ties(server, setting: Setting, clients: list[Client]) -> None:
  """Each send_models of PFLlib's FedFomo with torch.topk's ties (P's zeros and ones
  under partial participation) broken as ours breaks them in that round
  (fedfomo.selection_keys from our server's key, the algorithm key)."""
  import sys  # pylint: disable=import-outside-toplevel
  module = sys.modules[type(server).__module__]
  key = fedfomo.raw_key(root_keys(setting.seed)["algorithm"])
  shape, rounds, send = (len(clients), len(clients)), iter(range(1 << 20)), server.send_models

  def send_models():
    noise_key = fedfomo.selection_keys(key, jnp.int32(next(rounds)))[1]
    real = module.torch
    module.torch = _TopkTiesOurs(real, np.asarray(jax.random.uniform(noise_key, shape)))
    try:
      send()
    finally:
      module.torch = real
  server.send_models = send_models


def _kd_load_initial(server, state) -> None:
  """Our W_i into each PFLlib client's W_h (theirs: torch's own draw); ours maps h_s @ W_i,
  so its Linear weight is W_i^T."""
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    for client in server.clients:
      projection = np.asarray(state.clients.projection[client.id])
      client.W_h.weight.copy_(torch.from_numpy(projection.T.copy()))


def _kd_server_step(server) -> None:
  """FedKD's server after receive_models (serverkd.py's train()): the uniform mean, its
  decomposition at the round's energy, then the next round's energy."""
  server.aggregate_parameters()
  server.decomposition()
  round_index = getattr(server, "kd_round", 0)
  server.kd_round = round_index + 1
  server.energy = server.T_start + ((1 + round_index) / server.global_rounds
                                    * (server.T_end - server.T_start))


def _kd_ours_more(algorithm, state):
  """The mentee every client receives, then each client's W_i as a Dense layer with a
  zero bias (one layer after the mentee's)."""
  del algorithm
  mentee = state.server.mentee["params"]
  projection = np.asarray(state.clients.projection)
  count, dim = projection.shape[:2]
  layers = {name: jax.tree.map(lambda a: np.broadcast_to(a, (count,) + a.shape), layer)
            for name, layer in mentee.items()}
  layers[f"Dense_{len(mentee)}"] = {"kernel": projection, "bias": np.zeros((count, dim))}
  return {"params": layers}


def _kd_theirs_more(client):
  """The mentee the client received (its global_model), then W_h with a zero bias."""
  import torch  # pylint: disable=import-outside-toplevel
  weight = client.W_h.weight
  projection = torch.nn.Linear(weight.shape[1], weight.shape[0])
  with torch.no_grad():
    projection.weight.copy_(weight)
    projection.bias.zero_()
  return torch.nn.ModuleList([client.global_model, projection])


def _mtl_attach_server(server, state) -> None:
  """Each PFLlib client reaches its server (our clients read the round's W through the
  broadcast)."""
  del state
  for client in server.clients:
    client.mtl_server = server


def _mtl_train(client) -> None:
  """FedMTL's round for one client (servermtl.py's train()): W from every client's model
  before the first trains, then set_parameters with its column, then train."""
  server = client.mtl_server
  if client.id == 0:
    server.aggregate_parameters()
  client.set_parameters(server.W_glob, server.omega, client.id)
  client.train()


def _pcl_sorted(protos: dict) -> dict:
  """A prototype dict in class order, in place (PFLlib's server and clients share them)."""
  items = sorted(protos.items())
  protos.clear()
  protos.update(items)
  return protos


def _pcl_collect_loads(n: int, batch_size: int) -> list[np.ndarray]:
  return [np.arange(n).reshape(-1, batch_size)]


def _pcl_loads(key: jax.Array, n: int, epochs: int, batch_size: int
               ) -> list[list[np.ndarray]]:
  """FedPCL's loaders: train's epochs, then collect_protos' (any order: class means)."""
  return [bridges.shuffled_epochs(key, n, epochs, batch_size),
          _pcl_collect_loads(n, batch_size)]


def _pcl_server_step(server) -> None:
  """FedPCL's server after its clients train (serverpcl.py's train()): receive the
  prototypes, average them, pad each client's set, send them; its dicts kept in class
  order."""
  import flcore.servers.serverpcl as serverpcl  # pylint: disable=import-outside-toplevel
  server.receive_protos()
  server.global_protos = _pcl_sorted(serverpcl.proto_aggregation(server.uploaded_protos))
  server.prototype_padding()
  for protos in server.client_protos_set:
    _pcl_sorted(protos)
  server.send_protos()


def _pcl_prepare(server, setting: Setting, clients: list[Client]) -> None:
  """PFLlib's FedPCL with its prototype dicts in class order (its own follow the order
  classes first appear in a shuffled loader, and its similarities' column c is scored as
  class c), each client's model its base alone (main.py's fc = Identity: no head), and
  its first round run, every client's prototypes from the initial model (ours:
  fedpcl's init)."""
  import flcore.clients.clientpcl as clientpcl  # pylint: disable=import-outside-toplevel
  if not getattr(clientpcl.agg_func, "sorted_by_class", False):
    original = clientpcl.agg_func
    clientpcl.agg_func = lambda protos: _pcl_sorted(original(protos))
    clientpcl.agg_func.sorted_by_class = True
  for client, data in zip(server.clients, clients):
    client.model = client.model.base
    loader = bridges.EpochLoader(bridges.model_inputs(data.x_train),
                                 data.y_train.astype(np.int64),
                                 _pcl_collect_loads(len(data.y_train), setting.batch_size))
    client.load_train_data = lambda batch_size=None, loader=loader: loader
    client.train()                      # no prototypes yet: collect_protos only
  server.selected_clients = list(server.clients)
  _pcl_server_step(server)


def _pcl_ours_body(personal):
  """Our scored model's body (the head layer is unused)."""
  layers = personal.params["params"]
  head = max(layers, key=lambda name: int(name.rsplit("_", 1)[1]))
  return {"params": {name: layer for name, layer in layers.items() if name != head}}


def _pcl_ours_sets(algorithm, state):
  """Each client's prototype set P_i [C, d] as a Dense kernel [d, C], zero bias."""
  del algorithm
  sets = np.asarray(state.clients.prototypes)
  return {"params": {"Dense_0": {"kernel": np.swapaxes(sets, 1, 2),
                                 "bias": np.zeros(sets.shape[:2])}}}


def _pcl_sets(client):
  """The client's padded prototypes, class by class, as a Linear's weight."""
  import torch  # pylint: disable=import-outside-toplevel
  protos = torch.stack([client.protos[c] for c in range(len(client.protos))])
  layer = torch.nn.Linear(protos.shape[1], protos.shape[0])
  with torch.no_grad():
    layer.weight.copy_(protos)
    layer.bias.zero_()
  return layer


def _pcl_accuracy(client, data: Client) -> float:
  """PFLlib's own FedPCL scoring (clientpcl.test_metrics: the largest <r, prototype>)."""
  import torch  # pylint: disable=import-outside-toplevel
  client.load_test_data = lambda batch_size=None: [
      (torch.from_numpy(bridges.model_inputs(data.x_test)),
       torch.from_numpy(data.y_test.astype(np.int64)))]
  correct, count, _ = client.test_metrics()
  return correct / count


def _gen_draws(key: jax.Array, steps: int, class_weights, batch_size: int, noise_dim: int):
  """Our FedGen's generated batches, step s from fold_in(key, s) (fedgen's clients and
  server): [(labels, noise)]."""
  from fedora_jax.models.generator import draw_inputs  # pylint: disable=import-outside-toplevel
  return [tuple(np.asarray(a) for a in draw_inputs(jax.random.fold_in(key, s), class_weights,
                                                   batch_size, noise_dim))
          for s in range(steps)]


@contextlib.contextmanager
def _drawing(draws):
  """PFLlib's FedGen drawing our batches: np.random.choice its labels, torch.rand (in its
  Generative.forward) its noise, in turn."""
  import torch  # pylint: disable=import-outside-toplevel
  from unittest import mock  # pylint: disable=import-outside-toplevel
  queue = iter(draws)
  current: list = []

  def choice(_, size):
    current[:] = next(queue)
    assert len(current[0]) == size, (len(current[0]), size)
    return current[0].astype(np.int64)

  def rand(shape, device=None):
    del device
    assert tuple(shape) == current[1].shape, (shape, current[1].shape)
    return torch.from_numpy(current[1].copy())
  with mock.patch.object(np.random, "choice", choice), mock.patch.object(torch, "rand", rand):
    yield
  assert next(queue, None) is None, "a generated batch was left undrawn"


def _gen_load_initial(server, state) -> None:
  """Our initial generator into PFLlib's (fc1's Linear and BatchNorm, fc), and what its
  clients and server need to draw our batches: p(y), the server's key, our run's keys."""
  import torch  # pylint: disable=import-outside-toplevel
  generator = jax.tree.map(np.asarray, state.server.generator["params"])
  model = server.generative_model
  with torch.no_grad():
    for linear, ours in ((model.fc1[0], generator["Dense_0"]), (model.fc, generator["Dense_1"])):
      linear.weight.copy_(torch.from_numpy(ours["kernel"].T.copy()))
      linear.bias.copy_(torch.from_numpy(ours["bias"].copy()))
    model.fc1[1].weight.copy_(torch.from_numpy(generator["scale"].copy()))
    model.fc1[1].bias.copy_(torch.from_numpy(generator["offset"].copy()))
  server.gen_state = state.server
  for client in server.clients:
    client.gen_server = server


def _gen_train(client) -> None:
  """One PFLlib FedGen client's train() drawing our client's batches: from the second
  half of its round key (fedgen.client_update), one per step of its own samples (a
  padded client's real steps come first in an epoch, so one epoch's are the first)."""
  server = client.gen_server
  round_index = getattr(client, "gen_round", 0)
  client.gen_round = round_index + 1
  setting = server.gen_setting
  keys = client_keys(jax.random.fold_in(root_keys(setting.seed)["train"], round_index),
                     len(server.clients))
  steps = setting.local_epochs * client.train_samples // setting.batch_size
  draws = _gen_draws(jax.random.split(keys[client.id])[1], steps,
                     server.gen_state.class_weights, setting.batch_size, server.noise_dim)
  with _drawing(draws):
    client.train()


def _gen_prepare(server, setting: Setting, clients: list[Client]) -> None:
  del clients
  server.gen_setting = setting
  server.noise_dim = server.generative_model.noise_dim


def _gen_server_step(server) -> None:
  """train_generator drawing our server's batches (fedgen.aggregate: its key folded with
  the round, then with the step), then the FedAvg."""
  round_index = getattr(server, "gen_round", 0)
  server.gen_round = round_index + 1
  key = jax.random.fold_in(jax.random.wrap_key_data(server.gen_state.key), round_index)
  draws = _gen_draws(key, server.server_epochs, server.gen_state.class_weights,
                     server.batch_size, server.noise_dim)
  with _drawing(draws):
    server.train_generator()
  server.aggregate_parameters()


# The generator compared by its output on a fixed batch (PROBE_SIZE labels in turn,
# uniform noise from PROBE_SEED): its parameters under a ReLU that no sample opens, and its
# hidden bias under the BatchNorm, get gradients of rounding only, which Adam turns into
# steps of +-lr in each code, its own way, and which change no output.
PROBE_SIZE, PROBE_SEED = 20, 7


def _gen_probe(noise_dim: int) -> tuple[np.ndarray, np.ndarray]:
  labels = np.arange(PROBE_SIZE) % 10
  noise = np.asarray(jax.random.uniform(jax.random.key(PROBE_SEED), (PROBE_SIZE, noise_dim)))
  return labels, noise


def _gen_ours_generator(algorithm, state):
  """Our generator's output on the probe [B, d], as a Dense kernel [d, B] (zero bias),
  every client's (the one it receives)."""
  from fedora_jax.algorithms import fedgen  # pylint: disable=import-outside-toplevel
  del algorithm
  generator = state.server.generator
  head = state.server.params["params"]["Dense_1"]
  noise_dim = generator["params"]["Dense_0"]["kernel"].shape[0] - head["kernel"].shape[-1]
  labels, noise = _gen_probe(noise_dim)
  module = fedgen.generator_for(head, generator["params"]["Dense_0"]["kernel"].shape[1])
  outputs = np.asarray(module.apply(generator, jnp.asarray(noise), jnp.asarray(labels)))
  count = state.clients.shape[0]
  return {"params": {"Dense_0": {
      "kernel": np.broadcast_to(outputs.T, (count,) + outputs.T.shape),
      "bias": np.zeros((count, PROBE_SIZE), np.float32)}}}


def _gen_generator(client):
  """The output on the probe of the generator the client received, as a Linear's weight."""
  import torch  # pylint: disable=import-outside-toplevel
  generator = client.generative_model
  labels, noise = _gen_probe(generator.noise_dim)
  with _drawing([(labels, noise)]):
    np.random.choice(None, PROBE_SIZE)
    with torch.no_grad():
      outputs = generator(torch.from_numpy(labels.astype(np.int64)))
  layer = torch.nn.Linear(outputs.shape[1], PROBE_SIZE)
  with torch.no_grad():
    layer.weight.copy_(outputs)
    layer.bias.zero_()
  return layer


def fedgen_divergence(server_epochs: int, shift: float = 1e-6,
                      setting: Setting = Setting()) -> dict[str, tuple[float, float]]:
  """Why FedGen's row runs fewer generator steps than PFLlib's 1000: for the global model
  after the row's two rounds and for the generator's output on the probe, (PFLlib beside
  itself with the generator's hidden bias moved by `shift`, which its BatchNorm takes
  out in exact arithmetic; ours beside PFLlib), as max relative errors, at
  `server_epochs` Adam steps a round."""
  import torch  # pylint: disable=import-outside-toplevel
  reference = REFERENCES["fedgen"]
  reference = reference._replace(
      config={**reference.config, "server_epochs": server_epochs},
      args={**reference.args, "server_epochs": server_epochs})
  clients = real_clients(setting)
  result, initial, batches, compared = _our_round("fedgen", setting, clients, reference)
  loaded = _our_initial_state("fedgen", setting, clients, reference)
  runs = []
  for moved in (0.0, shift):
    def load(server, state, moved=moved):
      _gen_load_initial(server, state)
      with torch.no_grad():
        server.generative_model.fc1[0].bias.add_(moved)
    runs.append(_pfllib_round(reference._replace(load_initial=load), setting, clients,
                              bridges.dense_stack_to_torch(initial), batches, None, loaded))
  ours = bridges.dense_stack_to_torch(jax.tree.map(np.asarray,
                                                   result.final_state.algorithm.server.params))
  (server, scored, _), (moved_server, moved_scored, _) = runs
  return {"model": (relative_error(_flat(moved_server), _flat(server)),
                    relative_error(_flat(ours), _flat(server))),
          "generator": (relative_error(_flat(moved_scored[-1]), _flat(scored[-1])),
                        relative_error(_flat(compared[-1]), _flat(scored[-1])))}


def _cross_attach_server(server, state) -> None:
  """Each PFLlib client reaches its server and our deal of the middleware models."""
  server.cross_key = np.asarray(state.server.key)
  for client in server.clients:
    client.cross_server = server


def _cross_train(client) -> None:
  """FedCross's round for one client (servercross.py's train()): the middleware model of
  the slot our server deals it, trained, written back to that slot."""
  from fedora_jax.algorithms import fedcross  # pylint: disable=import-outside-toplevel
  server = client.cross_server
  round_index = getattr(client, "cross_round", 0)
  client.cross_round = round_index + 1
  slots = fedcross.round_slots(server.cross_key, round_index,
                               jnp.ones(len(server.clients), bool))
  slot = int(slots[client.id])
  client.set_parameters(server.w_locals[slot])
  client.train()
  client.clone_model(client.model, server.w_locals[slot])


def _cross_server_step(server) -> None:
  """FedCross's server after receive_models: the FedAvg of the uploads, the similarities,
  the cross-aggregation (its first stage never: bound 0)."""
  round_index = getattr(server, "cross_round", 0)
  server.cross_round = round_index + 1
  server.aggregate_parameters()
  similarity, _ = server.calculate_similarity()
  server.w_locals = server.cross_aggregation(round_index, similarity)


def _cross_ours_slots(algorithm, state):
  del algorithm
  return state.server.models


def _cross_slot(client):
  """Middleware slot k beside our slot k (PFLlib's DNN: its Linear layers)."""
  return client.cross_server.w_locals[client.id]


def _class_subset_clients(setting: Setting) -> list[Client]:
  """Clients of five classes each, client k classes 2k .. 2k + 4 (mod 10): some classes
  held by several clients, each lacking others. Disjoint samples of the official splits,
  taken in order; tests of the client's classes only."""
  mnist = load_mnist()
  taken_train = np.zeros(len(mnist.y_train), bool)
  taken_test = np.zeros(len(mnist.y_test), bool)
  clients = []

  def take(labels, taken, classes, count):
    chosen = np.flatnonzero(np.isin(labels, classes) & ~taken)[:count]
    taken[chosen] = True
    return chosen
  for k in range(setting.clients):
    classes = (2 * k + np.arange(5)) % 10
    train = take(mnist.y_train, taken_train, classes, setting.train_size)
    val = take(mnist.y_train, taken_train, classes, 20)
    test = take(mnist.y_test, taken_test, classes, setting.test_size)
    clients.append(Client(mnist.x_train[train], mnist.y_train[train], mnist.x_train[val],
                          mnist.y_train[val], mnist.x_test[test], mnist.y_test[test]))
  return clients


def _gc_load_initial(server, state) -> None:
  """Our initial heads (each client's classes' columns) into PFLlib's clients' bias-free
  heads and its server's copies (theirs: torch's own draws)."""
  import torch  # pylint: disable=import-outside-toplevel
  kernels = np.asarray(state.server.heads["params"]["Dense_1"]["kernel"])
  held = np.asarray(state.server.held)
  with torch.no_grad():
    for client in server.clients:
      rows = torch.from_numpy(kernels[client.id][:, held[client.id]].T.copy())
      client.model.head.weight.copy_(rows)
      server.client_heads[client.id].weight.copy_(rows)


def _gc_personalized(client):
  """The client's model with its head all classes wide: its rows at its classes, zeros
  elsewhere, a zero bias."""
  import torch  # pylint: disable=import-outside-toplevel
  weight = client.model.head.weight
  head = torch.nn.Linear(weight.shape[1], 10)
  with torch.no_grad():
    head.weight.zero_()
    head.bias.zero_()
    head.weight[client.classes_index] = weight
  return torch.nn.ModuleList([copy.deepcopy(client.model.base), head])


def _gc_ours_personal(personal):
  """Our scored models with the columns of the classes a client lacks zeroed."""
  params = personal.model["params"]
  held = np.asarray(personal.held)[:, None, :]
  head = {"kernel": np.asarray(params["Dense_1"]["kernel"]) * held,
          "bias": np.asarray(params["Dense_1"]["bias"])}
  return {"params": {**params, "Dense_1": head}}


# Training-set sizes of the unequal clients (multiples of the batch; 800 in all, as
# real_clients'), so that a server's weights show: sample counts against 1/|S|.
UNEQUAL_SIZES = (80, 120, 240, 360)


def _unequal_clients(setting: Setting) -> list[Client]:
  """real_clients' slices with training sets of UNEQUAL_SIZES (each client's validation
  and test slices as real_clients')."""
  mnist = load_mnist()
  starts = np.cumsum((0,) + UNEQUAL_SIZES)
  clients = real_clients(setting)
  return [client._replace(x_train=mnist.x_train[start:end], y_train=mnist.y_train[start:end])
          for client, start, end in zip(clients, starts[:-1], starts[1:])]


def _uniform_mean(server) -> None:
  """The authors' server mean (FedBABU's and LG-FedAvg's FedAvg(w), Ditto's
  simple_average: 1/|S| each) in place of PFLlib's sample-count weights."""
  server.uploaded_weights = [1.0 / len(server.uploaded_weights)] * len(server.uploaded_weights)


# FedBN's training images a client: 4 steps of SGD. On the BatchNorm CNN a pre-activation
# within float32's rounding of ReLU's zero takes the other side in one code now and then
# (2 of 80 steps at 200 images: client 3's step 9 moves bn1's shift 4e-3 apart), after
# which the clients part; at 50 and 100 images a client the round met one, at 20 and 40
# none (docs/log.md).
FEDBN_TRAIN = 40


def _fedbn_clients(setting: Setting) -> list[Client]:
  """real_clients with their first FEDBN_TRAIN training images."""
  return [c._replace(x_train=c.x_train[:FEDBN_TRAIN], y_train=c.y_train[:FEDBN_TRAIN])
          for c in real_clients(setting)]


# MOON's BatchNorm row: the first 20 training images of each client. Over its two rounds
# FedBN's 40 met a float32 tie at ReLU's zero, after which the codes part (docs/log.md).
MOON_BN_TRAIN = 20


def _moon_bn_clients(setting: Setting) -> list[Client]:
  return [c._replace(x_train=c.x_train[:MOON_BN_TRAIN], y_train=c.y_train[:MOON_BN_TRAIN])
          for c in real_clients(setting)]


def _moon_eval_train(client) -> None:
  """clientMOON.train with its global and previous models in eval(), on their running
  averages, as the authors' code runs them (PFLlib leaves them in train mode)."""
  client.global_model.eval()
  client.old_model.eval()
  client.train()


def _average_buffers(server) -> None:
  """BatchNorm's running averages averaged with the parameters' weights, as ours (PFLlib's
  aggregate_parameters averages parameters() and keeps the first upload's buffers)."""
  uploads = [dict(model.named_buffers()) for model in server.uploaded_models]
  for name, buffer in server.global_model.named_buffers():
    if not name.endswith("num_batches_tracked"):
      buffer.data = sum(w * upload[name].data
                        for w, upload in zip(server.uploaded_weights, uploads))


def _receive_buffers(server, setting: Setting, clients: list[Client]) -> None:
  """Each client's set_parameters taking the global model's running averages too, as ours
  (PFLlib's copies parameters() only, so a client keeps its own)."""
  del setting, clients
  for client in server.clients:
    def set_parameters(model, client=client, original=client.set_parameters):
      original(model)
      for new, old in zip(model.buffers(), client.model.buffers()):
        old.data = new.data.clone()
    client.set_parameters = set_parameters


MU = 0.1  # FedProx's mu and Ditto's lambda in the checks
REFERENCES = {
    "local": Reference("serverlocal.Local", "clientavg.py", ("train",), _own_key,
                       aggregates=False, personal="model", config={}, args={}),
    "fedavg": Reference("serveravg.FedAvg", "clientavg.py", ("train",), _own_key,
                        aggregates=True, personal=None, config={}, args={}),
    "fedprox": Reference("serverprox.FedProx", "clientprox.py", ("train",), _own_key,
                         aggregates=True, personal=None, config={"mu": MU},
                         args={"mu": MU}),
    "ditto": Reference("serverditto.Ditto", "clientditto.py", ("ptrain", "train"),
                       _ditto_keys, aggregates=True, personal="model_per",
                       config={"lam": MU, "lambda_selection": "fixed"},
                       args={"mu": MU, "plocal_epochs": 1}),
    # APFL's PFLlib form; alpha starts at our default 0.5 (PFLlib's main.py: 1.0).
    "apfl": Reference("serverapfl.APFL", "clientapfl.py", ("train",), _own_key,
                      aggregates=True, personal="model_per",
                      config={"mixing": "pfllib", "alpha": 0.5}, args={"alpha": 0.5},
                      rounds=2),
    # The base shared, the head the client's own; and the reverse.
    "fedper": Reference("serverper.FedPer", "clientper.py", ("train",), _own_key,
                        aggregates=True, personal="model", config={"personal_layers": 1},
                        args={}, split=True, compare_server=False),
    "lg_fedavg": Reference("serverlg.LG_FedAvg", "clientlg.py", ("train",), _own_key,
                           aggregates=True, personal="model",
                           config={"local_layers": 1, "local_side": "input"}, args={},
                           split=True, compare_server=False),
    # The body trained and averaged, the head frozen at the initial model; the global
    # model scored (finetune_epochs=0: PFLlib fine-tunes only after its last round).
    "fedbabu": Reference("serverbabu.FedBABU", "clientbabu.py", ("train",), _own_key,
                         aggregates=True, personal="model", config={"finetune_epochs": 0},
                         args={"fine_tuning_epochs": 0}, split=True, compare_server=False),
    # Two rounds: in the first a client's previous model is the global one in PFLlib (no
    # negative pair here), a constant contrastive loss either way.
    "moon": Reference("servermoon.MOON", "clientmoon.py", ("train",), _own_key,
                      aggregates=True, personal=None,
                      config={"mu": 1.0, "tau": 0.5, "evaluate": "global"},
                      args={"mu": 1.0, "tau": 0.5}, split=True, rounds=2),
    # pFedMe with PFLlib's values, the authors' mu theta term (0.001, its optimizer's
    # default) and beta 1 (PFLlib's default 0 would never move the global model). The
    # local model w_i is compared (ours: personal_model=local), read after training:
    # PFLlib's personalized_params are its model's own parameter tensors, so after
    # send_models its evaluate_personalized scores the new global model, neither theta_i
    # nor w_i (docs/verification.md).
    "pfedme": Reference("serverpFedMe.pFedMe", "clientpFedMe.py", ("train",), _own_key,
                        aggregates=True, personal="model",
                        config={"lam": 15.0, "k": 5, "personal_lr": 0.09, "eta": 0.05,
                                "beta": 1.0, "theta_l2": 0.001, "personal_model": "local"},
                        args={"lamda": 15.0, "K": 5, "p_learning_rate": 0.09,
                              "beta": 1.0},
                        scored_after_send=False),
    # One head epoch, then one body epoch, on one loader reshuffled each epoch.
    "fedrep": Reference("serverrep.FedRep", "clientrep.py", ("train",), _own_key,
                        aggregates=True, personal="model",
                        config={"head_epochs": 1, "head_layers": 1},
                        args={"plocal_epochs": 1, "local_epochs": 1}, split=True,
                        compare_server=False, our_epochs=2),
    # Two rounds: the control variates are zero through the first. Server lr 1, the
    # uniform 1/|S| mean (both the paper's and PFLlib's).
    "scaffold": Reference("serverscaffold.SCAFFOLD", "clientscaffold.py", ("train",),
                          _own_key, aggregates=True, personal=None, config={},
                          args={"server_learning_rate": 1.0}, rounds=2,
                          server_model=_global_params),
    # PFLlib's unsquared penalty (--feddyn_penalty=norm); two rounds, so that the
    # clients' g_k of the first round act in the second.
    "feddyn": Reference("serverdyn.FedDyn", "clientdyn.py", ("train",), _own_key,
                        aggregates=True, personal=None,
                        config={"alpha": 0.1, "penalty": "norm"}, args={"alpha": 0.1},
                        rounds=2, server_model=_global_params,
                        server_steps=("update_server_state", "aggregate_parameters")),
    # PFLlib's form: the KL times tau^2 and the uniform server mean; tau 2 so that the
    # factor shows (its DNN's log_softmax shifts each row of logits, which neither the
    # cross-entropy nor the not-true softmax sees).
    "fedntd": Reference("serverntd.FedNTD", "clientntd.py", ("train",), _own_key,
                        aggregates=True, personal=None,
                        config={"tau": 2.0, "beta": 1.0, "tau_squared": True,
                                "server_mean": "uniform"},
                        args={"tau": 2.0, "beta": 1.0}),
    # PFLlib's form: the federation's class counts and the softmax cross-entropy of the
    # calibrated logits (its server reads the model's head: the MLP split).
    "fedlc": Reference("serverlc.FedLC", "clientlc.py", ("train",), _own_key,
                       aggregates=True, personal=None,
                       config={"tau": 1.0, "counts": "global", "denominator": "all"},
                       args={"tau": 1.0}, split=True, server_model=_global_params),
    # The personal head starts as the initial head (PFLlib's copy); scored summed with
    # the generic head, after send_models as PFLlib's evaluate() reads it.
    "fedrod": Reference("serverrod.FedROD", "clientrod.py", ("train",), _own_key,
                        aggregates=True, personal=_rod_personalized,
                        config={"personal_init": "copy"}, args={}, split=True),
    # First-order, alpha = beta = the learning rate (PFLlib's); its server trains each
    # client twice a round (our two local epochs). Two rounds: the second scores the
    # adaptation of a trained global model (PFLlib adapts before training, as ours).
    # PFLlib's own values (alpha_K, lambda, sigma 1) and its step as given (clip_step
    # off). Its regulariser is built from p.data, detached: it has no gradient, so its
    # clients train like LOCAL, which ours does at lambda 0 (docs/verification.md). The
    # cloud models u_i, built from the round's models at the next send_models, compared.
    "fedamp": Reference("serveramp.FedAMP", "clientamp.py", ("train",), _own_key,
                        aggregates=True, personal="model",
                        config={"lam": 0.0, "alpha_k": 1.0, "sigma": 1.0,
                                "clip_step": False},
                        args={"lamda": 1.0, "alphaK": 1.0, "sigma": 1.0},
                        compare_server=False, also=(_amp_ours_cloud, _amp_cloud)),
    # PFLlib's form: its fixed-bandwidth MMD, the trained local model scored, mu ramped
    # over the run's rounds (ours: Q = 2 participations, all clients in every round).
    # Two rounds: in the first mu is 0 and the HPM starts equal to the global model.
    "fedphp": Reference("serverphp.FedPHP", "clientphp.py", ("train",), _own_key,
                        aggregates=True, personal="model",
                        config={"lam": 0.5, "mu_max": 0.9, "mu_participations": 2,
                                "personal_model": "local", "mmd_kernel": "pfllib"},
                        args={"lamda": 0.5, "mu": 0.9, "global_rounds": 2}, split=True,
                        rounds=2, scored_after_send=False, send_takes_round=True,
                        also=(_php_ours_hpm, _php_hpm)),
    # The codes' form: prototypes averaged over the training steps' representations,
    # their plain mean on the server, the MSE regulariser, and the nearest of all global
    # prototypes scored (PFLlib's test_metrics). Two rounds: the regulariser acts only
    # once global prototypes exist. Compared: each client's model, and that model with
    # the nearest-global-prototype head (our scored model).
    "fedproto": Reference("serverproto.FedProto", "clientproto.py", ("train",), _own_key,
                          aggregates=True, personal=_proto_personalized,
                          config={"lam": 1.0, "distance": "mse", "aggregation": "mean",
                                  "inference": "global", "prototypes": "training"},
                          args={"lamda": 1.0}, split=True, compare_server=False,
                          rounds=2, sends=False, server_steps=(_proto_server_step,),
                          accuracy=_pfllib_accuracy,
                          also=(_proto_ours_model, _proto_model)),
    "perfedavg": Reference("serverperavg.PerAvg", "clientperavg.py",
                           (_peravg_score, "train", "train"), _own_key, aggregates=True,
                           personal="adapted",
                           config={"alpha": 0.05, "beta": 0.05, "variant": "fo"}, args={},
                           rounds=2, our_epochs=2, loads=_peravg_loads),
    # The authors' kl_weight 50 with PFLlib's default momentum 0.1 (the running mean
    # carried over the steps); its initialization period, run as the server is built,
    # from the batches our init draws. Two rounds: the personal biases of the first
    # act in the second. Scored: the global model on the shifted representation.
    "feddbe": Reference("serverdbe.FedDBE", "clientdbe.py", ("train",), _own_key,
                        aggregates=True, personal=_dbe_personalized,
                        config={"kl_weight": 50.0, "mean_momentum": 0.1},
                        args={"kl_weight": 50.0, "momentum": 0.1}, split=True, rounds=2,
                        server_model=_dbe_server_model, built_loads=_dbe_built_loads),
    # FedALA in the authors' form (ALA_CONFIG) beside PFLlib's, whose utils/ALA.py is the
    # authors' (TsingZ0/FedALA system/utils/ALA.py, the same bytes): its ALA slices our
    # slice (_ala_prepare). Three rounds: ALA rests in the first, trains W until the
    # loss settles in the second, one epoch in the third; theta_hat and W of the last
    # round compared too. Scored: the trained local model (ours: theta_i; PFLlib scores
    # after its next round's ALA, which ours has not run).
    "fedala": Reference("serverala.FedALA", "clientala.py", (_ala_keep, "train"), _ala_keys,
                        aggregates=True, personal="model", config=ALA_CONFIG, args=ALA_ARGS,
                        rounds=3, scored_after_send=False, prepare=_ala_prepare,
                        also=(_ala_ours, _ala_theirs), also_previous=True),
    "fedala_round2": Reference("serverala.FedALA", "clientala.py", (_ala_keep, "train"),
                               _ala_keys, aggregates=True, personal="model",
                               config=ALA_CONFIG, args=ALA_ARGS, rounds=2,
                               scored_after_send=False, prepare=_ala_prepare,
                               also=(_ala_ours, _ala_theirs), also_previous=True,
                               algorithm="fedala"),
    "fedala_round1": Reference("serverala.FedALA", "clientala.py", ("train",), _ala_keys,
                               aggregates=True, personal="model", config=ALA_CONFIG,
                               args=ALA_ARGS, scored_after_send=False,
                               prepare=_ala_prepare, algorithm="fedala"),
    # W trained until the loss settles for longer than the first 11 epochs the authors'
    # threshold takes on this split: threshold 3e-5 (11 to 295 epochs, the same on both
    # sides), the bound of our traced loop out of reach (theirs has none).
    "fedala_converging": Reference(
        "serverala.FedALA", "clientala.py", (_ala_keep, "train"), _ala_keys,
        aggregates=True, personal="model",
        config={**ALA_CONFIG, "threshold": 3e-5, "max_epochs": 1000}, args=ALA_ARGS,
        rounds=2, scored_after_send=False,
        prepare=functools.partial(_ala_prepare, threshold=3e-5),
        also=(_ala_ours, _ala_theirs), also_previous=True, algorithm="fedala"),
    # FedCP (lambda 5, tau 1) beside PFLlib's (clientcp.py, servercp.py: the authors'
    # TsingZ0/FedCP files), our initial CPN and contexts loaded, its Gumbel noise ours
    # (_cp_prepare); no send before a round (its server sends after aggregating). Two
    # rounds: the contexts, h_g and CPN of the first act in the second. Compared: each
    # client's f (the server's, sent) and h_p, h_g, CPN and c_i (its global_model is the
    # initial one, unused); scored by PFLlib's test_metrics, noise-free.
    "fedcp": Reference("servercp.FedCP", "clientcp.py",
                       ("train_cs_model", "generate_upload_head"), _cp_keys,
                       aggregates=True, personal=lambda client: client.model.model,
                       config={"lam": 5.0, "temperature": 1.0}, args={"lamda": 5.0},
                       split=True, compare_server=False, rounds=2, sends=False,
                       server_steps=("aggregate_parameters", "send_models", "global_head",
                                     "global_cs"),
                       accuracy=_pfllib_accuracy,
                       also=(_cp_ours_more, _cp_theirs_more), prepare=_cp_prepare,
                       load_initial=_cp_load_initial,
                       our_personal=lambda personal: personal.model),
    # The authors' lambda 0.01 and mu 0.1. Its server aggregates, then sends phi, the GCE
    # (each client rebuilding its conditional inputs first) and the CoV; two rounds, so
    # that the conditional inputs act. Compared: phi, each client's phi and head, the
    # CoV's Linear layers; scored by PFLlib's own test_metrics (head on the CoV route).
    "gpfl": Reference("servergpfl.GPFL", "clientgpfl.py", ("train",), _own_key,
                      aggregates=True, personal="model", config={"lam": 0.01, "mu": 0.1},
                      args={"lamda": 0.01, "mu": 0.1}, split=True, rounds=2, sends=False,
                      server_steps=("aggregate_parameters", "send_models", "global_GCE",
                                    "global_CoV"),
                      server_model=_gpfl_server_model, accuracy=_pfllib_accuracy,
                      also=(_gpfl_ours_valve, _gpfl_valve), load_initial=_gpfl_load_initial,
                      our_personal=lambda personal: personal.model),
    # The authors' tau 0.5 and beta 100, PFLlib's first round (no customised models in
    # round 0: --fedcac_first_round=initial). Two rounds: the second builds them. Its
    # server sends at the end of a round (at the start only in round 0, to clients that
    # already hold the initial model).
    "fedcac": Reference("servercac.FedCAC", "clientcac.py", ("train",), _own_key,
                        aggregates=True, personal="model",
                        config={"tau": 0.5, "beta": 100.0, "first_round": "initial"},
                        args={"tau": 0.5, "beta": 100}, rounds=2, sends=False,
                        server_steps=(_cac_server_step,), server_model=_cac_server_model),
    # PFLlib's alignment constants (our defaults); two rounds, the second from a
    # Fisher-weighted global model. Its prototypes read from one batch of every sample
    # (ours average them all; its loader of 16 drops 8 of 200).
    "fedas": Reference("serveras.FedAS", "clientas.py", (_as_receive, _as_train), _own_key,
                       aggregates=True, personal="model", config={}, args={}, split=True,
                       rounds=2, sends=False, server_steps=("aggregate_wrt_fisher",),
                       loads=_as_loads, load_initial=_as_attach_server),
    # PFLlib's server lr 1 and its server header, client 0's own module
    # (--fedgh_server_head_start=first_client). Two rounds; the header the server
    # trains on the prototypes is compared in each client's model.
    "fedgh": Reference("servergh.FedGH", "clientgh.py", ("train", "collect_protos"),
                       _own_key, aggregates=True, personal="model",
                       config={"server_lr": 1.0, "server_head_start": "first_client"},
                       args={"server_learning_rate": 1.0}, split=True,
                       compare_server=False, rounds=2, server_steps=(_gh_server_step,),
                       loads=_gh_loads, load_initial=_gh_attach_key),
    # PFLlib's form: both losses into both models, its KLDivLoss's mean over the classes
    # too, each model's gradient clipped at 10, the memes' uniform mean; alpha = beta =
    # 0.5. Two rounds. Compared: the meme (PFLlib's global model) and each client's
    # personal model, which both score.
    "fml": Reference("serverfml.FML", "clientfml.py", ("train",), _own_key, aggregates=True,
                     personal="model",
                     config={"alpha": 0.5, "beta": 0.5, "detach_peer": False,
                             "kl_reduction": "mean", "clip_norm": 10.0,
                             "server_mean": "uniform"},
                     args={"alpha": 0.5, "beta": 0.5}, rounds=2),
    # PFLlib's form (target=raw), lambda 1, on the MLP twin (raw logits: PFLlib's DNN
    # would record its log_softmax). Two rounds: the first has no global logits.
    "feddistill": Reference("serverfd.FD", "clientfd.py", ("train",), _own_key,
                            aggregates=True, personal="model",
                            config={"lam": 1.0, "target": "raw"}, args={"lamda": 1.0},
                            split=True, compare_server=False, rounds=2, sends=False,
                            server_steps=(_fd_server_step,)),
    # PFLlib's detached penalty (--pflda_penalty_gradient=false: its heads train like
    # lambda 0); one loader for both phases, head epochs then extractor epochs. Two
    # rounds; the global head (its server's model) and each client's model compared.
    "pflda": Reference("serverda.PFL_DA", "clientda.py", ("train",), _own_key,
                       aggregates=True, personal="model",
                       config={"lam": 1.0, "penalty_gradient": False}, args={"lamda": 1.0},
                       split=True, rounds=2, loads=_da_loads),
    # FedFomo in PFLlib's form: P from the identity and the client a candidate of its
    # own, weights against the model its last training started from (old_model), its
    # validation the training data's last 20 %, P adding the raw weights, 1e-5 on the
    # distance; no exploration, M 5 >= K (every client's model received: no ties in
    # top-M). Two rounds: the first receives nothing there, identical models here.
    "fedfomo": Reference("serverfomo.FedFomo", "clientfomo.py", (_fomo_train,), _own_key,
                         aggregates=True, personal="model",
                         config={"num_models": 5, "epsilon": 0.0, "candidates": "self",
                                 "baseline": "previous", "validation": "train_tail",
                                 "affinity_update": "raw", "distance_eps": 1e-5},
                         args={"M": 5}, compare_server=False, rounds=2,
                         server_steps=(), loads=_fomo_loads),
    # FedKD in PFLlib's form: the mentee itself compressed, t_start in the first round,
    # the codes' rank search, its KLDivLoss's mean over the classes, mentor, mentee and
    # W_h each clipped at 10, the uniform mean; T_start 0.95 (one round of one: its
    # T_end 0.98 unused), the mentee at the run's lr, our W_i loaded. Compared: each
    # client's mentor (scored), the mentee it receives after the round (compressed by
    # the clients, averaged, compressed by the server) and its W_h. One round: the
    # second's cut falls between near-equal singular values, where float32 SVDs (JAX's
    # less accurate than NumPy's) part by about the tolerance (docs/verification.md).
    "fedkd": Reference("serverkd.FedKD", "clientkd.py", ("train",), _own_key,
                       aggregates=True, personal="model",
                       config={"compress": "parameters", "energy_round": "current",
                               "rank_rule": "codes", "kl_reduction": "mean",
                               "clip_norm": 10.0, "server_mean": "uniform"},
                       args={"T_start": 0.95, "T_end": 0.98, "global_rounds": 1,
                             "mentee_learning_rate": Setting().lr},
                       split=True, compare_server=False,
                       server_steps=(_kd_server_step,), load_initial=_kd_load_initial,
                       also=(_kd_ours_more, _kd_theirs_more)),
    # FedMTL in PFLlib's form: its regulariser of 10^-(digits + 1) (||W||^2 + (1 - 1/m)^2
    # ||sum of the models||^2), built from detached state_dict() copies: added to the
    # loss, no gradient (--fedmtl_regulariser_gradient=false). Two rounds, W rebuilt from
    # the first's models; each client's model compared.
    "fedmtl": Reference("servermtl.FedMTL", "clientmtl.py", (_mtl_train,), _own_key,
                        aggregates=False, personal="model",
                        config={"omega": "pfllib", "lam_scale": "digits",
                                "regulariser_gradient": False},
                        args={"itk": 4000}, rounds=2, load_initial=_mtl_attach_server),
    # FedPCL in PFLlib's form: tau 0.5 (so that it shows; its default 1), the gradient
    # clipped at 10; its dicts sorted by class (_pcl_prepare), its prototype-only first
    # round run first (ours: init). Two rounds of training after it. Compared: each
    # client's body and its padded prototype set; scored by PFLlib's test_metrics.
    "fedpcl": Reference("serverpcl.FedPCL", "clientpcl.py", ("train",), _own_key,
                        aggregates=True, personal=lambda client: client.model,
                        config={"tau": 0.5, "clip_norm": 10.0}, args={"tau": 0.5},
                        split=True, compare_server=False, rounds=2, sends=False,
                        server_steps=(_pcl_server_step,), loads=_pcl_loads,
                        prepare=_pcl_prepare, accuracy=_pcl_accuracy,
                        our_personal=_pcl_ours_body, also=(_pcl_ours_sets, _pcl_sets)),
    # FedGen with PFLlib's generator (noise 512, hidden 512, Adam at 0.005) for 20 steps a
    # round (PFLlib's 1000 part PFLlib from itself: fedgen_divergence) and its ensemble
    # weighted by samples (--fedgen_ensemble=samples); every generated batch ours
    # (np.random.choice and torch.rand fed our draws), our initial generator loaded. Two
    # rounds: the first trains the clients under the initial generator. Compared: the
    # global model and the generator's output on a fixed batch.
    "fedgen": Reference("servergen.FedGen", "clientgen.py", (_gen_train,),
                        lambda key: [jax.random.split(key)[0]], aggregates=True,
                        personal="model", config={"ensemble": "samples", "server_epochs": 20},
                        args={"noise_dim": 512, "hidden_dim": 512,
                              "generator_learning_rate": 0.005, "server_epochs": 20,
                              "localize_feature_extractor": False},
                        split=True, rounds=2, server_steps=(_gen_server_step,),
                        server_model=lambda server: server.params,
                        prepare=_gen_prepare, load_initial=_gen_load_initial,
                        also=(_gen_ours_generator, _gen_generator)),
    # FedCross in PFLlib's form (--fedcross_similarity=layers --fedcross_global_model=
    # uploads; alpha 0.99, lowest similarity), every client sampled, the middleware
    # models dealt as our server deals them. Two rounds: the second from cross-aggregated
    # models. Compared: the global model (every client's) and each middleware slot.
    "fedcross": Reference("servercross.FedCross", "clientcross.py", (_cross_train,),
                          _own_key, aggregates=True,
                          personal=lambda client: client.cross_server.global_model,
                          config={"similarity": "layers", "global_model": "uploads"},
                          args={"first_stage_bound": 0, "fedcross_alpha": 0.99,
                                "collaberative_model_select_strategy": 1},
                          rounds=2, sends=False, server_steps=(_cross_server_step,),
                          server_model=lambda server: server.global_model,
                          load_initial=_cross_attach_server,
                          also=(_cross_ours_slots, _cross_slot)),
    # FedGC (lambda 1) on clients of five classes each, our initial heads loaded into its
    # bias-free ones. Two rounds: the second from corrected heads. Compared: the global
    # body and each client's model (its head all classes wide, zero where it lacks one);
    # scored by PFLlib's test_metrics, over the client's classes.
    "fedgc": Reference("servergc.FedGC", "clientgc.py", ("train",), _own_key,
                       aggregates=True, personal=_gc_personalized, config={"lam": 1.0},
                       args={"lamda": 1.0}, split=True, rounds=2,
                       server_steps=("aggregate_parameters", "reg_train"),
                       server_model=lambda server: server.body,
                       load_initial=_gc_load_initial, accuracy=_pfllib_accuracy,
                       our_personal=_gc_ours_personal, clients=_class_subset_clients),
    # FedBN on a twin of our coaching_cnn_bn (PFLlib has no model with BatchNorm): its
    # clientbn.py takes from the server every parameter without "bn" in its name, so
    # BatchNorm's scale, shift and running averages stay the client's. The twin records
    # the biased batch variance in its running variance, as flax does (PyTorch: the
    # unbiased one, 2.5e-2 apart here; docs/verification.md). Compared: each client's
    # model after send_models, running averages included. Clients of FEDBN_TRAIN images.
    "fedbn": Reference("serverbn.FedBN", "clientbn.py", ("train",), _own_key,
                       aggregates=True, personal="model", config={}, args={},
                       compare_server=False, twin=twins.COACHING_CNN_BN_BIASED,
                       clients=_fedbn_clients),
}


# MOON on the BatchNorm twin (clients of MOON_BN_TRAIN images), its global and previous
# models in eval(), the authors' form (PFLlib's own leave them in train mode), its server
# averaging and sending the running averages as ours. Two rounds: in the first the
# contrastive loss is constant.
REFERENCES["moon_bn"] = REFERENCES["moon"]._replace(
    algorithm="moon", twin=twins.COACHING_CNN_BN_BIASED, clients=_moon_bn_clients,
    steps=(_moon_eval_train,), server_steps=("aggregate_parameters", _average_buffers),
    prepare=_receive_buffers)
# FedProto with half the clients a round, one round (so two are never sampled), scored
# under global_own: a client never sampled by every global prototype, as PFLlib's
# test_metrics scores every client.
# Per-FedAvg with half the clients a round, two rounds, scored as PFLlib scores it (our
# --perfedavg_evaluation=latest): after the last send_models every client, sampled or
# not, adapts the latest global model on its batch of our adaptation keys.
REFERENCES["perfedavg_sampled"] = REFERENCES["perfedavg"]._replace(
    algorithm="perfedavg", participation=0.5, steps=("train", "train"),
    config={**REFERENCES["perfedavg"].config, "evaluation": "latest"},
    args={"join_ratio": 0.5}, loads=_peravg_latest_loads,
    server_model=lambda server: server.model, final_step=_peravg_score,
    final_loads=_peravg_final_loads, our_personal=_peravg_ours_adapted)
# pFedMe with half the clients a round, one round, only the sampled trained (PFLlib's;
# ours --pfedme_train_clients=sampled): the server's model from the sampled uploads, the
# sampled clients' local models, the others' still the initial model in both.
REFERENCES["pfedme_sampled"] = REFERENCES["pfedme"]._replace(
    algorithm="pfedme", participation=0.5,
    config={**REFERENCES["pfedme"].config, "train_clients": "sampled"},
    args={**REFERENCES["pfedme"].args, "join_ratio": 0.5})
# Per-FedAvg beside PFLlib at a41f7ba, the code behind FedALA's table, two rounds, every
# client: its train_one_step adapts the latest global model by two steps on two test
# batches (ours: --perfedavg_evaluation=test), fed ours.
REFERENCES["perfedavg_a41f7ba"] = REFERENCES["perfedavg_sampled"]._replace(
    participation=1.0, args={},
    config={**REFERENCES["perfedavg_sampled"].config, "evaluation": "test"},
    final_loads=_peravg_final_test_loads, final_split="test",
    our_personal=_peravg_ours_tested, snapshot="PFLlib-a41f7ba")
# FedPHP beside PFLlib at a41f7ba, another algorithm there (ours: --fedphp_teacher=global):
# the received global model teaches, each client starts from (1 - mu) global + mu its
# own, mu 0.45 in the second round (0.9 R / 2), lambda 0.5; two rounds, every client
# scored after the closing send_models (mu 0.9), as its next evaluate() reads them.
REFERENCES["fedphp_a41f7ba"] = REFERENCES["fedphp"]._replace(
    algorithm="fedphp", config={"lam": 0.5, "mu_max": 0.9, "mu_participations": 2,
                                "mmd_kernel": "pfllib", "teacher": "global"},
    scored_after_send=True, also=None, snapshot="PFLlib-a41f7ba",
    server_model=lambda server: server.model)
REFERENCES["fedproto_sampled"] = REFERENCES["fedproto"]._replace(
    algorithm="fedproto", rounds=1, participation=0.5,
    config={**REFERENCES["fedproto"].config, "inference": "global_own"},
    args={**REFERENCES["fedproto"].args, "join_ratio": 0.5})


def _select_all(server) -> None:
  """After a round's receive: every client selected, so that the run's closing
  send_models builds every client's cloud model (each round's own selection is set again
  before its send_models)."""
  server.selected_clients = list(server.clients)


# FedAMP with half the clients a round, two rounds: its attention and cloud models from
# the round's uploaders only (our --fedamp_attention_from=uploaders, PFLlib's
# send_models), every client's cloud model built at the close, a stale own model in it
# for a client that sat the last round out.
REFERENCES["fedamp_sampled"] = REFERENCES["fedamp"]._replace(
    algorithm="fedamp", rounds=2, participation=0.5,
    config={**REFERENCES["fedamp"].config, "attention_from": "uploaders"},
    args={**REFERENCES["fedamp"].args, "join_ratio": 0.5},
    server_steps=("aggregate_parameters", _select_all))
# Server weights on clients of unequal sizes (UNEQUAL_SIZES), two rounds (the second
# trains from the weighted mean): "<name>_samples" PFLlib's as it is, weighted by sample
# counts (our --client_weights=samples, the default); "<name>_uniform" the authors'
# codes' 1/|S| (FedBABU's and LG-FedAvg's FedAvg(w), Ditto's simple_average: our
# --client_weights=uniform), PFLlib's weights set to it.
for _name in ("ditto", "lg_fedavg", "fedbabu"):
  REFERENCES[f"{_name}_samples"] = REFERENCES[_name]._replace(
      clients=_unequal_clients, algorithm=_name, rounds=2)
  REFERENCES[f"{_name}_uniform"] = REFERENCES[_name]._replace(
      clients=_unequal_clients, algorithm=_name, rounds=2, client_weights="uniform",
      server_steps=(_uniform_mean, "aggregate_parameters"))
# At seed 0, FedBABU's uniform round 2 meets a tie: a pre-activation within float32's
# rounding of zero (0 to 1.3e-8 of its layer's largest). Which side it takes follows the
# round-1 sum's rounding (PFLlib's upload order: 4 of 12 orders; XLA's optimisation level
# on ours), and the codes part by 1e-3 where it does. At seed 1 the smallest is 7.5e-7
# (verification/tie_probe.py).
REFERENCES["fedbabu_uniform"] = REFERENCES["fedbabu_uniform"]._replace(seed=1)
# FedFomo in PFLlib's form with half the clients a round, three rounds: its M is
# min(M, clients a round) = 2, and send_models sends min(M, last round's uploaders) of
# the top of P over every client's stored model (ours: --fedfomo_pool=uploader_count,
# none in the first round, stale models too); P's ties (its zeros and ones, from round 2
# on) broken by our noise (_fomo_ties), not by torch.topk's order.
# pFedLA beside KarhouTam/pFedLA (the public code; pfedla_driver.py), on coaching_cnn_bn's
# twin grouped into its layers' blocks (clients of FEDBN_TRAIN images), one client a round
# (its server trains a round's clients one after another), three rounds: the codes'
# trainable-only mixture (our --pfedla_buffers=own) and sign (after_minus_before), its
# defaults e = H = 100 and hn_lr 5e-3; each client's mixture from the final
# hypernetworks compared.
REFERENCES["pfedla"] = Reference(
    PFEDLA, "src/client/pFedLA.py", (), _own_key, aggregates=True, personal="model",
    config={"buffers": "own", "delta_sign": "after_minus_before", "server_lr": 5e-3},
    args={}, compare_server=False, rounds=3, participation=0.25,
    twin=pfedla_driver.GROUPED_TWIN, clients=_fedbn_clients)
REFERENCES["fedfomo_sampled"] = REFERENCES["fedfomo"]._replace(
    algorithm="fedfomo", rounds=3, participation=0.5,
    config={**REFERENCES["fedfomo"].config, "num_models": 2, "pool": "uploader_count"},
    args={**REFERENCES["fedfomo"].args, "join_ratio": 0.5}, prepare=_fomo_ties)


def _pac_stats_loads(n: int, batch_size: int) -> list[np.ndarray]:
  """statistics_extraction's loader, read three times (a batch for the shape, the class
  features, the class counts): any batches, the statistics are sums over the split."""
  return [np.arange(n).reshape(-1, batch_size)] * 3


def _pac_loads(key: jax.Array, n: int, epochs: int, batch_size: int
               ) -> list[list[np.ndarray]]:
  """FedPAC's loaders in a round: train's (its head epoch, then its body epochs: ours),
  collect_protos' (class means: any batches), and the next send_models' statistics."""
  return [bridges.shuffled_epochs(key, n, epochs, batch_size),
          [np.arange(n).reshape(-1, batch_size)], _pac_stats_loads(n, batch_size)]


def _pac_prepare(server, setting: Setting, clients: list[Client]) -> None:
  """Each PFLlib client's loader for the first send_models' statistics (each round's
  loads end with the next one's)."""
  for client, data in zip(server.clients, clients):
    loader = bridges.EpochLoader(bridges.model_inputs(data.x_train),
                                 data.y_train.astype(np.int64),
                                 _pac_stats_loads(len(data.y_train), setting.batch_size))
    client.load_train_data = lambda batch_size=None, loader=loader: loader


def _pac_server_step(server) -> None:
  """FedPAC's server after receive_models (serverpac.py's train()): the prototypes
  received, averaged and sent, the bases averaged, the heads combined. Two of its slips
  set right (docs/verification_departures.md): its V_i and h_i are paired with the
  uploads by client (train() lists them in the selection's order, the heads in
  receive_models' random.sample order), and the heads combined are copies of the
  uploads (its uploaded_heads are the clients' own modules, which set_head overwrites
  while later clients' combinations still read them)."""
  import flcore.servers.serverpac as serverpac  # pylint: disable=import-outside-toplevel
  uploaded = server.uploaded_ids
  server.receive_protos()           # sets uploaded_ids to the selection's order
  server.global_protos = serverpac.proto_aggregation(server.uploaded_protos)
  server.send_protos()
  server.uploaded_ids = uploaded
  server.aggregate_parameters()
  by_id = {client.id: client for client in server.clients}
  server.Vars = [by_id[i].V for i in uploaded]
  server.Hs = [by_id[i].h for i in uploaded]
  server.uploaded_heads = [copy.deepcopy(head) for head in server.uploaded_heads]
  with contextlib.redirect_stdout(io.StringIO()):  # it prints every client's weights
    server.aggregate_and_send_heads()


def _pac_ours_protos(algorithm, state):
  """Our global prototypes c_k [C, d] as a Dense kernel [d, C] (zero bias), every
  client's copy."""
  del algorithm
  protos = np.asarray(state.server.protos)
  clients = jax.tree.leaves(state.clients)[0].shape[0]
  return {"params": {"Dense_0": {
      "kernel": np.broadcast_to(protos.T, (clients,) + protos.T.shape),
      "bias": np.zeros((clients, protos.shape[0]))}}}


def _pac_protos(client):
  """The global prototypes the client received, class by class, as a Linear's weight."""
  import torch  # pylint: disable=import-outside-toplevel
  protos = torch.stack([client.global_protos[c] for c in range(10)])
  layer = torch.nn.Linear(protos.shape[1], protos.shape[0])
  with torch.no_grad():
    layer.weight.copy_(protos)
    layer.bias.zero_()
  return layer


# FedPAC beside PFLlib's (its server solves the heads' QP with cvxpy): one head epoch,
# then one body epoch (ours --local_epochs=2 --fedpac_head_epochs=1, PFLlib's
# --local_epochs=1), lambda 1, the global prototypes PFLlib's plain mean over clients
# (--fedpac_proto_mean=clients). Two rounds: the alignment acts once global prototypes
# exist. Compared: each client's model (the latest body under its combined head) and the
# global prototypes it received.
REFERENCES["fedpac"] = Reference(
    "serverpac.FedPAC", "clientpac.py", ("train",), _own_key, aggregates=True,
    personal="model", config={"lam": 1.0, "head_epochs": 1, "proto_mean": "clients"},
    args={"lamda": 1.0, "local_epochs": 1}, split=True, compare_server=False, rounds=2,
    our_epochs=2, loads=_pac_loads, prepare=_pac_prepare,
    server_steps=(_pac_server_step,), also=(_pac_ours_protos, _pac_protos))


def _apple_prepare(server, setting: Setting, clients: list[Client]) -> None:
  """PFLlib's APPLE as its code means it: each client a copy of the cores it is sent (its
  send_models hands every client the clients' own model_c modules, so a client would
  step, in place, the core that later clients mix, and its "recover self.model_cs[
  self.id] for other clients" copies model_c onto itself; the authors' code downloads
  copies), and its train(R) given the round (every client trains every round)."""
  del setting, clients
  for client in server.clients:
    client.set_models = lambda cores, client=client: type(client).set_models(
        client, copy.deepcopy(cores))
    client.train = lambda train=client.train, rounds=itertools.count(): train(next(rounds))


def _apple_ours_p(algorithm, state):
  """Each client's DR vector's move p_i - 1/N (it starts at 1/N) as a Dense kernel [N, 1]
  with a zero bias: the move itself compared, not p's value around 1/N."""
  del algorithm
  p = np.asarray(state.clients.p)
  moved = p - 1.0 / p.shape[1]
  return {"params": {"Dense_0": {"kernel": moved[:, :, None],
                                 "bias": np.zeros((p.shape[0], 1), np.float32)}}}


def _apple_p(client):
  """The client's ps - 1/N as a Linear's weight [1, N]."""
  import torch  # pylint: disable=import-outside-toplevel
  layer = torch.nn.Linear(len(client.ps), 1)
  with torch.no_grad():
    layer.weight.copy_(torch.tensor([client.ps], dtype=torch.float32) - 1.0 / len(client.ps))
    layer.bias.zero_()
  return layer


# APPLE beside PFLlib's (its p starts at 1/N, p_0 the size shares, so on clients of
# UNEQUAL_SIZES), two rounds (the second mixes the uploaded cores, lambda a round late):
# mu 0.1 (ours half: its proximal gradient is lambda mu (p - p_0)), L 1 (of its two
# global rounds: ours reg_rounds 2), its p lr APPLE_DRLR (ours p_lr_scale its ratio to the
# lr), its core step N lr (ours core_lr_scale N); ours in its form (apple.py): p from 1/N,
# its mean-of-means gradient after the core's step, the mixture before the last step
# uploaded and scored, lambda's lag. Each client's copies of the cores (_apple_prepare).
# Compared: each client's scored model (its self.model) and p's move.
APPLE_DRLR = 0.05
REFERENCES["apple"] = Reference(
    "serverapple.APPLE", "clientapple.py", ("train",), _own_key, aggregates=True,
    personal="model",
    config={"mu": 0.05, "reg_rounds": 2, "p_lr_scale": APPLE_DRLR / Setting().lr,
            "core_lr_scale": float(Setting().clients), "p_start": "uniform",
            "p_gradient": "pfllib", "upload": "mixture", "lambda_round": "previous"},
    args={"mu": 0.1, "dr_learning_rate": APPLE_DRLR, "L": 1.0, "global_rounds": 2},
    compare_server=False, rounds=2, server_steps=(), prepare=_apple_prepare,
    also=(_apple_ours_p, _apple_p), clients=_unequal_clients)


def _copy_uploads(server) -> None:
  """The uploaded models as copies: PFLlib's receive_models lists the clients' own
  modules, so once ALA writes a client's model in send_models, the cloud models of the
  clients after it would mix that theta_hat in place of the upload (PFLlib's FedAMP alone
  never writes a client's model there)."""
  server.uploaded_models = [copy.deepcopy(model) for model in server.uploaded_models]


def _ala_host_prepare(server, setting: Setting, clients: list[Client],
                      on: ala_hosts.AlaOn, first_round: int = 0) -> None:
  """The host's PFLlib clients with ALA where `on` says (ala_hosts.attach), on their
  training data as read_client_data reads our files, then the FedALA rows' slice
  (_ala_prepare); a host whose server first sends in round `first_round` (FedAMP: 1)
  draws that round's slice first."""
  from utils.data_utils import process_image  # pylint: disable=import-outside-toplevel
  train = [process_image({"x": bridges.model_inputs(c.x_train),
                          "y": c.y_train.astype(np.int64)}) for c in clients]
  ala_hosts.attach(server, train, on, ALA_ARGS)
  _ala_prepare(server, setting, clients)
  for client in server.clients:
    client.ALA.train_data.count = first_round


def _renumbered(*stacked) -> dict:
  """Dense-layer trees one after another, as one tree of Dense_0, Dense_1, ..."""
  layers = [layer for params in stacked for _, layer in sorted(
      params["params"].items(), key=lambda item: int(item[0].rsplit("_", 1)[1]))]
  return {"params": {f"Dense_{i}": layer for i, layer in enumerate(layers)}}


def _ala_host_ours(algorithm, state, earlier, received=lambda message: message,
                   more=None):
  """Each client's theta_hat as ala.with_ala builds it, from the last round's theta_i
  and the model its host sent (`received`: the host's ala_hooks.received), as the model
  the host trains from (theta_i with the received layers replaced); then W as one more
  layer. `more`: (our host's client state) -> layers compared before them."""
  sent = received(algorithm.broadcast(earlier.server, earlier.clients))
  local = earlier.clients.local
  theta_hat = jax.vmap(ala.aggregate_locally)(local, sent, state.clients.weights)
  start = {"params": {**local["params"], **theta_hat["params"]}}
  front = () if more is None else (more(state.clients.host),)
  return _renumbered(*front, start, state.clients.weights)


def _ala_host_theirs(client, more=None):
  """_ala_theirs after `more`'s module (client -> module), where the row compares one."""
  import torch  # pylint: disable=import-outside-toplevel
  ala_layers = _ala_theirs(client)
  return ala_layers if more is None else torch.nn.ModuleList([more(client), ala_layers])


def _on_host(name: str, on: ala_hosts.AlaOn, received=lambda message: message,
             first_round: int = 0, more: tuple | None = None, **changes) -> Reference:
  """Host `name`'s row (its Reference) under ALA in the authors' form (ALA_CONFIG): its
  PFLlib client with the authors' ALA where `on` says, its keys and loaders split as
  with_ala splits a client's key (the host's half second), three rounds (ALA rests,
  trains W until the loss settles, one epoch), theta_hat and W of the last round compared
  beside the host's scored model, read after training (the closing send_models would run
  ALA again, which ours has not run). `more`: (ours, theirs) compared before theta_hat."""
  host = REFERENCES[name]
  assert host.prepare is None and host.also_previous is False, name
  loads = None
  if host.loads is not None:
    loads = lambda key, *rest, host_loads=host.loads: host_loads(ala_host_key(key), *rest)
  return host._replace(
      algorithm=name, steps=(_ala_keep, *host.steps),
      trainings=lambda key, trainings=host.trainings: trainings(ala_host_key(key)),
      loads=loads, ala=ALA_CONFIG, rounds=3, scored_after_send=False,
      prepare=functools.partial(_ala_host_prepare, on=on, first_round=first_round),
      also=(functools.partial(_ala_host_ours, received=received,
                              more=None if more is None else more[0]),
            functools.partial(_ala_host_theirs, more=None if more is None else more[1])),
      also_previous=True, **changes)


# ALA on the hosts of the FedALA poster's "Applicability of ALA" table, each host's row
# above under --ala (ALA_CONFIG) beside its PFLlib client with the authors' ALA composed
# in (ala_hosts.py), on the model our host's ala_hooks name:
_WHOLE = ala_hosts.AlaOn(received=ala_hosts.whole_model, local=ala_hosts.whole_model)
# FedProx: the model it trains; set_parameters also keeps the global model as the
# proximal anchor, which ALA leaves alone (ours: --fedprox_ala_anchor=global, the
# default). Scored: theta_i, the trained model (FedAvg's hooks). fedprox_ala_theta_hat:
# the anchor at theta_hat on both sides (ours --fedprox_ala_anchor=theta_hat).
REFERENCES["fedprox_ala"] = _on_host("fedprox", _WHOLE, personal="model")
REFERENCES["fedprox_ala_theta_hat"] = _on_host(
    "fedprox", _WHOLE._replace(after=ala_hosts.anchor_at_theta_hat), personal="model",
    config={**REFERENCES["fedprox"].config, "ala_anchor": "theta_hat"})
# Per-FedAvg: the meta model, which its scoring adapts (theta_hat, kept before training).
REFERENCES["perfedavg_ala"] = _on_host("perfedavg", _WHOLE)
# FedRep: the base it receives, W over the base's top layer, learned on the whole model's
# loss (the base under the client's head: ala_hosts.routed_base). Scored: theta_i.
REFERENCES["fedrep_ala"] = _on_host(
    "fedrep", ala_hosts.AlaOn(received=ala_hosts.routed_base, local=ala_hosts.routed_base))
# pFedMe: theta's solver start and the local model w_i (both copies set_parameters makes).
REFERENCES["pfedme_ala"] = _on_host(
    "pfedme", _WHOLE._replace(after=ala_hosts.copy_model_into_local_params))
# Ditto: the global-model part it trains (ptrain's anchor too), not the personal model.
REFERENCES["ditto_ala"] = _on_host("ditto", _WHOLE)
# FedAMP: its cloud model u_i, which PFLlib's set_parameters builds, ALA then initialising
# the client's own model (ours: its start and, at our lambda 0 without effect, its
# anchor). Its server first sends in round 2: ALA rests in round 1 on our side only, and
# runs in rounds 2 and 3 on both (the cloud models of round 2 in its theta_hat).
REFERENCES["fedamp_ala"] = _on_host(
    "fedamp", _WHOLE._replace(received=lambda client: client.client_u),
    received=lambda message: message.cloud_model, first_round=1,
    server_steps=(_copy_uploads, "aggregate_parameters"))
# FedPHP: the model it trains against the HPM (mu ramped over the three rounds); the HPM
# compared too.
REFERENCES["fedphp_ala"] = _on_host(
    "fedphp", _WHOLE, more=(lambda host: host.hpm, _php_hpm),
    config={**REFERENCES["fedphp"].config, "mu_participations": 3},
    args={**REFERENCES["fedphp"].args, "global_rounds": 3})


def _mlp_twin(torch):
  """Our MLP 784-100-10 in PyTorch with PFLlib's layer names (fc1, fc): its DNN ends in
  log_softmax, which BaseHeadSplit would put under the head."""
  class MlpTwin(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.fc1, self.fc = torch.nn.Linear(784, HIDDEN), torch.nn.Linear(HIDDEN, 10)

    def forward(self, x):
      return self.fc(torch.relu(self.fc1(torch.flatten(x, 1))))
  return MlpTwin()
PFLLIB_COMMIT = "d832e76f6a23"
SNAPSHOT_COMMITS = {"PFLlib": PFLLIB_COMMIT, "PFLlib-a41f7ba": "a41f7bac0e25"}


def _pfllib_round(reference: Reference, setting: Setting, clients: list[Client], initial,
                  batches, built=None, loaded=None, final=None
                  ) -> tuple[list | None, list, list[float]]:
  """One PFLlib round: (the server's layers, None where it averages nothing; each client's
  layers of the model it is scored with; each client's test accuracy of that model)."""
  bridges.import_pfllib(reference.snapshot)
  import importlib  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from flcore.trainmodel import models  # pylint: disable=import-outside-toplevel
  module, class_name = reference.server.split(".")
  server_class = getattr(importlib.import_module(f"flcore.servers.{module}"), class_name)
  torch.manual_seed(setting.seed)
  # PFLlib's receive_models uploads in a random.sample order (its main.py seeds torch
  # only): the order in which the server sums, so rounding. Seeded, a row prints the
  # same number every run; unseeded, fedbabu_uniform met a ReLU tie in round 2 after 4
  # of 12 first-round orders (1e-03) and fedcac after 3 of 12 (5e-03).
  random.seed(setting.seed)
  warnings.filterwarnings("ignore", category=UserWarning, module="flcore")
  twin = reference.twin or _MLP
  if reference.twin is not None:
    model = reference.twin.build(torch)
  else:
    model = _mlp_twin(torch) if reference.split else models.DNN(784, HIDDEN, 10)
  twin.load(model, initial)
  if reference.split:
    head = copy.deepcopy(model.fc)
    model.fc = torch.nn.Identity()

    # a41f7ba's split is its LocalModel(base, predictor).
    model = (getattr(models, "BaseHeadSplit", None) or models.LocalModel)(model, head)
  args = _pfllib_args(setting, class_name, model, **reference.args)
  with tempfile.TemporaryDirectory() as folder:
    system = bridges.write_pfllib_split(clients, folder, "verify")
    with (_working_directory(system), contextlib.redirect_stdout(open(os.devnull, "w")),
          _loaders_while_built(built, clients)):
      server = server_class(args, 0)
  if reference.prepare is not None:
    reference.prepare(server, setting, clients)
  if loaded is not None:
    reference.load_initial(server, loaded)
  server.selected_clients = list(server.clients)
  train_key, sampled = root_keys(setting.seed)["train"], num_sampled_clients(
      reference.participation, len(clients))
  for round_index, round_batches in enumerate(batches):  # [round][client][load][epoch]
    active = np.asarray(sampled_clients(jax.random.fold_in(train_key, round_index),
                                        len(clients), sampled))
    if not active.all():
      server.selected_clients = [c for c in server.clients if active[c.id]]
    if reference.aggregates and reference.sends:
      _send_models(server, reference, round_index)
    for client, data, trainings in zip(server.clients, clients, round_batches):
      if not active[client.id]:
        continue
      loaders = iter([bridges.EpochLoader(bridges.model_inputs(data.x_train),
                                          data.y_train.astype(np.int64), epochs)
                      for epochs in trainings])
      client.load_train_data = lambda batch_size=None, loaders=loaders: next(loaders)
      for step in reference.steps:
        step(client) if callable(step) else getattr(client, step)()
    if reference.aggregates:
      server.receive_models()
      for step in reference.server_steps:
        step(server) if callable(step) else getattr(server, step)()
  if reference.aggregates and reference.sends and reference.scored_after_send:
    # Where PFLlib scores a round: its next round's evaluate() follows send_models (a
    # client scored with its own model holds the server's new part by then).
    _send_models(server, reference, len(batches))
  if final is not None:  # every client scored through its own step (final_step)
    for client, data, loads in zip(server.clients, clients, final):
      x, y = getattr(data, f"x_{reference.final_split}"), getattr(data, f"y_{reference.final_split}")
      loaders = iter([bridges.EpochLoader(bridges.model_inputs(x), y.astype(np.int64), epochs)
                      for epochs in loads])
      setattr(client, f"load_{reference.final_split}_data",
              lambda batch_size=None, loaders=loaders: next(loaders))
      reference.final_step(client)
  server_layers = None
  if reference.aggregates and reference.compare_server:
    server_layers = twin.read(copy.deepcopy(server.global_model))
  scored = [_scored_model(reference, c, server) for c in server.clients]
  scored_layers = [twin.read(m) for m in scored]
  if reference.also is not None:
    scored_layers += [bridges.torch_linear_layers(reference.also[1](c))
                      for c in server.clients]
  if reference.accuracy is not None:
    return (server_layers, scored_layers,
            [reference.accuracy(c, d) for c, d in zip(server.clients, clients)])
  return (server_layers, scored_layers,
          [_torch_accuracy(m, d) for m, d in zip(scored, clients)])


def _pfedla_round(reference: Reference, setting: Setting, clients: list[Client], initial,
                  batches, built=None, loaded=None, final=None
                  ) -> tuple[list | None, list, list[float]]:
  """_pfllib_round's answer from KarhouTam/pFedLA's code: no server model (it has
  none); each client's generated mixture and its test accuracy. Our initial
  hypernetworks loaded into its pickles; the clients our run samples, one a round."""
  del built, loaded, final
  state = _our_initial_state("pfedla", setting, clients, reference)
  active = pfedla_driver.sampled(root_keys(setting.seed)["train"], len(clients),
                                 num_sampled_clients(reference.participation, len(clients)))
  layers, accuracy = pfedla_driver.run(
      clients, initial, batches, state.server.hypernetworks, active,
      reference.config["server_lr"], setting.batch_size, setting.lr,
      reference.our_epochs or setting.local_epochs, _torch_accuracy)
  return None, layers, accuracy


def _reference_label(reference: Reference) -> str:
  if reference.server == PFEDLA:
    return (f"KarhouTam/pFedLA@{PFEDLA_COMMIT} src/server/pFedLA.py,"
            f" {reference.client_file}")
  server_file = reference.server.split(".")[0] + ".py"
  ala_file = "" if reference.ala is None else ", utils/ALA.py"  # composed in (ala_hosts.py)
  return (f"PFLlib@{SNAPSHOT_COMMITS[reference.snapshot]} flcore/servers/{server_file},"
          f" flcore/clients/{reference.client_file}{ala_file}")


def our_config(name: str, train: TrainConfig, reference: Reference):
  """Our algorithm's config for the row: its fields, under ALA where the row puts it."""
  config = algorithms.default_config(name, train, **reference.config)
  if reference.ala is None:
    return config
  return algorithms.Plugged(config, ala=ala.AlaConfig(**reference.ala))


def _our_initial_state(name: str, setting: Setting, clients: list[Client],
                       reference: Reference):
  """Our algorithm's state after init, as run_algorithm starts it (same keys)."""
  data = stack_clients(clients, num_classes=10)
  model = build_model((reference.twin or _MLP).model, 10, (HIDDEN,))
  epochs = reference.our_epochs or setting.local_epochs
  train = TrainConfig(rounds=reference.rounds, local_epochs=epochs,
                      batch_size=setting.batch_size, lr=setting.lr, momentum=0.0,
                      weight_decay=0.0, seed=setting.seed, log_every=0,
                      client_weights=reference.client_weights,
                      participation=reference.participation)
  trainer = make_client_trainer(model.apply, make_optimizer(train.lr, 0.0, 0.0),
                                epochs, train.batch_size)
  config = our_config(name, train, reference)
  keys = root_keys(setting.seed)
  init = jitted_init(algorithms.build(name, config, trainer), trainer, data)
  return init(initial_model(model, data, keys["init"]), data.buckets, keys["algorithm"])


def _built_batches(reference: Reference, setting: Setting, clients: list[Client]):
  """[client][load][epoch] -> batch indices the reference's clients read while its
  server is built, from the keys our algorithm.init hands client k (fold_in(algorithm
  key, k)); None where it trains nobody then."""
  if reference.built_loads is None:
    return None
  keys = client_keys(root_keys(setting.seed)["algorithm"], len(clients))
  epochs = reference.our_epochs or setting.local_epochs
  return [reference.built_loads(keys[k], len(c.x_train), epochs, setting.batch_size)
          for k, c in enumerate(clients)]


@contextlib.contextmanager
def _loaders_while_built(built, clients: list[Client]):
  """PFLlib's clients reading the loaders of `built` in order while the server is built
  (their data files otherwise); nothing where `built` is None."""
  if built is None:
    yield
    return
  from flcore.clients.clientbase import Client as PfllibClient  # pylint: disable=import-outside-toplevel
  loaders = [iter([bridges.EpochLoader(bridges.model_inputs(data.x_train),
                                       data.y_train.astype(np.int64), epochs)
                   for epochs in loads]) for loads, data in zip(built, clients)]
  original = PfllibClient.load_train_data
  PfllibClient.load_train_data = lambda self, batch_size=None: next(loaders[self.id])
  try:
    yield
  finally:
    PfllibClient.load_train_data = original


def _send_models(server, reference: Reference, round_index: int) -> None:
  server.send_models(*((round_index,) if reference.send_takes_round else ()))


def _scored_model(reference: Reference, client, server):
  if reference.personal is None:
    return server.global_model
  if callable(reference.personal):
    return reference.personal(client)
  return getattr(client, reference.personal)


def _our_round(name: str, setting: Setting, clients: list[Client], reference: Reference):
  """One round here: (the run's result, its initial model, the engine's batches)."""
  name = reference.algorithm or name
  data = stack_clients(clients, num_classes=10)
  model = build_model((reference.twin or _MLP).model, 10, (HIDDEN,))
  epochs = reference.our_epochs or setting.local_epochs
  train = TrainConfig(rounds=reference.rounds, local_epochs=epochs,
                      batch_size=setting.batch_size, lr=setting.lr, momentum=0.0,
                      weight_decay=0.0, seed=setting.seed, log_every=0,
                      client_weights=reference.client_weights,
                      participation=reference.participation)
  config = our_config(name, train, reference)
  keys = root_keys(setting.seed)
  initial = initial_model(model, data, keys["init"])
  if reference.loads is None:
    # Clients of unequal sizes are padded in their size bucket: the engine's shuffles
    # draw over the padded size.
    draw = (bridges.padded_client_batches if len(set(data.split_sizes("train"))) > 1
            else bridges.client_batches)
    batches = [draw(keys["train"], r, data, epochs, setting.batch_size, reference.trainings)
               for r in range(reference.rounds)]
  else:
    loads = lambda key, n: reference.loads(key, n, epochs, setting.batch_size)
    batches = [bridges.client_loads(keys["train"], r, data, loads)
               for r in range(reference.rounds)]
  result = run_algorithm(algorithms.make(name, config), model, data, train, progress=None)
  # Each client's scored model, as the algorithm defines it.
  trainer = make_client_trainer(model.apply, make_optimizer(train.lr, 0.0, 0.0),
                                train.local_epochs, train.batch_size)
  state = result.final_state.algorithm
  built = algorithms.build(name, config, trainer)
  personal = built.personalized_params(state.server, state.clients)
  compared = _client_layers(reference.our_personal(personal),
                            (reference.twin or _MLP).to_torch)
  if reference.also is not None:
    earlier = ()
    if reference.also_previous:  # the state a round earlier: a run one round shorter
      shorter = dataclasses.replace(train, rounds=train.rounds - 1)
      earlier = (run_algorithm(algorithms.make(name, config), model, data, shorter,
                               progress=None).final_state.algorithm,)
    compared += _client_layers(reference.also[0](built, state, *earlier))
  return result, initial, batches, compared


def _flat(layers) -> list[np.ndarray]:
  return [array for layer in layers for array in layer]


def _client_layers(stacked, to_torch=bridges.dense_stack_to_torch) -> list:
  """[K, ...] client parameters -> each client's PyTorch layers (nn.Linear's)."""
  count = jax.tree.leaves(stacked)[0].shape[0]
  return [to_torch(jax.tree.map(lambda a, k=k: np.asarray(a[k]), stacked))
          for k in range(count)]


def compare(name: str, setting: Setting = Setting(), control: bool = False) -> Comparison:
  """One round of `name` (a key of REFERENCES) beside PFLlib's: the server's model where
  it averages one, and the model each client is scored with. With `control`, the
  reference gets each epoch's batches in another order: a check that cannot tell is no
  check."""
  reference = REFERENCES[name]
  if reference.seed is not None:
    setting = setting._replace(seed=reference.seed)
  clients = (reference.clients or real_clients)(setting)
  result, initial, batches, compared = _our_round(name, setting, clients, reference)
  if control:
    batches = [[[[np.roll(epoch, 1, axis=0) for epoch in training] for training in client]
                for client in round_batches] for round_batches in batches]
  built = _built_batches(reference, setting, clients)
  loaded = (None if reference.load_initial is None
            else _our_initial_state(name, setting, clients, reference))
  twin = reference.twin or _MLP
  state = result.final_state.algorithm
  final = (None if reference.final_loads is None
           else reference.final_loads(state, setting, clients))
  run_reference = _pfedla_round if reference.server == PFEDLA else _pfllib_round
  server, scored, accuracy = run_reference(reference, setting, clients,
                                           twin.to_torch(initial), batches, built, loaded,
                                           final)
  errors = []
  if server is not None:
    ours = twin.to_torch(jax.tree.map(np.asarray, reference.server_model(state.server)))
    errors.append(relative_error(_flat(ours), _flat(server)))
  if reference.personal is not None:
    assert len(compared) == len(scored), (len(compared), len(scored))
    errors += [relative_error(_flat(o), _flat(r)) for o, r in zip(compared, scored)]
  ours_accuracy = [float(a) for a in result.history.test_score[-1]]
  return Comparison(
      algorithm=name, reference=_reference_label(reference),
      rounds=reference.rounds,
      max_relative_error=max(errors),
      accuracy_gap=float(np.max(np.abs(np.asarray(ours_accuracy) - np.asarray(accuracy)))),
      ours_accuracy=ours_accuracy, reference_accuracy=accuracy, seed=setting.seed)
