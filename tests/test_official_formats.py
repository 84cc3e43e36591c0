"""Tiny-ImageNet, AG News and Flowers102 loaders on tiny files in their official formats."""

import io
import zipfile

import jax
import numpy as np
import pytest
from PIL import Image

from fedora_jax.data import agnews, datasets, flowers102, tinyimagenet
from fedora_jax.errors import DataError, FedoraError
from fedora_jax.models import MODEL_INPUTS, MODELS, build_model, check_inputs, fasttext

# A few distinct, flat colours: JPEG keeps a flat 64x64 block within a few levels.
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)]


def _jpeg(colour, size=(64, 64), mode="RGB") -> bytes:
  buffer = io.BytesIO()
  image = Image.new("RGB", size, colour)
  (image.convert("L") if mode == "L" else image).save(buffer, format="JPEG", quality=95)
  return buffer.getvalue()


# --- Tiny-ImageNet ------------------------------------------------------------------------

WNIDS = [f"n{i:08d}" for i in range(200)]


def _tiny_files():
  """tiny-imagenet-200/ member -> bytes: one training image of every class, two of class
  199 (one greyscale), 3 validation images, and a test image without a label."""
  files = {"wnids.txt": ("\n".join(WNIDS) + "\n").encode()}
  for c in range(200):
    for i in range(2 if c == 199 else 1):
      mode = "L" if (c, i) == (199, 1) else "RGB"
      files[f"train/{WNIDS[c]}/images/{WNIDS[c]}_{i}.JPEG"] = _jpeg(COLOURS[c % 4], mode=mode)
    files[f"train/{WNIDS[c]}/{WNIDS[c]}_boxes.txt"] = b"x\t0\t0\t63\t63\n"
  rows = []
  for i, c in enumerate((1, 199, 0)):
    files[f"val/images/val_{i}.JPEG"] = _jpeg(COLOURS[c % 4])
    rows.append(f"val_{i}.JPEG\t{WNIDS[c]}\t0\t0\t63\t63")
  files["val/val_annotations.txt"] = ("\n".join(rows) + "\n").encode()
  files["test/images/test_0.JPEG"] = _jpeg(COLOURS[0])
  return files


def _write_tiny(root, as_zip):
  files = _tiny_files()
  if as_zip:
    with zipfile.ZipFile(root / tinyimagenet.ARCHIVE, "w") as z:
      for name, data in files.items():
        z.writestr(f"tiny-imagenet-200/{name}", data)
    return
  for name, data in files.items():
    path = root / "tiny-imagenet-200" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.parametrize("as_zip", [False, True])
def test_tinyimagenet_reads_the_official_layout(tmp_path, as_zip):
  (tmp_path / "tinyimagenet").mkdir()
  _write_tiny(tmp_path / "tinyimagenet", as_zip)
  data = tinyimagenet.load_tinyimagenet(str(tmp_path))  # the data root
  assert data.num_classes == 200 and data.name == "tinyimagenet"
  assert data.x_train.shape == (201, 64, 64, 3) and data.x_train.dtype == np.uint8
  np.testing.assert_array_equal(data.y_train, [*range(200), 199])  # wnids.txt order
  np.testing.assert_array_equal(data.y_test, [1, 199, 0])  # val_annotations.txt order
  # Each image decodes to its colour (JPEG: within a few levels); the grey one to grey.
  assert np.abs(data.x_train[0].astype(int) - COLOURS[0]).max() <= 4
  assert np.abs(data.x_test[1].astype(int) - COLOURS[3]).max() <= 4
  assert np.abs(data.x_train[6].astype(int) - COLOURS[2]).max() <= 4
  grey = data.x_train[200].astype(int)
  assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()


def test_tinyimagenet_registry_builds_dirichlet_clients(tmp_path):
  _write_tiny(tmp_path, as_zip=False)  # the dataset's own folder as --data_dir
  spec = datasets.get_spec("tinyimagenet")
  assert (spec.partition, spec.model, spec.num_clients) == ("dirichlet", "fedavg_cnn", 20)
  federated = datasets.build_federated_dataset(
      "tinyimagenet", str(tmp_path), num_clients=2, setting="balanced", seed=0)
  assert federated.partition.kind == "dirichlet" and federated.data.num_classes == 200
  assert federated.partition.class_counts.sum() + sum(
      len(c.x_val) for c in federated.partition.clients) == 201
  assert federated.data.input_shape == (64, 64, 3)


