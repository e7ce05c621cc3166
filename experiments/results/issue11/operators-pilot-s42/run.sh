#!/bin/bash
# issue 11 operator pilot: seed 42, cpu preset, the issue-9 pipeline's Phase-1 checkpoint
P1=/work/fresh/runs/cpu-20261122-084609/phase1/phase1.pt
cd /work/main
run() { /usr/bin/time -f "%e s wall" .venv/bin/pmnet train phase2 --preset cpu --condition $1 --seed 42 --phase1 $P1 --out /work/pilot/$1 --set threads=1 > /work/pilot/$1.log 2>&1; }
date
run operator_ema & run operator_overwrite & wait
date
run operator_linear & run operator_gru & wait
date
