"""`make gpu-check` (issues 36, 46): what the GPU path predicts, measured on the card, in one
table, in pieces that each fit a 10-minute command.

    python -m pmnet.gpu_check --kinds phase1 --budget 570   # one piece (docs/gpu-check.md)
    python -m pmnet.gpu_check --budget 570   # every piece not stored yet, while time is left
    python -m pmnet.gpu_check --report       # the table of the stored pieces
    python -m pmnet.gpu_check --self-test    # the same code paths on the CPU (debug preset)

Needs torch, Lightning and this repository only (no Ray, MLflow, pandas, statsmodels, no
network, nothing installed). Exit codes (`EXIT_*`): 0 ok, 1 a gate failed, 2 no CUDA GPU,
3 a piece timed out, 4 the check itself failed, 5 a usage error.

What runs first: the learning gate (`--kinds learning`, issue 62, `learning.py`): Phase 0
(the copy task) at a small shape for a few hundred steps on a ladder of settings, eager fp32,
then bf16, compile, CUDA graphs and the preset's batch, each added to the rung before; every
rung must learn the copy (held-out per-position accuracy above chance) and agree with the rung
before it, or the table's FAIL row names the phase and the setting that differs.

Then, for Phase 1 and each kind of Phase-2 condition of the preset (`KINDS`: the
paper's six conditions are four kinds of step and memory), a short real trial in a fresh
process (`--trial KIND`), its allocator capped at the kind's planned share (`GpuMemoryCap`):
train, validate, train, validate, test, with the preset's compiled steps (CUDA graphs on a
GPU), at the preset's batch. Each trial measures its peak memory (allocated, reserved,
against its cap, the process's share of the card), the median step time from CUDA events,
CUDA graphs captured and skipped, graph breaks, recompiles, host syncs
(`torch.cuda.set_sync_debug_mode`), the attention kernel, and whether dropout draws new
masks on two replays of the training graph. One more piece runs two trials in a row in
fresh threads, as a reused Ray actor does, and measures what stays reserved between them.
Each piece's result is stored (`--cache-dir`, with inductor's compile cache); the parent
compares every stored measurement with its prediction (`pmnet.gpu.footprint`, the planned
shares and number of Consolidator-only trials per card) within `TOLERANCES`
(docs/gpu-check.md), reports step time as information, and prints one table whose last row
names the next piece to run.

Where each part lives (issue 51 split the check, until then `pmnet/gpu/check.py`, into a
package above `pmnet.train`, whose trials it runs; `pmnet.gpu` keeps the footprint and the
cap that training and planning use):
    table.py   the table: exit codes, tolerances, `Row`, `table_rows` (pure: no torch)
    trials.py  on the card: the environment, one trial (`run_trial`), two trials in a row,
               the predictions (`pmnet.gpu.footprint`)
    learning.py  the learning gate: Phase 0 on the ladder of settings (`run_learning`)
    run.py     the pieces (each a fresh process, its result stored), `run_check`, `main`

This package's `__init__` imports nothing, so `python -m pmnet.gpu_check` loads only torch,
Lightning and the model (no Ray, MLflow, pandas or statsmodels).
"""
