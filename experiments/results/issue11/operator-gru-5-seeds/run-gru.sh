#!/bin/bash
# issue 11: operator_gru over the remaining paper seeds, paired with the issue-9 consolidator_only seeds
P1=/work/fresh/runs/cpu-20261122-084609/phase1/phase1.pt
cd /work/main
run() { /usr/bin/time -f "%e s wall" .venv/bin/pmnet train phase2 --preset cpu --condition operator_gru --seed $1 --phase1 $P1 --out /work/pilot/operator_gru-s$1 --set threads=1 > /work/pilot/operator_gru-s$1.log 2>&1; }
date
run 43 & run 44 & wait
date
run 45 & run 46 & wait
date
