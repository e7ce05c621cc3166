"""Issue 46: what a read of `make gpu-check` predicted would fail on its first card, each
shown on the CPU (a spy on the host-to-device copies of a real Trainer's step, the inputs a
compiled graph lifts, the check's own exit codes and pieces, ...), each failing on the code
before its fix."""

from __future__ import annotations

import numbers

import lightning as L
import pytest
import torch

from pmnet import task
from pmnet import train as T
from pmnet.gpu_check import run as R
from pmnet.gpu_check import trials as TR
from pmnet.model import PMNet
from pmnet.train.data import EpisodeData

# -- a Python number logged in a step: a host-to-device copy in every step -----------------


def _host_data_spy(monkeypatch, box: dict):
    """Count `torch.tensor` / `torch.as_tensor` calls that build a tensor from Python numbers
    while `box["on"]` (Lightning's `self.log` builds the tensor of a logged number so, with
    `device=` the module's device: on a GPU a synchronising host-to-device copy)."""
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def spy(data, *args, _real=real, **kwargs):
            if box["on"] and isinstance(data, numbers.Number):
                box["calls"].append((data, kwargs.get("device")))
            return _real(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, spy)


def _phase_module(kind: str, cfg):
    torch.manual_seed(0)
    model = PMNet(cfg.model)
    if kind == "phase1":
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith("consolidator."))
        return (T.Phase1Module(cfg, model, cfg.phase1_lr),
                EpisodeData(cfg, 0, cfg.phase1_episodes_per_epoch))
    cond = T.get_condition(kind)
    T.init_phase2(model, cfg, cond, 0)
    return T.Phase2Module(cfg, model, cond), EpisodeData(cfg, 0, cfg.episodes_per_epoch)


@pytest.mark.parametrize("kind", ["phase1", "consolidator_only"])
def test_a_training_step_logs_no_python_number(kind, monkeypatch, one_thread):
    """A real Trainer's second-epoch steps, the window gpu-check's sync counter watches (from
    the callbacks' on_train_batch_start to their on_train_batch_end): no tensor is built from a
    Python number. On main Phase 1 logged `float(k)` (`train/demos`): Lightning made it a
    CUDA tensor by a synchronising copy, one host sync per step on the card."""
    cfg = T.TrainConfig.from_name("debug", compile="off", batch_size=8,
                                  phase1_episodes_per_epoch=16, episodes_per_epoch=16,
                                  val_episodes=8, test_episodes=8)
    module, data = _phase_module(kind, cfg)
    box = {"on": False, "calls": []}
    _host_data_spy(monkeypatch, box)
    steps = []

    class Window(L.Callback):  # the second epoch's steps, as gpu-check counts them
        def on_train_batch_start(self, trainer, *args):
            box["on"] = trainer.current_epoch >= 1

        def on_train_batch_end(self, *args):
            steps.append(box["on"])
            box["on"] = False

    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Window()])
    trainer.fit(module, datamodule=data)
    assert steps == [False, False, True, True]
    assert box["calls"] == [], box["calls"]
    if kind == "phase1":  # the number of demonstrations is still logged, as a tensor
        assert "train/demos" in trainer.callback_metrics


# -- a global CPU tensor in the compiled evaluation step: CUDA graphs skipped ---------------


def test_the_compiled_evaluation_step_lifts_no_tensor_but_the_models_and_the_batchs(
        monkeypatch, one_thread):
    """The evaluation step as a trial compiles it (`step_fn(_outcomes, train=False)`), its
    graphs recorded: every tensor input is a parameter or buffer of the model or a field of
    the batch. On main `digit_prediction` moved the global `DIGIT_IDS` (a CPU tensor)
    `.to(device)` inside the step: dynamo lifted it as an input, a CPU input of a CUDA
    graph, for which inductor skips CUDA graphs ("cpu device") unless graph partitioning
    is on."""
    from pmnet.train import compiled_steps

    graphs: list[list] = []

    def record(gm, example_inputs):
        graphs.append(list(example_inputs))
        return gm.forward

    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", record)
    torch._dynamo.reset()
    cfg = T.TrainConfig.from_name("debug", compile=("eval",), batch_size=4)
    module, _ = _phase_module("consolidator_only", cfg)
    module.eval()
    batch = task.train_episodes(0, 0, 4, segments=cfg.segments)
    try:
        out = module.step_fn(module._outcomes, train=False)(batch, False)
    finally:
        torch._dynamo.reset()
    assert graphs and "pred/updated_ltm" in out
    known = {id(t) for t in [*module.model.parameters(), *module.model.buffers()]}
    known |= {id(getattr(batch, f)) for f in batch.__dataclass_fields__}
    lifted = [tuple(t.shape) for g in graphs for t in g
              if isinstance(t, torch.Tensor) and id(t) not in known]
    assert lifted == [], lifted


