#!/usr/bin/env bash
# Issue 52, item 7: on a lent GPU (torch and Lightning, no Ray or MLflow), in one command:
#   - the top rung's (`medium`) Phase 1 twice at once: seed 0 as the preset has it (Phase 1
#     eager) and seed 1 with the Phase-1 step compiled too (the compile's worth on the card);
#   - on each finished checkpoint, the two Consolidator-only arms (routing on and off), seed 42;
#   - as much of the `paper` preset's Phase 0 and Phase 1 as the minutes allow.
# Everything runs through `pmnet train` (pmnet.cli), the preset's recipe unchanged apart from
# `threads` (run-only) and, for seed 1, `compile`. What comes back ($OUT): runs.tgz (every
# metrics.csv, *_metrics.json, result.json, run log; no weights) and each medium phase1.pt in
# 15 MiB parts (the device returns files of at most 16 MiB).
# Usage (device): bash experiments/gpu/issue52_card.sh      Locally: MED=debug PAPER=debug ...
set -u
BUDGET=${BUDGET:-520}          # seconds for the whole script, packing included
P1WALL=${P1WALL:-300}          # medium Phase 1 pauses at the last epoch end within this
MED=${MED:-medium}
PAPER=${PAPER:-paper}
PY=${PY:-python3}
OUT=${OUT:-/tmp/card-out}
R=${R:-/tmp/card}
mkdir -p "$R" "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
log() { echo "[t+$(el)s] $*" | tee -a "$R/card.log"; }
export PYTHONUNBUFFERED=1
log "$(nvidia-smi -L 2>&1 | head -2)"
$PY -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1 | tee -a "$R/card.log"
nproc | tee -a "$R/card.log"
(command -v nvidia-smi >/dev/null && nvidia-smi dmon -s u -d 5 > "$R/dmon.txt" 2>&1) &

# job NAME TIMEOUT ARGS...: one `pmnet train` in the background, its exit code in NAME.rc
job() {
  local name=$1 limit=$2; shift 2
  # a compile cache per job: processes compiling at once into one cache race ("file too short")
  ( TORCHINDUCTOR_CACHE_DIR="$R/inductor-$name" TRITON_CACHE_DIR="$R/triton-$name" \
    timeout -k 15 "$limit" $PY -m pmnet.cli train "$@" --out "$R/$name" --set threads=2 \
      > "$R/$name.log" 2>&1; echo $? > "$R/$name.rc"; echo "[t+$(el)s] $name exit $(cat "$R/$name.rc")" | tee -a "$R/card.log" ) &
}

declare -A P1SET=([m0]="--set phase1_seed=0" [m1c]="--set phase1_seed=1 --set compile=phase1,phase2")
job m0 $((P1WALL + 120)) phase1 --preset "$MED" ${P1SET[m0]} --max-wall "$P1WALL"
job m1c $((P1WALL + 120)) phase1 --preset "$MED" ${P1SET[m1c]} --max-wall "$P1WALL"
job paper $((BUDGET - 50)) phase1 --preset "$PAPER" --max-wall $((BUDGET - 120))
log "started m0, m1c (medium Phase 1) and paper"

declare -A launched=()
while [ "$(el)" -lt $((BUDGET - 40)) ]; do
  for k in m0 m1c; do
    if [ -z "${launched[$k]:-}" ] && [ -f "$R/$k.rc" ]; then
      launched[$k]=1
      left=$((BUDGET - 40 - $(el)))
      if [ -f "$R/$k/phase1.pt" ] && [ "$left" -ge 60 ]; then
        for c in consolidator_only consolidator_only_routing_off; do
          job "$k-$c-s42" "$left" phase2 --preset "$MED" ${P1SET[$k]} --condition "$c" \
              --seed 42 --phase1 "$R/$k/phase1.pt"
        done
        log "$k finished: two Consolidator-only trials started (${left}s left)"
      else
        log "$k: no phase1.pt or too little time (${left}s left); no trials"
      fi
    fi
  done
  running=$(jobs -rp | wc -l)
  [ "$running" -le 1 ] && [ -n "${launched[m0]:-}" ] && [ -n "${launched[m1c]:-}" ] && break
  sleep 5
done
log "stopping what still runs"
pkill -TERM -f "pmnet.cli train" ; sleep 12; pkill -KILL -f "pmnet.cli train"; pkill -f "nvidia-smi dmon"
sleep 1
for f in "$R"/*.log; do echo "== $f"; tail -4 "$f"; done >> "$R/card.log"
(cd "$R" && tar czf "$OUT/runs.tgz" --exclude='*.pt' --exclude='*.ckpt' --exclude='ckpt' --exclude='inductor-*' --exclude='triton-*' .)
for k in m0 m1c; do
  [ -f "$R/$k/phase1.pt" ] && split -b 15M -d "$R/$k/phase1.pt" "$OUT/$k-phase1.pt.part" \
    && sha256sum "$R/$k/phase1.pt" | tee -a "$R/card.log"
done
cp "$R/card.log" "$OUT/card.log"
log "done"; ls -la "$OUT"
