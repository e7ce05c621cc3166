"""`make gpu-check` (issues 36, 46): what the GPU path predicts, measured on the card, in one
table, in pieces that each fit a 10-minute command.

    python -m pmnet.gpu.check --kinds phase1 --budget 570   # one piece (docs/gpu-check.md)
    python -m pmnet.gpu.check --budget 570   # every piece not stored yet, while time is left
    python -m pmnet.gpu.check --report       # the table of the stored pieces
    python -m pmnet.gpu.check --self-test    # the same code paths on the CPU (debug preset)

Needs torch, Lightning and this repository only (no Ray, MLflow, pandas, statsmodels, no
network, nothing installed). Exit codes (`EXIT_*`): 0 ok, 1 a gate failed, 2 no CUDA GPU,
3 a piece timed out, 4 the check itself failed, 5 a usage error.

What runs: for Phase 1 and each kind of Phase-2 condition of the preset (`KINDS`: the
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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

#: Exit codes (docs/gpu-check.md): 0 every piece measured and every gate holds; 1 a gate
#: failed (the table's FAIL rows); 2 no CUDA GPU; 3 not finished: a piece ran out of time
#: (its compiled graphs are in the cache) or pieces remain: run the table's "next piece"
#: command; 4 the check itself failed (an exception, a trial process that crashed); 5 a
#: usage error (an unknown piece or option)
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_TIMED_OUT, EXIT_ERROR, EXIT_USAGE = 0, 1, 2, 3, 4, 5

#: the torch this project is tested with (docker/constraints.txt pins the same; the code
#: leans on private torch APIs, e.g. `torch._C._dispatch_get_registrations_for_dispatch_key`
#: in pmnet/gpu/footprint.py and `torch._C._cuda_clearCublasWorkspaces`)
TESTED_TORCH = "2.13.0"

#: Phase 1 and the kinds of Phase-2 condition: one condition per kind of step (its trainable
#: set and objective decide the memory and the FLOPs; identity_full steps as learned_full,
#: the routing-off arm as consolidator_only)
KINDS = {"phase1": None, "full": "learned_full", "consolidator_only": "consolidator_only",
         "memory_consolidator": "memory_consolidator", "dual": "learned_full_dual"}
#: the two arms the two-trials-in-a-row process runs (different arms: a reused actor's case)
TWO_TRIALS = ("consolidator_only", "consolidator_only_routing_off")
#: the pieces of a check, one process each, each meant to fit a 10-minute command: a trial
#: per kind, then the two trials in a row (`--kinds` picks some; see `next_piece`)
PIECES = (*KINDS, "two_trials")

#: Tolerances: (low, high) bounds of measured / predicted, or an absolute bound; see
#: docs/gpu-check.md for why each is what it is.
TOLERANCES = {
    # the trial's peak on the card (reserved + CUDA context) against the memory model's
    # peak: planning packs trials at the predicted peak, so any excess is a failure. No
    # lower bound: the prediction is an eager CPU count with an assumed 1 GiB context, the
    # measurement a compiled GPU step; below it the ratio is information (issue 46)
    "peak_card": (0.0, 1.0),
    # Phase 1 is not modelled: it must fit what learned_full is planned to take
    "phase1_peak": (0.0, 1.0),
    # the measured CUDA context against CUDA_CONTEXT_BYTES (an assumed upper bound)
    "context": (0.0, 1.0),
    # counts that must be zero in the measured (second) epoch
    "graph_breaks": 0, "recompiles_epoch2": 0, "host_syncs": 0, "cudagraph_skips": 0,
    # graphs the dropout check compiles of its own: it replays the training graph
    "dropout_graphs_added": 0,
    # what stays reserved after a trial (released, cuBLAS workspaces cleared), before the
    # next starts in the same process: small live blocks only
    "reserved_between": 64 * 2**20,
}

#: The docs' assumed utilisation of the card's dense bf16 peak (docs/results.md, "What the
#: paper preset should cost on a GPU": 40% on an RTX 4090, 30% on an H100). Step time is
#: information, not a gate (issue 46): the table gives the measured milliseconds and the
#: utilisation they imply, next to this assumption
DOCS_UTILISATION = 0.35
#: dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of cards the docs' estimate can be
#: made for; matched by substring of `torch.cuda.get_device_name`
CARD_BF16_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0,
                    "H100 PCIe": 756.0, "H100": 756.0, "A100": 312.0, "L40S": 362.0,
                    "RTX 4090": 82.6, "RTX 3090": 71.0, "A10": 125.0, "L4": 121.0}

NA_CPU = "n/a (cpu)"


# -----------------------------------------------------------------------------------------
# The table
# -----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: what, for which trial, predicted, measured, tolerance, verdict
    (True pass, False fail, None: information or not measurable here)."""

    item: str
    trial: str = ""
    predicted: str = "-"
    measured: str = "-"
    tolerance: str = "-"
    ok: bool | None = None
    #: a row that reports no measurement: "timed out" (the piece ran out of time),
    #: "unfinished" (pieces remain) or "error" (the check itself failed); None for every
    #: measured row
    error: str | None = None

    @property
    def verdict(self) -> str:
        if self.error == "timed out":
            return "TIMED OUT"
        if self.error == "unfinished":
            return "TO RUN"
        return {True: "ok", False: "FAIL", None: ""}[self.ok]


