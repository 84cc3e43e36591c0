"""Downloads of the datasets with a public official source, into the data root.

A dataset missing from the data root (fedora_jax/data/root.py) whose files are public is
fetched into <root>/<dataset>/ from its official location, or the mirrors torchvision
and TFDS use for it, with the standard library only (urllib):

  - each file's checksums are verified against the official values hard-coded below;
  - each file is written to a temporary file beside it and moved in place
    (os.replace) once verified, so a failure, a bad checksum or Ctrl-C leaves nothing
    half written;
  - a failed try is retried (ATTEMPTS tries, BACKOFF_S, 2 BACKOFF_S, ... apart), each
    try going through the mirrors in turn;
  - progress shows as a tqdm bar on a terminal, as a line per file otherwise;
  - with no network (or FEDORA_JAX_OFFLINE set) it stops with one line naming what to
    fetch and where to put it.

FEDORA_JAX_MIRROR=<url> replaces every official location by a server laid out as a
data root: <url>/<dataset>/<file> (a local mirror; the tests' loopback server).
On a machine with internet, `python -m fedora_jax.data.download cifar10 --data_dir=DIR`
fills DIR to copy elsewhere.

Checksums (of the files as distributed):
  - MNIST, Fashion-MNIST: the MD5s torchvision's `resources` check (and Fashion-MNIST's
    README lists) and the files' SHA-256s (as torchvision's dataset prototypes pin
    them for Fashion-MNIST); both recomputed from the byte-identical copies in
    shared/data (shared/data/SOURCES.md).
  - CIFAR-10 / CIFAR-100 python versions: torchvision's `tgz_md5` and the SHA-256 Keras
    (`file_hash`) and torchvision's dataset prototypes check.
  - AG News CSV (Zhang et al. 2015, at the copy torchtext downloads): torchtext's MD5.
"""

import argparse
import hashlib
import http.client
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import NamedTuple

from fedora_jax.errors import ConfigError, DataError, FedoraError

ENV_MIRROR = "FEDORA_JAX_MIRROR"
ENV_OFFLINE = "FEDORA_JAX_OFFLINE"
ATTEMPTS = 3
BACKOFF_S = 1.0
TIMEOUT_S = 60.0
_CHUNK = 1 << 20


class RemoteFile(NamedTuple):
  name: str            # the file's name, in its dataset folder and at its source
  size: int | None     # bytes, where published
  sha256: str | None
  md5: str | None


class Remote(NamedTuple):
  files: tuple[RemoteFile, ...]
  mirrors: tuple[str, ...]  # base URLs, tried in order: <base><file name>
  homepage: str


_IDX = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
_KRIZ = ("https://www.cs.toronto.edu/~kriz/",)

# Keyed by the dataset's folder in the data root.
REMOTE: dict[str, Remote] = {
    "mnist": Remote(
        files=tuple(RemoteFile(n, s, sha, md5) for n, s, sha, md5 in zip(
            _IDX, (9912422, 28881, 1648877, 4542),
            ("440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
             "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
             "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
             "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
            ("f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432",
             "9fb629c4189551a2d022fa330f9573f3", "ec29112dd5afa0611ce80d1b7f02629c"))),
        # torchvision's mirror, TFDS's, then the original site.
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/",
                 "http://yann.lecun.com/exdb/mnist/"),
        homepage="http://yann.lecun.com/exdb/mnist/"),
    "fashion-mnist": Remote(
        files=tuple(RemoteFile(n, s, sha, md5) for n, s, sha, md5 in zip(
            _IDX, (26421880, 29515, 4422102, 5148),
            ("3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
             "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
             "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
             "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
            ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe",
             "bef4ecab320f06d8554ea6380940ec79", "bb300cfdad3c16e7a12a480ee83cd310"))),
        # Zalando's S3 site (torchvision's and TFDS's source), then its git repository.
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                 "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/"
                 "data/fashion/"),
        homepage="https://github.com/zalandoresearch/fashion-mnist"),
    "cifar10": Remote(
        files=(RemoteFile(
            "cifar-10-python.tar.gz", 170498071,
            "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
            "c58f30108f718f92721af3b95e74349a"),),
        mirrors=_KRIZ, homepage="https://www.cs.toronto.edu/~kriz/cifar.html"),
    "cifar100": Remote(
        files=(RemoteFile(
            "cifar-100-python.tar.gz", 169001437,
            "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
            "eb9058c3a382ffc7106e4002c42a8d85"),),
        mirrors=_KRIZ, homepage="https://www.cs.toronto.edu/~kriz/cifar.html"),
    "ag_news": Remote(
        files=(RemoteFile("train.csv", None, None, "b1a00f826fdfbd249f79597b59e1dc12"),
               RemoteFile("test.csv", None, None, "d52ea96a97a2d943681189a97654912d")),
        mirrors=("https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/"
                 "ag_news_csv/",),
        homepage="https://paperswithcode.com/dataset/ag-news"),
}


class _ChecksumError(Exception):
  pass


def urls(name: str, file: RemoteFile) -> list[str]:
  """Where `file` of dataset `name` is fetched from, in order."""
  mirror = os.environ.get(ENV_MIRROR)
  bases = [f"{mirror.rstrip('/')}/{name}/"] if mirror else REMOTE[name].mirrors
  return [base + file.name for base in bases]


