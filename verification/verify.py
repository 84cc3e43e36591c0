"""`make verify`: each covered algorithm's one round beside its reference implementation.

  python -m verification.verify                  # run the checks, print the table
  python -m verification.verify --algorithms=fedbn --record  # and record the rows run
  python -m verification.verify --render FILE    # the table of a written file, no training

With --record, merges the rows run (--algorithms) into results/verification/one_round.json
(--out), the file docs/verification.md's table renders; without it the tree is left as
it was, since a rerun's errors move in float32's last digits. Exits 1 when a row is off (a max
relative error over 1e-4 or any test accuracy unequal) or when the control row, the
reference given other batches, is not told apart; 0 with one line when
../shared/references or PyTorch is missing.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

from verification import bridges

TOLERANCE = 1e-4          # max relative error of any compared tensor, float32 on CPU
ACCURACY_TOLERANCE = 1e-6  # test accuracies: the same images classified alike
CONTROL_MINIMUM = 1e-3    # the control row must differ by at least this
COVERED = ("local", "fedavg", "fedprox", "ditto", "apfl", "fedper", "lg_fedavg", "fedrep",
           "fedbabu", "moon", "pfedme", "fedrod", "perfedavg", "fedamp", "fedphp", "fedproto",
           "scaffold", "feddyn", "fedntd", "fedlc", "feddbe", "gpfl", "fedcac", "fedas",
           "fedgh", "fml", "feddistill", "pflda")
# FedALA after one, two and three rounds, and with W trained longer (one_round.py); FedCP.
COVERED += ("fedala_round1", "fedala_round2", "fedala", "fedala_converging", "fedcp")
COVERED += ("fedfomo",)  # in PFLlib's form (one_round.py)
COVERED += ("fedfomo_sampled",)  # half the clients a round, last round's uploaders counted
COVERED += ("fedkd", "fedmtl", "fedpcl")  # in PFLlib's forms (one_round.py)
COVERED += ("fedgen", "fedcross", "fedgc")  # PFLlib's forms (one_round.py)
# Server weights on clients of unequal sizes: PFLlib's sample counts, the authors' 1/|S|.
COVERED += ("ditto_samples", "ditto_uniform", "lg_fedavg_samples", "lg_fedavg_uniform",
            "fedbabu_samples", "fedbabu_uniform")
COVERED += ("fedproto_sampled",)  # half the clients a round: some never sampled
COVERED += ("perfedavg_sampled",)  # half a round, every client adapting the latest model
COVERED += ("pfedme_sampled",)  # half the clients a round, only they trained (PFLlib's)
# Beside PFLlib at a41f7ba, the code behind FedALA's table, where it differs from the head.
COVERED += ("perfedavg_a41f7ba", "fedphp_a41f7ba")
COVERED += ("fedamp_sampled",)  # half the clients a round, the uploaders' attention
COVERED += ("fedbn",)  # on a PyTorch twin of coaching_cnn_bn (verification/twins.py)
COVERED += ("pfedla",)  # beside KarhouTam/pFedLA, on that twin (pfedla_driver.py)
COVERED += ("moon_bn",)  # MOON on that twin, its fixed models on running averages
COVERED += ("fedpac",)  # PFLlib's form; its server needs cvxpy (OPTIONAL)
COVERED += ("apple",)  # in PFLlib's form, each client its copies of the cores (one_round.py)
# ALA on the hosts of FedALA's "+ALA" table, each beside its PFLlib client with the
# authors' ALA composed in (one_round.py, ala_hosts.py).
COVERED += ("fedprox_ala", "fedprox_ala_theta_hat", "perfedavg_ala", "fedrep_ala",
            "pfedme_ala", "ditto_ala", "fedamp_ala", "fedphp_ala")
# Rows whose reference imports a package the others do not: (module, what it is).
OPTIONAL = {"fedpac": ("cvxpy", "cvxpy (PFLlib's FedPAC server solves its heads' QP with it)")}


def missing() -> str | None:
  """What this machine lacks for the checks, or None."""
  if not os.path.isdir(bridges.reference_path("PFLlib", "system")):
    return (f"no reference implementations at {bridges.reference_path()}: the project's"
            " shared/ folder, laid beside this checkout, holds them")
  for snapshot in bridges.PFLLIB_SNAPSHOTS:
    if not os.path.isdir(bridges.reference_path(snapshot, "system")):
      return (f"no {snapshot} in {bridges.reference_path()}: the project's shared/"
              " folder holds it (the PFLlib behind FedALA's table)")
  for module, extra in (("torch", "PyTorch"), ("sklearn", "scikit-learn"), ("h5py", "h5py")):
    if importlib.util.find_spec(module) is None:
      return f"{extra} is not installed: make verify installs the verify extra"
  return None


def verdict(row: dict) -> str:
  if row["control"]:
    return "told apart" if row["max_relative_error"] >= CONTROL_MINIMUM else "NOT TOLD APART"
  equal = (row["max_relative_error"] <= TOLERANCE
           and row["accuracy_gap"] <= ACCURACY_TOLERANCE)
  return "equal" if equal else "DIFFERS"


def row_line(row: dict) -> str:
  """A row's line of the table. Errors show one significant digit: the digits below it are
  float32 rounding that differs from machine to machine, and would flip the docs' block."""
  name = row["algorithm"] + (" (control: other batches)" if row["control"] else "")
  return (f"| {name} | {row['reference']} | {row['rounds']} |"
          f" {row['max_relative_error']:.0e} | {row['accuracy_gap']:.0e} | {verdict(row)} |")