def ratio_row(item: str, trial: str, predicted: float | None, measured: float | None,
              bounds: tuple[float, float], fmt=lambda x: f"{x:.3g}") -> Row:
    """measured / predicted within `bounds` (either missing: information only)."""
    tol = f"{bounds[0]:g}x..{bounds[1]:g}x"
    if predicted is None or measured is None:
        return Row(item, trial, "-" if predicted is None else fmt(predicted),
                   NA_CPU if measured is None else fmt(measured), tol)
    r = measured / predicted if predicted else math.inf
    return Row(item, trial, fmt(predicted), f"{fmt(measured)} ({r:.2f}x)", tol,
               bounds[0] <= r <= bounds[1])


def count_row(item: str, trial: str, measured: int | None, limit: int) -> Row:
    """A count that must stay at or below `limit` (None: not measurable here)."""
    if measured is None:
        return Row(item, trial, f"<= {limit}", NA_CPU, f"<= {limit}")
    return Row(item, trial, f"<= {limit}", str(measured), f"<= {limit}", measured <= limit)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def render(rows: list[Row]) -> str:
    head = ("item", "trial", "predicted", "measured", "tolerance", "verdict")
    cells = [head] + [(r.item, r.trial, r.predicted, r.measured, r.tolerance, r.verdict)
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c[i].ljust(widths[i]) for i in range(len(head))) + " |"
             for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    """4 if the check itself failed somewhere, else 3 if it is not finished (a piece timed
    out, or pieces remain), else 1 if a gate failed, else 0."""
    if any(r.error == "error" for r in rows):
        return EXIT_ERROR
    if any(r.error in ("timed out", "unfinished") for r in rows):
        return EXIT_TIMED_OUT
    return EXIT_FAILED if any(r.ok is False for r in rows) else EXIT_OK