def _size(n: int | None) -> str:
  if n is None:
    return "size unknown"
  return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _report(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


class _Progress:
  """A tqdm bar on a terminal (when tqdm is installed), else one line at the start."""

  def __init__(self, url: str, total: int | None):
    self._bar = None
    if sys.stderr.isatty():
      try:
        import tqdm  # pylint: disable=g-import-not-at-top
        self._bar = tqdm.tqdm(total=total, unit="B", unit_scale=True,
                              desc=os.path.basename(url), file=sys.stderr, leave=False)
      except ImportError:
        pass
    if self._bar is None:
      _report(f"downloading {url} ({_size(total)})")

  def update(self, n: int) -> None:
    if self._bar is not None:
      self._bar.update(n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def _download_once(url: str, dest: str, file: RemoteFile) -> None:
  """One try: stream `url` into a temporary file beside `dest`, verify, move in place."""
  request = urllib.request.Request(url, headers={"User-Agent": "fedora_jax"})
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest),
                             prefix=f".{os.path.basename(dest)}.", suffix=".part")
  try:
    start = time.monotonic()
    with os.fdopen(fd, "wb") as out, urllib.request.urlopen(
        request, timeout=TIMEOUT_S) as response:
      length = response.length  # Content-Length, None when the server sends none
      progress = _Progress(url, length or file.size)
      sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
      received = 0
      try:
        while chunk := response.read(_CHUNK):
          out.write(chunk)
          sha256.update(chunk)
          md5.update(chunk)
          received += len(chunk)
          progress.update(len(chunk))
      finally:
        progress.close()
      # http.client returns a short body when the connection drops mid-file.
      if length is not None and received != length:
        raise http.client.IncompleteRead(b"", length - received)
    for kind, digest, want in (("sha256", sha256, file.sha256), ("md5", md5, file.md5)):
      if want is not None and digest.hexdigest() != want:
        raise _ChecksumError(f"{kind} {digest.hexdigest()} is not the official {want}")
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
    os.replace(tmp, dest)
    _report(f"downloaded {dest} ({_size(received)} in {time.monotonic() - start:.1f} s,"
            " checksum verified)")
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def how_to_fetch(name: str, files, folder: str) -> str:
  """`files` of dataset `name` to fetch by hand, and where to put them (one line)."""
  remote = REMOTE[name]
  where = " or ".join(dict.fromkeys(os.path.dirname(urls(name, f)[0]) + "/" for f in files))
  return (f"fetch {', '.join(f.name for f in files)} from {where} (see {remote.homepage})"
          f" into {folder}/ (or run `python -m fedora_jax.data.download {name}"
          " --data_dir=DIR` online and pass --data_dir=DIR)")


def download_file(name: str, file: RemoteFile, dest: str, todo=()) -> None:
  """Fetches `file` of dataset `name` to `dest`, verified; one-line errors, which name
  `todo` (default: `file`) as the files left to fetch."""
  candidates = urls(name, file)
  last_url = candidates[0]
  last_error: Exception | None = None
  for attempt in range(ATTEMPTS):
    if attempt:
      time.sleep(BACKOFF_S * 2 ** (attempt - 1))
    for url in list(candidates):
      try:
        _download_once(url, dest, file)
        return
      except urllib.error.HTTPError as e:
        last_url, last_error = url, e
        if 400 <= e.code < 500:  # not there: no use asking this mirror again
          candidates.remove(url)
      except (_ChecksumError, OSError, http.client.HTTPException, ValueError) as e:
        last_url, last_error = url, e
    if not candidates:
      break
  tries = f"{attempt + 1} tr{'y' if attempt == 0 else 'ies'}"
  if isinstance(last_error, _ChecksumError):
    raise DataError(f"{name}: {file.name} from {last_url} failed its checksum after {tries}"
                    f" ({last_error}); nothing was kept")
  reason = getattr(last_error, "reason", None) or last_error
  reason = str(reason).strip().splitlines()[0] if str(reason).strip() else type(
      last_error).__name__
  raise ConfigError(f"{name}: cannot download {last_url} ({reason}; {tries}):"
                    f" {how_to_fetch(name, todo or [file], os.path.dirname(dest))}")


def fetch(name: str, root: str) -> str:
  """Downloads the files of dataset `name` missing from <root>/<name>/; returns that folder."""
  if name not in REMOTE:
    raise ConfigError(f"no download for {name!r}; downloadable: {', '.join(REMOTE)}")
  folder = os.path.join(root, name)
  missing = [f for f in REMOTE[name].files if not os.path.isfile(os.path.join(folder, f.name))]
  if not missing:
    return folder
  if os.environ.get(ENV_OFFLINE):
    raise ConfigError(f"{name} is not in {folder}/ and {ENV_OFFLINE} is set:"
                      f" {how_to_fetch(name, missing, folder)}")
  created = not os.path.isdir(folder)
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"{name}: cannot create {folder} ({e.strerror}); pass"
                      " --data_dir=<a writable root>") from None
  try:
    for i, file in enumerate(missing):
      download_file(name, file, os.path.join(folder, file.name), todo=missing[i:])
  except BaseException:
    if created and not os.listdir(folder):
      os.rmdir(folder)  # leave the root as it was
    raise
  return folder


def main(argv=None) -> int:
  from fedora_jax.data import root as root_lib  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(
      prog="python -m fedora_jax.data.download",
      description="Download datasets into a data root (one folder per dataset).")
  parser.add_argument("names", nargs="+", choices=sorted(REMOTE), metavar="NAME",
                      help=f"datasets: {', '.join(sorted(REMOTE))}")
  parser.add_argument("--data_dir", default=None,
                      help=f"the data root (default: ${root_lib.ENV_ROOT}, else"
                           " ~/.cache/fedora_jax)")
  args = parser.parse_args(argv)
  root = os.path.expanduser(args.data_dir) if args.data_dir else root_lib.default_root()
  try:
    for name in args.names:
      print(fetch(name, root))
  except FedoraError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
