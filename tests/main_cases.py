"""Runs `python -m experiments.main` once per argument list, in forked children of one
process that imported the command once (tests/test_main.py's bad-input cases: each case
costs its own work, not a fresh interpreter's imports of JAX, flax and optax).

  python tests/main_cases.py CASES.json   ->  prints [[exit code, stdout+stderr], ...]

CASES.json holds a list of argument lists. JAX's backend is never started in this parent,
so every child starts its own, as a fresh process would.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=wrong-import-position

from experiments import main as main_lib  # pylint: disable=wrong-import-position


def run_case(argv: list[str], output_path: str) -> int:
  """Exit code of `experiments.main argv`, its stdout and stderr written to output_path."""
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(fd, 1)
      os.dup2(fd, 2)
      sys.argv = ["experiments.main", *argv]
      try:
        app.run(main_lib.main)
        code = 0
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)  # pylint: disable=protected-access
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status)


def main() -> None:
  with open(sys.argv[1]) as f:
    cases = json.load(f)
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for i, argv in enumerate(cases):
      path = os.path.join(tmp, f"case{i}.txt")
      code = run_case(argv, path)
      with open(path) as f:
        results.append([code, f.read()])
  print(json.dumps(results))


if __name__ == "__main__":
  main()
