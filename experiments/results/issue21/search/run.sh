#!/bin/bash
# fair Phase-2 search (issue 21): both Consolidator-only arms x consolidator_lr, seed 42,
# Phase-1 checkpoint pd8g4s0 (seed 0, phase dim 8, route gain 4), 6 epochs; validation only (test on a scratch stream, unread)
cd /work/explore/s21/search
export TORCHINDUCTOR_CACHE_DIR=/work/explore/s21/search/inductor
run() { arm=$1; lr=$2; out=$arm-lr$lr
  /work/main/.venv/bin/pmnet train phase2 --preset cpu --phase1 ../pd8g4s0/phase1.pt --condition $arm --seed 42 --out $out \
    --set threads=1 --set model.phase_dim=8 --set model.route_gain=4 --set max_epochs=5 --set patience=5 --set consolidator_lr=$lr \
    --set test_seed=4000037 --set test_episodes=100 > $out.log 2>&1; }
export -f run
printf "%s\n" "consolidator_only 3e-3" "consolidator_only_routing_off 3e-3" "consolidator_only 1e-2" "consolidator_only_routing_off 1e-2" "consolidator_only 1e-3" "consolidator_only_routing_off 1e-3" | xargs -P 2 -L 1 bash -c 'run $0 $1'
