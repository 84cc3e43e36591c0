"""Check (b) of the verification (`make verify-long`, run by hand): twenty rounds of an
algorithm here and in PFLlib from the same initial model and the same batches, on MNIST
pathological at 10 % of the data with FedALA's CNN and training; the final accuracies
compared (within half a point) and the two curves drawn side by side.

  python -m verification.long                                 # the default algorithms
  python -m verification.long --rounds=3 --algorithms=fedavg,fedper   # a smoke test
  python -m verification.long --render                        # the table into the docs

The split: MNIST (the data root's, else the copy in the package; --data_dir) at 10 %
(PartitionConfig.data_fraction 0.1: 6,000 training and 1,000 test images), pathological
with 2 classes a client, 20 clients, an eighth of each client's pool for validation
(FedALA's MNIST column, experiments/paper/fedala_tables.json); each client's training
set cut to a multiple of the batch size (PFLlib drops a last partial batch, the engine
does not): about 260 images a client; a multiple of several batches where an algorithm
reads them so (BATCHES_A_CUT: Per-FedAvg's 2B, FedFomo's training share). The pixels as
PFLlib's generator writes them, (x / 255 - 0.5) / 0.5, the same floats on both sides
(our CNNs take floats unscaled).
The model: PFLlib's FedAvgCNN, ours `--model=fedavg_cnn`, the initial weights ours
(bridges.cnn_to_torch; checked on the first client's test images before training).
Where check (a) runs an algorithm on a twin (Reference.twin: FedBN and MOON-BN on
coaching_cnn_bn's, which BatchNorm needs; pFedLA on its grouped one), on it and ours
(twin.to_torch, load, read), the pixels as check (a) hands them (ours uint8, the twin's
/ 255, each standardised in its forward). pFedLA runs KarhouTam/pFedLA's code through
check (a)'s driver (pfedla_driver.run, scored each round), one client a round
(LONG_PARTICIPATION: its server trains a round's clients one after another, ours side by
side). APPLE with check (a)'s prepare, its ratios at this run's N, lr and rounds.
Training: FedALA's (batch 10, lr 0.005, one local epoch, plain SGD, every client every
round), each client's batches of every round drawn by the engine's functions from our
keys (bridges.padded_client_batches) and handed to PFLlib's client. Each algorithm in
check (a)'s form with check (a)'s hyperparameters (one_round.REFERENCES), its layers
split as PFLlib's main.py splits FedAvgCNN (the last Linear the head). Scored each round
where PFLlib's evaluate() scores (after the next send_models where check (a) reads it
there), as FedALA's metric: the test images right over all clients, over their count.

Each round, where the server averages a whole model (check (a)'s compared server), its
model here and in PFLlib is compared too: the max relative error (over its tensors, max
|ours - PFLlib's| / max |PFLlib's|) after every round, in the JSON, the table and
<out>/model_errors.png. With --float64_reference PFLlib also runs in float64 (its model
and inputs), the arithmetic that both float32 runs round, and each side's server model
is compared with that run's too: a gap that float32 rounding makes shows between each
side and it alike, one in what the code computes only on one side (docs/verification.md).

Writes <out>/<algorithm>.json as each algorithm finishes (both curves, the final gap,
the server model's errors), <out>/curves.png, <out>/table.md and, with --pack, one .tgz
of <out>. With --jobs=N, N processes at once, each one side of one algorithm (ours with
JAX alone; PFLlib's with PyTorch, its JAX on the CPU for the batches and the initial
model), so that JAX's compilations and PFLlib's Python-bound steps run side by side;
--time_budget stops what would end too late (a lent GPU's one command). The references come from
--references (default ../shared/references); where scikit-learn or h5py is missing,
PFLlib's imports of them get stand-ins (never called here). Without the references, or
without PyTorch, says so in one line and exits 0. Exits 1 when a final gap exceeds half
a point or an algorithm gives no result.
"""

import os

# Before JAX starts: PyTorch shares the accelerator, so JAX takes memory as it needs it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# pylint: disable=wrong-import-position
import argparse
import concurrent.futures
import contextlib
import copy
import glob
import importlib
import importlib.util
import json
import math
import random
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

# Before fedora_jax: stand-ins for the modules imported but never called here, where they
# are not installed (stand_ins.STOOD_IN).
from verification import stand_ins  # pylint: disable=unused-import
from fedora_jax import algorithms
from fedora_jax.algorithms import fedas
from fedora_jax.data.client_data import Client, FederatedData, stack_clients
from fedora_jax.data.partitions import PartitionConfig, make_partition
from fedora_jax.data.sources import load_mnist
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import (epoch_batches, make_client_trainer,
                                             make_optimizer)
from fedora_jax.models import build_model, default_client_chunk, default_eval_batch_size
from fedora_jax.rounds import client_keys, num_sampled_clients
from fedora_jax.simulation import (TrainConfig, initial_model, jitted_init, root_keys,
                                   run_algorithm)
from verification import bridges

MODEL = "fedavg_cnn"
GAP_POINTS = 0.5  # the largest final accuracy gap, in percentage points
# Most telling first: a run that must stop early (--time_budget) stops at the end.
CORE = ("fedavg", "fedala", "ditto", "fedper", "fedrep", "apfl", "lg_fedavg", "fedrod",
        "fedbabu", "moon", "fedprox", "local")
# Not FedDistill: PFLlib's target (raw logits as the class weights of a cross-entropy) is
# unbounded below: at lambda 1 the CNN diverges on both sides in round 2 (ours NaN,
# PFLlib's accuracy 11 %, 2026-12-04); at lambda 0.1 ours in round 3 (NaN, 2026-12-05).
MORE = ("pfedme", "scaffold", "feddyn", "fedntd", "fedlc", "fedamp", "fedcac", "fml",
        "fedphp", "fedproto", "fedcross", "fedgh", "fedpcl", "pflda", "fedmtl", "fedgc", "gpfl",
        "fedcp", "fedkd", "fedas", "feddbe", "perfedavg", "fedfomo", "fedpac", "fedgen")
# On check (a)'s other models or drivers: FedBN and MOON-BN on the twin of our
# coaching_cnn_bn (BatchNorm: on FedAvgCNN FedBN is FedAvg), pFedLA on its grouped twin
# beside KarhouTam/pFedLA (pfedla_driver.py); APPLE on FedAvgCNN with check (a)'s prepare.
OTHERS = ("apple", "fedbn", "moon_bn", "pfedla")
# ALA on each host check (a) covers, through its driver (ala_hosts.py): on the whole model
# it trains (Ditto's global part, FedProx's, ...) or on the base it receives (FedRep's).
ALA_HOSTS = ("ditto_ala", "fedrep_ala", "fedprox_ala", "fedprox_ala_theta_hat", "perfedavg_ala",
             "pfedme_ala", "fedamp_ala", "fedphp_ala")
DEFAULT = CORE + MORE + OTHERS + ALA_HOSTS


def settings_of(name: str) -> str:
  """Whose check (b) settings a row takes (LONG_CONFIG, BATCHES_A_CUT, LONG_LOADS, ...):
  an ALA row its host's (pfedme_ala pFedMe's), any other row its own."""
  if name not in ALA_HOSTS:
    return name
  from verification import one_round  # pylint: disable=import-outside-toplevel
  return one_round.REFERENCES[name].algorithm


class Setting(NamedTuple):
  """The split and training of check (b); see the module docstring."""
  clients: int = 20
  data_fraction: float = 0.1
  classes_per_client: int = 2
  val_fraction: float = 0.125
  batch_size: int = 10
  local_epochs: int = 1
  lr: float = 0.005
  seed: int = 0