def render(document: dict) -> str:
  lines = [f"One round beside the reference ({document['setting']}):", "",
           "| algorithm | reference | rounds | max relative error | test accuracy gap |"
           " verdict |", "|---|---|---|---|---|---|"]
  lines += [row_line(row) for row in document["rows"]]
  lines.append(f"\n{document['date']}, {document['machine']}; `{document['command']}`")
  return "\n".join(lines)


# Check (b)'s records (`make verify-long`: too slow for CI, run by hand), by where they ran.
LONG_RECORDS = (("H200", os.path.join("results", "verification", "long")),
                ("2-core CPU", os.path.join("results", "verification", "long_cpu")))


def long_summary(names: list[str], root: str = bridges.ROOT) -> str:
  """The recorded 20-round comparisons of the algorithms `names` run (a row variant such
  as fedbabu_uniform reads its algorithm's, one with a record of its own such as moon_bn
  its own), read from LONG_RECORDS, not rerun; and the covered algorithms that have none."""
  from verification import long  # pylint: disable=import-outside-toplevel
  recorded: dict[str, list[tuple[str, dict]]] = {}
  for machine, folder in LONG_RECORDS:
    for row in long.read_rows(os.path.join(root, folder)):
      recorded.setdefault(row["algorithm"], []).append((machine, row))
  lines = ["Twenty rounds beside the reference (check (b): MNIST pathological, FedAvgCNN or"
           " check (a)'s twin; recorded by `make verify-long`, read here, not rerun;"
           " docs/verification.md):", "",
           "| algorithm | ours | PFLlib | final gap (points) | verdict | where, when |",
           "|---|---|---|---|---|---|"]
  algorithms = list(dict.fromkeys(name if name in recorded else one_round_algorithm(name)
                                  for name in names))
  for name in algorithms:
    for machine, row in recorded.get(name, []):
      lines.append(f"| {name} | {100 * row['ours']['accuracy'][-1]:.2f} |"
                   f" {100 * row['reference_run']['accuracy'][-1]:.2f} |"
                   f" {row['final_gap_points']:.2f} | {long.verdict(row)} |"
                   f" {machine}, {row['date']} |")
  lacking = [name for name in algorithms if name not in recorded]
  if lacking:
    lines.append(f"\nNo 20-round record (docs/verification.md says why): {', '.join(lacking)}")
  return "\n".join(lines)


def one_round_algorithm(name: str) -> str:
  """The algorithm a check (a) row runs: its Reference's, else the row's own name (a
  host under ALA: the row's, another algorithm than its host)."""
  from verification import one_round  # pylint: disable=import-outside-toplevel
  reference = one_round.REFERENCES[name]
  return name if reference.ala is not None else reference.algorithm or name


def _key(row: dict) -> tuple[str, bool]:
  return row["algorithm"], row["control"]


def _seed(row: dict, document: dict) -> int:
  """The seed a row ran at (rows written before rows recorded it: the document's)."""
  return row.get("seed", document.get("settings", {}).get("seed", 0))


def merge(old: dict | None, new: dict) -> dict:
  """`new` (a run of some algorithms) laid over the written document `old`: rows not run
  are kept, and so is a row run again whose line renders as before (only digits not shown
  moved), with the old date and machine when no line changed, so a rerun that reproduces
  the table leaves the file as it was. Rows in COVERED's order, then others, then controls."""
  if old is None:
    return new
  rows = {_key(row): row for row in old["rows"]}
  changed = False
  for row in new["rows"]:
    kept = rows.get(_key(row))
    if (kept is None or row_line(kept) != row_line(row)
        or _seed(kept, old) != _seed(row, new)):
      rows[_key(row)] = row
      changed = True
  order = {name: i for i, name in enumerate(COVERED)}
  merged = sorted(rows.values(), key=lambda row: (
      row["control"], order.get(row["algorithm"], len(order)), row["algorithm"]))
  stamp = new if changed or old["setting"] != new["setting"] else old
  return {**new, "date": stamp["date"], "machine": stamp["machine"], "rows": merged}


