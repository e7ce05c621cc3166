#!/bin/bash
# issue 21, session 6: top blocks too small to hold the task (model.write_dims = [d0,d1,d2,d3]),
# the preset's 40-epoch schedule, every epoch's last.ckpt kept; one thread each, side by side.
# Usage: run.sh OUT_DIR NAME WRITE_DIMS SEED [NAME WRITE_DIMS SEED ...]
#   run.sh runs/issue21-screens-session6 r1s0 '[1,8,8,8]' 0 r2s0 '[2,8,8,8]' 0   (stopped at epoch 16-18)
#   run.sh runs/issue21-screens-session6 t11s0 '[1,1,8,8]' 0 t11s1 '[1,1,8,8]' 1
# (the first pair ran as --set model.root_write_dims=R, the same model under its first name)
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
P=.venv/bin/pmnet
D=$(realpath -m "$1"); shift; mkdir -p "$D"
run() { $P train phase1 --preset cpu --out $D/$1 --set threads=1 --set phase1_seed=$3 --set "model.write_dims=$2" > $D/$1.log 2>&1; }
watch() {  # copy each epoch's last.ckpt as it appears
  mkdir -p $D/$1/kept; last=""
  while [ ! -f $D/$1/phase1.pt ]; do
    f=$D/$1/phase1_ckpt/last.ckpt
    if [ -f $f ]; then m=$(stat -c %Y $f); if [ "$m" != "$last" ]; then sleep 3; cp $f $D/$1/kept/last-$m.ckpt; last=$m; fi; fi
    sleep 10
  done
}
while [ $# -ge 3 ]; do run $1 $2 $3 & watch $1 & shift 3; done
wait
