"""The checkpoint study of issue 39, as a resumable work queue (an experiment, not library).

A study is a directory that is committed as it grows (`experiments/results/issue39/study/`):

    checkpoints/p1s<k>/phase1.pt (+ .sha256, phase1_metrics.json)  Phase-1 checkpoint k
    checkpoints/p1s<k>/origin.json      where and how it was trained (CPU, threads, wall, commit)
    checkpoints/p1s<k>/diagnose.json    `pmnet diagnose phase1.pt` (routes, L route change)
    trials/<condition>-p<k>-s<seed>.json          the trial's result.json (test stream)
    trials/<condition>-p<k>-s<seed>-diagnose.json `pmnet diagnose best_model.pt` (seed 42,
                                                  routing-on arms: L removed per block)

Work happens in `runs/issue39/` (not committed): Phase 1 and Phase 2 resume there from their
own `last.ckpt` after a kill. A job whose output is in the study is never run again, so no
checkpoint is trained twice and a new session (another CPU) only adds what is missing: the
study grows by checkpoints (`--seeds`) and by arms (`--arms`), each unit in its own file.

    python experiments/checkpoint_study/study.py run --seeds 0-9 --arms core --jobs 2
    python experiments/checkpoint_study/study.py status

Jobs are scheduled checkpoint by checkpoint (Phase 1, then its diagnostics, then its
trials, before the next checkpoint's Phase 1 takes a free slot), so what is finished when a
session ends is whole checkpoints; `--order seed` runs every checkpoint's seed-42 trials
before any seed-43 one instead (the channel arms:
`run --seeds 0-9 --arms channel --channel-seeds 0-4 --order seed --jobs 2`). Each job is
one single-threaded process (two of them side by side beat one 2-thread process on 2
cores). The analysis is `analyze.py`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "experiments" / "results" / "issue39" / "study"
WORK = ROOT / "runs" / "issue39"
PRESET = "cpu"  # `--preset debug` for a quick check of the machinery (tests)
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").exists() else sys.executable
SEEDS = (42, 43)  # Phase-2 seeds: the `cpu` preset's two
ORDERS = ("checkpoint", "seed")  # how `run` orders the jobs (`jobs_for`)
#: the arms of the study, by name: `core` (both Consolidator-only arms, every checkpoint),
#: `channel` (can a capable operator or a trainable router use the routing channel?) and
#: `strict` (the strict-off twins: no router sees L, directly or through u)
ARMS: dict[str, tuple[str, ...]] = {
    "core": ("consolidator_only", "consolidator_only_routing_off"),
    "channel": ("operator_gru", "operator_gru_routing_off",
                "memory_consolidator", "memory_consolidator_routing_off"),
    "strict": ("consolidator_only_strict_off", "memory_consolidator_strict_off"),
}
#: arms whose seed-42 model is diagnosed (L removed from each block's routing where it
#: routes with L; every model: updated-LTM recall under strict routing off): all of them
DIAGNOSED = tuple(c for arm in ARMS.values() for c in arm)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = Path("/proc/cpuinfo").read_text()
                extra = " AMX" if "amx_tile" in flags else (" AVX-512" if "avx512f" in flags
                                                            else "")
                return name + extra
    except OSError:
        pass
    return platform.processor() or "unknown"


def copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ckpt_dir(k: int) -> Path:
    return STUDY / "checkpoints" / f"p1s{k}"


def trial_name(cond: str, k: int, seed: int) -> str:
    return f"{cond}-p{k}-s{seed}"


def phase1_args(k: int) -> list[str]:
    return ["train", "phase1", "--preset", PRESET, "--out", str(WORK / f"p1s{k}"),
            "--set", f"phase1_seed={k}", "--set", "threads=1"]


@dataclass(frozen=True)
class Job:
    kind: str  # "phase1" | "diagnose" | "trial"
    k: int
    cond: str = ""
    seed: int = 0

    @property
    def name(self) -> str:
        return {"phase1": f"phase1 p1s{self.k}", "diagnose": f"diagnose p1s{self.k}"}.get(
            self.kind, trial_name(self.cond, self.k, self.seed))

    def done(self) -> bool:
        if self.kind == "phase1":
            return (ckpt_dir(self.k) / "origin.json").is_file()
        if self.kind == "diagnose":
            return (ckpt_dir(self.k) / "diagnose.json").is_file()
        out = STUDY / "trials" / f"{trial_name(self.cond, self.k, self.seed)}.json"
        if self.cond in DIAGNOSED and self.seed == SEEDS[0]:
            return out.is_file() and out.with_name(out.stem + "-diagnose.json").is_file()
        return out.is_file()

    def ready(self) -> bool:
        if self.kind == "phase1":
            return True
        return Job("phase1", self.k).done() and (self.kind == "diagnose" or
                                                 Job("diagnose", self.k).done())

    def command(self) -> list[list[str]]:
        """The processes this job runs, in order (each resumable or cheap to redo)."""
        k = self.k
        cli = [PY, "-m", "pmnet.cli"]
        if self.kind == "phase1":
            if (WORK / f"p1s{k}" / "phase1.pt.sha256").is_file():
                return []  # trained, not yet collected
            return [cli + phase1_args(k)]
        ckpt = str(ckpt_dir(k) / "phase1.pt")
        if self.kind == "diagnose":
            return [cli + ["diagnose", ckpt, "--out", str(ckpt_dir(k) / "diagnose.json")]]
        out = WORK / "trials" / trial_name(self.cond, k, self.seed)
        cmds = [cli + ["train", "phase2", "--preset", PRESET, "--condition", self.cond,
                       "--seed", str(self.seed), "--phase1", ckpt, "--out", str(out),
                       "--set", f"phase1_seed={k}", "--set", "threads=1"]]
        if self.cond in DIAGNOSED and self.seed == SEEDS[0]:
            cmds.append(cli + ["diagnose", str(out / "best_model.pt"), "--out",
                               str(out / "diagnose.json")])
        return cmds

    def collect(self, wall_s: float) -> None:
        """Copy the job's outputs into the study (atomically; last the file `done` reads)."""
        k = self.k
        if self.kind == "phase1":
            src = WORK / f"p1s{k}"
            for f in ("phase1.pt", "phase1.pt.sha256", "phase1_metrics.json"):
                copy_atomic(src / f, ckpt_dir(k) / f)
            digest = hashlib.sha256((ckpt_dir(k) / "phase1.pt").read_bytes()).hexdigest()
            write_json(ckpt_dir(k) / "origin.json", {
                "phase1_seed": k, "sha256": digest, "cpu": cpu_name(), "threads": 1,
                "wall_s": round(wall_s, 1), "commit": git_commit(),
                "command": "pmnet " + " ".join(phase1_args(k)),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        elif self.kind == "trial":
            out = WORK / "trials" / trial_name(self.cond, k, self.seed)
            dst = STUDY / "trials" / f"{trial_name(self.cond, k, self.seed)}.json"
            if (out / "diagnose.json").is_file():
                copy_atomic(out / "diagnose.json", dst.with_name(dst.stem + "-diagnose.json"))
            result = json.loads((out / "result.json").read_text())
            result["phase1_seed"] = k  # as the pipeline's trials record it
            result["study"] = {"cpu": cpu_name(), "wall_s": round(wall_s, 1),
                               "commit": git_commit()}
            write_json(dst, result)


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise SystemExit(f"--seeds: distinct non-negative Phase-1 seeds, got {text!r}")
    return out


def jobs_for(seeds: list[int], arms: list[str], arm_seeds: dict[str, list[int]],
             order: str = "checkpoint") -> list[Job]:
    """Every job. `checkpoint` order: checkpoint by checkpoint (Phase 1, diagnostics, then
    each arm's trials), so what an interrupted study holds is whole checkpoints. `seed`
    order: every checkpoint's Phase 1 and diagnostics, then the trials Phase-2 seed by seed
    (every checkpoint's seed-42 trials before any seed-43 one), so an interrupted study has
    one seed on every checkpoint rather than two on some (how the channel arms ran)."""
    if order not in ORDERS:
        raise SystemExit(f"--order: one of {', '.join(ORDERS)}, got {order!r}")

    def trials(k: int, seeds_: tuple[int, ...]) -> list[Job]:
        return [Job("trial", k, c, s) for s in seeds_ for arm in arms
                if k in arm_seeds[arm] for c in ARMS[arm]]
    jobs: list[Job] = []
    if order == "checkpoint":
        for k in seeds:
            jobs += [Job("phase1", k), Job("diagnose", k), *trials(k, SEEDS)]
        return jobs
    for k in seeds:
        jobs += [Job("phase1", k), Job("diagnose", k)]
    for s in SEEDS:
        for k in seeds:
            jobs += trials(k, (s,))
    return jobs


def run(args) -> int:
    seeds = parse_seeds(args.seeds)
    arms = args.arms.split(",")
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"--arms: unknown arm {a!r} (known: {', '.join(ARMS)})")
    arm_seeds = {a: (parse_seeds(args.channel_seeds) if a == "channel" and args.channel_seeds
                     else seeds) for a in arms}
    todo = [j for j in jobs_for(seeds, arms, arm_seeds, args.order) if not j.done()]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(WORK / "compile-cache"),
           "TRITON_CACHE_DIR": str(WORK / "compile-cache" / "triton")}
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    running: dict[Job, tuple[subprocess.Popen, list[list[str]], float, object]] = {}
    print(f"{len(todo)} jobs to run, {args.jobs} at a time ({cpu_name()})", flush=True)
    while todo or running:
        for job, (proc, rest, t0, log) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            if rc != 0:
                log.close()
                del running[job]
                print(f"FAILED {job.name} (exit {rc}; {WORK / 'logs'})", flush=True)
                if args.stop_on_failure:
                    return 1
                continue
            if rest:
                running[job] = (subprocess.Popen(rest[0], cwd=ROOT, env=env, stdout=log,
                                                 stderr=subprocess.STDOUT), rest[1:], t0, log)
                continue
            log.close()
            del running[job]
            job.collect(time.time() - t0)
            print(f"{time.strftime('%H:%M:%S')} done {job.name} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        while len(running) < args.jobs:
            nxt = next((j for j in todo if j.ready()), None)
            if nxt is None:
                break
            todo.remove(nxt)
            cmds = nxt.command()
            if not cmds:
                nxt.collect(0.0)
                print(f"collected {nxt.name}", flush=True)
                continue
            log = open(WORK / "logs" / f"{nxt.name.replace(' ', '-')}.log", "a")
            print(f"{time.strftime('%H:%M:%S')} start {nxt.name}", flush=True)
            running[nxt] = (subprocess.Popen(cmds[0], cwd=ROOT, env=env, stdout=log,
                                             stderr=subprocess.STDOUT), cmds[1:], time.time(),
                            log)
        if not running and todo:
            print(f"{len(todo)} jobs wait on a failed one", flush=True)
            return 1
        time.sleep(5)
    return 0


def status(args) -> int:
    for d in sorted((STUDY / "checkpoints").glob("p1s*"), key=lambda p: int(p.name[3:])):
        trials = sorted(p.stem for p in (STUDY / "trials").glob(f"*-p{d.name[3:]}-s*.json")
                        if not p.stem.endswith("-diagnose"))
        print(f"{d.name}: phase1 {'yes' if (d / 'origin.json').is_file() else 'no'}, "
              f"diagnose {'yes' if (d / 'diagnose.json').is_file() else 'no'}, "
              f"{len(trials)} trials")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", default="0-9", help="Phase-1 seeds: 0-9 or 0,1,5")
    r.add_argument("--arms", default="core", help=f"comma-separated: {', '.join(ARMS)}")
    r.add_argument("--channel-seeds", default="", help="Phase-1 seeds of the channel arms")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--order", default="checkpoint", choices=ORDERS,
                   help="checkpoint: whole checkpoints first; "
                        "seed: one seed on every checkpoint first")
    r.add_argument("--stop-on-failure", action="store_true")
    st = sub.add_parser("status")
    for q in (r, st):
        q.add_argument("--preset", default=PRESET, help="training preset (default cpu)")
        q.add_argument("--study", default=str(STUDY), help="the committed study directory")
        q.add_argument("--work", default=str(WORK), help="where jobs train (not committed)")
    args = p.parse_args(argv)
    configure(args.preset, Path(args.study), Path(args.work))
    return run(args) if args.cmd == "run" else status(args)


def configure(preset: str, study: Path, work: Path) -> None:
    """Point the module at a study (the defaults: the `cpu` preset, issue 39's study)."""
    global PRESET, STUDY, WORK
    PRESET, STUDY, WORK = preset, study.resolve(), work.resolve()


if __name__ == "__main__":
    raise SystemExit(main())
