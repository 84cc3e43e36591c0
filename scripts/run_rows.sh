#!/usr/bin/env bash
# Runs several `python -m experiments.reproduce` commands side by side, one process each
# sharing the machine (and its GPU), until they finish or LIMIT seconds pass; then packs
# the four files of every finished row (run_config.json, results.json, timing.json,
# history.npz) into one archive. Unpacked here into the same --workdir, those rows are
# read by `reproduce`, not run again (fedora_jax/sweep, finished_results).
#
#   scripts/run_rows.sh LIMIT ARCHIVE 'FLAGS 1' ['FLAGS 2' ...]
#
# Each FLAGS is one reproduce command line's flags and names its --workdir. On a lent
# GPU (the device `run` tool brings back what is written under $OUT):
#   scripts/run_rows.sh 480 "$OUT/rows.tgz" \
#     '--table=coaching1 --columns=mnist_0.1 --workdir=runs/coaching1 --data_dir=D' \
#     '--table=coaching1 --columns=mnist_0.3 --workdir=runs/coaching1 --data_dir=D'
# Commands of the other papers' tables may share a --workdir (their rows live under
# <column>/seed<s>/); FEDORA's tables keep one per dataset. Commands that share a row
# (LOCAL, which each runs first) train it once: the first to reach it holds it, the others
# wait, then read it (fedora_jax/sweep, row_claimed). A row stopped at LIMIT leaves
# no results.json and is not packed; the exit status is 1 if any command did not finish.
set -uo pipefail

if [ "$#" -lt 3 ]; then
  echo "usage: scripts/run_rows.sh LIMIT ARCHIVE 'REPRODUCE FLAGS' ..." >&2
  exit 2
fi
limit=$1
archive=$2
shift 2
case $limit in
  ''|*[!0-9]*) echo "error: LIMIT must be whole seconds, got '$limit'" >&2; exit 2 ;;
esac

workdirs=()
for flags in "$@"; do
  workdir=$(printf '%s\n' $flags | sed -n 's/^--workdir=//p' | tail -n 1)
  if [ -z "$workdir" ]; then
    echo "error: each command needs its --workdir=, not given in: $flags" >&2
    exit 2
  fi
  workdirs+=("$workdir")
done

# Each process takes GPU memory as it needs it, not 75 % of it at start.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python}
pids=()
logs=()
for i in "${!workdirs[@]}"; do
  mkdir -p "${workdirs[$i]}"
  logs+=("${workdirs[$i]}/run_rows.$i.log")
  # shellcheck disable=SC2086  # the flags split into words, as on a command line
  timeout "$limit" "$python" -m experiments.reproduce $1 >"${logs[$i]}" 2>&1 &
  pids+=($!)
  shift
done
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    status=1
    echo "command $i did not finish; its log: ${logs[$i]}" >&2
  fi
done

# A row is finished once its results.json is written (a run's last step).
files=("${logs[@]}")
rows=0
while IFS= read -r row; do
  rows=$((rows + 1))
  for name in run_config.json results.json timing.json history.npz; do
    if [ -f "$row/$name" ]; then files+=("$row/$name"); fi
  done
done < <(printf '%s\n' "${workdirs[@]}" | sort -u |
         xargs -I{} find {} -name results.json -printf '%h\n' | sort -u)
mkdir -p "$(dirname "$archive")"
tar czf "$archive" "${files[@]}"
echo "$rows finished row(s) packed into $archive"
exit $status
