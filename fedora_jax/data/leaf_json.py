"""LEAF's JSON files: each user's samples, as LEAF's preprocessing writes them.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018;
github.com/TalwalkarLab/leaf) publishes FEMNIST (by writer) and Shakespeare (by speaking
role) as the JSON its `preprocess.sh` writes into <dataset>/data/train/ and
<dataset>/data/test/: several *.json files each, every file

  {"users": [user ids], "num_samples": [samples per user],
   "user_data": {user id: {"x": [samples], "y": [targets]}}}    (and maybe "hierarchies")

With LEAF's default sample split (`-t sample`) every user is in both folders, train file
i beside test file i; with its user split (`-t user`) a user is in one of them. Nothing
of the JSON is interpreted here beyond that layout: the dataset's loader
(fedora_jax/data/natural.py) turns x and y into arrays.
"""

import glob
import json
import os
from typing import Any, Iterator, NamedTuple

from fedora_jax.errors import DataError

SPLITS = ("train", "test")
EXPECTED = ("LEAF's train/ and test/ folders of *.json files ({\"users\", \"user_data\":"
            " {user: {\"x\", \"y\"}}}), as its preprocess.sh writes them under data/")


class LeafUser(NamedTuple):
  """One user's samples of one split, as the JSON holds them (lists)."""
  id: str
  x: list[Any]
  y: list[Any]


def holds(folder: str) -> bool:
  """Whether `folder` has LEAF's train/ and test/ folders of JSON files."""
  return all(glob.glob(os.path.join(folder, split, "*.json")) for split in SPLITS)


def json_files(folder: str, split: str) -> list[str]:
  """`split`'s JSON files in name order (LEAF numbers them all_data_<i>_...)."""
  paths = sorted(glob.glob(os.path.join(folder, split, "*.json")))
  if not paths:
    raise DataError(f"LEAF: no .json file in {os.path.join(folder, split)}; expected"
                    f" {EXPECTED}")
  return paths


def read_file(path: str) -> Iterator[LeafUser]:
  """The users of one JSON file, in its "users" order."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise DataError(f"LEAF: cannot read {path} ({e})") from None
  if not isinstance(data, dict) or not {"users", "user_data"} <= data.keys():
    raise DataError(f"LEAF: {path} lacks \"users\" or \"user_data\"; expected {EXPECTED}")
  for user in data["users"]:
    samples = data["user_data"].get(user)
    if not isinstance(samples, dict) or not {"x", "y"} <= samples.keys():
      raise DataError(f"LEAF: {path}: user {user!r} has no \"x\" and \"y\" in user_data")
    if len(samples["x"]) != len(samples["y"]):
      raise DataError(f"LEAF: {path}: user {user!r} has {len(samples['x'])} x but"
                      f" {len(samples['y'])} y")
    yield LeafUser(str(user), samples["x"], samples["y"])


def users(folder: str, split: str) -> Iterator[LeafUser]:
  """Every user of `split`, file by file in name order: read lazily, so taking the
  first K users reads only the files that hold them."""
  for path in json_files(folder, split):
    yield from read_file(path)


def find_users(folder: str, split: str, wanted: set[str]) -> dict[str, LeafUser]:
  """`split`'s samples of the `wanted` users: files read in name order until all are
  found (test file i holds train file i's users), or all were read."""
  found: dict[str, LeafUser] = {}
  for path in json_files(folder, split):
    found.update((u.id, u) for u in read_file(path) if u.id in wanted)
    if len(found) == len(wanted):
      break
  return found