def test_tinyimagenet_bad_files_are_one_line_errors(tmp_path):
  with pytest.raises(DataError, match=r"tinyimagenet: no data in .*tiny-imagenet-200.zip"):
    tinyimagenet.load_tinyimagenet(str(tmp_path))
  _write_tiny(tmp_path, as_zip=False)
  top = tmp_path / "tiny-imagenet-200"
  (top / "val" / "images" / "val_1.JPEG").write_bytes(b"not a jpeg")
  with pytest.raises(DataError, match=r"cannot decode image .*val_1.JPEG"):
    tinyimagenet.load_tinyimagenet(str(tmp_path))
  (top / "val" / "images" / "val_1.JPEG").unlink()
  with pytest.raises(DataError, match=r"cannot read .*val_1.JPEG"):
    tinyimagenet.load_tinyimagenet(str(tmp_path))
  (top / "wnids.txt").write_text("n1\nn2\n")
  with pytest.raises(DataError, match="wnids.txt lists 2 distinct class ids"):
    tinyimagenet.load_tinyimagenet(str(tmp_path))
  zip_path = tmp_path / "z" / tinyimagenet.ARCHIVE
  zip_path.parent.mkdir()
  zip_path.write_bytes(b"PK\x03\x04 truncated")
  with pytest.raises(DataError, match=r"tiny-imagenet-200.zip: truncated or not a zip"):
    tinyimagenet.load_tinyimagenet(str(zip_path))


def test_fedavg_cnn_takes_64x64_images_as_fedalas_code():
  # FedALA's main.py builds FedAvgCNN(dim=10816) for Tiny-ImageNet: 64 -> 60 -> 30 -> 26
  # -> 13 with VALID 5x5 convolutions and 2x2 pools, 13*13*64 = 10816 features.
  model = build_model("fedavg_cnn", num_outputs=200)
  params = model.init(jax.random.key(0), np.zeros((1, 64, 64, 3), np.uint8))
  assert params["params"]["Dense_0"]["kernel"].shape == (10816, 512)
  assert model.apply(params, np.zeros((2, 64, 64, 3), np.uint8)).shape == (2, 200)


# --- Flowers102 ---------------------------------------------------------------------------

# 8 images: classes (1-based, as imagelabels.mat) and the official splits (1-based ids).
FLOWER_LABELS = [1, 2, 102, 1, 2, 102, 5, 1]
TRNID, VALID, TSTID = [1, 2, 3], [4, 5], [8, 6, 7]


def _write_flowers(folder, as_tgz=True):
  import scipy.io
  import tarfile
  folder.mkdir(parents=True, exist_ok=True)
  scipy.io.savemat(folder / flowers102.LABELS,
                   {"labels": np.array([FLOWER_LABELS], np.uint8)})
  scipy.io.savemat(folder / flowers102.SPLITS,
                   {"trnid": np.array([TRNID], np.uint16), "valid": np.array([VALID], np.uint16),
                    "tstid": np.array([TSTID], np.uint16)})
  # Official images have varying sizes; each is resized to 64x64.
  jpegs = {f"jpg/image_{i:05d}.jpg": _jpeg(COLOURS[i % 4], size=(80 + 10 * i, 60 + 5 * i))
           for i in range(1, len(FLOWER_LABELS) + 1)}
  if as_tgz:
    with tarfile.open(folder / flowers102.ARCHIVE, "w:gz") as tar:
      for name, data in jpegs.items():
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
  else:
    for name, data in jpegs.items():
      (folder / name).parent.mkdir(exist_ok=True)
      (folder / name).write_bytes(data)