def test_digit_prediction_is_the_argmax_over_the_digit_tokens():
    from pmnet.evaluate import DIGIT_IDS, digit_prediction

    logits = torch.randn(64, 256)
    assert torch.equal(digit_prediction(logits), logits[:, DIGIT_IDS].argmax(-1))


# -- cuBLAS workspaces: reserved between two trials on a reused actor ------------------------


def test_the_release_between_trials_clears_the_cublas_workspaces(monkeypatch):
    """A fake CUDA: the release at a trial's end clears cuBLAS's workspaces (one per handle
    and stream, held in the caching allocator) before it empties the cache; on main they
    stayed reserved into the next trial. Guarded: a torch without the private call skips
    it."""
    from pmnet.train import compiled_steps

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: calls.append("clear_cublas"), raising=False)
    compiled_steps.release_compiled_steps()
    assert calls == ["clear_cublas", "empty_cache"]
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    calls.clear()
    compiled_steps.release_compiled_steps()
    assert calls == ["empty_cache"]


# -- the check's table: gates, information, pieces, exit codes -------------------------------

GiB = 2**30


def _G():
    from pmnet.gpu_check import table

    return table


def _card_env():
    return {"device": "cuda", "torch": "2.13.0+cu128", "lightning": "2.6.6", "cuda": "12.8",
            "driver": "580.1", "card": "NVIDIA H100 80GB HBM3", "card_bytes": 80 * GiB,
            "capability": "9.0", "bf16": True, "flash_attn": "not installed (SDPA)",
            "flash_attn_custom_op": False, "flash_capable": True}


def _card_trial(**over) -> dict:
    r = {"kind": "full", "batch": 256, "flops_per_episode": 7.42e9, "median_step_ms": 40.0,
         "step_ms": [40.0] * 20, "graph_breaks": 0, "recompiles_epoch2": 0,
         "recompile_limit_hits": 0, "host_syncs": 0, "graphs_captured": 4,
         "cudagraph_skips": 0, "attention_kernels": ["aten::scaled_dot_product_attention"],
         "dropout": 0.1, "dropout_masks_differ": True, "dropout_graphs_added": 0,
         "peak_allocated": 4 * GiB, "peak_reserved": 5 * GiB, "context": GiB // 2,
         "process_share": 0.07,
         "gpu_memory": {"share": 0.5, "card_bytes": 80 * GiB, "cap_bytes": 37 * GiB,
                        "peak_reserved": 5 * GiB, "within_cap": True}}
    r.update(over)
    return r


def _card_pred() -> dict:
    return {"context": GiB, "precision": "bf16-mixed", "card_tflops": 989.0,
            "consolidator_only_per_card": 3, "peak": {"full": 20 * GiB}, "share": {"full": 0.5}}


def _rows(**over):
    G = _G()
    return {r.item: r for r in G.table_rows(_card_env(), _card_pred(),
                                            {"full": _card_trial(**over)}, {})
            if r.trial == "full"}


def test_a_peak_well_below_the_prediction_passes_and_above_it_fails():
    """The peak's 0.5x lower bound is gone: it compared a compiled GPU step with an eager CPU
    count plus an assumed 1 GiB context. 5.5 of 20 GiB (0.28x) passes; above 1x fails."""
    assert _rows()["peak on card (reserved + context)"].ok is True
    assert _rows(peak_reserved=20 * GiB)["peak on card (reserved + context)"].ok is False


