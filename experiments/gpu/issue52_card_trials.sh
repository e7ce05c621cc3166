#!/usr/bin/env bash
# Issue 52, item 7, the second call: the two Consolidator-only arms (routing on and off, seed
# 42, the `cpu` Phase-2 recipe, eager: compiling would cost more than the call has) on a
# committed Phase-1 checkpoint of the `small` shape, side by side on the card, each cut at
# BUDGET seconds (Lightning's CSV keeps each finished epoch). Usage (device):
#   CKPT=experiments/results/issue52/phase1/W128/phase1.pt bash experiments/gpu/issue52_card_trials.sh
set -u
BUDGET=${BUDGET:-170}
CKPT=${CKPT:?CKPT=path of phase1.pt}
PY=${PY:-python3}
OUT=${OUT:-/tmp/card-out}
R=${R:-/tmp/card2}
SHAPE=${SHAPE:---set model.hidden=128 --set model.ffn=384 --set model.head_dim=32}
mkdir -p "$R" "$OUT"
T0=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | head -1
for c in consolidator_only consolidator_only_routing_off; do
  ( timeout -k 5 "$BUDGET" $PY -m pmnet.cli train phase2 --preset cpu $SHAPE --set compile=off \
      --set threads=2 --condition "$c" --seed 42 --phase1 "$CKPT" --out "$R/$c" \
      > "$R/$c.log" 2>&1; echo "$c exit $? at t+$(( $(date +%s) - T0 ))s" | tee -a "$R/card.log" ) &
done
wait
for c in consolidator_only consolidator_only_routing_off; do
  grep -v "^W11\|warn" "$R/$c.log" | tail -30 > "$R/$c.tail.log"
done
(cd "$R" && tar czf "$OUT/trials.tgz" --exclude='*.pt' --exclude='ckpt' --exclude='*.log' . \
   && cp ./*.tail.log card.log "$OUT/")
ls -la "$OUT"