def write(path: str, document: dict) -> dict:
  """Merges `document` into the file at `path` (merge) and writes it; the merged document."""
  old = None
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  merged = merge(old, document)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(merged, f, indent=2)
  os.replace(path + ".tmp", path)  # a run cut short leaves the old file whole
  return merged


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m verification.verify",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--render", metavar="FILE", help="print the table of FILE and stop")
  parser.add_argument("--out", default=os.path.join(bridges.ROOT, "results", "verification",
                                                    "one_round.json"))
  parser.add_argument("--algorithms", default=",".join(COVERED))
  parser.add_argument("--record", action="store_true",
                      help="merge the rows run into --out (the docs' table renders it)")
  args = parser.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      print(render(json.load(f)))
    return 0
  lack = missing()
  if lack is not None:
    print(f"verify: skipped, {lack}")
    return 0
  from verification import one_round  # pylint: disable=import-outside-toplevel
  setting = one_round.Setting()
  rows = []
  names = args.algorithms.split(",")
  for name, (module, what) in OPTIONAL.items():
    if name in names and importlib.util.find_spec(module) is None:
      print(f"verify: {name} skipped, {what} is not installed: make verify installs it")
      names.remove(name)
  for name in names:
    rows.append({**one_round.compare(name, setting)._asdict(), "control": False})
  rows.append({**one_round.compare("fedavg", setting, control=True)._asdict(), "control": True})
  document = {
      "setting": (f"{setting.clients} MNIST clients of {setting.train_size} training and"
                  f" {setting.test_size} test images, MLP 784-100-10, batch"
                  f" {setting.batch_size}, {setting.local_epochs} local epoch, SGD lr"
                  f" {setting.lr}, same initial model and batches; FedProx mu and Ditto"
                  " lambda 0.1, Ditto with one fixed lambda (PFLlib's form), APFL in"
                  " PFLlib's form from alpha 0.5; FedPer, LG-FedAvg, FedRep (one head"
                  " epoch, then one body epoch), FedBABU (its global model scored) and"
                  " MOON (mu 1, tau 0.5, two rounds) on the MLP split into its hidden"
                  " layer (base) and output layer (head); pFedMe (lambda 15, K 5,"
                  " personal lr 0.09, mu 0.001, beta 1) with its local models compared;"
                  " FedRoD (its personal head a copy of the initial head); Per-FedAvg"
                  " (first-order, alpha = beta = lr, PFLlib's two train calls a round, two"
                  " rounds); FedAMP (alpha_K, lambda, sigma 1, the step unclipped, our"
                  " lambda 0: PFLlib's regulariser has no gradient); FedPHP (PFLlib's"
                  " fixed-bandwidth MMD, lambda 0.5, two rounds); FedProto (the codes'"
                  " prototypes, mean aggregation, nearest global prototype, two rounds);"
                  " SCAFFOLD (two rounds); FedDyn (alpha 0.1, PFLlib's unsquared penalty,"
                  " two rounds); FedNTD (tau 2, beta 1, PFLlib's tau^2 and uniform mean);"
                  " FedLC (tau 1, PFLlib's federation counts and cross-entropy);"
                  " FedDBE (kl_weight 50, momentum 0.1, its initialization period from our"
                  " batches, two rounds); GPFL (lambda 0.01, mu 0.1, our initial GCE and"
                  " CoV, two rounds); FedCAC (tau 0.5, beta 100, PFLlib's first round);"
                  " FedAS (PFLlib's alignment); FedGH (server lr 1, PFLlib's server header);"
                  " FML, FedDistill and PFL-DA in PFLlib's forms; each over two rounds;"
                  " FedKD in PFLlib's form (T 0.95, one round); FedMTL in PFLlib's form"
                  " (its detached regulariser) and FedPCL in PFLlib's form (tau 0.5, its"
                  " dicts sorted by class, its prototype-only round 0 first), two rounds"),
      "settings": setting._asdict(),
      "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core CPU",
      "command": "python -m verification.verify", "rows": rows}
  document["setting"] += ("; FedALA in the authors' form (s 80, p 1, eta 1, their slice and"
                          " last-batch loss) over one, two and three rounds, and with"
                          " threshold 3e-5 over two; FedCP (lambda 5, tau 1, our initial"
                          " CPN and contexts, our Gumbel noise, two rounds)")
  document["setting"] += ("; FedGen (PFLlib's generator, 20 Adam steps a round, its"
                          " sample-weighted ensemble, our generated batches), FedCross"
                          " (alpha 0.99, lowest similarity, PFLlib's per-layer similarity"
                          " and global model, our deal) and FedGC (lambda 1, clients of five"
                          " classes each), two rounds each")
  document["setting"] += ("; Ditto, LG-FedAvg and FedBABU on clients of 80, 120, 240 and"
                          " 360 training images, two rounds, the server weighing by sample"
                          " counts (PFLlib's, our default) and uniformly (the authors' codes,"
                          " our --client_weights=uniform; PFLlib's weights set to 1/|S|;"
                          " FedBABU's uniform row at seed 1, seed 0's meeting a tie)")
  document["setting"] += ("; FedProto as above with half the clients a round (PFLlib's"
                          " selection set to ours), one round, scored by the client's own"
                          " classes' global prototypes (ours: global_own), every global"
                          " prototype for a client never sampled (PFLlib: every client)")
  document["setting"] += ("; Per-FedAvg as above with half the clients a round, two"
                          " rounds, every client scored by its adaptation of the latest"
                          " global model (ours: --perfedavg_evaluation=latest; PFLlib's"
                          " evaluate_one_step after its last send_models, fed our batches)")
  document["setting"] += ("; pFedMe as above with half the clients a round, one round,"
                          " only the sampled clients trained (PFLlib's; ours"
                          " --pfedme_train_clients=sampled)")
  document["setting"] += ("; beside PFLlib at a41f7ba (the code behind FedALA's table):"
                          " Per-FedAvg as above, every client scored after two steps on"
                          " two test batches (ours: --perfedavg_evaluation=test), and FedPHP"
                          " taught by the received global model from a start mixed with"
                          " the client's own (ours: --fedphp_teacher=global; lambda 0.5, mu"
                          " 0.9 ramped over the two rounds, PFLlib's MMD kernel), two rounds")
  document["setting"] += ("; FedAMP as above with half the clients a round, two rounds,"
                          " its attention and cloud models from the round's uploaders only"
                          " (PFLlib's; ours --fedamp_attention_from=uploaders), every"
                          " client's cloud model compared")
  document["setting"] += ("; FedFomo as above with half the clients a round, three rounds,"
                          " min(M, last round's uploaders) = 2 models of the top of P over"
                          " every stored model (PFLlib's send_models; ours"
                          " --fedfomo_pool=uploader_count), P's ties broken by our noise")
  document["setting"] += (f"; FedBN on coaching_cnn_bn and its PyTorch twin (its BatchNorm"
                          f" recording the biased batch variance, as ours), clients of"
                          f" {one_round.FEDBN_TRAIN} training images, one round, BatchNorm's"
                          " running averages compared too")
  document["setting"] += ("; pFedLA beside KarhouTam/pFedLA on the same twin grouped into"
                          f" our layers' blocks, clients of {one_round.FEDBN_TRAIN} training"
                          " images, one client a round, three rounds, e = H = 100, hn_lr"
                          " 5e-3, its trainable-only mixture and sign (ours"
                          " --pfedla_buffers=own --pfedla_delta_sign=after_minus_before),"
                          " our initial hypernetworks, each client's mixture compared")
  document["setting"] += (f"; MOON (mu 1, tau 0.5) on the same twin, clients of"
                          f" {one_round.MOON_BN_TRAIN} training images, two rounds,"
                          " PFLlib's global and previous models in eval() (the authors'"
                          " form; PFLlib's own: train mode), its server averaging and"
                          " sending BatchNorm's running averages as ours")
  document["setting"] += ("; FedPAC in PFLlib's form (lambda 1, one head epoch then one body"
                          " epoch, the clients' plain prototype mean: ours"
                          " --fedpac_proto_mean=clients; its QP by cvxpy, ours by FISTA),"
                          " two rounds, the global prototypes compared too")
  document["setting"] += ("; APPLE in PFLlib's form (mu 0.1, L 1, its p lr"
                          f" {one_round.APPLE_DRLR}, the core's step N lr, p from 1/N, its"
                          " mean-of-means p gradient after the core's step, the mixture"
                          " before the last step uploaded and scored, lambda a round late)"
                          " on clients of 80, 120, 240 and 360 training images, each client"
                          " its own copies of the cores, two rounds, p's move compared too")
  document["setting"] += ("; ALA on FedProx, Per-FedAvg, FedRep, pFedMe, Ditto, FedAMP and"
                          " FedPHP, each host's row above under --ala in the authors' form"
                          " beside its PFLlib client with the authors' utils/ALA.py run in"
                          " place of its copy of the received model (on FedRep's base, on"
                          " FedAMP's cloud model), three rounds, the last round's theta_hat"
                          " and W compared too (FedPHP: its HPM too); FedProx's also with"
                          " the proximal anchor at theta_hat on both sides (ours"
                          " --fedprox_ala_anchor=theta_hat)")
  print(render(write(args.out, document) if args.record else document))
  print("\n" + long_summary(names))
  failed = [row["algorithm"] for row in rows if verdict(row) in ("DIFFERS", "NOT TOLD APART")]
  print(f"verify: {len(rows) - len(failed)} passed, {len(failed)} failed")
  if failed:
    print(f"verify: failed: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
