"""The docs' result tables, rendered from results/.

  python scripts/render_docs.py            # rewrite the docs' blocks; name stale tables
  python scripts/render_docs.py --results  # rewrite the stale results tables (.md) too
  python scripts/render_docs.py --check    # change nothing; name each stale table or block

A doc (README.md, docs/*.md) embeds a results table as a block

  <!-- rendered: results/<folder>/<file> -->
  ... the table ...
  <!-- end rendered -->

whose body is what the file's renderer in RENDERERS makes of its runs' files now
(results.json, summaries, records; nothing trained). Where the file is itself a rendered
table (<file>.md), it must equal that too, so a block's numbers are never typed.
docs/verification.md's `verification.long` block is checked here too (its own command
writes it).
"""

import argparse
import os
import re
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

# pylint: disable=wrong-import-position
import algorithms_table  # noqa: E402
import byzantine_table  # noqa: E402
import coaching_eta_r  # noqa: E402
import coaching_variants  # noqa: E402
import communication_table  # noqa: E402
import confree_solver  # noqa: E402
import soak  # noqa: E402
import dp_table  # noqa: E402
import paper_gaps  # noqa: E402

BLOCK = re.compile(r"<!-- rendered: (?P<path>\S+) -->\n(?P<body>.*?)\n?<!-- end rendered -->",
                   re.DOTALL)


def _at(path: str) -> str:
  return os.path.join(ROOT, path)


def _leakage(measure: str) -> str:
  import json  # pylint: disable=import-outside-toplevel
  from experiments import leakage  # pylint: disable=import-outside-toplevel
  with open(_at(f"results/leakage/{measure}.json")) as f:
    report = json.load(f)
  return (leakage.dlg_table if measure == "dlg" else leakage.membership_table)(report)


def _json(path: str) -> dict:
  import json  # pylint: disable=import-outside-toplevel
  with open(_at(path)) as f:
    return json.load(f)


def _one_round() -> str:
  import json  # pylint: disable=import-outside-toplevel
  from verification import verify  # pylint: disable=import-outside-toplevel
  with open(_at("results/verification/one_round.json")) as f:
    return verify.render(json.load(f))


def _offsets() -> str:
  import coaching_offsets  # pylint: disable=import-outside-toplevel  (defines run flags)
  return coaching_offsets.table(_at("results/coaching1_offsets"))


def _verification(out: str) -> str:
  from verification import long  # pylint: disable=import-outside-toplevel
  return long.render(long.read_rows(_at(out)), out)


# results file -> the table its runs' files render now (a .md file: the file's own text).
RENDERERS: dict[str, Callable[[], str]] = {
    "results/algorithms20/mnist_pat/sweep.json":
        lambda: algorithms_table.table(_at("results/algorithms20/mnist_pat")),
    "results/byzantine/table.md": lambda: byzantine_table.table(_at("results/byzantine")),
    "results/communication/table_r1.md":
        lambda: communication_table.render(_at("results/communication"), 1),
    "results/communication/table_r30.md":
        lambda: communication_table.render(_at("results/communication"), 30),
    "results/dp/table.md": lambda: dp_table.table(_at("results/dp")),
    "results/coaching1/coaching1.json": paper_gaps.coaching1,
    "results/coaching2/coaching2.json": paper_gaps.coaching2,
    "results/fedora1/rmnist/table.json":
        lambda: paper_gaps.fedora(_json("results/fedora1/rmnist/table.json")),
    "results/fedora1/rfmnist/table.json":
        lambda: paper_gaps.fedora(_json("results/fedora1/rfmnist/table.json")),
    "results/fedora3/rmnist/table.json":
        lambda: paper_gaps.fedora(_json("results/fedora3/rmnist/table.json")),
    "results/fedora3/rfmnist/table.json":
        lambda: paper_gaps.fedora(_json("results/fedora3/rfmnist/table.json")),
    "results/fedora4/rmnist/table.json":
        lambda: paper_gaps.fedora(_json("results/fedora4/rmnist/table.json")),
    "results/fedora5/rmnist/table.json":
        lambda: paper_gaps.fedora(_json("results/fedora5/rmnist/table.json")),
    "results/coaching1_offsets": _offsets,
    "results/coaching_eta_r": lambda: coaching_eta_r.table(_at("results/coaching_eta_r")),
    "results/coaching1_variants/fmnist_0.1/seed0": coaching_variants.table,
    "results/confree_solver/errors.json": lambda: confree_solver.render(
        _json("results/confree_solver/errors.json")),
    "results/leakage/dlg.md": lambda: _leakage("dlg"),
    "results/leakage/membership.md": lambda: _leakage("membership"),
    "results/verification/long/table.md": lambda: _verification("results/verification/long"),
    "results/verification/long_cpu/table.md":
        lambda: _verification("results/verification/long_cpu"),
    "results/verification/one_round.json": _one_round,
    "results/soak/soak.json":
        lambda: soak.render(soak._done(_at("results/soak/soak.json"))),  # pylint: disable=protected-access
}