@pytest.mark.parametrize("as_tgz", [True, False])
def test_flowers102_reads_the_official_files(tmp_path, as_tgz):
  _write_flowers(tmp_path / "flowers102", as_tgz)
  data = flowers102.load_flowers102(str(tmp_path))  # the data root
  assert data.num_classes == 102 and data.name == "flowers102"
  assert data.x_train.shape == (5, 64, 64, 3) and data.x_test.shape == (3, 64, 64, 3)
  np.testing.assert_array_equal(data.y_train, [0, 1, 101, 0, 1])  # trnid then valid, 0-based
  np.testing.assert_array_equal(data.y_test, [0, 101, 4])         # tstid 8, 6, 7
  assert np.abs(data.x_test[0].astype(int) - COLOURS[8 % 4]).max() <= 4
  assert np.abs(data.x_train[2].astype(int) - COLOURS[3 % 4]).max() <= 4
  spec = datasets.get_spec("flowers102")
  assert (spec.partition, spec.model, spec.num_clients) == ("dirichlet", "fedavg_cnn", 20)


def test_flowers102_bad_files_are_one_line_errors(tmp_path):
  folder = tmp_path / "flowers102"
  with pytest.raises(DataError, match=r"flowers102: no data in .*102flowers.tgz"):
    flowers102.load_flowers102(str(tmp_path))
  _write_flowers(folder)
  (folder / flowers102.SPLITS).write_bytes(b"MATLAB 5.0 truncated")
  with pytest.raises(DataError, match=r"cannot read .*setid.mat"):
    flowers102.load_flowers102(str(folder))
  _write_flowers(folder)
  raw = (folder / flowers102.ARCHIVE).read_bytes()
  (folder / flowers102.ARCHIVE).write_bytes(raw[:len(raw) // 2])
  with pytest.raises(DataError, match=r"cannot read .*102flowers.tgz"):
    flowers102.load_flowers102(str(folder))
  _write_flowers(folder, as_tgz=False)
  (folder / flowers102.ARCHIVE).unlink()
  (folder / "jpg" / "image_00007.jpg").unlink()
  with pytest.raises(DataError, match=r"cannot read .*image_00007.jpg"):
    flowers102.load_flowers102(str(folder))


# --- AG News and fastText ------------------------------------------------------------------

AG_TRAIN = [
    ("3", "Wall St. Bears Claw Back", "Short-sellers, Wall Street's dwindling band, are back."),
    ("2", "Phelps wins gold", "Michael Phelps won the gold medal."),
    ("1", "Talks in Gaza", "Leaders met in Gaza on Monday, \"talks\" resumed."),
    ("4", "New chip", "A new chip from Intel; the chip is fast."),
]
AG_TEST = [("4", "Chip news", "Intel chip, unseen words."), ("2", "Gold", "")]


def _write_agnews(folder):
  import csv
  folder.mkdir(parents=True, exist_ok=True)
  for name, rows in (("train.csv", AG_TRAIN), ("test.csv", AG_TEST)):
    with open(folder / name, "w", newline="") as f:
      csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)  # as distributed: all quoted


def test_agnews_tokens_vocabulary_and_ids(tmp_path):
  assert agnews.tokenize("Wall St. Bears' 2nd-try!") == ["wall", "st", "bears", "2nd", "try"]
  _write_agnews(tmp_path / "ag_news")
  data = agnews.load_agnews(str(tmp_path), vocab_size=6, max_len=5)
  np.testing.assert_array_equal(data.y_train, [2, 1, 0, 3])
  np.testing.assert_array_equal(data.y_test, [3, 1])
  assert data.x_train.dtype == np.int32 and data.x_train.shape == (4, 5)
  # Training counts by hand: "chip" 3; "wall", "back", "phelps", "the", "gold", "in",
  # "gaza", "talks", "new" 2 each, in that order of first appearance (ties: first seen
  # first); the rest once. V = 6: ids 2..5 for chip, wall, back, phelps.
  vocabulary = agnews.build_vocabulary([f"{t} {d}" for _, t, d in AG_TRAIN], 6)
  assert vocabulary == {"chip": 2, "wall": 3, "back": 4, "phelps": 5}
  np.testing.assert_array_equal(data.x_train[0], [3, 1, 1, 1, 4])  # wall st bears claw back
  # "chip news intel chip unseen" (cut at 5), "gold" (unknown, then padding).
  np.testing.assert_array_equal(data.x_test, [[2, 1, 1, 2, 1], [1, 0, 0, 0, 0]])
  spec = datasets.get_spec("agnews")
  assert (spec.partition, spec.model, spec.num_clients) == ("dirichlet", "fasttext", 20)
  assert agnews.VOCAB_SIZE == fasttext.VOCAB_SIZE and agnews.MAX_LEN == 200


def test_agnews_bad_files_are_one_line_errors(tmp_path):
  folder = tmp_path / "ag_news"
  _write_agnews(folder)
  (folder / "test.csv").write_text('"5","title","text"\n')
  with pytest.raises(DataError, match=r"test.csv row 1: expected \"class index \(1-4\)\""):
    agnews.load_agnews(str(folder))
  (folder / "test.csv").write_bytes(b'"1","\xff\xfe","x"\n')
  with pytest.raises(DataError, match=r"cannot read .*test.csv"):
    agnews.load_agnews(str(folder))
  (folder / "test.csv").unlink()
  (folder / "train.csv").unlink()
  # A folder without the CSVs: the offline download stops with one line naming them.
  with pytest.raises(FedoraError, match="train.csv"):
    agnews.load_agnews(str(folder))


def test_fasttext_is_fedalas_model_and_the_bag_variant_averages_real_tokens():
  x = np.array([[5, 7, 0, 0], [9, 0, 0, 0]], np.int32)
  model, bag = build_model("fasttext", 4), build_model("fasttext_bag", 4)
  params = model.init(jax.random.key(0), x)
  shapes = jax.tree.map(lambda a: a.shape, params)["params"]
  assert shapes["Embed_0"]["embedding"] == (98_635, 32)
  assert shapes["Dense_0"]["kernel"] == (32, 32) and shapes["Dense_1"]["kernel"] == (32, 4)
  # By hand: 98635*32 + 32*32 + 32 + 32*4 + 4 (FedALA's fastText, hidden_dim 32).
  assert sum(a.size for a in jax.tree.leaves(params)) == 3_157_508
  table = params["params"]["Embed_0"]["embedding"]
  d0, d1 = params["params"]["Dense_0"], params["params"]["Dense_1"]
  padded = np.stack([(table[5] + table[7]) / 4, table[9] / 4])  # mean over all 4 positions
  np.testing.assert_allclose(model.apply(params, x),
                             (padded @ d0["kernel"] + d0["bias"]) @ d1["kernel"] + d1["bias"],
                             rtol=1e-5, atol=1e-5)
  real = np.stack([(table[5] + table[7]) / 2, table[9]])  # mean over the real tokens
  hidden = np.maximum(real @ d0["kernel"] + d0["bias"], 0)
  np.testing.assert_allclose(bag.apply(params, x), hidden @ d1["kernel"] + d1["bias"],
                             rtol=1e-5, atol=1e-5)
  # Padding (id 0) is a zero vector that gets no gradient, as padding_idx=0 in PyTorch.
  grad = jax.grad(lambda p: model.apply(p, x).sum())(params)["params"]["Embed_0"]["embedding"]
  assert not np.asarray(grad[0]).any() and np.asarray(grad[5]).any()


def test_a_model_the_samples_do_not_fit_is_refused_in_one_line():
  assert set(MODEL_INPUTS) == set(MODELS)  # every model says what it reads
  tokens, images, spectra = ((200,), np.int32), ((32, 32, 3), np.uint8), ((50,), np.float32)
  readers = {"tokens": {"fasttext", "fasttext_bag", "char_lstm"}, "vectors": {"mlp"},
             "images": {"mlp", "cnn", "coaching_cnn", "coaching_cnn_bn", "fedavg_cnn",
                        "pfl_cnn", "resnet18"}}
  for name in MODELS:
    for (shape, dtype), kind in ((tokens, "tokens"), (images, "images"), (spectra, "vectors")):
      if name in readers[kind]:
        check_inputs(name, shape, dtype, "data")
      else:
        with pytest.raises(FedoraError, match=f"^--model={name} reads .* but data's samples"
                           f" are {kind} of shape"):
          check_inputs(name, shape, dtype, "data")
  with pytest.raises(FedoraError) as error:
    check_inputs("cnn", *tokens, "agnews")
  assert str(error.value) == (
      "--model=cnn reads images, but agnews's samples are tokens of shape (200,) (int32);"
      " models for them: fasttext, fasttext_bag, char_lstm")