def test_step_time_is_information_with_the_utilisation_it_implies():
    """A step 20x the docs' estimate is no failure: the row gives the milliseconds and the
    implied utilisation of the card's bf16 peak, no verdict."""
    G = _G()
    rows = _rows(median_step_ms=800.0)
    row = rows["median step (ms); implied utilisation"]
    assert row.ok is None and row.tolerance == "information"
    achieved = 7.42e9 * 256 / 0.8 / 989e12
    assert f"{achieved:.1%}" in row.measured and "800.00" in row.measured
    assert G.exit_code(list(rows.values())) == G.EXIT_OK


def test_graphs_captured_is_a_gate_where_the_steps_run_as_cuda_graphs():
    """No CUDA graph captured by a trial whose steps should replay as CUDA graphs fails
    (on main the row was information only)."""
    assert _rows()["CUDA graphs captured"].ok is True
    assert _rows(graphs_captured=0)["CUDA graphs captured"].ok is False
    assert _rows(graphs_captured=0, cuda_graphs=False)["CUDA graphs captured"].ok is None


def test_each_trial_runs_under_its_memory_cap_and_the_table_gates_it():
    """The trial's Trainer carries `GpuMemoryCap` at the kind's planned share (main never
    exercised the cap): over the cap, or no cap on a card, fails."""
    rows = _rows()
    assert rows["memory within its cap (GpuMemoryCap)"].ok is True
    over = {"share": 0.5, "card_bytes": 80 * GiB, "cap_bytes": 4 * GiB,
            "peak_reserved": 5 * GiB, "within_cap": False}
    assert _rows(gpu_memory=over)["memory within its cap (GpuMemoryCap)"].ok is False
    assert _rows(gpu_memory=None)["memory within its cap (GpuMemoryCap)"].ok is False


def test_the_planned_share_reaches_the_trial_process(monkeypatch, tmp_path):
    """The parent passes each kind's planned share to its trial process (`--share`), Phase 1
    at learned_full's."""
    seen = {}

    def fake_subprocess(args, env, timeout):
        piece = args[1] if args[0] == "--trial" else "two_trials"
        seen[piece] = float(args[args.index("--share") + 1]) if "--share" in args else None
        return {"error": "not run", "timed_out": False}

    monkeypatch.setattr(R, "_subprocess", fake_subprocess)
    monkeypatch.setattr(R, "environment", lambda device: {**_card_env(), "device": device})
    monkeypatch.setattr(R, "predictions", lambda *a: {
        **_card_pred(), "share": {"phase1": 0.5, "full": 0.5, "consolidator_only": 0.25}})
    R.run_check("debug", {}, None, 2, ["phase1", "consolidator_only", "two_trials"], 60,
                True, tmp_path)
    assert seen == {"phase1": 0.5, "consolidator_only": 0.25, "two_trials": None}


def test_exit_codes_tell_a_failed_gate_a_timeout_and_a_broken_check_apart(monkeypatch,
                                                                           tmp_path):
    """0 ok, 1 a gate failed, 3 a piece timed out, 4 the check itself failed (an exception
    in the parent, a crashed trial), 5 a usage error; on main an exception in the parent
    exited 1, as a failed gate does, and an unknown piece 2, as no GPU does."""
    G = _G()
    assert len({G.EXIT_OK, G.EXIT_FAILED, G.EXIT_NO_GPU, G.EXIT_TIMED_OUT, G.EXIT_ERROR,
                G.EXIT_USAGE}) == 6
    gate = G.Row("x", ok=False)
    timeout = G.Row("trial", "full", ok=False, error="timed out")
    crash = G.Row("trial", "full", ok=False, error="error")
    assert G.exit_code([G.Row("x", ok=True)]) == G.EXIT_OK
    assert G.exit_code([gate]) == G.EXIT_FAILED
    assert G.exit_code([gate, timeout]) == G.EXIT_TIMED_OUT
    assert G.exit_code([gate, timeout, crash]) == G.EXIT_ERROR
    rows = G.table_rows(_card_env(), _card_pred(), {
        "full": {"error": "timed out after 480 s", "timed_out": True},
        "phase1": {"error": "exit 1: RuntimeError: CUDA out of memory"}}, {})
    assert [(r.trial, r.verdict) for r in rows if r.error] == [("full", "TIMED OUT"),
                                                              ("phase1", "FAIL")]

    def boom(*a, **k):
        raise RuntimeError("a bug in the check")

    monkeypatch.setattr(R, "run_check", boom)
    assert R.main(["--self-test", "--cache-dir", str(tmp_path)]) == G.EXIT_ERROR
    with pytest.raises(SystemExit) as e:
        R.main(["--self-test", "--no-such-option"])
    assert e.value.code == G.EXIT_USAGE
    assert R.main(["--self-test", "--kinds", "nope", "--cache-dir", str(tmp_path)]) \
        == G.EXIT_USAGE