# Where check (b) departs from check (a)'s settings (our config, PFLlib's arguments).
# LG-FedAvg: check (a)'s config is for the MLP's two layers; on the CNN (Conv_0, Conv_1,
# Dense_0, Dense_1) PFLlib's base, the three below the head, stays local. pFedMe: check
# (a)'s eta is its lr (0.05), here FedALA's 0.005; its personal lr FedALA's table's 0.01
# (experiments/paper/fedala_tables.json): at check (a)'s 0.09 our CNN's loss went NaN.
LONG_CONFIG: dict[str, tuple[dict, dict]] = {
    "lg_fedavg": ({"local_layers": 3}, {}),
    "pfedme": ({"eta": Setting().lr, "personal_lr": 0.01}, {"p_learning_rate": 0.01}),
    # FedKD: PFLlib decomposes a conv kernel per spatial position (check (a)'s MLP has
    # none); its mentee at this check's lr (check (a)'s is its own).
    "fedkd": ({"conv_svd": "spatial"}, {"mentee_learning_rate": Setting().lr}),
    # Per-FedAvg: alpha = beta = the run's lr, as PFLlib's client sets them.
    "perfedavg": ({"alpha": Setting().lr, "beta": Setting().lr}, {}),
}
# Training sets cut to a multiple of this many batches where an algorithm reads batches of
# several B: PFLlib's Per-FedAvg reads 2B at a time and drops a last partial one, where
# ours deals it to D and D' and trains on it.
BATCHES_A_CUT = {"perfedavg": 2, "fedfomo": 5}  # FedFomo: its 80 % training share too
# pFedLA: one client a round, as check (a)'s row. KarhouTam/pFedLA's server trains a
# round's clients one after another, each from hypernetworks and models its predecessors
# in the round updated; ours trains them side by side from the round's start: the two
# forms agree only where a round trains one client.
LONG_PARTICIPATION = {"pfedla": 1 / Setting().clients}


def _pflda_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                 ) -> list[list[np.ndarray]]:
  """PFL-DA's one loader (check (a)'s _da_loads) on a padded client: the head phase's
  epochs, then the extractor phase's, each over its n real samples of `padded`."""
  head_key, body_key = jax.random.split(key)
  return [bridges.leading_epochs(head_key, padded, n, epochs, batch_size)
          + bridges.leading_epochs(body_key, padded, n, epochs, batch_size)]


def _fedgh_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                 ) -> list[list[np.ndarray]]:
  """FedGH's loaders (check (a)'s _gh_loads) on a padded client: train's epochs over its
  n real samples of `padded`, then collect_protos' (any batches: class means)."""
  return [bridges.leading_epochs(key, padded, n, epochs, batch_size),
          [np.arange(n).reshape(-1, batch_size)]]


