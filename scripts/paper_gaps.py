"""Coaching's Tables 1 and 2 against the paper, cell by cell.

  python scripts/paper_gaps.py    # print both summaries

Pure functions of the tables `reproduce` wrote (results/coaching1/coaching1.json,
results/coaching2/coaching2.json and coaching2_sampled.json: each row's mean over seeds
and the paper's number); scripts/render_docs.py puts them into
docs/reproduce_other_papers.md. Accuracies in points (%).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITHIN = 2.0  # points: a row this close to the paper's counts as reproduced
# Not personalised rows: the reference, the global model, and FedBN (its own BatchNorm
# story in the measurements); every other paper row is.
NOT_PERSONALISED = ("local", "fedavg", "fedbn")


def read(path: str) -> dict:
  with open(os.path.join(ROOT, path)) as f:
    return json.load(f)


def scored(column: dict) -> dict[str, tuple[float, float]]:
  """row -> (ours, the paper's), for the rows holding both numbers."""
  return {row["row"]: (row["acc"], row["paper_acc"]) for row in column["rows"]
          if row.get("acc") is not None and row.get("paper_acc") is not None}


def _signed(value: float | None) -> str:
  return "—" if value is None else f"{value:+.1f}"


def _gap(rows: dict[str, tuple[float, float]], name: str) -> float | None:
  return rows[name][0] - rows[name][1] if name in rows else None


def _over_local(rows: dict[str, tuple[float, float]], side: int) -> list[float]:
  """Each personalised row minus LOCAL, ours (side 0) or the paper's (side 1)."""
  if "local" not in rows:
    return []
  return [acc[side] - rows["local"][side] for name, acc in rows.items()
          if name not in NOT_PERSONALISED]


def _within(rows: dict[str, tuple[float, float]]) -> int:
  return sum(abs(ours - paper) <= WITHIN for ours, paper in rows.values())


def table1(document: dict) -> str:
  """Per cell: rows within WITHIN of the paper, FedAvg's and LOCAL's gaps, and how far the
  personalised rows sit over LOCAL here and in the paper."""
  lines = ["| cell | rows within 2 of the paper | FedAvg − paper | LOCAL − paper |"
           " personalised − our LOCAL, mean | the paper's personalised − its LOCAL, max |"
           " coaching − our LOCAL |", "|---|---|---|---|---|---|---|"]
  total = within = 0
  for column in document["columns"].values():
    rows = scored(column)
    ours, paper = _over_local(rows, 0), _over_local(rows, 1)
    coaching = (rows["coaching"][0] - rows["local"][0]
                if "coaching" in rows and "local" in rows else None)
    total, within = total + len(rows), within + _within(rows)
    lines.append(f"| {column['label']} | {_within(rows)} of {len(rows)} |"
                 f" {_signed(_gap(rows, 'fedavg'))} | {_signed(_gap(rows, 'local'))} |"
                 f" {_signed(sum(ours) / len(ours) if ours else None)} |"
                 f" {_signed(max(paper) if paper else None)} | {_signed(coaching)} |")
  lines.append(f"\n{within} of the {total} rows with both numbers are within {WITHIN:g}"
               f" points of the paper; personalised: every paper row but"
               f" {', '.join(NOT_PERSONALISED)}. From `{document['command']}`.")
  return "\n".join(lines)


def table2(every: dict, sampled: dict) -> str:
  """Per cell: rows within WITHIN of the paper and coaching against LOCAL, scoring every
  client (`every`) or each round's sampled ones (`sampled`), and how far the rule moves a
  row."""
  lines = ["| cell | rows within 2 of the paper: every client / sampled |"
           " sampled − every client, min to max over rows | coaching − our LOCAL: every"
           " client / sampled |", "|---|---|---|---|"]
  for name, column in every["columns"].items():
    rows, other = scored(column), scored(sampled["columns"][name])
    moves = [other[row][0] - acc[0] for row, acc in rows.items() if row in other]
    coaching = [_signed(side["coaching"][0] - side["local"][0])
                if "coaching" in side and "local" in side else "—" for side in (rows, other)]
    lines.append(f"| {column['label']} | {_within(rows)} / {_within(other)} of {len(rows)} |"
                 f" {_signed(min(moves)) if moves else '—'} to"
                 f" {_signed(max(moves)) if moves else '—'} | {' / '.join(coaching)} |")
  lines.append(f"\nFrom `{every['command']}`, and with `--scored_clients=sampled`.")
  return "\n".join(lines)


def coaching1() -> str:
  return table1(read("results/coaching1/coaching1.json"))


def coaching2() -> str:
  return table2(read("results/coaching2/coaching2.json"),
                read("results/coaching2/coaching2_sampled.json"))


def _fedora_cell(mean: float | None, std: float | None, signed: bool = False) -> str:
  if mean is None:
    return "—"
  text = f"{mean + 0.0:+.4f}" if signed else f"{mean:.4f}"
  return text + (f" ± {std:.4f}" if std else "")


def _seeds_why(why: list[str]) -> str:
  """"seed 0: not started; seed 1: not started" -> "not started": one reason said once."""
  reasons = {text.split(": ", 1)[-1] for text in why}
  return reasons.pop() if len(reasons) == 1 and len(why) > 1 else "; ".join(why)


def fedora(document: dict) -> str:
  """A FEDORA table `reproduce` wrote (its table.json): each row's mean ± std over the
  seeds it finished beside the paper's Acc / R-Acc / PTR, and the rows not finished."""
  lines = ["| row | seeds | Acc | R-Acc | PTR | Acc (best val) | paper Acc / R-Acc / PTR |",
           "|---|---|---|---|---|---|---|"]
  for row in document["rows"]:
    local = row["algorithm"] == "local"
    paper = " / ".join(_fedora_cell(row.get(f"paper_{m}"), None, m == "r_acc")
                       for m in ("acc", "r_acc", "ptr"))
    lines.append(
        f"| {row['algorithm']} | {row['seeds']} | {_fedora_cell(row['acc'], row['acc_std'])} |"
        f" {'—' if local else _fedora_cell(row['r_acc'], row['r_acc_std'], True)} |"
        f" {'—' if local else _fedora_cell(row['ptr'], row['ptr_std'])} |"
        f" {_fedora_cell(row.get('best_val_acc'), row.get('best_val_acc_std'))} | {paper} |")
  unfinished = [f"{row} ({_seeds_why(why)})" for row, why in document["unfinished"].items()]
  lines.append(f"\n{document['dataset']}, {document['setting']}, {document['rounds']} rounds,"
               f" seeds {', '.join(map(str, document['seeds']))}; Acc at the final round."
               f" From `{document['command']}`."
               + (f" Not finished: {', '.join(unfinished)}." if unfinished else "")
               + (f" The table's {document['rule']}." if document.get("rule") else ""))
  return "\n".join(lines)


if __name__ == "__main__":
  print(coaching1(), coaching2(), sep="\n\n")
  sys.exit(0)
