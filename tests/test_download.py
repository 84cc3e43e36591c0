"""The data root and downloads, against an HTTP server on the loopback (no internet).

The server serves (a) the real MNIST / Fashion-MNIST files of shared/data, checked
against the official checksums hard-coded in fedora_jax/data/download.py, and (b) small
archives in the official CIFAR python formats written here (their checksums patched
in). FEDORA_JAX_MIRROR points the downloads at it.
"""

import contextlib
import functools
import hashlib
import http.server
import io
import os
import pickle
import socket
import tarfile
import threading

import numpy as np
import pytest

from conftest import SHARED_DATA, needs_shared
from fedora_jax.data import cifar, datasets, download, root, sources
from fedora_jax.errors import ConfigError, DataError


class _Handler(http.server.SimpleHTTPRequestHandler):
  """Serves a folder laid out as a data root; can cut the first `dying` bodies short."""

  def log_message(self, *args):
    pass

  def do_GET(self):
    self.server.requests.append(self.path)
    if self.server.dying <= 0:
      return super().do_GET()
    self.server.dying -= 1
    with open(self.translate_path(self.path), "rb") as f:
      body = f.read()
    self.send_response(200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body[:len(body) // 2])  # then the connection closes mid-file
    self.close_connection = True


@contextlib.contextmanager
def _serve(directory, dying=0):
  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(_Handler, directory=str(directory)))
  server.requests, server.dying = [], dying
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def online(monkeypatch, tmp_path):
  """Downloads on (conftest turns them off), no backoff wait; returns an empty root."""
  monkeypatch.delenv(download.ENV_OFFLINE, raising=False)
  monkeypatch.setattr(download, "BACKOFF_S", 0.0)
  data_root = tmp_path / "root"
  data_root.mkdir()
  return data_root


def _sha256(path):
  return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _cifar_archive(path, fmt, seed):
  """A small archive in the official python format of `fmt`; returns its arrays."""
  rng = np.random.default_rng(seed)
  arrays, n = {}, 3
  with tarfile.open(path, "w:gz") as tar:
    for name in (*fmt.train, fmt.test):
      images = rng.integers(0, 256, (n, 32, 32, 3), np.uint8)
      labels = rng.integers(0, fmt.num_classes, n).tolist()
      batch = {b"data": images.transpose(0, 3, 1, 2).reshape(n, 3072),  # CHW rows
               fmt.label_key: labels, b"filenames": [b"x.png"] * n}
      if fmt is cifar.CIFAR100:
        batch[b"coarse_labels"] = [label // 5 for label in labels]
      raw = pickle.dumps(batch, protocol=2)
      info = tarfile.TarInfo(f"{fmt.batch_dir}/{name}")
      info.size = len(raw)
      tar.addfile(info, io.BytesIO(raw))
      arrays[name] = images, np.array(labels)
  return arrays


@pytest.fixture
def cifar_mirror(tmp_path, monkeypatch):
  """A mirror with small CIFAR-10 and CIFAR-100 archives, their checksums patched in."""
  mirror = tmp_path / "mirror"
  arrays = {}
  for seed, fmt in enumerate((cifar.CIFAR10, cifar.CIFAR100)):
    (mirror / fmt.name).mkdir(parents=True)
    path = mirror / fmt.name / fmt.archive
    arrays[fmt.name] = _cifar_archive(path, fmt, seed)
    file = download.RemoteFile(fmt.archive, path.stat().st_size, _sha256(path),
                               hashlib.md5(path.read_bytes()).hexdigest())
    monkeypatch.setitem(download.REMOTE, fmt.name,
                        download.REMOTE[fmt.name]._replace(files=(file,)))
  return mirror, arrays


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_DATA, "fashion-mnist")),
                    reason=needs_shared("fashion-mnist"))
