"""Check (a) of the verification: one round of an algorithm here and in PFLlib, from the
same initial model and the same batches, on a small real split; every client's model and
the server's compared, and each client's test accuracy.

The split: K MNIST clients of `train_size` training images (a multiple of the batch size:
PFLlib drops a last partial batch, the engine does not), disjoint slices of the official
training set, each with its own test slice. The model: our MLP with one hidden layer of
100, PFLlib's DNN (784-100-10; its log_softmax before the cross-entropy changes neither
the loss nor the gradient). Client SGD without momentum or weight decay, PFLlib's.
"""

import argparse
import contextlib
import copy
import os
import tempfile
from typing import NamedTuple

import jax
import numpy as np

from fedora_jax import algorithms
from fedora_jax.data.client_data import Client, stack_clients
from fedora_jax.data.sources import load_mnist
from fedora_jax.models import build_model
from fedora_jax.simulation import TrainConfig, initial_model, root_keys, run_algorithm
from verification import bridges

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
  max_relative_error: float    # over every compared tensor: max |ours - ref| / max |ref|
  accuracy_gap: float          # max over clients of |our test accuracy - the reference's|
  ours_accuracy: list[float]
  reference_accuracy: list[float]


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
      mu=0.0)
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
  with torch.no_grad():
    logits = torch_model(torch.from_numpy(bridges.model_inputs(client.x_test)))
  return float(np.mean(logits.argmax(1).numpy() == client.y_test))


def _pfllib_round(name: str, setting: Setting, clients: list[Client], initial,
                  batches, **extra) -> tuple[list, list, list[float]]:
  """One PFLlib round of `name` (FedAvg, FedProx, Local): (the server's layers or None,
  each client's layers, each client's test accuracy of the model it is scored with)."""
  bridges.import_pfllib()
  import torch  # pylint: disable=import-outside-toplevel
  from flcore.servers.serveravg import FedAvg  # pylint: disable=import-outside-toplevel
  from flcore.servers.serverlocal import Local  # pylint: disable=import-outside-toplevel
  from flcore.servers.serverprox import FedProx  # pylint: disable=import-outside-toplevel
  from flcore.trainmodel.models import DNN  # pylint: disable=import-outside-toplevel
  server_class = {"FedAvg": FedAvg, "FedProx": FedProx, "Local": Local}[name]
  torch.manual_seed(setting.seed)
  model = DNN(784, HIDDEN, 10)
  bridges.load_linear_layers(model, initial)
  with tempfile.TemporaryDirectory() as folder:
    system = bridges.write_pfllib_split(clients, folder, "verify")
    with _working_directory(system), contextlib.redirect_stdout(open(os.devnull, "w")):
      server = server_class(_pfllib_args(setting, name, model, **extra), 0)
  server.selected_clients = list(server.clients)
  if name != "Local":
    server.send_models()
  for client, data, epochs in zip(server.clients, clients, batches):
    loader = bridges.EpochLoader(bridges.model_inputs(data.x_train),
                                 data.y_train.astype(np.int64), epochs)
    client.load_train_data = lambda batch_size=None, loader=loader: loader
    client.train()
  client_layers = [bridges.torch_linear_layers(c.model) for c in server.clients]
  if name == "Local":
    scored = [c.model for c in server.clients]
    return None, client_layers, [_torch_accuracy(m, d) for m, d in zip(scored, clients)]
  server.receive_models()
  server.aggregate_parameters()
  global_model = copy.deepcopy(server.global_model)
  return (bridges.torch_linear_layers(global_model), client_layers,
          [_torch_accuracy(global_model, d) for d in clients])


def _our_round(name: str, setting: Setting, clients: list[Client], config):
  """One round here: (the run's result, its initial model, the engine's batches)."""
  data = stack_clients(clients, num_classes=10)
  model = build_model("mlp", 10, (HIDDEN,))
  train = TrainConfig(rounds=1, local_epochs=setting.local_epochs,
                      batch_size=setting.batch_size, lr=setting.lr, momentum=0.0,
                      weight_decay=0.0, seed=setting.seed, log_every=0)
  keys = root_keys(setting.seed)
  initial = initial_model(model, data, keys["init"])
  batches = bridges.client_batches(keys["train"], 0, data, setting.local_epochs,
                                   setting.batch_size)
  result = run_algorithm(name, config, model, data, train, progress=None)
  return result, initial, batches


def _layers_of_clients(stacked) -> list:
  """[K, ...] client parameters -> each client's nn.Linear layers."""
  count = jax.tree.leaves(stacked)[0].shape[0]
  return [bridges.dense_stack_to_torch(jax.tree.map(lambda a, k=k: np.asarray(a[k]), stacked))
          for k in range(count)]


# PFLlib's files for each algorithm checked here: (server, client).
PFLLIB_FILES = {"fedavg": ("serveravg.py", "clientavg.py"),
                "fedprox": ("serverprox.py", "clientprox.py"),
                "local": ("serverlocal.py", "clientavg.py")}
PFLLIB_COMMIT = "d832e76f6a23"


def compare(name: str, setting: Setting = Setting(), control: bool = False) -> Comparison:
  """One round of `name` (fedavg, fedprox, local) beside PFLlib's. With `control`, the
  reference gets each epoch's batches in another order: a check that cannot tell is no
  check."""
  clients = real_clients(setting)
  mu = 0.1
  if name == "fedprox":
    config = algorithms.default_config("fedprox", mu=mu)
  else:
    config = algorithms.default_config(name)
  result, initial, batches = _our_round(name, setting, clients, config)
  initial_layers = bridges.dense_stack_to_torch(initial)
  reference_name = {"fedavg": "FedAvg", "fedprox": "FedProx", "local": "Local"}[name]
  if control:  # the reference given other batches: the check must see it
    batches = [[np.roll(epoch, 1, axis=0) for epoch in client] for client in batches]
  server, client_layers, accuracy = _pfllib_round(reference_name, setting, clients,
                                                  initial_layers, batches, mu=mu)
  state = result.final_state.algorithm
  ours_accuracy = [float(a) for a in result.history.test_score[-1]]
  if name == "local":
    ours_clients = _layers_of_clients(state.clients)
    error = max(relative_error(sum(map(list, o), []), sum(map(list, r), []))
                for o, r in zip(ours_clients, client_layers))
  else:
    ours_server = bridges.dense_stack_to_torch(jax.tree.map(np.asarray, state.server))
    error = relative_error(sum(map(list, ours_server), []), sum(map(list, server), []))
  server_file, client_file = PFLLIB_FILES[name]
  return Comparison(
      algorithm=name, reference=(f"PFLlib@{PFLLIB_COMMIT} flcore/servers/{server_file},"
                                 f" flcore/clients/{client_file}"),
      max_relative_error=error,
      accuracy_gap=float(np.max(np.abs(np.asarray(ours_accuracy) - np.asarray(accuracy)))),
      ours_accuracy=ours_accuracy, reference_accuracy=accuracy)
