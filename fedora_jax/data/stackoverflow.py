"""StackOverflow (TFF's federated version; Reddi et al., "Adaptive Federated Optimization",
ICLR 2021): each user's questions and answers, as word ids and tags.

TFF publishes it as stackoverflow.tar.bz2 (HDF5: stackoverflow_train.h5,
stackoverflow_held_out.h5, stackoverflow_test.h5) or stackoverflow.sqlite.lzma (SQLite,
splits train, heldout, test), read by fedora_jax/data/tff_files.py. Every example is
one post: `tokens` (its lowercased words, separated by spaces), `tags` (the question's
tags, separated by "|"), `title`, `score`, `type`, `creation_date`. The vocabularies
come from TFF's stackoverflow.word_count ("word count" lines, most frequent first) and
stackoverflow.tag_count (JSON {tag: count}) in the same folder, or, where absent, from
the loaded users' training posts (most frequent first, ties in first-seen order).

Read here for TFF's two tasks, as arrays per user:
  - next-word prediction: ids [n, seq_len + 1] int32 (0 padding, 1..V the V most
    frequent words, V + 1 any other word, V + 2 beginning, V + 3 end of post): the
    beginning id, the post's first seq_len words, the end id if the post ended, zeros;
  - tag prediction: the post's tags among the T most frequent, multi-hot [n, T] bool.
Neither is a single-label classification, the only classification the engine trains
(one softmax cross-entropy per sample): next-word prediction needs a loss at every
position of a sequence model, tag prediction a multi-label (sigmoid) loss. So the data
is loaded and tested but not registered as a --dataset (docs/datasets.md).
"""

import collections
import json
import logging
import os
from typing import Iterable, NamedTuple

import numpy as np

from fedora_jax.data import natural, tff_files
from fedora_jax.errors import DataError

logger = logging.getLogger("fedora_jax")

NAME = "stackoverflow"
VOCAB_SIZE, NUM_TAGS, SEQ_LEN = 10_000, 500, 20  # TFF's baselines' (Reddi et al. 2021)
PAD = 0
FILES = {"h5": {"train": "stackoverflow_train.h5", "test": "stackoverflow_test.h5"},
         "sqlite": {"train": "stackoverflow.sqlite", "test": "stackoverflow.sqlite"}}
WORD_COUNT, TAG_COUNT = "stackoverflow.word_count", "stackoverflow.tag_count"
WHERE = ("get TFF's StackOverflow: stackoverflow.tar.bz2 (HDF5: stackoverflow_train.h5,"
         " stackoverflow_test.h5) or stackoverflow.sqlite.lzma (decompress it with"
         " `unlzma`), with stackoverflow.word_count.tar.bz2 and"
         " stackoverflow.tag_count.tar.bz2, under storage.googleapis.com/tff-datasets-public/")


class StackOverflowUser(NamedTuple):
  """One user's posts: word ids and tags, training and test (empty without test posts)."""
  id: str
  words_train: np.ndarray  # [n, seq_len + 1] int32
  tags_train: np.ndarray   # [n, num_tags] bool
  words_test: np.ndarray
  tags_test: np.ndarray


class Vocabularies(NamedTuple):
  words: dict[str, int]  # word -> 1..V
  tags: dict[str, int]   # tag -> 0..T-1


def _texts(values: np.ndarray) -> list[str]:
  return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def ranked(counts: Iterable[str], size: int, first: int) -> dict[str, int]:
  """The `size` most frequent items -> first, first + 1, ... (ties: first seen first)."""
  common = collections.Counter(counts).most_common(size)
  return {item: first + i for i, (item, _) in enumerate(common)}