def test_real_mnist_and_fashion_mnist_download_against_the_official_checksums(
    online, monkeypatch):
  with _serve(SHARED_DATA) as (server, url):
    monkeypatch.setenv(download.ENV_MIRROR, url)
    fashion = sources.load_fashion_mnist(str(online))  # missing from the root: fetched
    assert download.fetch("mnist", str(online)) == str(online / "mnist")
  assert len(server.requests) == 8
  np.testing.assert_array_equal(np.bincount(fashion.y_test), [1000] * 10)
  for name in ("mnist", "fashion-mnist"):
    assert sorted(os.listdir(online / name)) == sorted(sources._IDX_FILES.values())
    for file in download.REMOTE[name].files:
      path = online / name / file.name
      assert path.read_bytes() == open(os.path.join(SHARED_DATA, name, file.name), "rb").read()
      assert hashlib.md5(path.read_bytes()).hexdigest() == file.md5  # torchvision's
      assert path.stat().st_size == file.size
  # The root's mnist/ is read, not the packaged copy (which it equals byte for byte).
  assert root.locate("mnist", str(online), sources.holds_idx_files, "",
                     fallback="packaged") == str(online / "mnist")


def test_cifar_archives_download_and_load_from_the_tar(online, cifar_mirror, monkeypatch):
  mirror, arrays = cifar_mirror
  with _serve(mirror) as (server, url):
    monkeypatch.setenv(download.ENV_MIRROR, url)
    data10 = cifar.load_cifar10(str(online))
    data100 = datasets.load_source("cifar100", str(online))
    again = cifar.load_cifar10(str(online))  # now on disk: no second request
  assert server.requests == ["/cifar10/cifar-10-python.tar.gz",
                             "/cifar100/cifar-100-python.tar.gz"]
  assert os.listdir(online / "cifar10") == ["cifar-10-python.tar.gz"]
  expected = arrays["cifar10"]
  np.testing.assert_array_equal(data10.x_train[:3], expected["data_batch_1"][0])
  np.testing.assert_array_equal(data10.x_train[12:], expected["data_batch_5"][0])
  np.testing.assert_array_equal(data10.y_test, expected["test_batch"][1])
  np.testing.assert_array_equal(again.x_test, data10.x_test)
  assert data10.name == "cifar10" and data10.num_classes == 10
  assert data100.name == "cifar100" and data100.num_classes == 100
  np.testing.assert_array_equal(data100.x_test, arrays["cifar100"]["test"][0])
  np.testing.assert_array_equal(data100.y_train, arrays["cifar100"]["train"][1])  # fine


def test_a_corrupted_file_fails_its_checksum_and_nothing_is_kept(
    online, cifar_mirror, monkeypatch):
  mirror, _ = cifar_mirror
  archive = mirror / "cifar10" / "cifar-10-python.tar.gz"
  raw = bytearray(archive.read_bytes())
  raw[100] ^= 0xFF
  archive.write_bytes(bytes(raw))
  with _serve(mirror) as (server, url):
    monkeypatch.setenv(download.ENV_MIRROR, url)
    with pytest.raises(DataError, match="failed its checksum after 3 tries") as error:
      cifar.load_cifar10(str(online))
  assert len(server.requests) == download.ATTEMPTS  # retried
  assert "sha256" in str(error.value) and "\n" not in str(error.value)
  assert not (online / "cifar10").exists()  # no archive, no temporary file, no folder


def test_a_server_dying_mid_file_is_retried_and_leaves_no_partial_file(
    online, cifar_mirror, monkeypatch):
  mirror, arrays = cifar_mirror
  with _serve(mirror, dying=1) as (server, url):  # the first try is cut short
    monkeypatch.setenv(download.ENV_MIRROR, url)
    data = cifar.load_cifar10(str(online))
  assert len(server.requests) == 2
  np.testing.assert_array_equal(data.x_test, arrays["cifar10"]["test_batch"][0])
  with _serve(mirror, dying=99) as (server, url):  # every try is cut short
    monkeypatch.setenv(download.ENV_MIRROR, url)
    with pytest.raises(ConfigError, match=r"cannot download .*IncompleteRead.*3 tries"):
      cifar.load_cifar100(str(online))
  assert len(server.requests) == download.ATTEMPTS
  assert not (online / "cifar100").exists()  # nor the folder made for it


def test_ctrl_c_mid_file_leaves_no_partial_file(online, cifar_mirror, monkeypatch):
  mirror, _ = cifar_mirror
  def interrupt(self, n):
    raise KeyboardInterrupt
  monkeypatch.setattr(download._Progress, "update", interrupt)
  with _serve(mirror) as (_, url):
    monkeypatch.setenv(download.ENV_MIRROR, url)
    with pytest.raises(KeyboardInterrupt):
      cifar.load_cifar10(str(online))
  assert not (online / "cifar10").exists()


