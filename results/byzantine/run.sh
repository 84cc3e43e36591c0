#!/usr/bin/env bash
# The Byzantine table of docs/robustness.md: FedAvg on rotated MNIST (36 clients, the
# MLP, the default training), 30 rounds, seed 0, under five aggregations, without attack
# and with 20 % of the clients attacking (sign_flip, alie; a fixed set from the seed).
# Each run's results.json, run_config.json, timing.json and history.npz are kept here;
# `python scripts/byzantine_table.py` renders table.md from them. Run from the repository
# root: bash results/byzantine/run.sh (each run's times: its timing.json).
set -euo pipefail
out=results/byzantine
common=(--dataset=rmnist --rounds=30 --seed=0 --cpu_devices=1 --checkpoint_every=0
        --log_every=10)
run() {  # run <name> <flags...>: skipped when its results.json exists
  local name=$1; shift
  [[ -f $out/$name/results.json ]] && return 0
  nice -n 10 python -m experiments.main "${common[@]}" --workdir=$out/$name "$@"
}
run local --algorithm=local
reference=(--algorithm=fedavg --reference=$out/local/results.json)
# f for Krum and beta for the trimmed mean are 20 % of the 36 uploads in every column, so
# the no-attack column runs the same rule; tau is near the honest updates' norm
# (docs/log.md, 2026-12-04).
declare -A rule=(
  [mean]=""
  [median]="--aggregation=median"
  [trimmed_mean]="--aggregation=trimmed_mean --robust_beta=0.2"
  [krum]="--aggregation=krum --robust_byzantine=0.2"
  [centered_clip]="--aggregation=centered_clip --robust_tau=0.05")
for aggregation in mean median trimmed_mean krum centered_clip; do
  # shellcheck disable=SC2086
  run "${aggregation}_none" "${reference[@]}" ${rule[$aggregation]}
  for attack in sign_flip alie; do
    # shellcheck disable=SC2086
    run "${aggregation}_${attack}" "${reference[@]}" ${rule[$aggregation]} \
      --attack=$attack --attackers=0.2
  done
done
