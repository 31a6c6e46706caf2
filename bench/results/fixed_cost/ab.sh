#!/bin/bash
# usage: ab.sh OUTDIR ROUNDS REPEATS CONFIGS TREE_A TREE_B  (each tree: a dir holding lit_mpstable/; bench script from TREE's bench/)
out=$1; rounds=$2; reps=$3; cfg=$4; A=$5; B=$6
mkdir -p $out
for r in $(seq 1 $rounds); do
  for t in A B; do
    tree=$A; [ $t = B ] && tree=$B
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python $tree/bench/bench_precision.py --no-memory --repeats $reps --configs $cfg --out $out/${t}_$r > $out/${t}_$r.log 2>&1)
  done
done
