"""Every file a doc points to is in the repository: the relative links of README.md and
docs/ and, outside the dated log, the `results/...` paths a doc cites as the source of
its numbers (a path with <, *, { or [ is a pattern, not a file)."""

import glob
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULTS_PATH = re.compile(r"`(results/[^`\s]*)`")
# The dated log records what a run left at the time; it may name files not kept.
DATED_LOG = ("docs/log.md", "docs/measurements/")


def _repository_paths() -> set[str]:
  """The files git tracks and every folder above them (a clean clone's tree)."""
  listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split("\n")
  paths = set()
  for path in filter(None, listed):
    while path and path not in paths:
      paths.add(path)
      path = os.path.dirname(path)
  return paths


def _docs() -> list[str]:
  return ["README.md"] + sorted(glob.glob("docs/**/*.md", recursive=True, root_dir=ROOT))


def test_every_link_and_cited_results_file_is_in_the_repository():
  paths = _repository_paths()
  missing = []
  for doc in _docs():
    with open(os.path.join(ROOT, doc)) as f:
      text = f.read()
    for target in LINK.findall(text):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue  # a web address or an anchor in the same page
      path = os.path.normpath(os.path.join(os.path.dirname(doc), target.split("#")[0]))
      if path not in paths:
        missing.append(f"{doc}: link {target}")
    if doc.startswith(DATED_LOG):
      continue
    for cited in RESULTS_PATH.findall(text):
      cited = cited.rstrip(".,;:/")
      if not any(c in cited for c in "<*{[") and cited not in paths:
        missing.append(f"{doc}: {cited}")
  assert not missing, "\n".join(missing)
