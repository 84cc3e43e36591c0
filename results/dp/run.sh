#!/usr/bin/env bash
# The accuracy-epsilon tables of docs/privacy.md: FedAvg on rotated MNIST (36 clients,
# the paper's, and 300, each with the paper's 128 training images; the MLP, the default
# training), 50 rounds, seed 0, without DP, with clipping only, and with user-level DP at
# epsilon 1, 2, 4 and 8 (delta 1e-5; every client every round, the engine's fixed-size
# cohort, RDP accounting). The clip norm 0.05 is about the clients' update norm in the
# first rounds without noise (the clipping-only run's dp_update_norm in history.npz).
# Each run's results.json, run_config.json, timing.json and history.npz are kept here;
# `python scripts/dp_table.py` renders table.md from them. Run from the repository root:
# bash results/dp/run.sh (about a minute a run on an idle core).
set -euo pipefail
out=results/dp
common=(--dataset=rmnist --rounds=50 --seed=0 --cpu_devices=1 --checkpoint_every=0
        --log_every=10)
run() {  # run <name> <flags...>: skipped when its results.json exists
  local name=$1; shift
  [[ -f $out/$name/results.json ]] && return 0
  nice -n 10 python -m experiments.main "${common[@]}" --workdir=$out/$name "$@"
}
# 36 clients: the dataset's default (no --num_clients), in folders without a prefix.
for clients in 36 300; do
  prefix="" size=()
  [[ $clients == 36 ]] || { prefix="k${clients}_"; size=(--num_clients=$clients); }
  run "${prefix}local" --algorithm=local "${size[@]}"
  fedavg=(--algorithm=fedavg "${size[@]}" --reference=$out/${prefix}local/results.json)
  run "${prefix}fedavg" "${fedavg[@]}"
  run "${prefix}fedavg_clip" "${fedavg[@]}" --dp_clip_norm=0.05 --dp_noise_multiplier=0
  for epsilon in 1 2 4 8; do
    run "${prefix}fedavg_eps$epsilon" "${fedavg[@]}" --dp_clip_norm=0.05 \
      --dp_target_epsilon=$epsilon --dp_delta=1e-5
  done
done
