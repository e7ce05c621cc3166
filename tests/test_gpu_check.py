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
    assert "--kinds learning" in proc.stdout
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


# -- the learning gate (issue 62): Phase 0 on a ladder of settings ---------------------------


def _rung(setting: str, label: str, accuracy=(0.09, 0.08, 0.085, 0.1), end=2.8,
          batch=32) -> dict:
    """A rung that learned: 100 steps falling from 5.5 to the plateau, then to `end`."""
    losses = [5.5 - 2.2 * i / 20 for i in range(20)] + [3.26] * 20 + [
        3.26 - (3.26 - end) * i / 59 for i in range(60)]
    return {"setting": setting, "label": label, "batch": batch, "losses": losses,
            "accuracy": list(accuracy)}


def _learning(**change) -> dict:
    rungs = [_rung("reference", "eager, fp32, batch 32"), _rung("bf16", "eager, bf16, batch 32"),
             _rung("compile", "compiled, bf16, batch 32"),
             _rung("cuda graphs", "compiled, CUDA graphs, bf16, batch 32"),
             _rung("batch", "compiled, CUDA graphs, bf16, batch 256", batch=256, end=2.7)]
    for setting, over in change.items():
        i = next(i for i, r in enumerate(rungs) if r["setting"] == setting.replace("_", " "))
        rungs[i] = {**rungs[i], **over}
    return {"kind": "learning", "rungs": rungs, "skipped": {}}


def _failed(rows) -> list[str]:
    return [f"{r.item} ({r.trial})" for r in rows if r.ok is False]


def test_the_learning_gate_passes_a_ladder_that_learns_alike_and_comes_first():
    rows = G.table_rows(_env(), _pred(), {}, {}, _learning())
    assert G.exit_code(rows) == G.EXIT_OK, G.render(rows)
    learning = [r for r in rows if r.item.startswith("phase 0 learns the copy")]
    assert len(learning) == 5 + 4  # an accuracy row per rung, a comparison per later rung
    first = next(i for i, r in enumerate(rows) if not r.item.startswith("env: "))
    assert rows[first] is learning[0]  # right after the environment


@pytest.mark.parametrize("setting, over, why", [
    # CUDA graphs: stuck on the plateau (the H200's Phase 0), at chance
    ("cuda_graphs", {"losses": [5.5 - 2.2 * i / 20 for i in range(20)] + [3.26] * 80,
                     "accuracy": [0.04, 0.037, 0.036, 0.039]}, "held-out accuracy"),
    # compile: learns, but its curve departs from bf16 eager's by more than CURVE_TOL
    ("compile", _rung("compile", "compiled", end=2.2), "loss curve"),
    # the preset's batch: ends above the rung before
    ("batch", _rung("batch", "batch 256", batch=256, end=3.05), "last loss"),
])
def test_the_learning_gate_names_the_phase_and_the_setting_that_differs(setting, over, why):
    over = {k: v for k, v in over.items() if k in ("losses", "accuracy")}
    rows = G.table_rows(_env(), _pred(), {}, {}, _learning(**{setting: over}))
    assert G.exit_code(rows) == G.EXIT_FAILED
    failed = _failed(rows)
    name = setting.replace("_", " ")
    assert failed and all(f"(phase 0: {name} added)" in f for f in failed), failed
    assert any(why in f for f in failed), failed
    order = [r["setting"] for r in _learning()["rungs"]]
    later = order[order.index(name) + 1:]  # reported, not judged: one setting is named
    after = [r for r in rows if any(r.trial == f"phase 0: {s} added" for s in later)]
    assert all(r.ok is None and "not judged" in r.tolerance for r in after)
    assert len(after) == 2 * len(later)


