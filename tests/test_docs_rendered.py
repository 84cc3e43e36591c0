"""The docs' result tables are what their runs' files render now, and so are the rendered
results tables they come from (scripts/render_docs.py; nothing trained, files read only)."""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _render_docs():
  spec = importlib.util.spec_from_file_location(
      "render_docs", os.path.join(ROOT, "scripts", "render_docs.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


render_docs = _render_docs()


def test_every_rendered_block_and_table_matches_its_files():
  blocks = [match["path"] for doc in render_docs.docs()
            for match in render_docs.BLOCK.finditer(open(doc).read())]
  # The docs embed these tables: none may drop out unnoticed.
  assert {"results/communication/table_r1.md", "results/communication/table_r30.md",
          "results/byzantine/table.md", "results/leakage/dlg.md",
          "results/leakage/membership.md", "results/soak/soak.json",
          "results/dp/table.md", "results/verification/one_round.json",
          "results/coaching1/coaching1.json", "results/coaching2/coaching2.json",
          "results/coaching_eta_r", "results/confree_solver/errors.json",
          "results/coaching1_variants/fmnist_0.1/seed0"} <= set(blocks)
  assert render_docs.problems() == []


def test_a_stale_block_takes_its_files_text():
  path = "results/byzantine/table.md"
  stale = f"before\n<!-- rendered: {path} -->\n| a | b |\n|---|---|\n| 1 | 2 |\n" \
          "<!-- end rendered -->\nafter\n"
  with open(os.path.join(ROOT, path)) as f:
    table = f.read().rstrip("\n")
  assert render_docs.rendered(stale, "doc.md") == (
      f"before\n<!-- rendered: {path} -->\n{table}\n<!-- end rendered -->\nafter\n")
  # Rendering is a fixed point: a fresh block renders to itself.
  fresh = render_docs.rendered(stale, "doc.md")
  assert render_docs.rendered(fresh, "doc.md") == fresh


@pytest.mark.parametrize("path,message", [
    ("results/byzantine/run.sh", "which no renderer makes"),
    ("README.md", "which no renderer makes")])
def test_a_block_of_a_file_no_renderer_makes_is_refused(path, message):
  text = f"<!-- rendered: {path} -->\n<!-- end rendered -->\n"
  with pytest.raises(SystemExit, match=re.escape(f"doc.md embeds {path}, {message}")):
    render_docs.rendered(text, "doc.md")


def _column(label, rows):
  return {"label": label, "rows": [{"row": name, "acc": acc, "paper_acc": paper}
                                   for name, acc, paper in rows]}


def test_a_paper_tables_gaps_are_its_rows_differences():
  import paper_gaps  # pylint: disable=import-outside-toplevel  (scripts/, on the path)
  column = _column("A", [("local", 90.0, 85.0), ("fedavg", 80.0, 60.0),
                         ("fedprox", 91.0, 92.5), ("coaching", 88.0, 95.0),
                         ("pfedla", None, 90.0)])
  line = paper_gaps.table1({"columns": {"a": column}, "command": "c"}).splitlines()[2]
  # 1 of the 4 rows with both numbers within 2 (LOCAL +5, FedAvg +20, FedProx -1.5,
  # coaching -7); personalised over our LOCAL: (1 - 2) / 2; the paper's: max(7.5, 10).
  assert line == "| A | 1 of 4 | +20.0 | +5.0 | -0.5 | +10.0 | -2.0 |"
  sampled = _column("A", [("local", 92.0, 85.0), ("fedavg", 79.0, 60.0),
                          ("fedprox", 95.0, 92.5), ("coaching", 91.0, 95.0)])
  line = paper_gaps.table2({"columns": {"a": column}, "command": "c"},
                           {"columns": {"a": sampled}}).splitlines()[2]
  assert line == "| A | 1 / 0 of 4 | -1.0 to +4.0 | -2.0 / -1.0 |"


def test_the_readme_lists_every_registered_algorithm_and_counts_them():
  from fedora_jax.algorithms import REGISTRY  # pylint: disable=import-outside-toplevel
  readme = open(os.path.join(ROOT, "README.md")).read()
  table = readme[readme.index("| `--algorithm` | method |"):]
  listed = {name for row in table.split("\n\n", 1)[0].splitlines()
            for name in re.findall(r"`([a-z0-9_]+)`", row.split(" | ", 1)[0])}
  assert listed == set(REGISTRY)
  others = int(re.search(r"alongside LOCAL, FedAvg,\s+(\d+) other registered", readme)[1])
  assert others == len(REGISTRY) - 3  # FEDORA, LOCAL and FedAvg named beside it