def _fedpcl_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                  ) -> list[list[np.ndarray]]:
  """FedPCL's loaders (check (a)'s _pcl_loads) on a padded client: train's epochs over
  its n real samples of `padded`, then collect_protos' (class means)."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  return [bridges.leading_epochs(key, padded, n, epochs, batch_size),
          one_round._pcl_collect_loads(n, batch_size)]  # pylint: disable=protected-access


def _fedas_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                 ) -> list[list[np.ndarray]]:
  """FedAS's loaders (check (a)'s _as_loads) on a padded client: its prototypes' batch of
  every sample, the alignment's epoch of 16s over the n real ones (the last partial, as
  ours), train's epochs, the Fisher trace's epoch (fedas.client_update's keys)."""
  align_key, train_key, fisher_key = jax.random.split(key, 3)
  align_batch = fedas.FedAsConfig().align_batch_size
  mask = np.arange(padded) < n
  indices, weights = epoch_batches(jax.random.split(align_key, 1)[0], mask, n, align_batch,
                                   -(-padded // align_batch))
  align = [i[w > 0] for i, w in zip(np.asarray(indices), np.asarray(weights)) if w.any()]
  fisher = np.asarray(epoch_batches(fisher_key, mask, n, batch_size,
                                    -(-padded // batch_size))[0])[:n // batch_size]
  return [[[np.arange(n)], align],
          bridges.leading_epochs(train_key, padded, n, epochs, batch_size), [fisher]]


def _perfedavg_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                     ) -> list[list[np.ndarray]]:
  """Per-FedAvg's loaders (check (a)'s _peravg_loads) on a padded client: the scoring's
  batch of B, then one loader an epoch of 2B, each its D followed by its D' (n a multiple
  of 2B: BATCHES_A_CUT)."""
  train_key, adapt_key = jax.random.split(key)
  mask = np.arange(padded) < n
  adapt = np.asarray(epoch_batches(adapt_key, mask, n, batch_size,
                                   -(-padded // batch_size))[0])[:n // batch_size]
  meta = bridges.leading_epochs(train_key, padded, n, epochs, 2 * batch_size)
  return [[adapt]] + [[np.concatenate([chunks[:, 0::2], chunks[:, 1::2]], axis=1)]
                      for chunks in meta]


def _fedfomo_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                   ) -> list[list[np.ndarray]]:
  """FedFomo's training loader (check (a)'s _fomo_loads) on a padded client: our trainer's
  epochs over the first n - n // 5 real samples (fedfomo.train_tail's mask; n a multiple
  of 5B: BATCHES_A_CUT)."""
  return [bridges.leading_epochs(key, padded, n - n // 5, epochs, batch_size)]


def _fedpac_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                  ) -> list[list[np.ndarray]]:
  """FedPAC's loaders (check (a)'s _pac_loads) on a padded client: train's epochs (its
  head epoch, then its body's), collect_protos' and the next send_models' statistics
  (sums over the n real samples: any batches)."""
  everything = np.arange(n).reshape(-1, batch_size)
  return [bridges.leading_epochs(key, padded, n, epochs, batch_size), [everything],
          [everything] * 3]


def _feddbe_built_loads(key: jax.Array, padded: int, n: int, epochs: int, batch_size: int
                        ) -> list[list[np.ndarray]]:
  """FedDBE's client while built (check (a)'s _dbe_built_loads) on a padded client: a
  loader it reads one batch of, then its initialization period's epochs."""
  training = bridges.leading_epochs(key, padded, n, epochs, batch_size)
  return [training, training]


# Check (a)'s loaders (Reference.loads) are cut for clients of one size; here clients of
# 240 to 270 share a bucket padded to the largest: the same loaders, drawn as the engine
# draws over the padded size, (client key, padded size, size, epochs, batch size) ->
# [load][epoch]. An algorithm with Reference.loads and none here is refused.
LONG_LOADS = {"pflda": _pflda_loads, "fedgh": _fedgh_loads, "fedpcl": _fedpcl_loads,
              "fedas": _fedas_loads, "perfedavg": _perfedavg_loads,
              "fedfomo": _fedfomo_loads, "fedpac": _fedpac_loads}
# And those its clients read while its server is built (Reference.built_loads), drawn
# from the keys our init hands client k.
LONG_BUILT_LOADS = {"feddbe": _feddbe_built_loads}


class Split(NamedTuple):
  clients: list[Client]       # our inputs: float32 [N, 28, 28]
  data: FederatedData


def missing(references: str) -> str | None:
  """What this machine lacks for the check, or None."""
  if not os.path.isdir(os.path.join(references, "PFLlib", "system")):
    return (f"no reference implementations at {references}: the project's shared/"
            " folder, laid beside this checkout, holds them (or pass --references)")
  if importlib.util.find_spec("torch") is None:
    return "PyTorch is not installed: make verify-long installs the verify extra"
  return None


# ---------------------------------------------------------------- the split

def build_split(setting: Setting, data_dir: str | None, batches: int = 1,
                pixels: str = "pfllib") -> Split:
  """MNIST pathological at 10 %, each client's training set cut to a multiple of
  `batches` batches, the pixels PFLlib's floats (module docstring), or with
  pixels="uint8" the dataset's, as check (a) hands them to a twin's row (ours
  standardises them, the twin standardises pixels / 255: reference_inputs)."""
  source = load_mnist(data_dir)
  partition = make_partition(source, setting.clients, PartitionConfig(
      kind="pathological", classes_per_client=setting.classes_per_client,
      val_fraction=setting.val_fraction, data_fraction=setting.data_fraction), setting.seed)
  clients = []
  convert = bridges.pfllib_pixels if pixels == "pfllib" else lambda x: x
  for client in partition.clients:
    cut = batches * setting.batch_size
    kept = len(client.x_train) // cut * cut
    clients.append(Client(
        convert(client.x_train[:kept]), client.y_train[:kept],
        convert(client.x_val), client.y_val, convert(client.x_test), client.y_test))
  return Split(clients, stack_clients(clients, num_classes=source.num_classes))


def nchw(x: np.ndarray) -> np.ndarray:
  """Our [N, 28, 28] images as PFLlib's [N, 1, 28, 28]."""
  return np.ascontiguousarray(x[:, None])


def split_kind(name: str) -> tuple[int, str]:
  """build_split's (batches, pixels) for `name`: uint8 pixels where it runs on a twin."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  twin = one_round.REFERENCES[name].twin is not None
  return BATCHES_A_CUT.get(settings_of(name), 1), "uint8" if twin else "pfllib"


def reference_inputs(reference, float64: bool = False):
  """Our clients' images -> the reference model's inputs: PFLlib's floats in NCHW for
  FedAvgCNN; for a twin, pixels / 255 (check (a)'s bridges.model_inputs: the twin
  standardises them in its forward, as ours the uint8 pixels); in float64 with
  `float64`."""
  base = nchw if reference.twin is None else bridges.model_inputs
  return (lambda x: base(x).astype(np.float64)) if float64 else base


def model_name(reference) -> str:
  """Our model of the row: FedAvgCNN, or check (a)'s where it runs on a twin."""
  return MODEL if reference.twin is None else reference.twin.model


def to_torch(reference, params) -> list:
  """Our model's variables as the PyTorch model's layers (cnn_to_torch, or the twin's)."""
  convert = bridges.cnn_to_torch if reference.twin is None else reference.twin.to_torch
  return convert(jax.tree.map(np.asarray, params))


# ---------------------------------------------------------------- our side

def long_reference(name: str, rounds: int):
  """check (a)'s Reference of `name` for a run of `rounds` on the CNN: LONG_CONFIG's
  changes, and FedPHP's mu ramped over the run (ours over each client's
  participations: with every client in every round, the rounds). An ALA row takes its
  host's changes (settings_of)."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  reference = one_round.REFERENCES[name]
  name = settings_of(name)
  config, args = LONG_CONFIG.get(name, ({}, {}))
  if name == "fedphp":
    config = {**config, "mu_participations": rounds}
  if name == "fedkd":  # its energy ramps from T_start to T_end over the run's rounds
    args = {**args, "global_rounds": rounds}
  if name == "fedfomo":  # M = 5 of 20 clients: P's ties broken as ours breaks them
    reference = reference._replace(prepare=one_round._fomo_ties)  # pylint: disable=protected-access
  if name == "apple":  # check (a)'s ratios at this run's N, lr and rounds (L 1: all 20)
    config = {**config, "reg_rounds": rounds, "core_lr_scale": float(Setting().clients),
              "p_lr_scale": one_round.APPLE_DRLR / Setting().lr}
    args = {**args, "global_rounds": rounds}
  if name in LONG_PARTICIPATION:
    reference = reference._replace(participation=LONG_PARTICIPATION[name])
  return reference._replace(config={**reference.config, **config},
                            args={**reference.args, **args})


def initial_state(name: str, split: Split, setting: Setting, rounds: int):
  """Our algorithm's state after init on the CNN, as run_algorithm starts it (same
  keys): what check (a)'s load_initial hands the reference beside the model (its
  server's keys, the objects its steps reach)."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  reference = long_reference(name, rounds)
  train = train_config(setting, rounds, reference)
  model = build_model(model_name(reference), split.data.num_classes)
  trainer = make_client_trainer(model.apply, make_optimizer(train.lr, 0.0, 0.0),
                                train.local_epochs, train.batch_size)
  ours = reference.algorithm or name
  config = one_round.our_config(ours, train, reference)
  keys = root_keys(setting.seed)
  init = jitted_init(algorithms.build(ours, config, trainer), trainer, split.data)
  return init(initial_model(model, split.data, keys["init"]), split.data.buckets,
              keys["algorithm"])


def train_config(setting: Setting, rounds: int, reference) -> TrainConfig:
  """Our run's training: the setting's, check (a)'s epochs, weights and participation."""
  platform, model = jax.default_backend(), model_name(reference)
  return TrainConfig(rounds=rounds, local_epochs=reference.our_epochs or setting.local_epochs,
                     batch_size=setting.batch_size, lr=setting.lr, momentum=0.0,
                     weight_decay=0.0, seed=setting.seed, log_every=0, eval_every=1,
                     client_weights=reference.client_weights,
                     participation=reference.participation,
                     client_chunk=default_client_chunk(model, platform),
                     eval_batch_size=default_eval_batch_size(model, platform))


# Where check (a)'s compared server model is a part, not the CNN (PFL-DA's global head).
PART_SERVERS = frozenset({"pflda"})


def compares_server(name: str, reference) -> bool:
  """Whether the server's model is compared round by round: where the server averages
  a whole model (check (a)'s rule)."""
  return reference.aggregates and reference.compare_server and name not in PART_SERVERS


def flat_layers(layers) -> list[np.ndarray]:
  return [array for layer in layers for array in layer]


def run_ours(name: str, split: Split, setting: Setting, rounds: int) -> dict:
  """Our run: the weighted test accuracy after every round, each client's last, the
  initial model's logits on the first client's test images, the server's model after
  every round in PyTorch's layout (None where it is not compared), the times."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  reference = long_reference(name, rounds)
  train = train_config(setting, rounds, reference)
  model = build_model(model_name(reference), split.data.num_classes)
  initial = initial_model(model, split.data, root_keys(setting.seed)["init"])
  ours = reference.algorithm or name
  config = one_round.our_config(ours, train, reference)
  server_models: list[list[np.ndarray]] = []

  def keep_server_model(_, state) -> None:
    server_models.append(flat_layers(to_torch(reference,
                                              reference.server_model(state.algorithm.server))))
  result = run_algorithm(algorithms.make(ours, config), model, split.data, train,
                         progress=None,
                         on_state=keep_server_model if compares_server(name, reference) else None)
  scores = np.asarray(result.history.test_score, np.float64)  # [R, K]
  tests = split.data.split_sizes("test").astype(np.float64)
  return {"accuracy": [float(a) for a in scores @ tests / tests.sum()],
          "client_accuracy": [float(a) for a in scores[-1]],
          # In inference mode (BatchNorm on the running averages folded into `initial`).
          "initial_logits": np.asarray(batch_stats.model_apply(model.apply)(
              initial, split.clients[0].x_test)).tolist(),
          "server_models": server_models if compares_server(name, reference) else None,
          "compile_seconds": result.compile_seconds, "round_seconds": result.round_seconds,
          "seconds": time.perf_counter() - start,
          "machine": f"JAX on {jax.devices()[0].device_kind}"}


# ---------------------------------------------------------------- PFLlib's side

def torch_model(reference, device: str, layers, float64: bool = False,
                split: bool | None = None):
  """The reference's model with our weights `layers`: PFLlib's FedAvgCNN, or the row's
  twin (check (a)'s Reference.twin); split as PFLlib's main.py splits it where the
  algorithm takes a head (BaseHeadSplit: fc the head; `split` None: the reference's), on
  `device`; in float64 with `float64`."""
  import torch  # pylint: disable=import-outside-toplevel
  from flcore.trainmodel import models  # pylint: disable=import-outside-toplevel
  if reference.twin is None:
    model = models.FedAvgCNN(in_features=1, num_classes=10, dim=1024)
    bridges.load_torch_layers(model, layers)
  else:
    model = reference.twin.build(torch)
    reference.twin.load(model, layers)
  if reference.split if split is None else split:
    head = copy.deepcopy(model.fc)
    model.fc = torch.nn.Identity()
    model = models.BaseHeadSplit(model, head)
  return (model.double() if float64 else model).to(device)


def torch_layers(reference, model) -> list:
  """The reference model's layers (bridges.torch_layers, or the twin's: BatchNorm's
  running averages too)."""
  return (bridges.torch_layers if reference.twin is None else reference.twin.read)(model)


def round_batches(name: str, reference, train_key: jax.Array, round_index: int,
                  data: FederatedData, epochs: int, batch_size: int) -> list:
  """[client][load][epoch] -> the batch indices PFLlib's client k reads in the round,
  as our client k draws them (LONG_LOADS where check (a) cuts its own loaders)."""
  if reference.loads is None:
    return bridges.padded_client_batches(train_key, round_index, data, epochs, batch_size,
                                         reference.trainings)
  loads = LONG_LOADS.get(settings_of(name))
  if loads is None:
    raise ValueError(f"{name}: check (a)'s loaders are for clients of one size and"
                     " LONG_LOADS has none for padded clients")
  keys = client_keys(jax.random.fold_in(train_key, round_index), data.num_clients)
  if name in ALA_HOSTS:
    from verification import one_round  # pylint: disable=import-outside-toplevel
    keys = [one_round.ala_host_key(key) for key in keys]
  sizes, padded = data.split_sizes("train"), bridges.padded_sizes(data)
  return [loads(keys[k], int(padded[k]), int(sizes[k]), epochs, batch_size)
          for k in range(data.num_clients)]


def built_batches(name: str, reference, algorithm_key: jax.Array, data: FederatedData,
                  epochs: int, batch_size: int) -> list | None:
  """[client][load][epoch] -> the batch indices PFLlib's client k reads while its server
  is built, as our init draws them for client k; None where it trains nobody then."""
  if reference.built_loads is None:
    return None
  if name not in LONG_BUILT_LOADS:
    raise ValueError(f"{name}: check (a)'s loaders while built are for clients of one size"
                     " and LONG_BUILT_LOADS has none for padded clients")
  keys = client_keys(algorithm_key, data.num_clients)
  sizes, padded = data.split_sizes("train"), bridges.padded_sizes(data)
  return [LONG_BUILT_LOADS[name](keys[k], int(padded[k]), int(sizes[k]), epochs, batch_size)
          for k in range(data.num_clients)]


def correct(model, x, y) -> int:
  """The right answers of `model` in eval(), as PFLlib's test_metrics scores (BatchNorm
  on its running averages)."""
  import torch  # pylint: disable=import-outside-toplevel
  model.eval()
  with torch.no_grad():
    return int((model(x).argmax(1) == y).sum())


def run_reference(name: str, split: Split, setting: Setting, rounds: int,
                  device: str, float64: bool = False) -> dict:
  """The reference's run from our initial model and batches: its weighted test accuracy
  after every round, each client's last, its initial model's logits on the first
  client's test images, its server's model where each round is scored (None where it is
  not compared), the times. PFLlib's server and clients, or pFedLA's driver
  (pfedla_driver.py, on the CPU). With `float64` (PFLlib's), its model and inputs in
  float64 (its code makes its other tensors alike, zeros_like): the arithmetic both
  float32 runs round."""
  import torch  # pylint: disable=import-outside-toplevel
  from verification import one_round  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  reference = long_reference(name, rounds)
  driven = reference.server == one_round.PFEDLA
  if driven and float64:
    raise ValueError(f"{name}: its driver runs in float32 only")
  device = "cpu" if driven else device  # the driver's server and client: the CPU
  keys = root_keys(setting.seed)
  initial = to_torch(reference, initial_model(
      build_model(model_name(reference), split.data.num_classes), split.data, keys["init"]))
  inputs = reference_inputs(reference, float64)
  initial_logits = torch_model(reference, device, initial, float64, split=False).eval()
  with torch.no_grad():
    initial_logits = initial_logits(
        torch.from_numpy(inputs(split.clients[0].x_test)).to(device)).cpu().numpy()
  if driven:
    scored, round_seconds = _pfedla_rounds(name, reference, split, setting, rounds, initial)
    server_models = None
  else:
    scored, round_seconds, server_models = _pfllib_rounds(
        name, reference, split, setting, rounds, device, float64, initial)
  counts = np.asarray(scored, np.float64)  # [R, K] right answers
  sizes = np.asarray([len(c.y_test) for c in split.clients], np.float64)
  machine = (f"PyTorch on {torch.cuda.get_device_name(0)}" if device == "cuda"
             else f"PyTorch on a {os.cpu_count()}-core CPU")
  machine += ", float64" if float64 else ""
  return {"accuracy": [float(a) for a in counts.sum(1) / sizes.sum()],
          "client_accuracy": [float(a) for a in counts[-1] / sizes],
          "initial_logits": initial_logits.tolist(),
          "server_models": server_models,
          "round_seconds": float(np.median(round_seconds)),
          "seconds": time.perf_counter() - start, "machine": machine,
          "train_sizes": [int(n) for n in split.data.split_sizes("train")]}


def _pfllib_rounds(name: str, reference, split: Split, setting: Setting, rounds: int,
                   device: str, float64: bool, initial: list
                   ) -> tuple[list[list[int]], list[float], list | None]:
  """PFLlib's rounds: ([round][client] right answers, each round's seconds, its server's
  model where each round is scored, None where it is not compared)."""
  import torch  # pylint: disable=import-outside-toplevel
  from verification import one_round  # pylint: disable=import-outside-toplevel
  if reference.participation != 1.0:
    raise ValueError(f"{name}: PFLlib's rows here train every client every round")
  module, class_name = reference.server.split(".")
  server_class = getattr(importlib.import_module(f"flcore.servers.{module}"), class_name)
  keys = root_keys(setting.seed)
  inputs = reference_inputs(reference, float64)
  torch.manual_seed(setting.seed)
  # PFLlib's receive_models takes the uploads in random.sample's order, so its server
  # sums them in another order each run: seeded, one run rounds as the next.
  random.seed(setting.seed)
  warnings.filterwarnings("ignore", category=UserWarning, module="flcore")
  check_a = one_round.Setting(clients=setting.clients, batch_size=setting.batch_size,
                              local_epochs=setting.local_epochs, lr=setting.lr,
                              seed=setting.seed)
  args = one_round._pfllib_args(  # pylint: disable=protected-access
      check_a, class_name, torch_model(reference, device, initial, float64),
      **{**reference.args, "device": device, "global_rounds": rounds})
  epochs = reference.our_epochs or setting.local_epochs
  with tempfile.TemporaryDirectory() as folder:
    system = bridges.write_pfllib_split(split.clients, folder, args.dataset,
                                        inputs=inputs)
    with (one_round._working_directory(system),  # pylint: disable=protected-access
          contextlib.redirect_stdout(open(os.devnull, "w")),
          one_round._loaders_while_built(  # pylint: disable=protected-access
              built_batches(name, reference, keys["algorithm"], split.data, epochs,
                            setting.batch_size),
              [c._replace(x_train=inputs(c.x_train)) for c in split.clients])):
      server = server_class(args, 0)
  if reference.prepare is not None:  # the clients as PFLlib reads them (FedPCL's loaders)
    reference.prepare(server, check_a, [c._replace(x_train=inputs(c.x_train))
                                        for c in split.clients])
  if reference.load_initial is not None:
    reference.load_initial(server, initial_state(name, split, setting, rounds))
  server.selected_clients = list(server.clients)
  tests = [(torch.from_numpy(inputs(c.x_test)).to(device),
            torch.from_numpy(c.y_test.astype(np.int64)).to(device)) for c in split.clients]
  train_x = [inputs(c.x_train) for c in split.clients]
  train_y = [c.y_train.astype(np.int64) for c in split.clients]
  # Where PFLlib's evaluate() reads a round: after the next send_models (its next
  # round's start), or right after training where check (a) reads it there.
  after_send = reference.aggregates and reference.sends and reference.scored_after_send

  server_models: list[list[np.ndarray]] = []

  def score() -> list[int]:
    if compares_server(name, reference):
      server_models.append(flat_layers(torch_layers(reference, server.global_model)))
    if reference.accuracy is not None:  # its own scoring (FedProto's prototypes)
      return [round(reference.accuracy(c, d._replace(x_test=inputs(d.x_test)))
                    * len(d.y_test)) for c, d in zip(server.clients, split.clients)]
    return [correct(one_round._scored_model(reference, c, server), x, y)  # pylint: disable=protected-access
            for c, (x, y) in zip(server.clients, tests)]

  scored, round_seconds = [], []
  with contextlib.redirect_stdout(open(os.devnull, "w")):
    for r in range(rounds):
      batches = round_batches(name, reference, keys["train"], r, split.data, epochs,
                              setting.batch_size)
      began = time.perf_counter()
      if reference.aggregates and reference.sends:
        one_round._send_models(server, reference, r)  # pylint: disable=protected-access
      if after_send and r > 0:
        scored.append(score())
      trained = time.perf_counter()
      for client, x, y, trainings in zip(server.clients, train_x, train_y, batches):
        loaders = iter([bridges.EpochLoader(x, y, drawn) for drawn in trainings])
        client.load_train_data = lambda batch_size=None, loaders=loaders: next(loaders)
        for step in reference.steps:
          step(client) if callable(step) else getattr(client, step)()
      if reference.aggregates:
        server.receive_models()
        for step in reference.server_steps:
          step(server) if callable(step) else getattr(server, step)()
      round_seconds.append(time.perf_counter() - trained)
      if not after_send:
        scored.append(score())
      log(f"{name}: PFLlib round {r + 1}/{rounds}, {time.perf_counter() - began:.1f} s")
    if after_send:
      one_round._send_models(server, reference, rounds)  # pylint: disable=protected-access
      scored.append(score())
  return scored, round_seconds, server_models if compares_server(name, reference) else None


def _pfedla_rounds(name: str, reference, split: Split, setting: Setting, rounds: int,
                   initial: list) -> tuple[list[list[int]], list[float]]:
  """KarhouTam/pFedLA's rounds through check (a)'s driver (pfedla_driver.run): our
  initial hypernetworks, the clients our run samples, our batches; each round every
  client's mixture from the updated hypernetworks scored, as its test() does.
  ([round][client] right answers, each round's seconds of training)."""
  from verification import one_round, pfedla_driver  # pylint: disable=import-outside-toplevel
  keys = root_keys(setting.seed)
  epochs = reference.our_epochs or setting.local_epochs
  batches = [round_batches(name, reference, keys["train"], r, split.data, epochs,
                           setting.batch_size) for r in range(rounds)]
  active = pfedla_driver.sampled(keys["train"], setting.clients, num_sampled_clients(
      reference.participation, setting.clients))
  hypernetworks = initial_state(name, split, setting, rounds).server.hypernetworks
  scored, round_seconds, began = [], [], [time.perf_counter()]

  def on_round(personalised) -> None:
    round_seconds.append(time.perf_counter() - began[0])
    _, accuracy = personalised()
    scored.append([round(a * len(c.y_test)) for a, c in zip(accuracy, split.clients)])
    log(f"{name}: pFedLA round {len(scored)}/{rounds}, {round_seconds[-1]:.1f} s")
    began[0] = time.perf_counter()
  pfedla_driver.run(split.clients, initial, batches, hypernetworks, active,
                    reference.config["server_lr"], setting.batch_size, setting.lr, epochs,
                    one_round._torch_accuracy, on_round=on_round)  # pylint: disable=protected-access
  return scored, round_seconds


# ---------------------------------------------------------------- the comparison

def merge(name: str, rounds: int, ours: dict, theirs: dict, setting: Setting,
          extra: dict, exact: dict | None = None) -> dict:
  """One algorithm's row: both runs (their initial logits and server models replaced by
  the largest relative differences between them), the gaps in percentage points,
  `extra`; with `exact` (PFLlib's run in float64), its accuracies and each float32
  side's server model errors against it."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  reference = long_reference(name, rounds)
  ours, theirs = dict(ours), dict(theirs)
  ours_logits = np.asarray(ours.pop("initial_logits"))
  their_logits = np.asarray(theirs.pop("initial_logits"))
  ours_servers, their_servers = ours.pop("server_models"), theirs.pop("server_models")
  server_errors = model_errors(ours_servers, their_servers)
  control = {}
  if exact is not None:
    exact = dict(exact)
    exact.pop("initial_logits")
    exact_servers = exact.pop("server_models")
    control = {"float64_run": exact, "server_model_error_float64": {
        "ours": model_errors(ours_servers, exact_servers),
        "reference": model_errors(their_servers, exact_servers)}}
  sizes = np.asarray(theirs["train_sizes"])
  gaps = np.abs(np.asarray(ours["accuracy"]) - np.asarray(theirs["accuracy"])) * 100
  return {
      "algorithm": name,
      "reference": one_round._reference_label(reference),  # pylint: disable=protected-access
      "rounds": rounds,
      "config": {k: _plain(v) for k, v in reference.config.items()},
      "reference_args": {k: _plain(v) for k, v in reference.args.items()},
      "ours": ours, "reference_run": theirs,
      "initial_logit_error": float(np.max(np.abs(ours_logits - their_logits))
                                   / np.max(np.abs(their_logits))),
      # After each round, the max over tensors of max |ours - PFLlib's| / max |PFLlib's|.
      "server_model_error": server_errors, **control,
      "final_gap_points": float(gaps[-1]), "largest_gap_points": float(gaps.max()),
      "best_gap_points": float(abs(max(ours["accuracy"]) - max(theirs["accuracy"])) * 100),
      "setting": describe(setting, sizes, rounds, reference),
      "settings": setting._asdict(),
      "date": time.strftime("%Y-%m-%d"),
      "machine": f"{theirs['machine']}, {ours['machine']}", **extra}


def model_errors(ours: list | None, theirs: list | None) -> list[float] | None:
  """Each round's max over tensors of max |ours - theirs| / max |theirs|; None where a
  side has no server models."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  if ours is None or theirs is None:
    return None
  return [one_round.relative_error(o, t) for o, t in zip(ours, theirs)]


def _plain(value: Any) -> Any:
  return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def summary(row: dict) -> str:
  ours, theirs = row["ours"], row["reference_run"]
  return (f"{row['algorithm']}: ours {100 * ours['accuracy'][-1]:.2f} %, PFLlib"
          f" {100 * theirs['accuracy'][-1]:.2f} % after {row['rounds']} rounds (gap"
          f" {row['final_gap_points']:.2f} point, {verdict(row)}); ours"
          f" {ours['seconds']:.0f} s (compiling {ours['compile_seconds']:.0f} s,"
          f" {ours['round_seconds']:.3f} s a round), PFLlib {theirs['seconds']:.0f} s"
          f" ({theirs['round_seconds']:.2f} s a round)")


# ---------------------------------------------------------------- outputs

def verdict(row: dict) -> str:
  # Rounded: our accuracy is a float32 mean, so 5 images of 1,000 read 0.5000007 point.
  return ("within 0.5 point" if round(row["final_gap_points"], 4) <= GAP_POINTS
          else "DIFFERS")


def read_rows(out: str) -> list[dict]:
  rows = []
  for path in glob.glob(os.path.join(out, "*.json")):
    with open(path) as f:
      rows.append(json.load(f))
  order = {name: i for i, name in enumerate(DEFAULT)}
  return sorted(rows, key=lambda row: (order.get(row["algorithm"], len(order)),
                                       row["algorithm"]))


def render(rows: list[dict], out: str) -> str:
  """The markdown table of the rows (one per algorithm)."""
  if not rows:
    return f"No results in {out}."
  lines = ["| algorithm | reference | rounds | ours | PFLlib | final gap (points) |"
           " largest gap over the rounds | initial logits | verdict |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    lines.append(
        f"| {row['algorithm']} | {row['reference']} | {row['rounds']} |"
        f" {100 * row['ours']['accuracy'][-1]:.2f} |"
        f" {100 * row['reference_run']['accuracy'][-1]:.2f} |"
        f" {row['final_gap_points']:.2f} | {row['largest_gap_points']:.2f} |"
        f" {row['initial_logit_error']:.1e} | {verdict(row)} |")
  first = rows[0]
  smoke = (" A smoke test: fewer rounds than check (b)'s 20, not its result."
           if max(row["rounds"] for row in rows) < 20 else "")
  times = "; ".join(f"{row['algorithm']} {row['ours']['round_seconds']:.2f} /"
                    f" {row['reference_run']['round_seconds']:.2f}" for row in rows)
  # Rows run by different commands (added to a folder later) each name theirs.
  runs: dict[tuple[str, str, str], list[str]] = {}
  for row in rows:
    runs.setdefault((row["date"], row["machine"], row["command"]), []).append(
        row["algorithm"])
  ran = " ".join(f"{', '.join(names) + ': ' if len(runs) > 1 else ''}{date}, {machine};"
                 f" `{command}`." for (date, machine, command), names in runs.items())
  # Rows of another setting than the first row's (another model, participation) name it.
  settings: dict[str, list[str]] = {}
  for row in rows:
    settings.setdefault(row["setting"], []).append(row["algorithm"])
  others = "".join(f" {', '.join(names)}: {setting}." for setting, names in settings.items()
                   if setting != first["setting"])
  lines.append(f"\n{first['setting']}.{others} {ran}{smoke} Seconds a round, ours /"
               f" PFLlib's (after compiling): {times}.")
  compared = [row for row in rows if row.get("server_model_error")]
  if compared:
    lines.append("\n" + render_model_errors(compared))
  return "\n".join(lines)


def error_rounds(rounds: int) -> list[int]:
  return [r for r in (1, 2, 3, 5, 10) if r < rounds] + [rounds]


def render_model_errors(rows: list[dict]) -> str:
  """The server's model after some rounds, ours against PFLlib's (and, where PFLlib also
  ran in float64, each against that): the max over tensors of max |a - b| / max |b|."""
  rounds = error_rounds(max(row["rounds"] for row in rows))
  lines = ["| algorithm | compared | " + " | ".join(f"round {r}" for r in rounds)
           + " | final accuracy |", "|---|---|" + "---|" * (len(rounds) + 1)]

  def line(name: str, compared: str, errors: list[float], accuracy: str) -> str:
    return (f"| {name} | {compared} | " + " | ".join(
        f"{errors[r - 1]:.1e}" if r <= len(errors) else "" for r in rounds)
            + f" | {accuracy} |")
  for row in rows:
    final = lambda run: f"{100 * run['accuracy'][-1]:.2f}"
    lines.append(line(row["algorithm"], "ours, PFLlib", row["server_model_error"],
                      f"{final(row['ours'])}, {final(row['reference_run'])}"))
    exact = row.get("server_model_error_float64")
    if exact and exact["ours"] and exact["reference"]:
      lines.append(line(row["algorithm"], "ours, PFLlib float64", exact["ours"],
                        f"{final(row['ours'])}, {final(row['float64_run'])}"))
      lines.append(line(row["algorithm"], "PFLlib, PFLlib float64", exact["reference"],
                        f"{final(row['reference_run'])}, {final(row['float64_run'])}"))
  return ("The server's model after a round, where the server averages a whole model:"
          " the max relative error of the first against the second (the largest over"
          " its tensors of max |a - b| / max |b|); PFLlib float64 is PFLlib's run with"
          " its model and inputs in float64 (`--float64_reference`), the arithmetic"
          " both float32 runs round:\n\n" + "\n".join(lines))


def draw(rows: list[dict], path: str) -> None:
  """Each algorithm's two curves side by side, one panel an algorithm."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  columns = min(4, len(rows))
  lines = math.ceil(len(rows) / columns)
  figure, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 2.6 * lines),
                              squeeze=False)
  for ax, row in zip(axes.flat, rows):
    rounds = np.arange(1, row["rounds"] + 1)
    ax.plot(rounds, 100 * np.asarray(row["ours"]["accuracy"]), label="fedora_jax")
    ax.plot(rounds, 100 * np.asarray(row["reference_run"]["accuracy"]), "--",
            label="PFLlib")
    if "float64_run" in row:
      ax.plot(rounds, 100 * np.asarray(row["float64_run"]["accuracy"]), ":",
              label="PFLlib float64")
    ax.set_title(f"{row['algorithm']} (gap {row['final_gap_points']:.2f})", fontsize=9)
    ax.set_xlabel("round", fontsize=8)
    ax.set_ylabel("test accuracy (%)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  for ax in list(axes.flat)[len(rows):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def draw_model_errors(rows: list[dict], path: str) -> None:
  """The server model's relative error after each round, one line an algorithm."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  figure, ax = plt.subplots(figsize=(6.4, 4.0))
  for row in rows:
    errors = row["server_model_error"]
    rounds = np.arange(1, len(errors) + 1)
    drawn = ax.semilogy(rounds, errors, marker=".",
                        label=f"{row['algorithm']}: ours, PFLlib")[0]
    exact = row.get("server_model_error_float64")
    if exact and exact["ours"] and exact["reference"]:
      ax.semilogy(rounds, exact["ours"], "--", color=drawn.get_color(),
                  label=f"{row['algorithm']}: ours, PFLlib float64")
      ax.semilogy(rounds, exact["reference"], ":", color=drawn.get_color(),
                  label=f"{row['algorithm']}: PFLlib, PFLlib float64")
  ax.set_xlabel("round")
  ax.set_ylabel("server model: max relative error")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.legend(fontsize=7, ncol=2)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def write_outputs(out: str, pack: str | None) -> list[dict]:
  """The figure and table of every result in `out`, and `out` packed."""
  rows = read_rows(out)
  if rows:
    draw(rows, os.path.join(out, "curves.png"))
    compared = [row for row in rows if row.get("server_model_error")]
    if compared:
      draw_model_errors(compared, os.path.join(out, "model_errors.png"))
    with open(os.path.join(out, "table.md"), "w") as f:
      f.write(render(rows, out) + "\n")
  if pack:
    os.makedirs(os.path.dirname(os.path.abspath(pack)), exist_ok=True)
    with tarfile.open(pack, "w:gz") as tar:
      tar.add(out, arcname=os.path.basename(os.path.normpath(out)))
  return rows


BEGIN, END = "<!-- verification.long: begin -->", "<!-- verification.long: end -->"


def doc_block(out: str) -> str:
  """The block, BEGIN to END, that docs/verification.md holds for the results in `out`."""
  relative = os.path.relpath(os.path.abspath(out), bridges.ROOT)
  return (f"{BEGIN}\nRendered from `{relative}/` by `python -m verification.long --render"
          f" --out={relative}`:\n\n{render(read_rows(out), relative)}\n\n"
          f"![the curves side by side](../{relative}/curves.png)\n{END}")


def render_into(doc: str, out: str) -> str:
  """Replaces the block between BEGIN and END in `doc` with the table of `out`."""
  with open(doc) as f:
    text = f.read()
  if BEGIN not in text or END not in text:
    raise SystemExit(f"verify-long: {doc} has no {BEGIN} ... {END} block to render into")
  block = doc_block(out)
  head, rest = text.split(BEGIN, 1)
  with open(doc, "w") as f:
    f.write(head + block + rest.split(END, 1)[1])
  return block


# ---------------------------------------------------------------- main

def parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m verification.long",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--algorithms", default=",".join(DEFAULT),
                      help="comma-separated, run in this order (default: %(default)s)")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--device", default=None, choices=("cpu", "cuda"),
                      help="PyTorch's device (default: cuda where available); JAX uses"
                           " the devices it finds")
  parser.add_argument("--references", default=bridges.REFERENCES,
                      help="the folder holding PFLlib/ (default: %(default)s)")
  parser.add_argument("--data_dir", default=None,
                      help="the data root or MNIST's folder (default: the data root's,"
                           " else the copy in the package)")
  parser.add_argument("--out", default=os.path.join(bridges.ROOT, "results", "verification",
                                                    "long"))
  parser.add_argument("--pack", default=None, metavar="FILE.tgz",
                      help="also pack --out into this one file, after every algorithm")
  parser.add_argument("--jobs", type=int, default=1,
                      help="processes at once, each running one side of one algorithm"
                           " (ours with JAX alone, PFLlib's with PyTorch and JAX on the"
                           " CPU); 1: both sides of each algorithm in this process")
  parser.add_argument("--time_budget", type=float, default=0.0, metavar="SECONDS",
                      help="start nothing that the longest so far would carry past this"
                           " many seconds from the start, and (with --jobs) stop what"
                           " still runs then (0: no limit)")
  parser.add_argument("--overlap", default=None, choices=("on", "off"),
                      help="with --jobs=1: our run in a thread while PFLlib's trains"
                           " (default: on with cuda)")
  parser.add_argument("--precision", default="highest", choices=("highest", "default"),
                      help="float32 matmuls and convolutions in full float32 on both"
                           " sides (no TF32 on GPUs), or each library's default")
  parser.add_argument("--float64_reference", action="store_true",
                      help="also run PFLlib with its model and inputs in float64, the"
                           " arithmetic both float32 runs round: a gap that float32"
                           " rounding makes shows between each side and it alike")
  parser.add_argument("--torch_threads", type=int, default=1,
                      help="PyTorch's CPU threads (default: %(default)s)")
  parser.add_argument("--render", action="store_true",
                      help="no training: render --out's table into --doc")
  parser.add_argument("--doc", default=os.path.join(bridges.ROOT, "docs", "verification.md"))
  parser.add_argument("--side", default=None, choices=SIDES + (EXACT,),
                      help=argparse.SUPPRESS)
  parser.add_argument("--parts", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  unknown = [a for a in args.algorithms.split(",") if a not in DEFAULT]
  if unknown:
    parser.error(f"--algorithms: {', '.join(unknown)} not covered; covered:"
                 f" {', '.join(DEFAULT)}")
  if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}")
  return args


SIDES = ("ours", "reference")
EXACT = "reference64"  # PFLlib in float64 (--float64_reference)
COMMAND = "VERIFY_LONG_COMMAND"  # the command a child records: its parent's


def main(argv: list[str]) -> int:
  args = parse(argv)
  if args.render:
    print(render_into(args.doc, args.out))
    return 0
  references = os.path.abspath(args.references)
  lack = missing(references)
  if lack is not None:
    print(f"verify-long: skipped, {lack}")
    return 0
  bridges.REFERENCES = references
  if args.side is not None:  # a child: one side of one algorithm
    return run_side(args)
  os.makedirs(args.out, exist_ok=True)
  names = args.algorithms.split(",")
  extra = {"command": os.environ.get(COMMAND) or ("python -m verification.long "
                                                  + " ".join(argv)).strip(),
           "precision": args.precision}
  if args.jobs > 1:
    failures = run_in_children(args, names, extra)
  else:
    failures = run_here(args, names, extra)
  rows = write_outputs(args.out, args.pack)
  print(render(rows, args.out))
  differ = [row["algorithm"] for row in rows if verdict(row) == "DIFFERS"]
  if differ:
    log(f"final gap over {GAP_POINTS} point: {', '.join(differ)}")
  if failures:
    log(f"no result: {', '.join(failures)}")
  return 1 if differ or failures else 0


def log(message: str) -> None:
  print(f"verify-long: {message}", file=sys.stderr, flush=True)


def prepare_torch(args: argparse.Namespace) -> str:
  """PFLlib importable (stand-ins where its unused imports are absent), PyTorch set up;
  returns its device."""
  import torch  # pylint: disable=import-outside-toplevel
  if stand_ins.STOOD_IN:
    log(f"stand-ins for {', '.join(stand_ins.STOOD_IN)} (imported, never called here)")
  bridges.import_pfllib()
  # One thread: on a shared 2-core CPU PyTorch's two spinning threads took 318 ms a
  # FedAvgCNN step of batch 10, one thread 12 ms (2026-12-04); its GPU work needs none.
  torch.set_num_threads(args.torch_threads)
  if args.precision == "highest":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
  return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def prepare_jax(args: argparse.Namespace) -> None:
  if args.precision == "highest":
    jax.config.update("jax_default_matmul_precision", "highest")


def run_side(args: argparse.Namespace) -> int:
  """A child's work: one side of one algorithm, written to <parts>/<name>.<side>.json."""
  setting, name = Setting(), args.algorithms
  prepare_jax(args)
  device = prepare_torch(args) if args.side != "ours" else None
  split = build_split(setting, args.data_dir, *split_kind(name))
  part = (run_ours(name, split, setting, args.rounds) if args.side == "ours"
          else run_reference(name, split, setting, args.rounds, device,
                             float64=args.side == EXACT))
  write_part(os.path.join(args.parts, f"{name}.{args.side}"), part)
  return 0


def write_part(path: str, part: dict) -> None:
  """A side's result as <path>.json, its server models (arrays) as <path>.npz."""
  part = dict(part)
  models = part.pop("server_models")
  if models is not None:
    np.savez(path + ".npz", **{f"{r}_{i}": a for r, model in enumerate(models)
                               for i, a in enumerate(model)})
  with open(path + ".json", "w") as f:
    json.dump({**part, "server_models": None if models is None else len(models)}, f)


def read_part(path: str) -> dict:
  """write_part's side, its server models read back."""
  part = read_json(path + ".json")
  rounds = part["server_models"]
  if rounds is not None:
    with np.load(path + ".npz") as arrays:
      tensors = len(arrays.files) // max(rounds, 1)
      part["server_models"] = [[arrays[f"{r}_{i}"] for i in range(tensors)]
                               for r in range(rounds)]
  return part


def run_here(args: argparse.Namespace, names: list[str], extra: dict) -> list[str]:
  """Both sides of each algorithm in this process, one algorithm after the other, each
  one's JSON, figure, table and pack written as it finishes."""
  prepare_jax(args)
  device = prepare_torch(args)
  overlap = (args.overlap or ("on" if device == "cuda" else "off")) == "on"
  setting = Setting()
  splits = {kind: build_split(setting, args.data_dir, *kind)
            for kind in {split_kind(name) for name in names}}
  split = splits.get((1, "pfllib")) or next(iter(splits.values()))
  sizes = split.data.split_sizes("train")
  log(f"{setting.clients} clients of {sizes.min()} to {sizes.max()} training images"
      f" ({sizes.sum()} in all), {split.data.split_sizes('test').sum()} test images;"
      f" PyTorch on {device}, JAX on {jax.default_backend()}")
  start, durations, failures = time.perf_counter(), [], []
  for name in names:
    elapsed = time.perf_counter() - start
    if args.time_budget and durations and elapsed + max(durations) > args.time_budget:
      log(f"{name}: not started, {elapsed:.0f} s of the {args.time_budget:.0f} s budget"
          f" spent (the longest algorithm so far took {max(durations):.0f} s)")
      continue
    began = time.perf_counter()
    split = splits[split_kind(name)]
    try:
      if overlap:  # ours in a thread while PFLlib's trains
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
          ours_future = pool.submit(run_ours, name, split, setting, args.rounds)
          theirs = run_reference(name, split, setting, args.rounds, device)
          ours = ours_future.result()
      else:
        ours = run_ours(name, split, setting, args.rounds)
        theirs = run_reference(name, split, setting, args.rounds, device)
      exact = (run_reference(name, split, setting, args.rounds, device, float64=True)
               if args.float64_reference else None)
    except Exception:  # pylint: disable=broad-except
      # One algorithm's failure leaves the others' results (a one-shot run on a lent GPU).
      log(f"{name}: failed\n{traceback.format_exc()}")
      failures.append(name)
      continue
    row = merge(name, args.rounds, ours, theirs, setting,
                {**extra, "overlap": overlap, "jobs": 1}, exact)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
      json.dump(row, f, indent=1)
    durations.append(time.perf_counter() - began)
    write_outputs(args.out, args.pack)
    log(summary(row))
  return failures


def run_in_children(args: argparse.Namespace, names: list[str], extra: dict) -> list[str]:
  """Each side of each algorithm in a child process, up to --jobs at once, in order
  (ours, then PFLlib's, algorithm by algorithm); an algorithm's JSON, and the figure,
  table and pack, written once both its sides are done. PFLlib's side runs JAX on the
  CPU (its batches and initial model), so that only PyTorch shares the accelerator with
  the JAX of our side's processes. With --time_budget, nothing starts that the longest
  so far would carry past it, and what still runs then is stopped."""
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  parts = tempfile.mkdtemp(prefix="verify_long_")
  forwarded = [f"--rounds={args.rounds}", f"--precision={args.precision}",
               f"--torch_threads={args.torch_threads}", f"--references={bridges.REFERENCES}",
               f"--parts={parts}"]
  forwarded += [f"--{flag}={getattr(args, flag)}" for flag in ("device", "data_dir")
                if getattr(args, flag) is not None]
  environment = {**os.environ, COMMAND: extra["command"]}
  sides = SIDES + ((EXACT,) if args.float64_reference else ())
  pending = [(name, side) for name in names for side in sides]
  running: dict[tuple[str, str], tuple[Any, float]] = {}
  durations: list[float] = []
  failures: list[str] = []
  merged: set[str] = set()
  start = time.perf_counter()
  setting = Setting()
  while pending or running:
    elapsed = time.perf_counter() - start
    over = bool(args.time_budget) and elapsed > args.time_budget
    estimate = max(durations, default=0.0)
    while (pending and len(running) < args.jobs and not over
           and not (args.time_budget and elapsed + estimate > args.time_budget)):
      name, side = task = pending.pop(0)
      child_environment = dict(environment)
      if side != "ours":
        child_environment["JAX_PLATFORMS"] = "cpu"
      command = [sys.executable, "-m", "verification.long", f"--algorithms={name}",
                 f"--side={side}"] + forwarded
      running[task] = (subprocess.Popen(command, cwd=bridges.ROOT, env=child_environment),
                       time.perf_counter())
    if over or (pending and not running):
      for (name, side), (process, _) in running.items():
        process.terminate()
        log(f"{name}: its {side} side stopped at the {args.time_budget:.0f} s budget")
      for process, _ in running.values():
        process.wait()
      for name, side in pending:
        log(f"{name}: its {side} side not started, the {args.time_budget:.0f} s budget"
            " spent")
      failures += sorted({name for name, _ in list(running) + pending})
      running.clear()
      pending.clear()
      break
    time.sleep(0.5)
    for task, (process, began) in list(running.items()):
      if process.poll() is None:
        continue
      del running[task]
      durations.append(time.perf_counter() - began)
      name, side = task
      if process.returncode != 0:
        log(f"{name}: its {side} side failed (exit {process.returncode})")
        failures.append(name)
        continue
      files = [os.path.join(parts, f"{name}.{s}") for s in sides]
      if name not in merged and all(os.path.exists(f + ".json") for f in files):
        merged.add(name)
        ours, theirs, *exact = (read_part(f) for f in files)
        row = merge(name, args.rounds, ours, theirs, setting, {**extra, "jobs": args.jobs},
                    exact[0] if exact else None)
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
          json.dump(row, f, indent=1)
        write_outputs(args.out, args.pack)
        log(summary(row))
  shutil.rmtree(parts, ignore_errors=True)
  return sorted(set(failures))


def read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


# The model a row's setting names: FedAvgCNN, or check (a)'s twin's.
MODEL_LABELS = {MODEL: "FedAvgCNN",
                "coaching_cnn_bn": "coaching_cnn_bn (BatchNorm) and its PyTorch twin"}


def describe(setting: Setting, sizes: np.ndarray, rounds: int, reference=None) -> str:
  model = MODEL_LABELS[MODEL if reference is None else model_name(reference)]
  count = (setting.clients if reference is None
           else num_sampled_clients(reference.participation, setting.clients))
  clients = ("every client every round" if count == setting.clients
             else f"{count} client{'s' if count > 1 else ''} a round, sampled as ours")
  return (f"MNIST pathological ({setting.classes_per_client} classes a client) at"
          f" {setting.data_fraction:.0%} of the data, {setting.clients} clients of"
          f" {sizes.min()} to {sizes.max()} training images, {model}, batch"
          f" {setting.batch_size}, {setting.local_epochs} local epoch, SGD lr {setting.lr},"
          f" {clients}, {rounds} rounds, same initial model and batches;"
          " each algorithm in check (a)'s form and hyperparameters")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
