"""The table of `make gpu-check`: its exit codes, tolerances and rows, from the environment,
the predictions and what the trials measured (pure: `tests/test_gpu_check.py` feeds it
synthetic measurements). Docs: docs/gpu-check.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
#: the pieces of a check, one process each, each meant to fit a 10-minute command: first the
#: learning gate (does Phase 0 learn the copy as the preset trains it? issue 62,
#: `pmnet.gpu_check.learning`), a trial per kind, then the two trials in a row (`--kinds`
#: picks some; see `next_piece`)
PIECES = ("learning", *KINDS, "two_trials")

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


def _error_row(item: str, trial: str, r: dict) -> Row:
    return Row(item, trial, measured=r["error"], ok=False,
               error="timed out" if r.get("timed_out") else "error")


def table_rows(env: dict, pred: dict, trials: dict[str, dict], two: dict,
               learning: dict | None = None) -> list[Row]:
    """The table from the environment, the predictions and what the trials measured (the
    pure part: `tests/test_gpu_check.py` feeds it synthetic measurements); the learning
    gate's rows first (`learning_rows`)."""
    from pmnet.gpu.footprint import usable_bytes

    rows = environment_rows(env)
    if learning:
        rows += learning_rows(learning)
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


#: the learning gate's bounds (`pmnet.gpu_check.learning`, whose docstring gives the
#: measurements behind them): a rung's mean per-position held-out copy accuracy at least
#: acc_min (1.5x chance, 1/26: 5.8%; at 2048 x 4 = 8192 predictions chance's standard error
#: is 0.2 pp, and runs that stayed on the plateau read 3.1-4.4%, runs that left it 7.3-10.9%);
#: its loss curve within curve_tol nats of the rung before it (the largest gap between
#: windowed means over the second half of training: two eager fp32 runs that differ in
#: seed, and so in when they leave the plateau, differ by up to 0.08-0.1; a run that stays
#: on the plateau while the other learns, by 0.35-0.45); the batch rung's last window at
#: most batch_slack nats above the rung before it (a larger batch learned no slower)
LEARNING = {"acc_min": 1.5 / 26, "curve_tol": 0.25, "batch_slack": 0.1, "windows": 10}


def loss_curve(losses: list[float], windows: int = LEARNING["windows"]) -> list[float]:
    """A loss curve as the means of `windows` consecutive windows of equal length."""
    n = max(1, len(losses) // windows)
    return [sum(losses[i:i + n]) / len(losses[i:i + n]) for i in range(0, n * windows, n)
            if losses[i:i + n]]


def curve_gap(a: list[float], b: list[float]) -> float:
    """The largest gap (nats) between two windowed loss curves (`loss_curve`) over the
    second half of training (why not the first: `pmnet.gpu_check.learning`)."""
    half = len(a) // 2
    return max((abs(x - y) for x, y in zip(a[half:], b[half:])), default=0.0)


def learning_rows(r: dict) -> list[Row]:
    """The learning gate (issue 62): for each rung of Phase 0's ladder (eager fp32, then
    bf16, compile, CUDA graphs, the preset's batch, each adding one setting), whether it
    learns the copy (held-out per-position accuracy) and whether its loss curve agrees with
    the rung before it. A failed row names the phase and the setting its rung added; the
    rungs after the first failed one are reported, not judged (each carries the failed
    setting too, so only the first names the setting that differs)."""
    item = "phase 0 learns the copy"
    if "error" in r:
        return [_error_row(f"{item} (learning gate)", "learning", r)]
    chance = 1 / 26
    acc_min, tol = LEARNING["acc_min"], LEARNING["curve_tol"]
    rows: list[Row] = []
    previous, failed = None, None
    for rung in r["rungs"]:
        trial = f"phase 0: {rung['setting']}" + (
            "" if rung["setting"] == "reference" else " added")
        mine: list[Row] = []  # this rung's rows
        add = mine.append
        acc = rung["accuracy"]
        mean = sum(acc) / len(acc) if acc else 0.0
        curve = loss_curve(rung["losses"])
        add(Row(f"{item}: held-out accuracy ({rung['label']})", trial,
                f">= {acc_min:.1%} (1.5x chance {chance:.1%})",
                f"{mean:.1%} (per position {', '.join(f'{a:.1%}' for a in acc)}); "
                f"loss {curve[0]:.3f} -> {curve[-1]:.3f}"
                + (f"; {rung['steps']} steps, {rung['wall_s']:.0f} s" if "wall_s" in rung else ""),
                f">= {acc_min:.1%}",
                mean >= acc_min))
        if previous is not None:
            before = loss_curve(previous["losses"])
            if rung["setting"] == "batch":
                slack = LEARNING["batch_slack"]
                add(Row(f"{item}: last loss vs {previous['label']}", trial,
                        f"<= {before[-1]:.3f} + {slack:g}", f"{curve[-1]:.3f}",
                        f"<= +{slack:g} nats", curve[-1] <= before[-1] + slack))
            else:
                gap = curve_gap(curve, before)
                add(Row(f"{item}: loss curve vs {previous['label']}", trial,
                        f"gap <= {tol:g} nats", f"gap {gap:.3f} (last {curve[-1]:.3f} vs "
                        f"{before[-1]:.3f})", f"<= {tol:g} nats", gap <= tol))
        if failed is not None:  # after a failed rung: information
            for row in mine:
                row.ok, row.tolerance = None, f"not judged (after {failed})"
        elif any(row.ok is False for row in mine):
            failed = f"the failed {rung['setting']} rung"
        rows += mine
        previous = rung
    for setting, why in r.get("skipped", {}).items():
        rows.append(Row(f"{item}: {setting}", "phase 0", measured=f"not run ({why})"))
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
