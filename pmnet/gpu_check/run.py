"""The pieces of `make gpu-check`, each a fresh process of its own whose result is stored
(`run_check`; a piece past its time is killed, its compiled graphs stay cached), and the
command line (`main`, run by `python -m pmnet.gpu_check`). Docs: docs/gpu-check.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pmnet.gpu_check as _package
from pmnet.gpu_check.learning import run_learning
from pmnet.gpu_check.table import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_NO_GPU,
    EXIT_OK,
    EXIT_USAGE,
    KINDS,
    PIECES,
    Row,
    exit_code,
    render,
    table_rows,
)
from pmnet.gpu_check.trials import environment, predictions, run_trial, run_two_trials


def _subprocess(args: list[str], env: dict, timeout: float) -> dict:
    """Run `python -m pmnet.gpu_check ARGS` (a trial) in a fresh process of its own session;
    past `timeout` the whole session (inductor's compile workers too) is killed and the
    result says so (`timed_out`: what inductor compiled by then stays in the cache)."""
    import signal

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "pmnet.gpu_check", *args, "--json", str(path)]
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


# -----------------------------------------------------------------------------------------
# Pieces: each a process of its own, its result stored; the table merges what is stored
# -----------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where the compile cache and the pieces' results persist between commands:
    $PMNET_GPU_CHECK_CACHE, else ~/.cache/pmnet-gpu-check."""
    env = os.environ.get("PMNET_GPU_CHECK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pmnet-gpu-check"


def run_key(preset: str, overrides: dict, batch: int | None, steps: int,
            self_test: bool, learn_steps: int | None = None) -> str:
    """The stored results a run may reuse: same preset, batch, steps, overrides, torch and
    pmnet sources (a code change measures afresh)."""
    import hashlib

    import torch

    h = hashlib.sha256(json.dumps([preset, overrides, batch, steps, self_test,
                                   torch.__version__, learn_steps], sort_keys=True,
                                  default=str).encode())
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
              budget: float | None = None, command: str = "python -m pmnet.gpu_check",
              learn_steps: int | None = None) -> list[Row]:
    """Run `pieces` (each in a fresh process, within `timeout` and what is left of
    `budget`), store each result under `cache_dir`, and make the table of every piece
    stored for this run key (the pieces of earlier commands included)."""
    import torch

    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() and not self_test else "cpu"
    env = environment(device)
    pred = predictions(preset, overrides, batch, env)
    cache_dir = Path(cache_dir).resolve()
    results_dir = cache_dir / "results" / run_key(preset, overrides, batch, steps, self_test,
                                                  learn_steps)
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
        args = (["--trial", piece, *common] if piece in KINDS else
                ["--learning", *common] if piece == "learning" else ["--two-trials", *common])
        if piece == "learning" and learn_steps:
            args += ["--learn-steps", str(learn_steps)]
        if share is not None and piece in KINDS:
            args += ["--share", repr(share)]
        t = time.time()
        r = _subprocess(args, proc_env, limit)
        (results_dir / f"{piece}.json").write_text(json.dumps(r))
        print(f"  {piece}: {'error' if 'error' in r else 'done'} ({time.time() - t:.0f} s)",
              file=sys.stderr, flush=True)
    stored = stored_results(results_dir)
    trials = {k: stored[k] for k in KINDS if k in stored}
    rows = table_rows(env, pred, trials, stored.get("two_trials", {}), stored.get("learning"))
    rows.append(next_row(stored, command))
    return rows


#: a piece is started only with at least this much of `--budget` left
MIN_PIECE_S = 60.0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit EXIT_USAGE, not argparse's 2 (= no GPU)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    p = _Parser(prog="python -m pmnet.gpu_check", description=_package.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="paper (default on a GPU), debug (self-test)")
    p.add_argument("--batch", type=int, default=None, help="batch (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="training steps per epoch")
    p.add_argument("--kinds", default=None,
                   help=f"pieces to run, comma-separated, of {','.join(PIECES)} (default: "
                        "every piece not yet stored for this run)")
    p.add_argument("--learn-steps", type=int, default=None,
                   help="Phase-0 steps per rung of the learning gate (default: 800 on a GPU, "
                        "600 in the self-test; fewer may not learn the copy: the gate fails)")
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
    p.add_argument("--learning", action="store_true", help=argparse.SUPPRESS)
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
    if a.trial or a.two_trials or a.learning:  # a child process
        if a.backend:
            from pmnet.train import compiled_steps

            compiled_steps.COMPILE_BACKEND = a.backend
        preset, steps = a.preset or "paper", a.steps or 20
        if a.learning:  # the learning gate: its own steps (LEARN_STEPS), not --steps
            out = run_learning(preset, overrides, a.batch, a.learn_steps)
        elif a.trial:
            out = run_trial(a.trial, preset, overrides, a.batch, steps, share=a.share)
        else:
            out = run_two_trials(preset, overrides, a.batch, steps)
        Path(a.json).write_text(json.dumps(out))
        return EXIT_OK
    if not a.self_test and not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None
               else "torch sees no CUDA device")
        print(f"gpu-check: no CUDA GPU here ({why}; torch {torch.__version__}). It measures "
              "the GPU path on a GPU; `python -m pmnet.gpu_check --self-test` runs its code "
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
                                                  a.self_test, a.learn_steps)
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
    command = "python -m pmnet.gpu_check" + (" --self-test" if a.self_test else "") + "".join(
        f" {o} {v}" for o, v in (("--preset", a.preset), ("--batch", a.batch),
                                 ("--steps", a.steps), ("--learn-steps", a.learn_steps),
                                 ("--cache-dir", a.cache_dir)) if v)
    command += "".join(f" --set {s}" for s in a.set)
    rows = run_check(preset, overrides, a.batch, steps, pieces, a.timeout, a.self_test,
                     cache_dir, a.budget, command, a.learn_steps)
    print(render(rows))
    code = exit_code(rows)
    failed = [f"{r.item} ({r.trial}): {r.verdict}" for r in rows if r.ok is False]
    todo = next((r.measured for r in rows if r.error == "unfinished"), None)
    passed = "all checks passed" + (f" so far; next: {todo}" if todo else "")
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else passed} "
          f"(exit {code}; {time.time() - t0:.0f} s; tolerances and exit codes: "
          "docs/gpu-check.md)")
    return code
