"""ConFREE's dual solver against scipy's SLSQP (docs/confree.md's solver table).

  python scripts/confree_solver.py            # run (a few CPU-minutes), write the JSON
  python scripts/confree_solver.py --render   # print the table of the written JSON

Relative error of d* = g0 + r (w* G) / ||w* G|| against SLSQP with exact gradients in
float64 (the authors' solver), max over 4 random instances per row, for the solver
before FISTA (exponentiated gradient, 500 steps, read from commit 29d83a6) and FISTA at
100 and 300 steps (the default), all in float32. Writes results/confree_solver/errors.json.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "confree_solver", "errors.json")
OLD_COMMIT = "29d83a6"  # the exponentiated-gradient solver's last commit
CASES = ((5, 3, 0.0), (20, 5, 0.0), (12, 5000, 0.5), (40, 2000, 0.5))  # K, dim, mean
SOLVERS = ("old, 500 steps", "FISTA, 100", "FISTA, 300 (default)")


def _slsqp(G: np.ndarray, g0: np.ndarray, r: float) -> np.ndarray:
  from scipy import optimize  # pylint: disable=import-outside-toplevel
  A, b, n = G @ G.T, G @ g0, len(G)
  res = optimize.minimize(
      lambda w: w @ b + r * np.sqrt(w @ A @ w), np.full(n, 1 / n),
      jac=lambda w: b + r * A @ w / np.sqrt(w @ A @ w), method="SLSQP",
      bounds=[(0, 1)] * n,
      constraints={"type": "eq", "fun": lambda w: 1 - w.sum(), "jac": lambda w: -np.ones(n)},
      options={"ftol": 1e-15, "maxiter": 2000})
  return res.x


def _direction(w: np.ndarray, g0: np.ndarray, r: float, G: np.ndarray) -> np.ndarray:
  """d = g0 + r (w G) / ||w G||, in float64."""
  return g0 + r * (w @ G) / np.linalg.norm(w @ G)


def _old_module():
  src = subprocess.run(["git", "show", f"{OLD_COMMIT}:fedora_jax/algorithms/confree.py"],
                       capture_output=True, text=True, check=True, cwd=ROOT).stdout
  old = importlib.util.module_from_spec(importlib.util.spec_from_loader("old", loader=None))
  exec(src, old.__dict__)  # pylint: disable=exec-used
  return old


def measure() -> dict:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, ROOT)
  from fedora_jax.algorithms import confree  # pylint: disable=import-outside-toplevel
  old = _old_module()
  rng = np.random.default_rng(0)
  rows = []
  for k, dim, mean in CASES:
    errors = []
    for _ in range(4):
      G = (mean + rng.normal(size=(k, dim))).astype(np.float32)
      G64 = G.astype(np.float64)
      g0 = np.asarray(confree.guidance_vector(jnp.asarray(G)), np.float64)
      r = 0.4 * np.linalg.norm(g0)
      ref = _direction(_slsqp(G64, g0, r), g0, r, G64)
      A = jnp.asarray(G64 @ G64.T, jnp.float32)
      b = jnp.asarray(G64 @ g0, jnp.float32)
      ws = [old.simplex_weights(A, b, jnp.float32(r), 500)] + [
          confree.simplex_weights(A, b, jnp.float32(r), None, s) for s in (100, 300)]
      errors.append([float(np.linalg.norm(
          _direction(np.asarray(w, np.float64), g0, r, G64) - ref) / np.linalg.norm(ref))
                     for w in ws])
    rows.append({"k": k, "dim": dim, "mean": mean,
                 "errors": dict(zip(SOLVERS, np.max(errors, axis=0).tolist()))})
  return {"command": "python scripts/confree_solver.py", "date": time.strftime("%Y-%m-%d"),
          "machine": f"{os.cpu_count()}-core CPU", "rows": rows}


def render(document: dict) -> str:
  """The table; errors to two significant digits."""
  lines = ["| K | dim | mean of updates | " + " | ".join(SOLVERS) + " |",
           "|---|---|---|" + "---|" * len(SOLVERS)]
  for row in document["rows"]:
    errors = " | ".join(f"{row['errors'][name]:.1e}" for name in SOLVERS)
    lines.append(f"| {row['k']} | {row['dim']} | {row['mean']} | {errors} |")
  lines.append(f"\n{document['date']}, {document['machine']}; `{document['command']}`")
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--render", action="store_true", help="print the written table")
  args = parser.parse_args()
  if not args.render:
    document = measure()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
      json.dump(document, f, indent=2)
  with open(OUT) as f:
    print(render(json.load(f)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
