#!/bin/bash
# issue 21 screens after the 40-epoch pipeline: seed 0 at 40 epochs with every epoch's last.ckpt kept
# (route trajectory), seeds 0 and 2 at 30 epochs; one thread each, all at once. Usage: run.sh [OUT_DIR]
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
P=.venv/bin/pmnet
D=$(realpath -m "${1:-runs/issue21-screens-session5}"); mkdir -p "$D"
run() { $P train phase1 --preset cpu --out $D/$1 --set threads=1 --set phase1_max_epochs=$2 --set phase1_patience=$2 --set phase1_seed=$3 > $D/$1.log 2>&1; }
watch() {  # copy each epoch's last.ckpt as it appears
  mkdir -p $D/$1/kept; last=""
  while [ ! -f $D/$1/phase1.pt ]; do
    f=$D/$1/phase1_ckpt/last.ckpt
    if [ -f $f ]; then m=$(stat -c %Y $f); if [ "$m" != "$last" ]; then sleep 3; cp $f $D/$1/kept/last-$m.ckpt; last=$m; fi; fi
    sleep 10
  done
}
run e40s0 40 0 & watch e40s0 &
run e30s0 30 0 &
run e30s2 30 2 &
wait
