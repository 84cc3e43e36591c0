"""The soak test: the algorithm matrix at many clients on two CPU devices,
then every seed table's cheapest column at a few rounds, each table back to back in one
`reproduce` process on the default CPU mesh (one device per core), several passes.
Counts the hangs.

  python scripts/soak.py --passes=3 --out=results/soak/soak.json --data_dir=../shared/data
  python scripts/soak.py --render results/soak/soak.json      # the table, no training

A hang is a table process the watchdog found stalled (a row recorded as failed: its
"no progress" line) or one still running at --table_timeout (killed). Each finished
table process and matrix shard is appended to --out as it ends, so a soak stopped
midway keeps what it measured, and rerunning it with the same --out skips those.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# table -> the flags of its cheapest column (the MLP on rotated MNIST for FEDORA's, the
# MNIST or CIFAR-10 cell with the fewest clients for the others').
CHEAPEST = {
    "fedora1": ["--dataset=rmnist"],
    "fedora3": ["--dataset=rmnist"],
    "fedora4": ["--dataset=rmnist"],
    "fedora5": ["--dataset=rmnist"],
    "coaching1": ["--columns=mnist_0.1"],
    "coaching2": ["--columns=mnist_0.1"],
    "fedala1": ["--columns=mnist_pat"],
    "fedala_ala": ["--columns=cifar10_dir"],
    "confree2": ["--columns=cifar10_c20_p30"],
}
STALL_LINE = "no progress for"
ROW_STARTED = r"\brow \d+/\d+ \S+ seed \d+ -> "
ROW_READ = r"\brow \d+/\d+ \S+ seed \d+: finished in "


def _done(out: str) -> list[dict]:
  if not os.path.isfile(out):
    return []
  with open(out) as f:
    return [json.loads(line) for line in f if line.strip()]


def _append(out: str, record: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "a") as f:
    f.write(json.dumps(record) + "\n")


def _run(command: list[str], timeout: float, log_path: str,
         env: dict | None = None) -> tuple[int | None, float, str]:
  """(exit status or None if killed at `timeout`, minutes, its output)."""
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    try:
      code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      code = None
  with open(log_path) as f:
    output = f.read()
  return code, (time.perf_counter() - start) / 60, output


def soak_table(table: str, number: int, args) -> dict:
  workdir = os.path.join(args.workdir, f"pass{number}", table)
  command = [sys.executable, "-m", "experiments.reproduce", f"--table={table}",
             *CHEAPEST[table], f"--rounds={args.rounds}", f"--data_dir={args.data_dir}",
             f"--workdir={workdir}", "--log_every=0", "--nokeep_checkpoints",
             f"--stall_timeout={args.stall_timeout}", "--compile_timeout=900"]
  os.makedirs(workdir, exist_ok=True)
  code, minutes, output = _run(command, args.table_timeout, os.path.join(workdir, "log.txt"))
  return {"kind": "table", "table": table, "pass": number, "flags": CHEAPEST[table],
          "rounds": args.rounds, **count_rows(output), "minutes": round(minutes, 2),
          "exit": code, "hangs": output.count(STALL_LINE) + (code is None)}


def count_rows(output: str) -> dict:
  """Rows a table process trained ("row 3/17 fedavg seed 0 -> <workdir>") and read
  finished ("... seed 0: finished in <workdir>, read", after a restart)."""
  return {"rows": len(re.findall(ROW_STARTED, output, re.MULTILINE)),
          "rows_read": len(re.findall(ROW_READ, output, re.MULTILINE))}


def soak_matrix(shard: int, args) -> dict:
  command = [sys.executable, os.path.join(ROOT, "tests", "algorithm_matrix.py"),
             str(shard), str(args.matrix_shards), str(args.matrix_clients)]
  log = os.path.join(args.workdir, f"matrix{shard}.txt")
  os.makedirs(args.workdir, exist_ok=True)
  # Two CPU devices, as the commands' default mesh on a 2-core machine.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  code, minutes, output = _run(command, args.table_timeout, log, env)
  rows = json.loads(output.strip().splitlines()[-1]) if code == 0 else {}
  failed = sorted(k for k, v in rows.items() if isinstance(v, str))
  return {"kind": "matrix", "shard": shard, "clients": args.matrix_clients,
          "rows": len(rows), "failed": failed, "minutes": round(minutes, 2),
          "exit": code, "hangs": int(code is None)}


def render(records: list[dict]) -> str:
  order = list(CHEAPEST)
  records = sorted(records, key=lambda r: (r["kind"] != "matrix", r.get("pass", 0),
                                           order.index(r["table"]) if "table" in r else
                                           r["shard"]))
  lines = ["| what | pass | rows | minutes | exit | hangs |", "|---|---|---|---|---|---|"]
  for r in records:
    what = (f"`{r['table']}` {' '.join(r['flags'])}, {r['rounds']} rounds"
            if r["kind"] == "table" else
            f"algorithm matrix shard {r['shard']}, {r['clients']} clients"
            + (f" (failed: {', '.join(r['failed'])})" if r["failed"] else ""))
    lines.append(f"| {what} | {r.get('pass', '')} | {r['rows']} | {r['minutes']:.1f} |"
                 f" {r['exit']} | {r['hangs']} |")
  tables = [r for r in records if r["kind"] == "table"]
  lines.append(f"\n{len(tables)} table processes ({sum(r['rows'] for r in tables)} rows),"
               f" {len(records) - len(tables)} matrix shards,"
               f" {sum(r['minutes'] for r in records):.0f} process-minutes,"
               f" hangs: {sum(r['hangs'] for r in records)},"
               f" non-zero exits: {sum(r['exit'] != 0 for r in records)}")
  if records:
    lines.append(f"machine: {records[0]['machine']}")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--render", help="print the table of this soak file and stop")
  parser.add_argument("--recount", action="store_true",
                      help="count each table record's rows again from its log, and stop")
  parser.add_argument("--out", default="results/soak/soak.json")
  parser.add_argument("--workdir", default="runs/soak")
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--passes", type=int, default=3)
  parser.add_argument("--start_pass", type=int, default=1,
                      help="the first pass this process runs (another may run the others)")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--tables", default=",".join(CHEAPEST))
  parser.add_argument("--matrix_clients", type=int, default=100)
  parser.add_argument("--matrix_shards", type=int, default=4)
  parser.add_argument("--table_timeout", type=float, default=4 * 3600)
  parser.add_argument("--stall_timeout", type=float, default=300,
                      help="each row's --stall_timeout (its compile limit: 900 s)")
  args = parser.parse_args()
  if args.render:
    print(render(_done(args.render)))
    return
  if args.recount:  # the row counts of the records, again from the logs
    records = [{**r, **count_rows(open(os.path.join(args.workdir, f"pass{r['pass']}",
                                                     r["table"], "log.txt")).read())}
               if r["kind"] == "table" else r for r in _done(args.out)]
    with open(args.out, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    return
  machine = f"{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
  # The records are read again before each step: another soak process (a later pass,
  # side by side) may have added some.
  for shard in range(args.matrix_shards):
    if any(r["kind"] == "matrix" and r["shard"] == shard for r in _done(args.out)):
      continue
    record = {**soak_matrix(shard, args), "machine": machine}
    _append(args.out, record)
    print(json.dumps(record), flush=True)
  for number in range(args.start_pass, args.passes + 1):
    for table in args.tables.split(","):
      if any(r["kind"] == "table" and r["table"] == table and r["pass"] == number
             for r in _done(args.out)):
        continue
      record = {**soak_table(table, number, args), "machine": machine}
      _append(args.out, record)
      print(json.dumps(record), flush=True)
  print(render(_done(args.out)))


if __name__ == "__main__":
  main()
