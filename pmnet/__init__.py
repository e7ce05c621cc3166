"""PMNet + Consolidator: the model, the task, training, statistics and the report.

Importing `pmnet` asks Intel MKL (torch's CPU BLAS) for its strict reproducible mode,
`MKL_CBWR=AUTO,STRICT`, unless the environment already sets `MKL_CBWR`: without it MKL
splits a long reduction (a weight gradient's sum over the batch) among its threads, so the
same training on 1 and on 2 threads gives different bits on Intel CPUs, and a checkpoint
trained alone would not equal one trained in a wave of two (docs/choices.md, "Threads do
not change what a unit computes"). MKL reads the variable at its first call, so this must
run before any matmul; every entry point imports `pmnet` first.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
