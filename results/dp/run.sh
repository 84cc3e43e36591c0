#!/usr/bin/env bash
# The accuracy-epsilon tables of docs/privacy.md (issue 50). Each run's results.json,
# run_config.json, timing.json and history.npz are kept here; `python scripts/dp_table.py`
# renders table.md and accuracy_epsilon.png from them. Run from the repository root:
# bash results/dp/run.sh [parts...] (rmnist36, pathological, rmnist300; all by default;
# DATA_DIR, PYTHON, the rotated-MNIST ALGORITHMS, PAT_ROUNDS and PAT_ALGORITHMS from the
# environment); a run whose results.json exists is skipped, so an interrupted sweep
# resumes.
#
# 1. Rotated MNIST (the MLP, the default training), 50 rounds, seed 0: FedAvg, Ditto,
#    FedRep and FedALA without DP, with clipping only, and with user-level DP at epsilon
#    8, 4, 2 and 1 (delta 1e-5; every client every round, the engine's fixed-size cohort,
#    RDP accounting), scored against LOCAL (R-Acc). 36 clients (the paper's) in folders
#    without a prefix, then 300 (k300_, each with the same 128 training images). The clip
#    norm 0.05 is about FedAvg's update norm in the first rounds without noise (the
#    clipping-only run's dp_update_norm in history.npz); every host uses it.
# 2. FedALA's MNIST pathological setting (pat_: its flags from
#    experiments/paper/fedala_tables.json, column mnist_pat: 20 clients of 2 classes, the
#    4-layer CNN, 1 local epoch, batch 10, lr 0.005), FedAvg and FedALA, no DP and epsilon
#    8 and 2, scored against LOCAL (pat_local), PAT_ROUNDS rounds (far fewer than the
#    authors' 1000: a CPU budget). Its CNN's update norm is not the MLP's: these runs
#    clip to C = 0.7 (a 2-round FedAvg probe without noise, clip 1000: mean update norm
#    0.92, then 0.64). Adaptive clipping does not fit 20 clients: its count noise
#    sigma_b = m / 20 = 1 must exceed z / 2 (z = 3.1 at epsilon 8 over 6 rounds).
set -euo pipefail
out=results/dp
data_dir=${DATA_DIR:-../shared/data}
PAT_ROUNDS=${PAT_ROUNDS:-6}
# run <name> <flags...>: skipped when its results.json exists, when it failed (failed.md:
# its error line, kept as its result; delete it to retry) or when another copy of this
# script holds it (so several may run side by side).
run() {
  local name=$1; shift
  [[ -f $out/$name/results.json || -f $out/$name/failed.md ]] && return 0
  mkdir -p "$out/$name"
  local lock
  exec {lock}>"$out/$name/.run.lock"
  flock -n "$lock" || { exec {lock}>&-; return 0; }
  if ! nice -n 15 "${PYTHON:-python}" -m experiments.main --seed=0 --cpu_devices=1 \
      --checkpoint_every=0 --log_every=10 --data_dir="$data_dir" --workdir=$out/$name \
      "$@" 2> >(tee "$out/$name/stderr.log" >&2); then
    grep "^error:" "$out/$name/stderr.log" | tail -n 1 > "$out/$name/failed.md"
    [[ -s $out/$name/failed.md ]] || rm "$out/$name/failed.md"  # not a run's error line
  fi
  exec {lock}>&-
}
rmnist() {  # rmnist <clients> <algorithms...>
  local clients=$1; shift
  local prefix="" size=(--dataset=rmnist --rounds=50)
  # 36 clients: the dataset's default (no --num_clients), in folders without a prefix.
  [[ $clients == 36 ]] || { prefix="k${clients}_"; size+=(--num_clients=$clients); }
  run "${prefix}local" --algorithm=local "${size[@]}"
  # Breadth first (a sweep cut short still has every algorithm's ends): no DP, epsilon 8
  # and 1; then epsilon 2 and 4; then clipping only (what clipping alone costs).
  for stage in "none 8 1" "2 4" clip; do
    for algorithm in "$@"; do
      local flags=(--algorithm=$algorithm "${size[@]}"
                   --reference=$out/${prefix}local/results.json)
      for variant in $stage; do
        case $variant in
          none) run "${prefix}$algorithm" "${flags[@]}" ;;
          clip) run "${prefix}${algorithm}_clip" "${flags[@]}" --dp_clip_norm=0.05 \
                  --dp_noise_multiplier=0 ;;
          *) run "${prefix}${algorithm}_eps$variant" "${flags[@]}" --dp_clip_norm=0.05 \
               --dp_target_epsilon=$variant --dp_delta=1e-5 ;;
        esac
      done
    done
  done
}
pathological() {
  local flags=(--dataset=mnist --partition=pathological --classes_per_client=2
               --model=fedavg_cnn --val_fraction=0.125 --num_clients=20 --participation=1.0
               --local_epochs=1 --batch_size=10 --lr=0.005 --momentum=0 --weight_decay=0
               --rounds=$PAT_ROUNDS --log_every=1)
  local fedavg=(--algorithm=fedavg) fedala=(--algorithm=fedala --ala_s=80 --ala_p=1
                                            --ala_eta=1 --ala_batch_size=10)
  run pat_local --algorithm=local "${flags[@]}"
  flags+=(--reference=$out/pat_local/results.json)
  for algorithm in ${PAT_ALGORITHMS:-fedavg fedala}; do
    local -n host=$algorithm
    run "pat_$algorithm" "${host[@]}" "${flags[@]}"
    for epsilon in 8 2; do
      run "pat_${algorithm}_eps$epsilon" "${host[@]}" "${flags[@]}" \
        --dp_clip_norm=0.7 --dp_target_epsilon=$epsilon \
        --dp_delta=1e-5
    done
  done
}
read -ra algorithms <<< "${ALGORITHMS:-fedavg ditto fedrep fedala}"
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(rmnist36 pathological rmnist300)
for part in "${parts[@]}"; do
  case $part in
    rmnist36) rmnist 36 "${algorithms[@]}" ;;
    pathological) pathological ;;
    rmnist300) rmnist 300 "${algorithms[@]}" ;;
    *) echo "unknown part $part (rmnist36, pathological, rmnist300)" >&2; exit 2 ;;
  esac
done
