"""TensorFlow Federated's client data files, read with h5py or sqlite3 (no TensorFlow).

TFF (tff.simulation.datasets) publishes its federated datasets in two formats:
  - HDF5, the older archives (fed_cifar100.tar.bz2, stackoverflow.tar.bz2, ...; the
    files FedML, FL-bench and other PyTorch ports read): one file per split, every
    client a group `examples/<client id>` holding one dataset per feature, [n, ...];
  - SQLite, the current ones (<name>.sqlite.lzma, decompressed to <name>.sqlite): a
    table `examples(split_name, client_id, serialized_example_proto)` of serialized
    tf.train.Example protos and a table `client_metadata(client_id, split_name,
    num_examples)` (TFF's sql_client_data_utils). The protos are parsed with the
    wire-compatible copy of tf.train.Example that tensorflow_datasets ships
    (tensorflow_datasets.proto.tf_example_pb2), so TensorFlow is not needed.

A client's features come back as numpy arrays over its examples: HDF5's as stored,
SQLite's flattened per example ([n, d] numbers, d > 1; [n] for one value; bytes as an
object array), to be reshaped by the dataset's loader (fedora_jax/data/natural.py).
"""

import os
import sqlite3

import numpy as np

from fedora_jax.errors import DataError

H5_SUFFIXES = (".h5", ".hdf5")
SQLITE_SUFFIXES = (".sqlite", ".db")


def _kind(path: str) -> str:
  if path.endswith(H5_SUFFIXES):
    return "h5"
  if path.endswith(SQLITE_SUFFIXES):
    return "sqlite"
  raise DataError(f"TFF: {path} is neither HDF5 ({', '.join(H5_SUFFIXES)}) nor SQLite"
                  f" ({', '.join(SQLITE_SUFFIXES)})")


def _open_h5(path: str):
  try:
    import h5py  # pylint: disable=g-import-not-at-top  (only the HDF5 archives need it)
  except ImportError:
    raise DataError(f"TFF: reading {path} needs h5py: pip install h5py (or the"
                    " package's [federated] extra), or use TFF's SQLite file") from None
  try:
    f = h5py.File(path, "r")
  except OSError as e:
    raise DataError(f"TFF: cannot read {path} as HDF5 ({e})") from None
  if "examples" not in f:
    f.close()
    raise DataError(f"TFF: {path} has no `examples` group (TFF's HDF5 client data)")
  return f


def _connect(path: str) -> sqlite3.Connection:
  if not os.path.isfile(path):
    raise DataError(f"TFF: {path} not found")
  connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
  try:
    tables = {row[0] for row in connection.execute(
        "SELECT name FROM sqlite_master WHERE type='table'")}
  except sqlite3.DatabaseError as e:
    connection.close()
    raise DataError(f"TFF: cannot read {path} as SQLite ({e})") from None
  if not {"examples", "client_metadata"} <= tables:
    connection.close()
    raise DataError(f"TFF: {path} lacks the tables examples and client_metadata (TFF's"
                    " SQLite client data)")
  return connection


def client_sizes(path: str, split: str) -> list[tuple[str, int]]:
  """(client id, examples) of every client of `split`, sorted by id. HDF5 files hold
  one split each, so `split` names the SQLite file's split only."""
  if not os.path.isfile(path):
    raise DataError(f"TFF: {path} not found")
  if _kind(path) == "h5":
    with _open_h5(path) as f:
      examples = f["examples"]
      sizes = []
      for client in sorted(examples):
        features = list(examples[client].values())
        sizes.append((client, len(features[0]) if features else 0))
      return sizes
  connection = _connect(path)
  with connection:
    rows = connection.execute(
        "SELECT client_id, num_examples FROM client_metadata WHERE split_name = ?"
        " ORDER BY client_id", (split,)).fetchall()
    splits = [r[0] for r in connection.execute(
        "SELECT DISTINCT split_name FROM client_metadata ORDER BY split_name")]
  connection.close()
  if not rows:
    raise DataError(f"TFF: {path} has no client in split {split!r} (its splits:"
                    f" {', '.join(map(str, splits)) or 'none'})")
  return [(str(c), int(n)) for c, n in rows]


def _feature_values(feature) -> list:
  kind = feature.WhichOneof("kind")
  if kind is None:
    return []
  return list(getattr(feature, kind).value)


def _stack(values: list[list]) -> np.ndarray:
  """One feature over a client's examples: bytes -> object array, numbers -> [n(, d)]."""
  if values and values[0] and isinstance(values[0][0], bytes):
    return np.array([v[0] if len(v) == 1 else v for v in values], dtype=object)
  if len({len(v) for v in values}) > 1:
    raise DataError("TFF: a numeric feature's length differs between examples")
  array = np.asarray(values)
  return array[:, 0] if array.ndim == 2 and array.shape[1] == 1 else array


def _parse_examples(protos: list[bytes], where: str) -> dict[str, np.ndarray]:
  from google.protobuf.message import DecodeError  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.proto import tf_example_pb2  # pylint: disable=g-import-not-at-top
  columns: dict[str, list[list]] = {}
  for i, proto in enumerate(protos):
    example = tf_example_pb2.Example()
    try:
      example.ParseFromString(proto)
    except DecodeError:
      raise DataError(f"TFF: {where}: example {i} is not a tf.train.Example") from None
    features = example.features.feature
    if i == 0:
      columns = {key: [] for key in sorted(features)}
    if set(features) != set(columns):
      raise DataError(f"TFF: {where}: example {i} has features {sorted(features)}, the"
                      f" first {sorted(columns)}")
    for key in columns:
      columns[key].append(_feature_values(features[key]))
  return {key: _stack(values) for key, values in columns.items()}


def read_clients(path: str, split: str, ids: list[str]) -> dict[str, dict[str, np.ndarray]]:
  """The features of clients `ids` of `split` (each client's examples in stored order;
  a client absent from the split is absent from the result)."""
  if _kind(path) == "h5":
    with _open_h5(path) as f:
      examples = f["examples"]
      return {c: {k: np.asarray(v) for k, v in examples[c].items()}
              for c in ids if c in examples}
  connection = _connect(path)
  protos: dict[str, list[bytes]] = {c: [] for c in ids}
  with connection:
    # The table has no index on client_id: one pass over it per chunk of 500 ids.
    for start in range(0, len(ids), 500):
      chunk = ids[start:start + 500]
      rows = connection.execute(
          "SELECT client_id, serialized_example_proto FROM examples WHERE split_name = ?"
          f" AND client_id IN ({','.join('?' * len(chunk))}) ORDER BY rowid",
          (split, *chunk))
      for client, proto in rows:
        protos[client].append(proto)
  connection.close()
  return {c: _parse_examples(p, f"{path} client {c}") for c, p in protos.items() if p}
