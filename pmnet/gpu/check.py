"""`make gpu-check` (issue 36): what the GPU path predicts, measured on the card, in one table.

    python -m pmnet.gpu.check               # on a CUDA GPU: the table; exit 1 if a check fails
    python -m pmnet.gpu.check --self-test   # the same code paths on the CPU (debug preset)

Needs torch, Lightning and this project only (no Ray, no MLflow, no network). Without a
CUDA GPU (and without `--self-test`) it says so and exits 2.

What runs: for Phase 1 and each kind of Phase-2 condition of the preset (`KINDS`: the
paper's six conditions are four kinds of step and memory), a short real trial in a fresh
process (`--trial KIND`): train, validate, train, validate, test, with the preset's
compiled steps (CUDA graphs on a GPU), at the preset's batch. Each trial measures its peak
memory (allocated, reserved, the process's share of the card), the median step time from
CUDA events, CUDA graphs captured and skipped, graph breaks, recompiles, host syncs
(`torch.cuda.set_sync_debug_mode`), the attention kernel, and whether dropout draws new
masks on each replay of the compiled step. One more process runs two trials in a row in
fresh threads, as a reused Ray actor does, and measures what stays reserved between them.
The parent compares each measurement with its prediction (`pmnet.gpu.footprint`, the
docs' step-time estimate, the planned number of Consolidator-only trials per card) within
the tolerances of `TOLERANCES` (docs/gpu-check.md) and prints one table.
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

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2

#: Phase 1 and the kinds of Phase-2 condition: one condition per kind of step (its trainable
#: set and objective decide the memory and the FLOPs; identity_full steps as learned_full,
#: the routing-off arm as consolidator_only)
KINDS = {"phase1": None, "full": "learned_full", "consolidator_only": "consolidator_only",
         "memory_consolidator": "memory_consolidator", "dual": "learned_full_dual"}
#: the two arms the two-trials-in-a-row process runs (different arms: a reused actor's case)
TWO_TRIALS = ("consolidator_only", "consolidator_only_routing_off")

#: Tolerances: (low, high) bounds of measured / predicted, or an absolute bound; see
#: docs/gpu-check.md for why each is what it is.
TOLERANCES = {
    # the trial's peak on the card (reserved + CUDA context) against the memory model's
    # peak: planning packs trials at the predicted peak, so any excess is a failure; more
    # than 2x below wastes the card
    "peak_card": (0.5, 1.0),
    # Phase 1 is not modelled: it must fit what learned_full is planned to take
    "phase1_peak": (0.0, 1.0),
    # the measured CUDA context against CUDA_CONTEXT_BYTES (an assumed upper bound)
    "context": (0.0, 1.0),
    # median step time against the docs' estimate (the card's dense bf16 peak at
    # DOCS_UTILISATION): within a factor of 2 either way
    "step_time": (0.5, 2.0),
    # counts that must be zero in the measured (second) epoch
    "graph_breaks": 0, "recompiles_epoch2": 0, "host_syncs": 0, "cudagraph_skips": 0,
    # what stays reserved after a trial, before the next starts in the same process
    "reserved_between": 64 * 2**20,
}

#: The docs' assumed utilisation of the card's dense bf16 peak (docs/results.md, "What the
#: paper preset should cost on a GPU": 40% on an RTX 4090, 30% on an H100)
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

    @property
    def verdict(self) -> str:
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


def environment_rows(env: dict) -> list[Row]:
    rows = [Row(f"env: {k}", measured=str(env[k])) for k in
            ("torch", "lightning", "cuda", "driver", "card", "capability", "bf16",
             "flash_attn")]
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
              condition: str | None = None) -> dict:
    """One short real trial of `kind` in this process (on the GPU when there is one):
    train, validate, train, validate, test; returns what it measured."""
    import lightning as L
    import torch
    from torch._dynamo.utils import counters

    from pmnet import task
    from pmnet.conditions import get_condition
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
    trainer = L.Trainer(
        max_epochs=2, accelerator="gpu" if cuda else "cpu", devices=1, precision=precision,
        gradient_clip_val=cfg.grad_clip, callbacks=[probe.callback()], logger=False,
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
           "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]) if cuda else None}
    # one eager step: which attention kernel the dispatcher picks, and the step's FLOPs
    module.to(device).train()
    if condition is None:
        batch0 = task.train_episodes(seed, 0, 4).to(device)
        k = task.N_DEMOS
        args = (batch0.seg_tokens[:, 0, : task.DEMO_LEN * k].clone(), batch0.query_tokens[:, 0],
                batch0.target[:, 0])
        eager = lambda: module.stm_loss(*args)[0]  # noqa: E731
        compiled = lambda: module.step_fn(module.stm_loss, train=True)(*args)[0]  # noqa: E731
    else:
        batch0 = task.train_episodes(seed, 0, 4, segments=cfg.segments).to(device)
        eager = lambda: module.objective(batch0)["loss"]  # noqa: E731
        compiled = lambda: module.step_fn(module.objective, train=True)(batch0)["loss"]  # noqa: E731
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    autocast = lambda: torch.autocast(device.type, dtype=half or torch.bfloat16,  # noqa: E731
                                      enabled=half is not None)
    with autocast():
        out["attention_kernels"] = _attention_kernels(eager)
    from torch.utils.flop_counter import FlopCounterMode

    with autocast(), FlopCounterMode(display=False) as fc:
        eager().backward()
    module.model.zero_grad(set_to_none=True)
    out["flops_per_episode"] = fc.get_total_flops() / 4
    # dropout: two calls of the compiled step on the same batch draw new masks
    with torch.no_grad(), autocast():
        a, b = float(compiled()), float(compiled())
    out["dropout"] = cfg.model.attn_dropout
    out["dropout_masks_differ"] = (a != b) if cfg.model.attn_dropout > 0 else None
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out.update(peak_allocated=int(torch.cuda.max_memory_allocated(device)),
                   peak_reserved=int(torch.cuda.max_memory_reserved(device)),
                   reserved_now=int(torch.cuda.memory_reserved(device)),
                   card_used=int(total - free), card_bytes=int(total),
                   context=int(total - free - torch.cuda.memory_reserved(device)))
        out["process_share"] = (out["peak_reserved"] + out["context"]) / total
    return out


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
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "pmnet.gpu.check", *args, "--json", str(path)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: {' / '.join(tail)}"}
        return json.loads(path.read_text())


def predictions(preset: str, overrides: dict, batch: int | None, env: dict) -> dict:
    """What the docs and the memory model predict for each kind (peaks include the CUDA
    context; `share`: the planned Consolidator-only trials per card)."""
    from pmnet.gpu.footprint import CUDA_CONTEXT_BYTES, StepSpec, gpu_share, trial_memory

    cfg = trial_config(preset, overrides, batch, 1)
    precision = cfg.resolved_precision("gpu")  # what the card trains in
    out = {"context": CUDA_CONTEXT_BYTES, "precision": precision, "peak": {}}
    for kind, condition in KINDS.items():
        if condition is not None:
            m = trial_memory(cfg.model, condition, batch_size=cfg.batch_size,
                             precision=precision, spec=StepSpec.from_config(cfg))
            out["peak"][kind] = m.peak
    card = env.get("card_bytes")
    if card:
        share = gpu_share(out["peak"]["consolidator_only"], card)
        out["consolidator_only_per_card"] = share.trials_per_gpu if share else 0
    tflops = next((v for k, v in CARD_BF16_TFLOPS.items() if k in str(env.get("card"))), None)
    out["card_tflops"] = tflops
    return out


def table_rows(env: dict, pred: dict, trials: dict[str, dict], two: dict) -> list[Row]:
    """The table from the environment, the predictions and what the trials measured (the
    pure part: `tests/test_gpu_check.py` feeds it synthetic measurements)."""
    from pmnet.gpu.footprint import usable_bytes

    rows = environment_rows(env)
    cuda = env.get("device") == "cuda"
    tflops = pred.get("card_tflops")
    for kind, r in trials.items():
        if "error" in r:
            rows.append(Row("trial", kind, measured=r["error"], ok=False))
            continue
        predicted = pred["peak"].get(kind)
        if kind == "phase1":
            rows.append(ratio_row("peak on card (reserved + context) vs learned_full's",
                                  kind, pred["peak"].get("full"),
                                  _card_peak(r), TOLERANCES["phase1_peak"], gib))
        else:
            rows.append(ratio_row("peak on card (reserved + context)", kind, predicted,
                                  _card_peak(r), TOLERANCES["peak_card"], gib))
        rows.append(Row("peak allocated / reserved", kind,
                        gib(predicted - pred["context"]) if predicted else "-",
                        (f"{gib(r['peak_allocated'])} / {gib(r['peak_reserved'])}"
                         if cuda else NA_CPU)))
        rows.append(Row("process's share of the card", kind, measured=(
            f"{r['process_share']:.3f}" if cuda else NA_CPU)))
        rows.append(ratio_row("CUDA context", kind, pred["context"],
                              r.get("context") if cuda else None, TOLERANCES["context"], gib))
        estimate = (r["flops_per_episode"] * r["batch"] / (tflops * 1e12 * DOCS_UTILISATION)
                    * 1e3 if tflops else None)
        if cuda and estimate is None:
            rows.append(Row("median step (ms) vs docs' estimate", kind,
                            "n/a (card not in CARD_BF16_TFLOPS)",
                            f"{r['median_step_ms']:.2f}"))
        elif cuda:
            rows.append(ratio_row("median step (ms) vs docs' estimate", kind, estimate,
                                  r["median_step_ms"], TOLERANCES["step_time"],
                                  lambda x: f"{x:.2f}"))
        else:
            rows.append(Row("median step (ms), host clock", kind, "-",
                            f"{r['median_step_ms']:.2f}" if r["median_step_ms"] else "-"))
        rows.append(Row("GFLOP per episode (fwd + bwd)", kind,
                        measured=f"{r['flops_per_episode'] / 1e9:.3g}"))
        rows.append(Row("CUDA graphs captured", kind,
                        measured=str(r["graphs_captured"]) if cuda else NA_CPU))
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
                            str(r["dropout_masks_differ"]), ok=r["dropout_masks_differ"]))
    if two:
        if "error" in two:
            rows.append(Row("two trials in a row", "+".join(TWO_TRIALS), measured=two["error"],
                            ok=False))
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


def _card_peak(r: dict) -> int | None:
    if r.get("peak_reserved") is None:
        return None
    return r["peak_reserved"] + r["context"]


def run_check(preset: str, overrides: dict, batch: int | None, steps: int,
              kinds: list[str], two: bool, timeout: float, self_test: bool) -> list[Row]:
    import torch

    device = "cuda" if torch.cuda.is_available() and not self_test else "cpu"
    env = environment(device)
    pred = predictions(preset, overrides, batch, env)
    proc_env = dict(os.environ)
    proc_env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as Ray's
    cache = Path(tempfile.gettempdir()) / "pmnet-gpu-check-compile-cache"
    proc_env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    proc_env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    if self_test:
        proc_env["CUDA_VISIBLE_DEVICES"] = ""
    common = ["--preset", preset, "--steps", str(steps)]
    common += [f"--set={k}={json.dumps(v) if not isinstance(v, str) else v}"
               for k, v in overrides.items()]
    if batch:
        common += ["--batch", str(batch)]
    if self_test:
        common += ["--backend", "eager"]
    trials = {}
    for kind in kinds:
        trials[kind] = _subprocess(["--trial", kind, *common], proc_env, timeout)
        print(f"  {kind}: {'error' if 'error' in trials[kind] else 'done'} "
              f"({trials[kind].get('wall_s', 0):.0f} s)", file=sys.stderr, flush=True)
    two_trials = _subprocess(["--two-trials", *common], proc_env, timeout) if two else {}
    return table_rows(env, pred, trials, two_trials)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pmnet.gpu.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="paper (default on a GPU), debug (self-test)")
    p.add_argument("--batch", type=int, default=None, help="batch (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="training steps per epoch")
    p.add_argument("--kinds", default=",".join(KINDS), help="trials to run (default: all)")
    p.add_argument("--no-two-trials", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--self-test", action="store_true",
                   help="run the table's code paths on the CPU (debug preset, eager backend)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per trial process")
    p.add_argument("--trial", choices=list(KINDS), help=argparse.SUPPRESS)
    p.add_argument("--two-trials", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch

    from pmnet.train.config import parse_overrides

    overrides = parse_overrides(a.set)
    if a.trial or a.two_trials:  # a child process
        if a.backend:
            from pmnet.train import compiled_steps

            compiled_steps.COMPILE_BACKEND = a.backend
        preset, steps = a.preset or "paper", a.steps or 20
        out = (run_trial(a.trial, preset, overrides, a.batch, steps) if a.trial
               else run_two_trials(preset, overrides, a.batch, steps))
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
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"gpu-check: unknown kinds {unknown}; known: {', '.join(KINDS)}",
              file=sys.stderr)
        return EXIT_NO_GPU
    t0 = time.time()
    print(f"gpu-check: preset {preset}, {len(kinds)} trials in fresh processes"
          f"{'' if a.no_two_trials else ' + two in a row'}"
          f"{' (self-test on the CPU)' if a.self_test else ''}", file=sys.stderr)
    rows = run_check(preset, overrides, a.batch, steps, kinds, not a.no_two_trials,
                     a.timeout, a.self_test)
    print(render(rows))
    code = exit_code(rows)
    failed = [f"{r.item} ({r.trial})" for r in rows if r.ok is False]
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'} "
          f"({time.time() - t0:.0f} s; tolerances: docs/gpu-check.md)")
    return code


if __name__ == "__main__":
    sys.exit(main())
