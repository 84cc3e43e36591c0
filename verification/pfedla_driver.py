"""pFedLA's check beside KarhouTam/pFedLA (the public code; ../shared/references/pFedLA).

Its server (src/server/pFedLA.py) is a script that parses argv and reads its own dataset
pickles, so the driver builds a bare pFedLAServer and calls the methods its train() calls
for a client: generate_client_model_parameters (the layer-wise mixture, trainable
tensors by the hypernetwork's alpha, buffers by a one-hot weight), its pFedLAClient's
_train (our batches in place of its loader), update_hypernetwork and
update_client_model_parameters. The model: a twin of our coaching_cnn_bn grouped into
blocks as our layers are (its hypernetwork gives one alpha per top-level block, ours one
per top-level flax module), our initial model for every client and our initial
hypernetworks in its per-client pickles. Its modules are named utils, client, server,
base, as PFLlib's are: they are imported while the driver runs and taken out after.
"""

import argparse
import contextlib
import os
import pathlib
import pickle
import sys
import tempfile
import types
from typing import Any, Callable

import jax
import numpy as np

from verification import bridges, twins

# Our layer l (layers.layer_names' order) is the twin's block l + 1.
BLOCKS = ("block1", "block2", "block3", "block4", "block5")
# The top-level modules the reference's code imports under these names.
_NAMES = ("utils", "client", "server", "base", "path")


def grouped_twin(torch):
  """coaching_cnn_bn's twin (BatchNorm recording the biased variance, as flax) with its
  convolution or dense layer and BatchNorm in one top-level block each, as our ConvBN_0,
  ConvBN_1, DenseBN_0, DenseBN_1 and Dense_0 are; the same layers in the same order."""
  flat = twins.coaching_cnn_bn_twin(torch, unbiased_variance=False)
  nn = torch.nn

  class GroupedCnnBn(nn.Module):
    def __init__(self):
      super().__init__()
      self.block1 = nn.ModuleDict({"conv": flat.conv1, "bn": flat.bn1})
      self.block2 = nn.ModuleDict({"conv": flat.conv2, "bn": flat.bn2})
      self.block3 = nn.ModuleDict({"fc": flat.fc1, "bn": flat.bn3})
      self.block4 = nn.ModuleDict({"fc": flat.fc2, "bn": flat.bn4})
      self.block5 = nn.ModuleDict({"fc": flat.fc})

    def forward(self, x):
      x = ((x - twins.MNIST_MEAN) / twins.MNIST_STD).reshape(x.shape[0], 1, 28, 28)
      pool = lambda h: torch.nn.functional.max_pool2d(h, 2)
      x = pool(torch.relu(self.block1["bn"](self.block1["conv"](x))))
      x = pool(torch.relu(self.block2["bn"](self.block2["conv"](x))))
      x = torch.relu(self.block3["bn"](self.block3["fc"](torch.flatten(x, 1))))
      return self.block5["fc"](torch.relu(self.block4["bn"](self.block4["fc"](x))))
  return GroupedCnnBn()


GROUPED_TWIN = twins.COACHING_CNN_BN._replace(build=grouped_twin)


def _path_stand_in() -> types.ModuleType:
  """The `path` package's Path where it is not installed: what the reference uses of it
  (parent, abspath, /) on pathlib's."""
  class Path(type(pathlib.Path())):  # type: ignore[misc]
    def abspath(self):
      return Path(os.path.abspath(self))
  module = types.ModuleType("path")
  module.Path = Path  # type: ignore[attr-defined]
  return module


@contextlib.contextmanager
def reference_modules():
  """(server module, client module, models module) of the reference, imported with its
  src/ and src/server/ on sys.path; sys.modules and sys.path as they were after."""
  src = bridges.reference_path("pFedLA", "src")
  clashing = {name: module for name, module in sys.modules.items()
              if name.split(".")[0] in _NAMES}
  for name in clashing:
    del sys.modules[name]
  saved_path = list(sys.path)
  sys.path[:0] = [src, os.path.join(src, "server")]
  try:
    import importlib.util  # pylint: disable=import-outside-toplevel
    if importlib.util.find_spec("path") is None:
      sys.modules["path"] = _path_stand_in()
    import importlib  # pylint: disable=import-outside-toplevel,reimported
    yield (importlib.import_module("server.pFedLA"), importlib.import_module("client.pFedLA"),
           importlib.import_module("utils.models"))
  finally:
    for name in [n for n in sys.modules if n.split(".")[0] in _NAMES]:
      del sys.modules[name]
    sys.modules.update(clashing)
    sys.path[:] = saved_path


