"""`make gpu-check` without a GPU (issue 36): the exit-2 path, the tolerance logic on
synthetic measurements, and the table's code paths run on the CPU (`--self-test`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pmnet.gpu_check import table as G

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def _run(*args: str, env: dict | None = None, timeout: float = 600):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pmnet.gpu_check", *args], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_exits_2_with_a_clear_message_without_a_gpu():
    proc = _run(env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == G.EXIT_NO_GPU == 2
    assert "no CUDA GPU here" in proc.stderr and "--self-test" in proc.stderr
    assert proc.stdout == ""


#: what a bare GPU image (torch and Lightning) lacks and gpu-check must not import
BLOCKED = ("ray", "mlflow", "pandas", "statsmodels")


def _blocked_env(tmp_path) -> dict:
    """An environment whose Python processes (the check's trial processes too) find no
    BLOCKED package, as in a venv without them: in a sitecustomize, `sys.meta_path`'s path
    finder replaced by one that finds nothing of them (`importlib.util.find_spec` says None,
    `import` raises ModuleNotFoundError, as for a package that is not installed)."""
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        f"BLOCKED = {BLOCKED!r}\n"
        "class _Absent(PathFinder):\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in BLOCKED:\n"
        "            return None\n"
        "        return PathFinder.find_spec(name, path, target)\n"
        "sys.meta_path[:] = [_Absent if f is PathFinder else f for f in sys.meta_path]\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_gpu_check_needs_neither_ray_nor_mlflow(tmp_path):
    """The check's modules import with Ray, MLflow, pandas and statsmodels blocked."""
    code = ("import sys, pmnet.gpu_check.run, pmnet.gpu_check.trials, pmnet.train, "
            "pmnet.gpu.footprint, pmnet.gpu.cap, pmnet.train.data; "
            f"print(sorted(m for m in {BLOCKED!r} if m in sys.modules))")
    env = {**os.environ, **_blocked_env(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-500:]
    blocked = subprocess.run([sys.executable, "-c", "import mlflow"], capture_output=True,
                             text=True, timeout=60, env=env)
    assert "No module named 'mlflow'" in blocked.stderr  # the blocker blocks


def _env():
    return {"device": "cuda", "torch": "2.13.0+cu128", "lightning": "2.6.6", "cuda": "12.8",
            "driver": "580.1", "card": "NVIDIA GeForce RTX 4090", "card_bytes": 24 * GiB,
            "capability": "8.9", "bf16": True, "flash_attn": "2.8.3 (torch custom ops)",
            "flash_attn_custom_op": True, "flash_capable": True}


def _trial(kind: str, **over) -> dict:
    r = {"kind": kind, "batch": 256, "flops_per_episode": 7.42e9, "median_step_ms": 0.0,
         "step_ms": [1.0] * 10, "graph_breaks": 0, "recompiles_epoch2": 0,
         "recompile_limit_hits": 0, "host_syncs": 0, "graphs_captured": 4,
         "cudagraph_skips": 0, "attention_kernels": ["flash_attn::_flash_attn_forward"],
         "dropout": 0.1, "dropout_masks_differ": True, "dropout_graphs_added": 0,
         "peak_allocated": 4 * GiB, "peak_reserved": 5 * GiB, "context": GiB // 2,
         "process_share": 0.23,
         "gpu_memory": {"share": 0.2666, "card_bytes": 24 * GiB, "cap_bytes": int(5.1 * GiB),
                        "peak_reserved": 5 * GiB, "within_cap": True}}
    # the docs' estimate for this card: flops x batch / (82.6 TFLOP/s x DOCS_UTILISATION)
    r["median_step_ms"] = 7.42e9 * 256 / (82.6e12 * G.DOCS_UTILISATION) * 1e3
    r.update(over)
    return r


def _pred() -> dict:
    return {"context": GiB, "precision": "bf16-mixed", "card_tflops": 82.6,
            "consolidator_only_per_card": 3,
            "peak": {"full": 12 * GiB, "consolidator_only": 6 * GiB},
            "share": {"full": 0.5, "phase1": 0.5, "consolidator_only": 0.2666}}


def _two(reserved=0) -> dict:
    return {"trials": [_trial("consolidator_only"), _trial("consolidator_only")],
            "reserved_after": [reserved, reserved]}


def _verdicts(rows, trial):
    return {r.item: r.ok for r in rows if r.trial == trial}


def test_a_card_within_every_tolerance_passes():
    rows = G.table_rows(_env(), _pred(), {"consolidator_only": _trial("consolidator_only"),
                                          "phase1": _trial("phase1")}, _two())
    assert G.exit_code(rows) == G.EXIT_OK, G.render(rows)
    v = _verdicts(rows, "consolidator_only")
    assert v["peak on card (reserved + context)"] is True  # 5.5 of 6 GiB
    assert v["memory within its cap (GpuMemoryCap)"] is True
    assert v["median step (ms); implied utilisation"] is None  # information (issue 46)
    assert v["Consolidator-only trials at once on the card"] is True  # 3 x 5.5 <= 22.8
    text = G.render(rows)
    for item in ("env: torch", "env: driver", "env: capability", "env: bf16", "env: flash_attn",
                 "peak allocated / reserved", "process's share of the card", "CUDA context",
                 "CUDA graphs captured", "CUDA graphs skipped", "graph breaks",
                 "recompiles in epoch 2", "host syncs per epoch-2 step", "attention kernel",
                 "dropout masks new on each replay", "reserved after trial 1 (MiB)"):
        assert item in text, item


@pytest.mark.parametrize("over, item", [
    ({"peak_reserved": int(5.6 * GiB)}, "peak on card (reserved + context)"),  # 6.1 > 6
    ({"context": int(1.2 * GiB)}, "CUDA context"),
    ({"graph_breaks": 1}, "graph breaks"),
    ({"recompiles_epoch2": 1}, "recompiles in epoch 2"),
    ({"recompile_limit_hits": 1}, "recompile-limit hits"),
    ({"host_syncs": 3}, "host syncs per epoch-2 step"),
    ({"cudagraph_skips": 1}, "CUDA graphs skipped"),
    ({"dropout_masks_differ": False}, "dropout masks new on each replay"),
    ({"dropout_graphs_added": 1}, "graphs the dropout check compiled"),
])
def test_a_measurement_off_by_more_than_its_tolerance_fails(over, item):
    rows = G.table_rows(_env(), _pred(), {"consolidator_only": _trial("consolidator_only",
                                                                      **over)}, {})
    assert _verdicts(rows, "consolidator_only")[item] is False, G.render(rows)
    assert G.exit_code(rows) == G.EXIT_FAILED


def test_phase1_packing_and_two_trials_in_a_row_are_checked():
    big = _trial("phase1", peak_reserved=12 * GiB)  # 12.5 GiB > learned_full's 12
    pred = {**_pred(), "consolidator_only_per_card": 5}  # 5 x 5.5 GiB > 22.8 usable
    rows = G.table_rows(_env(), pred, {"phase1": big,
                                       "consolidator_only": _trial("consolidator_only")},
                        _two(reserved=100 * 2**20))
    assert _verdicts(rows, "phase1")[
        "peak on card (reserved + context) vs learned_full's"] is False
    assert _verdicts(rows, "consolidator_only")[
        "Consolidator-only trials at once on the card"] is False
    assert _verdicts(rows, "two in a row")["reserved after trial 1 (MiB)"] is False
    failed = G.table_rows(_env(), _pred(), {}, {"error": "FailOnRecompileLimitHit: ..."})
    assert [r.ok for r in failed if r.item == "two trials in a row"] == [False]


def test_a_card_without_a_known_peak_gets_no_step_time_verdict():
    env = {**_env(), "card": "Some Future GPU"}
    rows = G.table_rows(env, {**_pred(), "card_tflops": None},
                        {"consolidator_only": _trial("consolidator_only")}, {})
    row = next(r for r in rows if r.item.startswith("median step"))
    assert row.ok is None and "n/a" in row.predicted


def test_self_test_runs_the_tables_code_paths_on_the_cpu(tmp_path):
    """A real trial in a fresh process and two trials in a row, on the CPU (eager steps,
    to stay fast; `test_self_test_with_compiled_steps` compiles them): the CUDA-only cells
    say so, what the CPU can measure is measured, exit 0."""
    proc = _run("--self-test", "--kinds", "consolidator_only,two_trials", "--steps", "2",
                "--set", "compile=off", "--cache-dir", str(tmp_path),
                env=_blocked_env(tmp_path))  # as a venv without Ray, MLflow, pandas
    # every gate held; the other pieces are still to run (exit 3, the next one named)
    assert proc.returncode == G.EXIT_TIMED_OUT, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--kinds phase1" in proc.stdout
    out = proc.stdout
    assert "| env: torch" in out and G.NA_CPU in out
    lines = {ln.split("|")[1].strip(): ln for ln in out.splitlines() if ln.startswith("| ")}
    assert "dropout masks new on each replay" in lines and "| True " in lines[
        "dropout masks new on each replay"]
    assert "scaled_dot_product" in lines["attention kernel"]
    assert "trial 2: recompile-limit hits" in lines
    assert "all checks passed" in out


@pytest.mark.slow
def test_self_test_with_compiled_steps(tmp_path):
    """Every kind and two trials in a row with compiled steps (dynamo's eager backend): no
    graph break, no recompile in the second epoch, no recompile-limit hit."""
    proc = _run("--self-test", "--steps", "2", "--cache-dir", str(tmp_path), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("| graph breaks ") == len(G.KINDS)