def test_a_timed_out_piece_is_killed_with_its_workers_and_reported(monkeypatch, tmp_path):
    """A piece past its time: its whole process session (inductor's compile workers too)
    is killed, and the result says it timed out (exit 3, its own code)."""
    import os
    import sys
    import time

    fake = tmp_path / "python"
    pidfile = tmp_path / "worker.pid"
    fake.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pidfile}\nsleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    t = time.time()
    r = R._subprocess(["--trial", "full"], dict(os.environ), 1.0)
    assert r["timed_out"] is True and "timed out" in r["error"]
    assert time.time() - t < 30
    worker = int(pidfile.read_text())
    time.sleep(0.2)
    try:
        state = next(ln for ln in open(f"/proc/{worker}/status") if ln.startswith("State"))
        assert "Z" in state, state  # killed, not yet reaped
    except FileNotFoundError:
        pass  # killed and reaped


def test_pieces_are_stored_and_the_table_names_the_next_one(tmp_path):
    G = _G()
    results = tmp_path / "r"
    results.mkdir()
    assert R.next_piece({}) == "learning"  # the learning gate first (issue 62)
    (results / "learning.json").write_text('{"kind": "learning", "rungs": []}')
    assert R.next_piece(R.stored_results(results)) == "phase1"
    (results / "phase1.json").write_text('{"kind": "phase1"}')
    (results / "full.json").write_text('{"error": "timed out after 480 s", "timed_out": true}')
    stored = R.stored_results(results)
    assert R.next_piece(stored) == "full"  # timed out: run it again (its cache is warm)
    row = R.next_row(stored, "python -m pmnet.gpu_check")
    assert "python -m pmnet.gpu_check --kinds full" in row.measured
    assert "again" in row.measured and row.trial == f"2 of {len(G.PIECES)} measured"
    assert G.exit_code([row]) == G.EXIT_TIMED_OUT  # not finished: run the next piece
    done = {p: {} for p in G.PIECES}
    assert R.next_piece(done) is None
    assert "none" in R.next_row(done, "x").measured
    assert G.exit_code([R.next_row(done, "x")]) == G.EXIT_OK
    assert G.PIECES[0] == "learning" and G.PIECES[-1] == "two_trials"
    assert set(G.KINDS) < set(G.PIECES)


# -- the Makefile: an interpreter as it is, the tested torch ---------------------------------


def _make_n(*args: str) -> str:
    from tests.support.make import make_dry_run

    return make_dry_run(*args)


def test_make_gpu_check_with_an_interpreter_creates_no_venv_and_installs_nothing():
    """`make gpu-check PY=...` on a bare GPU box (torch and Lightning, no network): that
    interpreter runs the check, nothing else; on main it made a venv and pip-installed
    torch and the dev extra (Ray, MLflow) first."""
    out = _make_n("gpu-check", "PY=/opt/bare/bin/python3", "GPU_CHECK_ARGS=--kinds phase1")
    assert out.strip().splitlines() == ["/opt/bare/bin/python3 -m pmnet.gpu_check --kinds phase1"]
    assert "venv" not in out and "pip" not in out
    default = _make_n("-B", "gpu-check")  # without PY: the project's venv, as before
    assert "pip install" in default and ".venv/bin/python -m pmnet.gpu_check" in default