def test_offline_is_one_line_naming_what_to_fetch_and_where(online, monkeypatch):
  with socket.socket() as s:  # a loopback port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setenv(download.ENV_MIRROR, f"http://127.0.0.1:{port}")
  with pytest.raises(ConfigError) as error:
    sources.load_fashion_mnist(str(online))
  message = str(error.value)
  assert "\n" not in message and "refused" in message
  assert f"http://127.0.0.1:{port}/fashion-mnist/train-images-idx3-ubyte.gz" in message
  assert (f"fetch train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,"
          f" t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz from http://127.0.0.1:{port}"
          f"/fashion-mnist/ (see https://github.com/zalandoresearch/fashion-mnist) into"
          f" {online}/fashion-mnist/") in message
  assert not (online / "fashion-mnist").exists()  # nor the folder made for it
  # FEDORA_JAX_OFFLINE: no try at all; the official sources are named.
  monkeypatch.delenv(download.ENV_MIRROR)
  monkeypatch.setenv(download.ENV_OFFLINE, "1")
  with pytest.raises(ConfigError, match=r"FEDORA_JAX_OFFLINE is set: fetch"
                     r" cifar-100-python.tar.gz from https://www.cs.toronto.edu/~kriz/"):
    cifar.load_cifar100(str(online))


def test_the_data_root_holds_one_folder_per_dataset(tmp_path, monkeypatch):
  monkeypatch.setenv(root.ENV_ROOT, str(tmp_path / "env_root"))
  assert root.default_root() == str(tmp_path / "env_root")
  monkeypatch.delenv(root.ENV_ROOT)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  assert root.default_root() == str(tmp_path / "cache" / "fedora_jax")
  # A root whose cifar10/ links to an extracted copy elsewhere, as for shared/data.
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  arrays = _cifar_archive(elsewhere / "a.tar.gz", cifar.CIFAR10, seed=3)
  with tarfile.open(elsewhere / "a.tar.gz") as tar:
    tar.extractall(elsewhere, filter="data")
  data_root = tmp_path / "root"
  data_root.mkdir()
  os.symlink(elsewhere, data_root / "cifar10")
  for data_dir in (data_root, elsewhere, elsewhere / "cifar-10-batches-py"):  # or its folder
    data = cifar.load_cifar10(str(data_dir))
    np.testing.assert_array_equal(data.x_test, arrays["test_batch"][0])
  # MNIST: the copy in the package when the root has no mnist/.
  assert root.locate("mnist", str(data_root), sources.holds_idx_files, "",
                     fallback=sources.embedded_mnist_dir()) == sources.embedded_mnist_dir()
  with pytest.raises(DataError, match="data directory not found"):
    cifar.load_cifar10(str(tmp_path / "typo"))


def test_the_data_root_is_tfds_data_dir(tmp_path, monkeypatch):
  (tmp_path / "fashion_mnist" / "3.0.1").mkdir(parents=True)
  (tmp_path / "fashion_mnist" / "3.0.1" / "dataset_info.json").write_text("{}")
  assert root.tfds_data_dir("fashion_mnist", str(tmp_path)) == str(tmp_path)
  # The dataset's own TFDS folder stands for its root.
  assert root.tfds_data_dir("fashion_mnist", str(tmp_path / "fashion_mnist")) == str(tmp_path)
  monkeypatch.setenv(root.ENV_ROOT, str(tmp_path))
  assert root.tfds_data_dir("mnist", None) == str(tmp_path)
  # No root named and none prepared in the cache: TFDS's own default.
  monkeypatch.delenv(root.ENV_ROOT)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  assert root.tfds_data_dir("mnist", None) is None


def test_download_command_fills_a_root(online, cifar_mirror, monkeypatch, capsys):
  mirror, _ = cifar_mirror
  with _serve(mirror) as (_, url):
    monkeypatch.setenv(download.ENV_MIRROR, url)
    assert download.main(["cifar10", "cifar100", f"--data_dir={online}"]) == 0
  assert capsys.readouterr().out.split() == [str(online / "cifar10"), str(online / "cifar100")]
  assert os.listdir(online / "cifar100") == ["cifar-100-python.tar.gz"]
  monkeypatch.setenv(download.ENV_OFFLINE, "1")
  assert download.main(["ag_news", f"--data_dir={online}"]) == 1
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ag_news is not in") and "train.csv, test.csv from" in err
