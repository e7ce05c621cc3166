#!/bin/bash
# Phase-2 recipe check for the write-dims cpu preset (issue 21, session 6): both
# Consolidator-only arms x consolidator_lr 1e-2, 3e-2, seed 42, the pipeline's Phase-1
# checkpoint of seed 0 (cpu-20261124-053922); validation only (test on a scratch stream, 100
# episodes, seed 7,000,003, unread). lr 3e-3 is the pipeline's own trial.
cd /work/explore/s6search
export TORCHINDUCTOR_CACHE_DIR=/work/clone-s6/runs/compile-cache
P1=/work/clone-s6/runs/cpu-20261124-053922/phase1-p1s0/phase1.pt
run() { arm=$1; lr=$2; out=$arm-lr$lr
  /work/main/.venv/bin/pmnet train phase2 --preset cpu --phase1 $P1 --condition $arm --seed 42 --out $out \
    --set threads=1 --set consolidator_lr=$lr --set test_seed=7000003 --set test_episodes=100 > $out.log 2>&1; }
export -f run; export P1
printf "%s\n" "consolidator_only 1e-2" "consolidator_only_routing_off 1e-2" "consolidator_only 3e-2" "consolidator_only_routing_off 3e-2" | xargs -P 2 -L 1 bash -c 'run $0 $1'
