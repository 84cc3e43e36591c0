"""The same flags give a byte-identical results.json.

tests/golden/ holds results.json files written by `experiments.main` before the library
API and flag layer were rebuilt (2026-11-26, commit 869d5e7); every later change must
reproduce them byte for byte. A change that is meant to alter results regenerates them
with the command below and says why in its commit:

  python -m experiments.main <COMMON> <extra> --workdir=/tmp/x && cp /tmp/x/results.json \
      tests/golden/<name>.results.json
"""

import os
import re
import subprocess
import sys

import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ("--dataset=rmnist", "--num_clients=3", "--rounds=2", "--local_epochs=1",
          "--lr=0.05", "--hidden=32", "--log_every=0", "--checkpoint_every=0",
          "--cpu_devices=2")
RUNS = {
    "fedora_authors": ("--algorithm=fedora",),
    "fedora_paper": ("--algorithm=fedora", "--fedora_variant=paper"),
    "fedavg": ("--algorithm=fedavg",),
    # fixed lambda was ditto's default until 2026-11-26
    "ditto": ("--algorithm=ditto", "--ditto_lambda_selection=fixed"),
    "fedala": ("--algorithm=fedala",),
    "fedavg_ala": ("--algorithm=fedavg", "--ala"),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_results_json_is_byte_identical(name, tmp_path):
  # The files were written at XLA's default optimisation level; the suite's cheaper
  # level (tests/conftest.py) gives the same bytes (checked 2026-11-26).
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.main", *COMMON, *RUNS[name],
       f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(GOLDEN, f"{name}.results.json"), "rb") as f:
    # The one intended change since the golden files: TrainConfig.client_batch was
    # renamed client_chunk (clients per lax.map chunk, not samples per step).
    expected = f.read().replace(b'"client_batch"', b'"client_chunk"')
  if name.startswith("fedora"):
    # And FedoraConfig gained val_loss and val_batch_size (2026-11-26), at values that
    # leave every number as it was.
    expected = expected.replace(
        b'"similarity": "principal_angles"\n',
        b'"similarity": "principal_angles",\n    "val_loss": "mean",\n'
        b'    "val_batch_size": 64\n')
  if name == "fedavg_ala":
    # And AlaConfig gained sample and epoch_loss (2026-12-04), at defaults that leave
    # every number as it was.
    expected = expected.replace(
        b'"batch_size": 64\n    },\n    "aggregation"',
        b'"batch_size": 64,\n      "sample": "random",\n      "epoch_loss": "mean"\n'
        b'    },\n    "aggregation"')
  with open(tmp_path / "results.json", "rb") as f:
    written = f.read()
  # And results.json gained the run's bytes_up and bytes_down (2026-12-04),
  # which leave every other byte as it was (their counts: tests/test_communication.py).
  assert written.count(b'\n  "bytes_up": ') == written.count(b'\n  "bytes_down": ') == 1
  assert re.sub(rb'\n  "bytes_(up|down)": \d+,', b"", written) == expected
