"""`pmnet/__init__.py`: importing the package asks MKL for its strict reproducible mode, so
what a unit computes does not depend on how many threads it ran on (docs/choices.md,
"Threads do not change what a unit computes")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# In a fresh interpreter: import pmnet, then a product whose reduction (4,096 long) MKL
# would split among threads, on 1 and on 2 threads: the same bits in strict mode.
PROBE = """
import json, os, pmnet, torch
torch.manual_seed(0)
a, b = torch.randn(64, 4096), torch.randn(4096, 48)
out = {}
for t in (1, 2):
    torch.set_num_threads(t)
    out[t] = a @ b
print(json.dumps({"cbwr": os.environ.get("MKL_CBWR"), "equal": torch.equal(out[1], out[2])}))
"""


def _probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_pmnet_makes_the_blas_give_the_same_bits_on_any_thread_count():
    got = _probe()
    assert got == {"cbwr": "AUTO,STRICT", "equal": True}


def test_an_mkl_cbwr_the_user_set_is_kept():
    assert _probe(MKL_CBWR="AUTO")["cbwr"] == "AUTO"