def test_the_gpu_install_path_pins_the_tested_torch_and_says_when_another_is_there():
    """On a GPU machine `make install` asks for the tested torch (main: the newest, untested)
    and says when the torch it finds is another; one pin for the Makefile, the image and
    the check (docker/constraints.txt = gpu_check.table.TESTED_TORCH)."""
    import re
    from pathlib import Path

    G = _G()
    root = Path(__file__).resolve().parents[1]
    pin = re.search(r"^torch==(\S+)", (root / "docker" / "constraints.txt").read_text(), re.M)
    assert pin[1] == G.TESTED_TORCH
    out = _make_n("-B", "install", "HAS_GPU=1")
    assert f'pip install -q "torch=={G.TESTED_TORCH}"' in out and "--system-site-packages" in out
    assert "UNTESTED" in out
    assert G.torch_tested(G.TESTED_TORCH + "+cu128")[0] is True
    ok, text = G.torch_tested("2.14.0+cu128")
    assert ok is False and "UNTESTED" in text


# -- the dropout check: two replays of the training graph, no graph of its own ----------------


@pytest.mark.slow  # a whole trial with dynamo tracing its steps: about 20 s
def test_the_dropout_check_compares_two_replays_and_compiles_no_graph(monkeypatch, tmp_path,
                                                                      one_thread):
    """A real trial in this process, its training step compiled (dynamo's eager backend):
    the dropout check calls the training graph three times at the trial's batch and mode
    and compares the second and third calls, replays both; the step's code object holds
    the same compiled entries after the check as before it. On main the check called the
    step under `no_grad` at batch 4 (a fourth graph per kind, 107-308 s cold on a CPU with
    inductor) and compared the first call with the second."""
    from pmnet.train import compiled_steps
    from pmnet.train.modules import Phase2Module

    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", False)
    monkeypatch.chdir(tmp_path)
    try:
        out = TR.run_trial("consolidator_only", "debug",
                          {"compile": ["phase2"], "model.attn_dropout": 0.1,
                           "threads": 1}, batch=4, steps=1)
        after = TR._cache_entries([Phase2Module.objective])
    finally:
        torch._dynamo.reset()
    assert after == {k: v for k, v in out["cache_entries"].items() if k in after}
    assert out["dropout_graphs_added"] == 0
    assert len(out["dropout_losses"]) == 3 and out["dropout_masks_differ"] is True
    assert out["dropout_masks_differ"] == (out["dropout_losses"][1] != out["dropout_losses"][2])


# -- the image's pip step resolves under its constraints --------------------------------------

_NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution",
                   "Name or service not known", "Could not fetch URL", "Network is unreachable",
                   "ConnectTimeout", "ReadTimeout")


def _pip_dry_run(constraints, *, no_index: bool):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
           "--disable-pip-version-check", *(["--no-index"] if no_index else []),
           "-c", str(constraints), "-e", ".[dev,postgres]"]  # docker/Dockerfile's
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)


def test_the_images_pip_step_resolves_under_its_constraints(tmp_path):
    """docker/Dockerfile's project step, `pip install -c docker/constraints.txt -e
    .[dev,postgres]`, as a dry run: it resolves (offline from this environment when it holds
    the tested versions, else from the index; skipped without a network). A pin with an extra, as
    `ray[tune]==...` was, stops it ("Constraints cannot have extras")."""
    from pathlib import Path

    pytest.importorskip("setuptools")  # --no-build-isolation builds the metadata here
    constraints = Path(__file__).resolve().parents[1] / "docker" / "constraints.txt"
    proc = _pip_dry_run(constraints, no_index=True)
    if proc.returncode != 0:  # this environment lacks a pinned version: ask the index
        proc = _pip_dry_run(constraints, no_index=False)
        if proc.returncode != 0 and any(e in proc.stdout + proc.stderr
                                        for e in _NETWORK_ERRORS):
            pytest.skip("no network to resolve the image's pins")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    assert "Would install pmnet-consolidator" in proc.stdout
    extra = tmp_path / "constraints.txt"
    extra.write_text(constraints.read_text().replace("ray==", "ray[tune]=="))
    bad = _pip_dry_run(extra, no_index=True)
    assert bad.returncode != 0 and "Constraints cannot have extras" in bad.stderr