def test_a_reference_that_does_not_learn_fails_the_reference_and_a_crash_is_an_error():
    stuck = {"accuracy": [0.04] * 4}
    rows = G.table_rows(_env(), _pred(), {}, {}, _learning(reference=stuck))
    assert _failed(rows) == ["phase 0 learns the copy: held-out accuracy (eager, fp32, "
                             "batch 32) (phase 0: reference)"]
    crashed = G.table_rows(_env(), _pred(), {}, {}, {"error": "exit 1: RuntimeError: ..."})
    assert [r.verdict for r in crashed if r.error] == ["FAIL"]
    assert G.exit_code(crashed) == G.EXIT_ERROR


def test_a_loss_curve_is_compared_over_its_second_half():
    a = [5.0] * 50 + [3.0] * 50
    b = [4.0] * 50 + [3.1] * 50  # far apart in the first half only
    assert G.loss_curve(a) == [5.0] * 5 + [3.0] * 5
    assert G.curve_gap(G.loss_curve(a), G.loss_curve(b)) == pytest.approx(0.1)


@pytest.mark.slow
def test_self_test_runs_the_learning_gate_and_the_cpu_learns_the_copy(tmp_path):
    """The learning gate's CPU self-test: Phase 0 at the gate's shape, eager and compiled
    fp32 (dynamo's eager backend), 600 steps each: both learn the copy (held-out accuracy at
    least 1.5x chance) and their curves agree; the other pieces remain (exit 3)."""
    proc = _run("--self-test", "--kinds", "learning", "--cache-dir", str(tmp_path),
                env=_blocked_env(tmp_path), timeout=1800)
    assert proc.returncode == G.EXIT_TIMED_OUT, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| phase 0 learns")]
    assert sum("| ok " in ln for ln in rows) == 3, "\n".join(rows)  # 2 accuracies, 1 curve
    assert "all checks passed" in proc.stdout


def test_the_learning_gates_self_test_fails_naming_the_phase_when_it_cannot_learn(tmp_path):
    """The gate through the real command, on the CPU, with too few steps to leave the ln-26
    plateau (30): it fails (exit 1 once the other pieces are stored; here exit 3, as they
    remain), the FAIL row names Phase 0 and the rung, the one reference rung here."""
    proc = _run("--self-test", "--kinds", "learning", "--learn-steps", "30", "--cache-dir",
                str(tmp_path), timeout=900)
    assert proc.returncode == G.EXIT_TIMED_OUT, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED: phase 0 learns the copy: held-out accuracy (eager, fp32, batch 32) " \
           "(phase 0: reference): FAIL" in proc.stdout
    # the compiled rung is reported, not judged: the first failed rung names the setting
    assert "(phase 0: compile added): FAIL" not in proc.stdout
    assert "not judged (after the failed reference rung)" in proc.stdout
    assert "not run (the preset trains in fp32 on a CPU)" in proc.stdout


def test_the_ladder_adds_the_presets_phase0_settings_one_at_a_time():
    from pmnet.gpu_check.learning import LEARN_BATCH, ladder

    rungs, skipped = ladder(True, "bf16-mixed", True, True, 256)  # the paper preset, a card
    assert [r.setting for r in rungs] == ["reference", "bf16", "compile", "cuda graphs",
                                          "batch"] and skipped == {}
    for a, b in zip(rungs, rungs[1:]):  # each rung differs from the one before in one field
        diff = [f for f in ("precision", "compiled", "cuda_graphs", "batch")
                if getattr(a, f) != getattr(b, f)]
        assert len(diff) == 1, (a, b)
    assert rungs[0].label == f"eager, fp32, batch {LEARN_BATCH}"
    assert rungs[-1].label == "compiled, CUDA graphs, bf16, batch 256"
    cpu, skipped = ladder(False, "32-true", True, True, 16)  # the self-test
    assert [r.setting for r in cpu] == ["reference", "compile"]
    assert set(skipped) == {"bf16", "cuda graphs", "batch"}
    eager, skipped = ladder(True, "32-true", False, True, LEARN_BATCH)
    assert [r.setting for r in eager] == ["reference"] and len(skipped) == 4
