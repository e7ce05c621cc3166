"""What `make gpu-check` measures on the card: the environment, one short real trial of a
kind (`run_trial`, in a fresh process: `--trial KIND`), two trials in a row as a reused
Ray actor runs them (`run_two_trials`), and what the docs and the memory model predict
(`predictions`). Runs `pmnet.train`'s modules and phases, as a pipeline trial does."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import threading
import time
import warnings

from pmnet.gpu_check.table import CARD_BF16_TFLOPS, KINDS, NA_CPU, TWO_TRIALS


def environment(device: str) -> dict:
    import lightning
    import torch

    from pmnet.backbone import FLASH_IS_OP, FLASH_MIN_CAPABILITY, flash_status

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
    (`release_compiled_steps`, as `pipelines.trial.train_trial` ends)."""
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