# -----------------------------------------------------------------------------------------
# The environment
# -----------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import lightning
    import torch

    from pmnet.model import FLASH_IS_OP, FLASH_MIN_CAPABILITY, flash_status

    env = {"torch": torch.__version__, "lightning": lightning.__version__,
           "cuda": torch.version.cuda or "none (CPU build)", "flash_attn": flash_status(),
           "flash_attn_custom_op": FLASH_IS_OP, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(card=props.name, card_bytes=int(props.total_memory),
                   capability=f"{props.major}.{props.minor}",
                   flash_capable=(props.major, props.minor) >= FLASH_MIN_CAPABILITY,
                   bf16=bool(torch.cuda.is_bf16_supported()), driver=_driver_version())
    else:
        env.update(card=NA_CPU, capability=NA_CPU, bf16=NA_CPU, driver=NA_CPU)
    return env


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def torch_tested(version: str) -> tuple[bool, str]:
    """Whether `version` (torch.__version__) is the tested torch, and what the table says."""
    v = version.split("+")[0]
    if v == TESTED_TORCH:
        return True, f"{version} (tested)"
    return False, (f"{version}: UNTESTED (tested: {TESTED_TORCH}; the code uses private torch "
                   "APIs, which change between versions)")


def environment_rows(env: dict) -> list[Row]:
    rows = [Row(f"env: {k}", measured=str(env[k])) for k in
            ("torch", "lightning", "cuda", "driver", "card", "capability", "bf16",
             "flash_attn")]
    rows.append(Row("env: torch is the tested one", predicted=TESTED_TORCH,
                    measured=torch_tested(env["torch"])[1], tolerance="information"))
    if env.get("device") == "cuda":
        rows.append(Row("env: flash-attn usable", predicted="custom op on sm80+",
                        measured=f"custom op: {env['flash_attn_custom_op']}, "
                                 f"sm80+: {env['flash_capable']}"))
        rows.append(Row("env: bf16 supported", predicted="True", measured=str(env["bf16"]),
                        ok=bool(env["bf16"])))
    return rows


# -----------------------------------------------------------------------------------------
# One trial (run in a fresh process: `--trial KIND`)
# -----------------------------------------------------------------------------------------


def trial_config(preset: str, overrides: dict, batch: int | None, steps: int):
    """The preset with the paper preset's compiled steps, `steps` training batches per
    epoch and one evaluation batch per stream."""
    from pmnet.train import COMPILE_STEPS, TrainConfig

    cfg = TrainConfig.from_name(preset, **overrides)
    b = batch or cfg.batch_size
    if "compile" not in overrides:
        cfg = dataclasses.replace(cfg, compile=COMPILE_STEPS)
    return dataclasses.replace(
        cfg, batch_size=b, episodes_per_epoch=b * steps, phase1_episodes_per_epoch=b * steps,
        val_episodes=cfg.eval_batch_size, test_episodes=cfg.eval_batch_size, max_epochs=2,
        phase1_max_epochs=2)


class Probe:
    """Lightning callback measuring each training step (CUDA events on a GPU, the host
    clock on a CPU) and, in the second epoch, host syncs."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.times: list[list[float]] = [[], []]
        self.syncs = 0
        self._start = None
        self._warn = None

    def callback(self):
        from lightning.pytorch.callbacks import Callback

        probe = self

        class _Probe(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                probe.start(trainer.current_epoch)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                probe.end(trainer.current_epoch)

        return _Probe()

    def start(self, epoch: int) -> None:
        torch = self.torch
        if self.cuda:
            self._start = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self._start[0].record()
            if epoch >= 1:
                self._warn = warnings.catch_warnings(record=True)
                self._caught = self._warn.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
        else:
            self._start = time.perf_counter()

    def end(self, epoch: int) -> None:
        torch = self.torch
        if self.cuda:
            self._start[1].record()
            if self._warn is not None:
                torch.cuda.set_sync_debug_mode("default")
                self.syncs += sum("synchroniz" in str(w.message) for w in self._caught)
                self._warn.__exit__(None, None, None)
                self._warn = None
            torch.cuda.synchronize()
            ms = self._start[0].elapsed_time(self._start[1])
        else:
            ms = (time.perf_counter() - self._start) * 1e3
        self.times[min(epoch, 1)].append(ms)


def _count_graphs():
    """Count CUDA-graph captures (torch.cuda.CUDAGraph.capture_begin)."""
    import torch

    box = {"captured": 0}
    original = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self, *args, **kwargs):
        box["captured"] += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = capture_begin
    return box


def _cache_entries(fns) -> dict[str, int]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {f.__qualname__: len(_debug_get_cache_entry_list(f.__code__)) for f in fns}


def _attention_kernels(fn) -> list[str]:
    """The attention ops one eager call of `fn` dispatches (profiler event names)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    keys = ("flash_attn", "scaled_dot_product", "efficient_attention", "cudnn_attention")
    return sorted(n for n in names if any(k in n for k in keys) and "backward" not in n)


def run_trial(kind: str, preset: str = "paper", overrides: dict | None = None,
              batch: int | None = None, steps: int = 20, seed: int = 0,
              condition: str | None = None, share: float | None = None) -> dict:
    """One short real trial of `kind` in this process (on the GPU when there is one):
    train, validate, train, validate, test, its allocator capped at `share` of the card as
    a pipeline trial's is (`GpuMemoryCap`); returns what it measured."""
    import lightning as L
    import torch
    from torch._dynamo.utils import counters

    from pmnet import task
    from pmnet.conditions import get_condition
    from pmnet.gpu.cap import GpuMemoryCap
    from pmnet.model import PMNet
    from pmnet.train import Phase1Module, Phase2Module
    from pmnet.train.data import EpisodeData
    from pmnet.train.phases import _setup_threads, evaluation_inference_mode, init_phase2

    cfg = trial_config(preset, dict(overrides or {}), batch, steps)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = cfg.resolved_precision("gpu" if cuda else "cpu")
    _setup_threads(cfg)  # as every trial: a fresh compile state
    counters.clear()
    graphs = _count_graphs() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)
    model = PMNet(cfg.model)
    condition = condition or KINDS[kind]
    if condition is None:  # Phase 1: the Consolidator frozen
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith("consolidator."))
        module = Phase1Module(cfg, model, cfg.phase1_lr)
        data = EpisodeData(cfg, seed, cfg.phase1_episodes_per_epoch)
        step_fns = [Phase1Module.stm_loss, Phase1Module._outcomes]
    else:
        cond = get_condition(condition)
        init_phase2(model, cfg, cond, seed)
        module = Phase2Module(cfg, model, cond)
        data = EpisodeData(cfg, seed, cfg.episodes_per_epoch, segments=cfg.segments)
        step_fns = [Phase2Module.objective, Phase2Module._outcomes]
    probe = Probe(device)
    cap = GpuMemoryCap(share)  # as run_phase1 / run_phase2 cap a pipeline trial
    trainer = L.Trainer(
        max_epochs=2, accelerator="gpu" if cuda else "cpu", devices=1, precision=precision,
        gradient_clip_val=cfg.grad_clip, callbacks=[cap, probe.callback()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1,
        inference_mode=evaluation_inference_mode(cfg), log_every_n_steps=10)
    t0 = time.time()
    entries_at: list[dict[str, int]] = []  # after each epoch's training and validation

    class _Epochs(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            entries_at.append(_cache_entries(step_fns))

    trainer.callbacks.append(_Epochs())
    trainer.fit(module, datamodule=data)
    trainer.test(module, datamodule=data, verbose=False)
    wall = time.time() - t0
    entries = _cache_entries(step_fns)
    entries_epoch1, entries_epoch2 = (entries_at + [{}, {}])[:2]
    out = {"kind": kind, "condition": condition, "preset": cfg.preset, "batch": cfg.batch_size,
           "precision": precision, "device": str(device), "wall_s": wall,
           "compile": list(cfg.compile),
           "step_ms_epoch1": probe.times[0], "step_ms": probe.times[1],
           "median_step_ms": statistics.median(probe.times[1]) if probe.times[1] else None,
           "graph_breaks": int(sum(counters["graph_break"].values())),
           "recompile_limit_hits": int(sum(v for k, v in counters["unimplemented"].items()
                                           if "recompile limit" in k.lower())),
           "cache_entries": entries,
           # graphs compiled in the second epoch (training and validation): the first
           # compiled every shape and mode of them, so any here is a recompile
           "recompiles_epoch2": int(sum(entries_epoch2.values())
                                    - sum(entries_epoch1.values())),
           "host_syncs": probe.syncs if cuda else None,
           "graphs_captured": graphs["captured"] if cuda else None,
           "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]) if cuda else None,
           "share": share, "gpu_memory": cap.record,
           # whether the steps should run as CUDA graphs (compiled, `cuda_graphs`, a card)
           "cuda_graphs": bool(cuda and cfg.cuda_graphs and cfg.compile)}
    module.to(device).train()
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    autocast = lambda: torch.autocast(device.type, dtype=half or torch.bfloat16,  # noqa: E731
                                      enabled=half is not None)
    # dropout: the compiled training step, at the trial's batch, in the trial's grad and
    # autocast modes (the graph training recorded and replays: no graph of its own), called
    # three times on one batch; the second and third calls, two replays, must differ
    out["dropout"] = cfg.model.attn_dropout
    before = _cache_entries(step_fns)
    losses = [float(x) for x in _replays(module, condition, cfg, device, seed, autocast)]
    out["dropout_losses"] = losses
    out["dropout_masks_differ"] = (losses[1] != losses[2]) if cfg.model.attn_dropout > 0 \
        else None
    out["dropout_graphs_added"] = int(sum(_cache_entries(step_fns).values())
                                      - sum(before.values()))
    # one eager step at batch 4: which attention kernel the dispatcher picks, the FLOPs
    if condition is None:
        batch0 = task.train_episodes(seed, 0, 4).to(device)
        k = task.N_DEMOS
        args = (batch0.seg_tokens[:, 0, : task.DEMO_LEN * k].clone(), batch0.query_tokens[:, 0],
                batch0.target[:, 0])
        eager = lambda: module.stm_loss(*args)[0]  # noqa: E731
    else:
        batch0 = task.train_episodes(seed, 0, 4, segments=cfg.segments).to(device)
        eager = lambda: module.objective(batch0)["loss"]  # noqa: E731
    with autocast():
        out["attention_kernels"] = _attention_kernels(eager)
    from torch.utils.flop_counter import FlopCounterMode

    with autocast(), FlopCounterMode(display=False) as fc:
        eager().backward()
    module.model.zero_grad(set_to_none=True)
    out["flops_per_episode"] = fc.get_total_flops() / 4
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out.update(peak_allocated=int(torch.cuda.max_memory_allocated(device)),
                   peak_reserved=int(torch.cuda.max_memory_reserved(device)),
                   reserved_now=int(torch.cuda.memory_reserved(device)),
                   card_used=int(total - free), card_bytes=int(total),
                   context=int(total - free - torch.cuda.memory_reserved(device)))
        out["process_share"] = (out["peak_reserved"] + out["context"]) / total
    return out


def _replays(module, condition, cfg, device, seed: int, autocast, n: int = 3):
    """`n` calls of the trial's compiled training step (as `training_step` calls it: grad
    on, the trial's autocast, a batch of the trial's size) on one batch: the losses. After
    the trial's two epochs every call replays the graph training recorded."""
    import torch

    from pmnet import task

    b = cfg.batch_size
    if condition is None:
        ep = task.train_episodes(seed, 0, b).to(device)
        k = task.N_DEMOS
        args = (ep.seg_tokens[:, 0, : task.DEMO_LEN * k].clone(), ep.query_tokens[:, 0],
                ep.target[:, 0])
        step = module.step_fn(module.stm_loss, train=True)
        if module.phase in cfg.compile:
            torch._dynamo.maybe_mark_dynamic(args[0], 1)
        call = lambda: step(*args)[0]  # noqa: E731
    else:
        ep = task.train_episodes(seed, 0, b, segments=cfg.segments).to(device)
        step = module.step_fn(module.objective, train=True)
        call = lambda: step(ep)["loss"]  # noqa: E731
    losses = []
    for _ in range(n):
        with autocast():
            losses.append(call().detach().float().clone())
    return losses


def run_two_trials(preset: str, overrides: dict, batch: int | None, steps: int) -> dict:
    """Two trials of different arms in a row in this process, each in a fresh thread (as
    a reused Ray actor runs them), with the pipeline's release between them
    (`pipelines.trial.release_device_memory` = `release_compiled_steps`)."""
    import torch

    from pmnet.train.compiled_steps import release_compiled_steps

    results: list[dict] = []
    between: list[int | None] = []
    for condition in TWO_TRIALS:
        box: dict = {}

        def body(condition=condition, box=box):
            try:
                box["r"] = run_trial("consolidator_only", preset, overrides, batch, steps,
                                     condition=condition)
            except BaseException as e:  # noqa: BLE001 - reported in the table
                box["error"] = f"{type(e).__name__}: {e}"
            finally:
                release_compiled_steps()

        t = threading.Thread(target=body)
        t.start()
        t.join()
        if "error" in box:
            return {"error": box["error"], "trials": results}
        results.append(box["r"])
        between.append(int(torch.cuda.memory_reserved()) if torch.cuda.is_available()
                       else None)
    return {"trials": results, "reserved_after": between}


# -----------------------------------------------------------------------------------------
# The parent: trials in fresh processes, predictions, the table
# -----------------------------------------------------------------------------------------


def _subprocess(args: list[str], env: dict, timeout: float) -> dict:
    """Run `python -m pmnet.gpu.check ARGS` (a trial) in a fresh process of its own session;
    past `timeout` the whole session (inductor's compile workers too) is killed and the
    result says so (`timed_out`: what inductor compiled by then stays in the cache)."""
    import signal

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "pmnet.gpu.check", *args, "--json", str(path)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.communicate()
            return {"error": f"timed out after {timeout:.0f} s", "timed_out": True}
        if proc.returncode != 0 or not path.is_file():
            tail = (stderr or stdout).strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: {' / '.join(tail)}"}
        return json.loads(path.read_text())


def predictions(preset: str, overrides: dict, batch: int | None, env: dict) -> dict:
    """What the docs and the memory model predict for each kind (peaks include the CUDA
    context; `share`: each kind's planned GPU share, the cap its trial runs under (Phase 1:
    learned_full's); `consolidator_only_per_card`: the planned Consolidator-only trials per
    card)."""
    from pmnet.gpu.footprint import CUDA_CONTEXT_BYTES, StepSpec, gpu_share, trial_memory

    cfg = trial_config(preset, overrides, batch, 1)
    precision = cfg.resolved_precision("gpu")  # what the card trains in
    out = {"context": CUDA_CONTEXT_BYTES, "precision": precision, "peak": {}, "share": {}}
    for kind, condition in KINDS.items():
        if condition is not None:
            m = trial_memory(cfg.model, condition, batch_size=cfg.batch_size,
                             precision=precision, spec=StepSpec.from_config(cfg))
            out["peak"][kind] = m.peak
    card = env.get("card_bytes")
    if card:
        for kind in KINDS:
            share = gpu_share(out["peak"]["full" if kind == "phase1" else kind], card)
            out["share"][kind] = share.fraction if share else None
        share = gpu_share(out["peak"]["consolidator_only"], card)
        out["consolidator_only_per_card"] = share.trials_per_gpu if share else 0
    tflops = next((v for k, v in CARD_BF16_TFLOPS.items() if k in str(env.get("card"))), None)
    out["card_tflops"] = tflops
    return out


def _error_row(item: str, trial: str, r: dict) -> Row:
    return Row(item, trial, measured=r["error"], ok=False,
               error="timed out" if r.get("timed_out") else "error")


def table_rows(env: dict, pred: dict, trials: dict[str, dict], two: dict) -> list[Row]:
    """The table from the environment, the predictions and what the trials measured (the
    pure part: `tests/test_gpu_check.py` feeds it synthetic measurements)."""
    from pmnet.gpu.footprint import usable_bytes

    rows = environment_rows(env)
    cuda = env.get("device") == "cuda"
    tflops = pred.get("card_tflops")
    for kind, r in trials.items():
        if "error" in r:
            rows.append(_error_row("trial", kind, r))
            continue
        predicted = pred["peak"].get(kind)
        if kind == "phase1":
            rows.append(ratio_row("peak on card (reserved + context) vs learned_full's",
                                  kind, pred["peak"].get("full"),
                                  _card_peak(r), TOLERANCES["phase1_peak"], gib))
        else:
            rows.append(ratio_row("peak on card (reserved + context)", kind, predicted,
                                  _card_peak(r), TOLERANCES["peak_card"], gib))
        rows.append(_cap_row(kind, r, cuda))
        rows.append(Row("peak allocated / reserved", kind,
                        gib(predicted - pred["context"]) if predicted else "-",
                        (f"{gib(r['peak_allocated'])} / {gib(r['peak_reserved'])}"
                         if cuda else NA_CPU)))
        rows.append(Row("process's share of the card", kind, measured=(
            f"{r['process_share']:.3f}" if cuda else NA_CPU)))
        rows.append(ratio_row("CUDA context", kind, pred["context"],
                              r.get("context") if cuda else None, TOLERANCES["context"], gib))
        rows.append(_step_time_row(kind, r, cuda, tflops))
        rows.append(Row("GFLOP per episode (fwd + bwd)", kind,
                        measured=f"{r['flops_per_episode'] / 1e9:.3g}"))
        rows.append(_captured_row(kind, r, cuda))
        rows.append(count_row("CUDA graphs skipped", kind, r["cudagraph_skips"],
                              TOLERANCES["cudagraph_skips"]))
        rows.append(count_row("graph breaks", kind, r["graph_breaks"],
                              TOLERANCES["graph_breaks"]))
        rows.append(count_row("recompiles in epoch 2", kind, r["recompiles_epoch2"],
                              TOLERANCES["recompiles_epoch2"]))
        rows.append(count_row("recompile-limit hits", kind, r["recompile_limit_hits"], 0))
        rows.append(count_row("host syncs per epoch-2 step", kind,
                              None if r["host_syncs"] is None
                              else math.ceil(r["host_syncs"] / max(1, len(r["step_ms"]))),
                              TOLERANCES["host_syncs"]))
        rows.append(Row("attention kernel", kind, "flash-attn" if env.get("flash_attn_custom_op")
                        and env.get("flash_capable") else "SDPA",
                        ", ".join(r["attention_kernels"]) or "none seen"))
        if r["dropout_masks_differ"] is None:
            rows.append(Row("dropout masks new on each replay", kind, "True",
                            f"n/a (dropout {r['dropout']})"))
        else:
            rows.append(Row("dropout masks new on each replay", kind, "True",
                            f"{r['dropout_masks_differ']} (replays 2 and 3)",
                            "must hold", r["dropout_masks_differ"]))
        rows.append(count_row("graphs the dropout check compiled", kind,
                              r.get("dropout_graphs_added"),
                              TOLERANCES["dropout_graphs_added"]))
    if two:
        if "error" in two:
            rows.append(_error_row("two trials in a row", "+".join(TWO_TRIALS), two))
        else:
            first, second = two["trials"]
            rows.append(count_row("reserved after trial 1 (MiB)", "two in a row",
                                  None if two["reserved_after"][0] is None
                                  else two["reserved_after"][0] // 2**20,
                                  TOLERANCES["reserved_between"] // 2**20))
            rows.append(count_row("trial 2: recompile-limit hits", "two in a row",
                                  second["recompile_limit_hits"], 0))
            rows.append(count_row("trial 2: graph breaks", "two in a row",
                                  second["graph_breaks"], 0))
            if cuda:
                rows.append(ratio_row("trial 2: peak on card vs trial 1's", "two in a row",
                                      _card_peak(first), _card_peak(second), (0.0, 1.05), gib))
    if cuda and "consolidator_only" in trials and "error" not in trials["consolidator_only"]:
        n = pred.get("consolidator_only_per_card", 0)
        footprint = _card_peak(trials["consolidator_only"])
        usable = usable_bytes(env["card_bytes"])
        rows.append(Row("Consolidator-only trials at once on the card", "consolidator_only",
                        f"{n} (planned)", f"{n} x {gib(footprint)} = {gib(n * footprint)} "
                        f"of {gib(usable)} usable", "n x measured <= usable",
                        n * footprint <= usable))
    return rows


def _captured_row(kind: str, r: dict, cuda: bool) -> Row:
    """CUDA graphs captured: a gate where the steps should run as CUDA graphs (at least one
    graph captured), information elsewhere."""
    item = "CUDA graphs captured"
    if not cuda:
        return Row(item, kind, measured=NA_CPU)
    if not r.get("cuda_graphs", True):
        return Row(item, kind, "- (steps not compiled to CUDA graphs)",
                   str(r["graphs_captured"]), "information")
    return Row(item, kind, ">= 1", str(r["graphs_captured"]), ">= 1",
               r["graphs_captured"] >= 1)


def _cap_row(kind: str, r: dict, cuda: bool) -> Row:
    """The trial ran under `GpuMemoryCap` at its planned share: its reserved peak within the
    cap (on a card: a trial without a cap fails, the cap was not exercised)."""
    item = "memory within its cap (GpuMemoryCap)"
    if not cuda:
        return Row(item, kind, "peak reserved <= cap", NA_CPU, "must hold")
    rec = r.get("gpu_memory")
    if not rec:
        return Row(item, kind, "peak reserved <= cap", "no cap set (no planned share)",
                   "must hold", False)
    return Row(item, kind, f"cap {gib(rec['cap_bytes'])} (share {rec['share']:.4f})",
               f"peak reserved {gib(rec['peak_reserved'])}", "must hold",
               bool(rec["within_cap"]))


def _step_time_row(kind: str, r: dict, cuda: bool, tflops: float | None) -> Row:
    """The median step: information, not a gate. On a card in CARD_BF16_TFLOPS, the
    utilisation of its dense bf16 peak that the measured time implies, next to the docs'
    assumed DOCS_UTILISATION."""
    ms = r.get("median_step_ms")
    if not ms:
        return Row("median step (ms)", kind, measured="-", tolerance="information")
    if not cuda:
        return Row("median step (ms), host clock", kind, measured=f"{ms:.2f}",
                   tolerance="information")
    if not tflops:
        return Row("median step (ms); implied utilisation", kind,
                   "n/a (card not in CARD_BF16_TFLOPS)", f"{ms:.2f}", "information")
    achieved = r["flops_per_episode"] * r["batch"] / (ms / 1e3) / (tflops * 1e12)
    docs_ms = r["flops_per_episode"] * r["batch"] / (tflops * 1e12 * DOCS_UTILISATION) * 1e3
    return Row("median step (ms); implied utilisation", kind,
               f"{docs_ms:.2f} at {DOCS_UTILISATION:.0%} (docs)",
               f"{ms:.2f}; {achieved:.1%} of {tflops:g} TFLOP/s", "information")


def _card_peak(r: dict) -> int | None:
    if r.get("peak_reserved") is None:
        return None
    return r["peak_reserved"] + r["context"]


# -----------------------------------------------------------------------------------------
# Pieces: each a process of its own, its result stored; the table merges what is stored
# -----------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where the compile cache and the pieces' results persist between commands:
    $PMNET_GPU_CHECK_CACHE, else ~/.cache/pmnet-gpu-check."""
    env = os.environ.get("PMNET_GPU_CHECK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pmnet-gpu-check"


def run_key(preset: str, overrides: dict, batch: int | None, steps: int,
            self_test: bool) -> str:
    """The stored results a run may reuse: same preset, batch, steps, overrides, torch and
    pmnet sources (a code change measures afresh)."""
    import hashlib

    import torch

    h = hashlib.sha256(json.dumps([preset, overrides, batch, steps, self_test,
                                   torch.__version__], sort_keys=True, default=str).encode())
    for f in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(f.read_bytes())
    return f"{preset}-{'cpu' if self_test else 'gpu'}-{h.hexdigest()[:12]}"


def stored_results(results_dir: Path) -> dict[str, dict]:
    out = {}
    for piece in PIECES:
        f = results_dir / f"{piece}.json"
        if f.is_file():
            out[piece] = json.loads(f.read_text())
    return out


def next_piece(stored: dict[str, dict]) -> str | None:
    """The first piece (in PIECES' order) not measured yet or whose last run failed."""
    return next((p for p in PIECES if p not in stored or "error" in stored[p]), None)


def next_row(stored: dict[str, dict], command: str) -> Row:
    piece = next_piece(stored)
    done = sum(1 for p in PIECES if p in stored and "error" not in stored[p])
    if piece is None:
        return Row("next piece", measured=f"none: all {len(PIECES)} pieces measured",
                   tolerance="information")
    again = " (again: its compiled graphs are cached)" if piece in stored else ""
    return Row("next piece", f"{done} of {len(PIECES)} measured",
               measured=f"{command} --kinds {piece}{again}", tolerance="all pieces",
               error="unfinished")


def run_check(preset: str, overrides: dict, batch: int | None, steps: int,
              pieces: list[str], timeout: float, self_test: bool, cache_dir: Path,
              budget: float | None = None, command: str = "python -m pmnet.gpu.check"
              ) -> list[Row]:
    """Run `pieces` (each in a fresh process, within `timeout` and what is left of
    `budget`), store each result under `cache_dir`, and make the table of every piece
    stored for this run key (the pieces of earlier commands included)."""
    import torch

    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() and not self_test else "cpu"
    env = environment(device)
    pred = predictions(preset, overrides, batch, env)
    cache_dir = Path(cache_dir).resolve()
    results_dir = cache_dir / "results" / run_key(preset, overrides, batch, steps, self_test)
    results_dir.mkdir(parents=True, exist_ok=True)
    proc_env = dict(os.environ)
    proc_env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as Ray's
    # inductor's caches (its FX graphs, AOTAutograd's, Triton's kernels) on disk, kept
    # between the pieces: a piece that timed out left what it compiled for its rerun
    proc_env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    proc_env.setdefault("TRITON_CACHE_DIR", str(cache_dir / "inductor" / "triton"))
    proc_env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    proc_env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    if self_test:
        proc_env["CUDA_VISIBLE_DEVICES"] = ""
    common = ["--preset", preset, "--steps", str(steps)]
    common += [f"--set={k}={json.dumps(v) if not isinstance(v, str) else v}"
               for k, v in overrides.items()]
    if batch:
        common += ["--batch", str(batch)]
    if self_test:
        common += ["--backend", "eager"]
    for piece in pieces:
        limit = timeout
        if budget is not None:
            left = budget - (time.time() - t0)
            if left < MIN_PIECE_S:
                print(f"  {piece}: not started ({left:.0f} s of the budget left)",
                      file=sys.stderr, flush=True)
                break
            limit = min(timeout, left)
        share = pred["share"].get(piece)
        args = (["--trial", piece, *common] if piece in KINDS else ["--two-trials", *common])
        if share is not None and piece in KINDS:
            args += ["--share", repr(share)]
        t = time.time()
        r = _subprocess(args, proc_env, limit)
        (results_dir / f"{piece}.json").write_text(json.dumps(r))
        print(f"  {piece}: {'error' if 'error' in r else 'done'} ({time.time() - t:.0f} s)",
              file=sys.stderr, flush=True)
    stored = stored_results(results_dir)
    trials = {k: stored[k] for k in KINDS if k in stored}
    rows = table_rows(env, pred, trials, stored.get("two_trials", {}))
    rows.append(next_row(stored, command))
    return rows


#: a piece is started only with at least this much of `--budget` left
MIN_PIECE_S = 60.0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit EXIT_USAGE, not argparse's 2 (= no GPU)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    p = _Parser(prog="python -m pmnet.gpu.check", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="paper (default on a GPU), debug (self-test)")
    p.add_argument("--batch", type=int, default=None, help="batch (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="training steps per epoch")
    p.add_argument("--kinds", default=None,
                   help=f"pieces to run, comma-separated, of {','.join(PIECES)} (default: "
                        "every piece not yet stored for this run)")
    p.add_argument("--no-two-trials", action="store_true",
                   help="leave the two_trials piece out of the default pieces")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--self-test", action="store_true",
                   help="run the table's code paths on the CPU (debug preset, eager backend)")
    p.add_argument("--timeout", type=float, default=480.0,
                   help="seconds per piece's process (exit 3 when one runs out)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for this command: pieces start while at least "
                        f"{MIN_PIECE_S:.0f} s are left, each within what is left")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="compile cache and stored pieces, kept between commands (default: "
                        "$PMNET_GPU_CHECK_CACHE or ~/.cache/pmnet-gpu-check)")
    p.add_argument("--fresh", action="store_true",
                   help="forget the stored pieces of this run (the compile cache stays)")
    p.add_argument("--report", action="store_true",
                   help="run nothing: the table of the stored pieces")
    p.add_argument("--trial", choices=list(KINDS), help=argparse.SUPPRESS)
    p.add_argument("--two-trials", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--share", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        return _main(a)
    except Exception:  # noqa: BLE001 - the check itself failed: its own exit code
        import traceback

        traceback.print_exc()
        print(f"gpu-check: the check itself failed (exit {EXIT_ERROR}; a failed gate exits "
              f"{EXIT_FAILED})", file=sys.stderr)
        return EXIT_ERROR


def _main(a) -> int:
    import torch

    from pmnet.train.config import parse_overrides

    overrides = parse_overrides(a.set)
    if a.trial or a.two_trials:  # a child process
        if a.backend:
            from pmnet.train import compiled_steps

            compiled_steps.COMPILE_BACKEND = a.backend
        preset, steps = a.preset or "paper", a.steps or 20
        out = (run_trial(a.trial, preset, overrides, a.batch, steps, share=a.share)
               if a.trial else run_two_trials(preset, overrides, a.batch, steps))
        Path(a.json).write_text(json.dumps(out))
        return EXIT_OK
    if not a.self_test and not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None
               else "torch sees no CUDA device")
        print(f"gpu-check: no CUDA GPU here ({why}; torch {torch.__version__}). It measures "
              "the GPU path on a GPU; `python -m pmnet.gpu.check --self-test` runs its code "
              "paths on the CPU.", file=sys.stderr)
        return EXIT_NO_GPU
    preset = a.preset or ("debug" if a.self_test else "paper")
    steps = a.steps or (4 if a.self_test else 20)
    if a.self_test:
        overrides.setdefault("model.attn_dropout", 0.1)  # exercise the dropout check
        # the paper preset's Phase 1 (every step at N_DEMOS demonstrations): the debug
        # preset's curriculum draws the number per step, and its short attention window
        # splits the lengths into three graphs, so an epoch of a few steps meets lengths the
        # first did not, a recompile the paper preset cannot have
        overrides.setdefault("phase1_curriculum", False)
    cache_dir = a.cache_dir or default_cache_dir()
    results_dir = cache_dir / "results" / run_key(preset, overrides, a.batch, steps,
                                                  a.self_test)
    if a.fresh and results_dir.is_dir():
        for f in results_dir.glob("*.json"):
            f.unlink()
    if a.kinds is None:  # every piece not yet stored (or whose last run failed)
        stored = stored_results(results_dir)
        pieces = [k for k in PIECES if (k not in stored or "error" in stored[k])
                  and not (a.no_two_trials and k == "two_trials")]
    else:
        pieces = [k for k in a.kinds.split(",") if k]
        unknown = [k for k in pieces if k not in PIECES]
        if unknown:
            print(f"gpu-check: unknown pieces {unknown}; known: {', '.join(PIECES)}",
                  file=sys.stderr)
            return EXIT_USAGE
    if a.report:
        pieces = []
    t0 = time.time()
    print(f"gpu-check: preset {preset}, pieces {','.join(pieces) or 'none'} (each in a fresh "
          f"process; stored under {results_dir})"
          f"{' (self-test on the CPU)' if a.self_test else ''}", file=sys.stderr)
    command = "python -m pmnet.gpu.check" + (" --self-test" if a.self_test else "") + "".join(
        f" {o} {v}" for o, v in (("--preset", a.preset), ("--batch", a.batch),
                                 ("--steps", a.steps), ("--cache-dir", a.cache_dir)) if v)
    command += "".join(f" --set {s}" for s in a.set)
    rows = run_check(preset, overrides, a.batch, steps, pieces, a.timeout, a.self_test,
                     cache_dir, a.budget, command)
    print(render(rows))
    code = exit_code(rows)
    failed = [f"{r.item} ({r.trial}): {r.verdict}" for r in rows if r.ok is False]
    todo = next((r.measured for r in rows if r.error == "unfinished"), None)
    passed = "all checks passed" + (f" so far; next: {todo}" if todo else "")
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else passed} "
          f"(exit {code}; {time.time() - t0:.0f} s; tolerances and exit codes: "
          "docs/gpu-check.md)")
    return code


if __name__ == "__main__":
    sys.exit(main())
