#!/bin/bash
# Alternate two trees' bench_precision runs: ab.sh OUT ROUNDS REPEATS CONFIGS TREE_BEFORE TREE_AFTER
# (each tree holds lit_mpstable/ and bench/; its own package on PYTHONPATH; PYTHON: the interpreter, default python).
# Per round: before, then after, each --repeats REPEATS of CONFIGS, written to OUT/A_<round> and OUT/B_<round>.
out=$1; rounds=$2; reps=$3; cfg=$4; A=$5; B=$6
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for t in A B; do
    tree=$A; [ $t = B ] && tree=$B
    (cd "$tree" && PYTHONPATH="$tree" ${PYTHON:-python} "$tree/bench/bench_precision.py" --no-memory --repeats "$reps" \
      --configs "$cfg" --out "$out/${t}_$r" > "$out/${t}_$r.log" 2>&1)
  done
done
