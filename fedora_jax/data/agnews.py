"""AG News (Zhang, Zhao & LeCun, NeurIPS 2015) from its official CSVs, as token ids.

The distribution (ag_news_csv.tar.gz; the copy torchtext reads and
fedora_jax/data/download.py fetches into <root>/ag_news/) holds `train.csv` (120,000
rows) and `test.csv` (7,600): no header, every field quoted,
"class index (1-4)","title","description" (World, Sports, Business, Sci/Tech). As
torchtext's AG_NEWS, an article's text is its title and description joined by a space.

Text -> ids, as FedALA's text pipeline (PFLlib dataset/generate_agnews.py: torchtext's
`basic_english` tokenizer, a vocabulary built over the corpus, sequences cut or
zero-padded to max_len = 200) with these choices of ours, stated:
  - tokens: the text lowercased and split on every non-alphanumeric character
    (`basic_english` also lowercases, but keeps . , ( ) ! ? ' as tokens of their own);
  - vocabulary: the `vocab_size` - 2 most frequent training-set tokens (ties: first seen
    first), id 0 padding, id 1 unknown. PFLlib builds it over train and test together,
    with every token (98,635 ids in FedALA's main.py) and `<unk>` sharing id 0 with the
    padding; building it from the training set alone keeps the test set unseen. The
    default vocab_size, 98,635, is FedALA's embedding table size (fasttext's default);
  - each article becomes its first `max_len` ids, zero-padded: int32 [N, max_len].

The arrays take an image's place in ImageDataset (x is [N, L] int32, not uint8 pixels),
so every label-skew partition and the engine take them unchanged; the fasttext models
(fedora_jax/models/fasttext.py) read them.
"""

import collections
import csv
import os
import re

import numpy as np

from fedora_jax.data import root as data_root
from fedora_jax.data.sources import ImageDataset
from fedora_jax.errors import DataError

NAME = "ag_news"
FILES = ("train.csv", "test.csv")
NUM_CLASSES = 4
PAD, UNKNOWN = 0, 1
VOCAB_SIZE = 98_635  # FedALA's main.py (vocab_size); models/fasttext.py VOCAB_SIZE
MAX_LEN = 200        # FedALA's main.py and PFLlib's generate_agnews.py (max_len)
EXPECTED = "train.csv and test.csv (ag_news_csv)"
_SPLIT = re.compile(r"[^0-9a-z]+")


def tokenize(text: str) -> list[str]:
  """Lowercase, split on non-alphanumerics (see the module docstring)."""
  return [t for t in _SPLIT.split(text.lower()) if t]


def build_vocabulary(texts, vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
  """token -> id for the vocab_size - 2 most frequent tokens; 0 pads, 1 is unknown."""
  if vocab_size < 3:
    raise DataError(f"{NAME}: vocab_size must be >= 3 (padding, unknown, a word), got"
                    f" {vocab_size}")
  counts = collections.Counter(t for text in texts for t in tokenize(text))
  return {t: i + 2 for i, (t, _) in enumerate(counts.most_common(vocab_size - 2))}


def encode(texts, vocabulary: dict[str, int], max_len: int = MAX_LEN) -> np.ndarray:
  """[N, max_len] int32 ids: each text's first max_len tokens, then zero padding."""
  ids = np.full((len(texts), max_len), PAD, np.int32)
  for row, text in enumerate(texts):
    tokens = [vocabulary.get(t, UNKNOWN) for t in tokenize(text)[:max_len]]
    ids[row, :len(tokens)] = tokens
  return ids


def read_csv(path: str) -> tuple[list[str], np.ndarray]:
  """An official AG News CSV -> (title + " " + description texts, labels 0..3)."""
  if not os.path.isfile(path):
    raise DataError(f"{NAME}: {path} not found; expected {EXPECTED}")
  texts, labels = [], []
  try:
    with open(path, newline="", encoding="utf-8") as f:
      for line_no, row in enumerate(csv.reader(f), 1):
        if len(row) != 3 or not row[0].strip().isdigit() or not (
            1 <= int(row[0]) <= NUM_CLASSES):
          raise DataError(f"{NAME}: {path} row {line_no}: expected \"class index"
                          f" (1-{NUM_CLASSES})\",\"title\",\"description\", got"
                          f" {str(row)[:60]}")
        labels.append(int(row[0]) - 1)
        texts.append(f"{row[1]} {row[2]}")
  except (OSError, UnicodeDecodeError, csv.Error) as e:
    raise DataError(f"{NAME}: cannot read {path} ({e})") from None
  if not texts:
    raise DataError(f"{NAME}: {path} has no rows")
  return texts, np.asarray(labels, np.int32)


def _holds(folder: str) -> bool:
  return all(os.path.isfile(os.path.join(folder, f)) for f in FILES)


def load_agnews(data_dir: str | None = None, vocab_size: int = VOCAB_SIZE,
                max_len: int = MAX_LEN) -> ImageDataset:
  """AG News as [N, max_len] int32 token ids with the 4 class labels.

  `data_dir`: the data root (its ag_news/ folder, downloaded there when missing) or the
  folder holding train.csv and test.csv.
  """
  folder = data_root.locate(NAME, data_dir, _holds, EXPECTED)
  if os.path.isfile(folder):
    folder = os.path.dirname(folder)
  train_texts, y_train = read_csv(os.path.join(folder, "train.csv"))
  test_texts, y_test = read_csv(os.path.join(folder, "test.csv"))
  vocabulary = build_vocabulary(train_texts, vocab_size)
  return ImageDataset(name=NAME, x_train=encode(train_texts, vocabulary, max_len),
                      y_train=y_train, x_test=encode(test_texts, vocabulary, max_len),
                      y_test=y_test, num_classes=NUM_CLASSES)