def read_vocabularies(folder: str, vocab_size: int, num_tags: int) -> Vocabularies | None:
  """TFF's word and tag counts in `folder`, or None where either file is absent."""
  words_path, tags_path = os.path.join(folder, WORD_COUNT), os.path.join(folder, TAG_COUNT)
  if not (os.path.isfile(words_path) and os.path.isfile(tags_path)):
    return None
  try:
    with open(words_path, encoding="utf-8") as f:
      words = [line.split()[0] for line, _ in zip(f, range(vocab_size)) if line.strip()]
    with open(tags_path, encoding="utf-8") as f:
      tag_counts = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, IndexError) as e:
    raise DataError(f"{NAME}: cannot read {words_path} or {tags_path} ({e})") from None
  if not isinstance(tag_counts, dict):
    raise DataError(f"{NAME}: {tags_path} is not a JSON object of tag counts")
  tags = sorted(tag_counts, key=lambda t: -tag_counts[t])[:num_tags]
  return Vocabularies({w: i + 1 for i, w in enumerate(words)},
                      {t: i for i, t in enumerate(tags)})


def encode_words(posts: list[str], words: dict[str, int], seq_len: int) -> np.ndarray:
  """Posts -> [n, seq_len + 1] ids: beginning, the first seq_len words, end, padding."""
  oov, bos, eos = len(words) + 1, len(words) + 2, len(words) + 3
  ids = np.full((len(posts), seq_len + 1), PAD, np.int32)
  for row, post in enumerate(posts):
    tokens = post.split()
    sequence = [bos] + [words.get(t, oov) for t in tokens[:seq_len]]
    if len(tokens) < seq_len:
      sequence.append(eos)
    ids[row, :len(sequence)] = sequence
  return ids


def encode_tags(tag_lists: list[str], tags: dict[str, int]) -> np.ndarray:
  """"a|b" strings -> [n, T] multi-hot over the known tags."""
  hot = np.zeros((len(tag_lists), len(tags)), bool)
  for row, joined in enumerate(tag_lists):
    for tag in joined.split("|"):
      if tag in tags:
        hot[row, tags[tag]] = True
  return hot


def _posts(features: dict[str, np.ndarray], client: str) -> tuple[list[str], list[str]]:
  if not {"tokens", "tags"} <= features.keys():
    raise DataError(f"{NAME}: client {client!r} lacks the features tokens and tags (has"
                    f" {', '.join(sorted(features))})")
  return _texts(features["tokens"]), _texts(features["tags"])


def load_stackoverflow(data_dir: str | None, num_clients: int, vocab_size: int = VOCAB_SIZE,
                       num_tags: int = NUM_TAGS, seq_len: int = SEQ_LEN
                       ) -> list[StackOverflowUser]:
  """The first `num_clients` training users (id order) with >= natural.MIN_TRAIN posts."""
  holds = lambda folder: any(os.path.isfile(os.path.join(folder, f["train"]))
                             for f in FILES.values())
  folder = natural.find_folder(NAME, data_dir, holds, WHERE)
  kind = "h5" if os.path.isfile(os.path.join(folder, FILES["h5"]["train"])) else "sqlite"
  paths = {split: os.path.join(folder, name) for split, name in FILES[kind].items()}
  ids = natural.first_users(tff_files.client_sizes(paths["train"], "train"), num_clients,
                            NAME)
  train = {c: _posts(f, c) for c, f in tff_files.read_clients(paths["train"], "train",
                                                              ids).items()}
  test: dict[str, tuple[list[str], list[str]]] = {}
  if os.path.isfile(paths["test"]):
    test = {c: _posts(f, c) for c, f in tff_files.read_clients(paths["test"], "test",
                                                               ids).items()}
  vocabularies = read_vocabularies(folder, vocab_size, num_tags)
  if vocabularies is None:
    logger.info("%s: no %s and %s in %s: vocabularies from the loaded users' training"
                " posts", NAME, WORD_COUNT, TAG_COUNT, folder)
    posts = [p for c in ids for p in train[c][0]]
    tag_lists = [t for c in ids for t in train[c][1]]
    vocabularies = Vocabularies(
        ranked((w for p in posts for w in p.split()), vocab_size, 1),
        ranked((t for joined in tag_lists for t in joined.split("|")), num_tags, 0))
  users = []
  for client in ids:
    posts, tag_lists = train[client]
    test_posts, test_tags = test.get(client, ([], []))
    users.append(StackOverflowUser(
        client, encode_words(posts, vocabularies.words, seq_len),
        encode_tags(tag_lists, vocabularies.tags),
        encode_words(test_posts, vocabularies.words, seq_len),
        encode_tags(test_tags, vocabularies.tags)))
  return users
