#!/usr/bin/env bash
# docs/coaching.md's "The set-up's eta_r = 0.01 diverges" table: coaching with the paper's
# stated R step (--coach_lr_r_rule=fixed --coach_lr_r=0.01), no LOCAL reference. A run
# that diverges stops with the engine's one-line error (NaN or Inf loss in round N), kept
# as its result in <run>/failed.md; a run that finishes keeps its four files. Run from the
# repository root: bash results/coaching_eta_r/run.sh (DATA_DIR, PYTHON from the
# environment); `python scripts/render_docs.py` renders the table. A run whose
# results.json or failed.md exists is skipped.
set -uo pipefail
out=results/coaching_eta_r
data_dir=${DATA_DIR:-../shared/data}
run() {  # run <name> <flags...>
  local name=$1; shift
  [[ -f $out/$name/results.json || -f $out/$name/failed.md ]] && return 0
  mkdir -p "$out/$name"
  echo "$*" > "$out/$name/flags.md"
  if ! nice -n 15 "${PYTHON:-python}" -m experiments.main --algorithm=coaching \
      --coach_lr_r_rule=fixed --coach_lr_r=0.01 --reference=none --seed=0 \
      --cpu_devices=1 --checkpoint_every=0 --data_dir="$data_dir" --workdir=$out/$name \
      "$@" 2> "$out/$name/stderr.log"; then
    grep "^error:" "$out/$name/stderr.log" | tail -n 1 > "$out/$name/failed.md"
    [[ -s $out/$name/failed.md ]] || rm "$out/$name/failed.md"  # not a run's error line
  fi
}
# Rotated MNIST: 36 clients, the MLP, the project's training (lr 0.005, momentum 0.9).
run rmnist --dataset=rmnist --rounds=40
# MNIST, Dirichlet alpha 0.1, 10 clients of 600 images, the MLP, the paper's W schedule
# (5 local epochs, SGD lr 0.01): docs/measurements/2026-11-26-coaching-mlp.md's $MNIST01.
run mnist01 --dataset=mnist --partition=dirichlet --dirichlet_alpha=0.1 --num_clients=10 \
  --fixed_train_size=600 --rounds=50 --lr=0.01 --momentum=0 --weight_decay=0 \
  --local_epochs=5
# The same split on FEDORA's CNN, 1 local epoch.
run mnist01_cnn --dataset=mnist --partition=dirichlet --dirichlet_alpha=0.1 \
  --num_clients=10 --fixed_train_size=600 --rounds=50 --lr=0.01 --momentum=0 \
  --weight_decay=0 --local_epochs=1 --model=cnn
