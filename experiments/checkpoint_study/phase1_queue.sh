#!/usr/bin/env bash
# Train the checkpoint study's Phase-1 checkpoints (issue 39), JOBS at a time, one torch
# thread each, each resumable from its own last.ckpt (runs/issue39/p1s<k>/phase1_ckpt/).
# A finished checkpoint is copied into the committed study directory by `study.py collect`.
# usage: experiments/checkpoint_study/phase1_queue.sh "0 1 2 3 4 5 6 7 8 9" [JOBS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${1:?Phase-1 seeds, space separated}
JOBS=${2:-2}
WORK=${WORK:-runs/issue39}
mkdir -p "$WORK"
for k in $SEEDS; do echo "$k"; done | xargs -P "$JOBS" -I{} bash -c '
  k={}; out='"$WORK"'/p1s$k
  if [ -f experiments/results/issue39/study/checkpoints/p1s$k/phase1.pt ] || [ -f $out/phase1.pt ]; then
    echo "p1s$k: done"; exit 0; fi
  echo "p1s$k: start $(date -u +%FT%TZ)"
  OMP_NUM_THREADS=1 .venv/bin/python -m pmnet.cli train phase1 --preset cpu --out $out \
    --set phase1_seed=$k --set threads=1 > '"$WORK"'/p1s$k.log 2>&1 \
    && echo "p1s$k: finished $(date -u +%FT%TZ)" || echo "p1s$k: FAILED (see '"$WORK"'/p1s$k.log)"'