def docs() -> list[str]:
  """README.md and docs/*.md (not the dated log: docs/log.md, docs/measurements/)."""
  folder = _at("docs")
  return [_at("README.md")] + sorted(
      os.path.join(folder, name) for name in os.listdir(folder)
      if name.endswith(".md") and name != "log.md")


def _read(path: str) -> str:
  with open(path) as f:
    return f.read().rstrip("\n")


def stale_results() -> list[str]:
  """The rendered results tables (.md) whose text is not what their renderer makes now."""
  return [path for path, render in RENDERERS.items()
          if path.endswith(".md") and os.path.exists(_at(path))
          and _read(_at(path)) != render().rstrip("\n")]


def rendered(text: str, where: str) -> str:
  """`text` with every block's body replaced by its file's table rendered now; SystemExit
  (one line) for a block naming a file no renderer makes a table of."""
  def body(match: re.Match) -> str:
    path = match["path"]
    if path not in RENDERERS:
      raise SystemExit(f"render_docs: {where} embeds {path}, which no renderer makes"
                       f" (known: {', '.join(RENDERERS)})")
    if not os.path.exists(_at(path)):
      raise SystemExit(f"render_docs: {where} embeds {path}, which does not exist")
    table = RENDERERS[path]().rstrip("\n")
    return f"<!-- rendered: {path} -->\n{table}\n<!-- end rendered -->"
  return BLOCK.sub(body, text)


def _verification_block(doc: str) -> tuple[str, str] | None:
  """docs/verification.md's verification.long block: (as held, as rendered now)."""
  from verification import long  # pylint: disable=import-outside-toplevel
  with open(doc) as f:
    text = f.read()
  if long.BEGIN not in text:
    return None
  held = long.BEGIN + text.split(long.BEGIN, 1)[1].split(long.END, 1)[0] + long.END
  return held, long.doc_block(_at("results/verification/long"))


def problems() -> list[str]:
  """Every stale results table and every doc block that differs from its file."""
  found = [f"{path} differs from what its runs' files render" for path in stale_results()]
  for doc in docs():
    with open(doc) as f:
      text = f.read()
    name = os.path.relpath(doc, ROOT)
    found += [f"{name}: the block of {match['path']} differs from the file"
              for match in BLOCK.finditer(text)
              if match.group(0) != rendered(match.group(0), name)]
  verification = _verification_block(_at("docs/verification.md"))
  if verification and verification[0] != verification[1]:
    found.append("docs/verification.md: the verification.long block is stale"
                 " (python -m verification.long --render --out=results/verification/long)")
  return found


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 naming each stale table or block")
  parser.add_argument("--results", action="store_true",
                      help="also rewrite each stale results table from its runs' files")
  args = parser.parse_args()
  if args.check:
    found = problems()
    print("\n".join(found) or "every rendered table matches its files")
    return 1 if found else 0
  for path in stale_results():
    if args.results:
      with open(_at(path), "w") as f:
        f.write(RENDERERS[path]().rstrip("\n") + "\n")
    print(f"{'rewrote' if args.results else 'stale (--results rewrites it)'}: {path}")
  for doc in docs():
    with open(doc) as f:
      text = f.read()
    new = rendered(text, os.path.relpath(doc, ROOT))
    if new != text:
      with open(doc, "w") as f:
        f.write(new)
      print(f"rewrote {os.path.relpath(doc, ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