def _load_hypernetworks(torch, hypernet, ours, cache: pathlib.Path) -> None:
  """Our initial hypernetworks (pfedla.LayerHypernetworks, [N, ...]) into the reference's
  embedding table and per-client pickles ({"mlp": Sequential, "fc": {block: Linear}})."""
  with torch.no_grad():
    hypernet.embedding.weight.copy_(torch.from_numpy(np.array(ours.embeddings)))
  for client in range(hypernet.client_num):
    with open(cache / f"{client}.pkl", "rb") as f:
      parts = pickle.load(f)
    linears = [m for m in parts["mlp"] if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
      for linear, (w, b) in zip(linears, ours.hidden, strict=True):
        linear.weight.copy_(torch.from_numpy(np.asarray(w[client]).T.copy()))
        linear.bias.copy_(torch.from_numpy(np.asarray(b[client]).copy()))
      for layer, block in enumerate(BLOCKS):
        fc = parts["fc"][block]
        fc.weight.copy_(torch.from_numpy(np.asarray(ours.heads_w[client, layer]).T.copy()))
        fc.bias.copy_(torch.from_numpy(np.asarray(ours.heads_b[client, layer]).copy()))
    with open(cache / f"{client}.pkl", "wb") as f:
      pickle.dump(parts, f)


def run(clients: list, initial_layers: list, batches: list, hypernetworks: Any,
        active: Callable[[int], np.ndarray], hn_lr: float, batch_size: int, lr: float,
        epochs: int, accuracy: Callable[[Any, Any], float],
        on_round: Callable[[Callable[[], tuple[list, list[float]]]], None] | None = None
        ) -> tuple[list, list[float]]:
  """The reference's rounds ([round][client][training][epoch] batch indices; the
  clients `active(round)` trains, one after another in id order, as its train() loop
  does for its sampled list): each client's personalised model (its generated mixture
  from the final hypernetworks and models) as the twin's layers, and its test accuracy.
  `on_round`, after each round, gets a function that returns those of that round
  (check (b)'s scoring, verification/long.py)."""
  import torch  # pylint: disable=import-outside-toplevel
  with reference_modules() as (server_module, client_module, models_module), \
      tempfile.TemporaryDirectory() as folder:
    models_module.TEMP_DIR = pathlib.Path(folder)
    twin = grouped_twin(torch)
    GROUPED_TWIN.load(twin, initial_layers)
    server = object.__new__(server_module.pFedLAServer)
    state = twin.state_dict()
    server.client_num_in_total = len(clients)
    server.device = torch.device("cpu")
    server.args = argparse.Namespace(hn_lr=hn_lr)
    server.logger = None
    server.client_model_params_list = [[t.clone() for t in state.values()]
                                       for _ in clients]
    server.all_params_name = list(state)
    server.trainable_params_name = [n for n, p in twin.state_dict(keep_vars=True).items()
                                    if p.requires_grad]
    server.hypernet = models_module.HyperNetwork(
        embedding_dim=hypernetworks.embeddings.shape[1], client_num=len(clients),
        hidden_dim=hypernetworks.heads_w.shape[2], backbone=twin, K=0, gpu=0)
    assert sorted(server.hypernet.blocks_name) == list(BLOCKS), server.hypernet.blocks_name
    _load_hypernetworks(torch, server.hypernet, hypernetworks, server.hypernet.cache_dir)
    trainer = client_module.pFedLAClient(
        backbone=twin, dataset="mnist", batch_size=batch_size, valset_ratio=0.0,
        testset_ratio=0.0, local_epochs=epochs, local_lr=lr, logger=None, gpu=0)
    for round_index, round_batches in enumerate(batches):
      for client_id in np.flatnonzero(active(round_index)):
        params, retain = server.generate_client_model_parameters(int(client_id))
        trainer.client_id = int(client_id)
        trainer.set_parameters(params)
        data = clients[client_id]
        (epochs_of_client,) = round_batches[client_id]
        trainer.trainset = bridges.EpochLoader(bridges.model_inputs(data.x_train),
                                               data.y_train.astype(np.int64),
                                               epochs_of_client)
        diff = trainer._train()  # pylint: disable=protected-access
        server.update_hypernetwork(int(client_id), diff, retain)
        server.update_client_model_parameters(int(client_id), diff)
      if on_round is not None:
        on_round(lambda: _personalised(torch, server, clients, accuracy))
    return _personalised(torch, server, clients, accuracy)


def _personalised(torch, server, clients: list, accuracy: Callable[[Any, Any], float]
                  ) -> tuple[list, list[float]]:
  """Each client's mixture from the server's hypernetworks and models now, as the twin's
  layers, and its test accuracy; the server's stored models left as they were."""
  layers, accuracies = [], []
  for client_id, data in enumerate(clients):
    stored = server.client_model_params_list[client_id]
    params, _ = server.generate_client_model_parameters(client_id)
    server.client_model_params_list[client_id] = stored  # generating stores its mixture
    model = grouped_twin(torch)
    model.load_state_dict({k: v.detach() for k, v in params.items()})
    layers.append(GROUPED_TWIN.read(model))
    accuracies.append(accuracy(model, data))
  return layers, accuracies


def sampled(train_key: jax.Array, num_clients: int, count: int) -> Callable[[int], np.ndarray]:
  """round -> our run's sampled clients (rounds.sampled_clients), as a mask."""
  from fedora_jax.rounds import sampled_clients  # pylint: disable=import-outside-toplevel
  return lambda r: np.asarray(sampled_clients(jax.random.fold_in(train_key, r), num_clients,
                                              count))
