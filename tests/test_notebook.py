"""notebooks/fedora_colab.ipynb runs top to bottom on CPU, small, and shows the plots."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from fedora_jax import plots
from fedora_jax.engine import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "fedora_colab.ipynb")


@pytest.mark.slow
def test_notebook_runs_fedora_and_shows_the_plots(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  # The kernel inherits this process's environment, where the notebook reads its settings.
  for name, value in {"FEDORA_NOTEBOOK_ROUNDS": "2", "FEDORA_NOTEBOOK_CLIENTS": "4",
                      "FEDORA_NOTEBOOK_HIDDEN": "16", "FEDORA_NOTEBOOK_LOCAL_EPOCHS": "1",
                      "FEDORA_NOTEBOOK_WORKDIR": str(workdir), "JAX_PLATFORMS": "cpu"}.items():
    monkeypatch.setenv(name, value)
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # Raises CellExecutionError, with the cell and its traceback, if any cell fails.
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()

  outputs = [out for cell in notebook.cells if cell.cell_type == "code"
             for out in cell.outputs]
  assert not [out for out in outputs if out.output_type == "error"]
  text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
  assert "nothing to install" in text and "devices:" in text
  # Every core a CPU device, as on the command line.
  devices_line = next(line for line in text.splitlines() if line.startswith("devices:"))
  assert devices_line.count("CpuDevice") == sharding.cpu_device_count(), devices_line
  assert "final round 2" in text
  shown = [out for out in outputs if "image/png" in out.get("data", {})]
  assert len(shown) == 3
  for name in (plots.RELATIVE_ACCURACY_PNG, plots.SIMILARITY_PNG, plots.ACCURACY_CURVES_PNG):
    assert (workdir / name).stat().st_size > 1000
  assert (workdir / "tensorboard" / "fedora").is_dir()
