"""A durable store made without training (issue 53's tests of `pmnet.store_verify` and
`pmnet.store_repair`): the `debug` preset's `phase1_variance` grid, narrowed to one
condition and seed, with each Phase-1 unit a few stand-in bytes under their sha256 and
each trial's result naming it. The units are whole in every way the store's check reads
them, and made with this code's `debug` configuration, so planning reuses them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from pmnet.store_layout import StoreLayout, StoreRecord

GRID = dict(preset="debug", grid="phase1_variance", conditions="consolidator_only", seeds="42")
#: the pipeline's command line for the same grid (the CLI's `start` arguments)
ARGS = ["--preset", "debug", "--grid", "phase1_variance", "--conditions", "consolidator_only",
        "--seeds", "42", "--stage1-cpus", "1", "--gpus-per-trial", "0"]


def grid():
    """(TrainConfig, Space) of GRID."""
    from pipelines.plan import build_space
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug")
    return cfg, build_space(cfg, grid="phase1_variance", conditions="consolidator_only",
                            seeds="42", overrides={})


def make_store(root: Path) -> StoreLayout:
    """Every unit of GRID, whole (module docstring)."""
    from pipelines.plan import Phase1Slot
    from pipelines.records import Provenance, Stage1Record
    from pipelines.store import config_hash, phase1_unit_config, unit_config
    from pmnet.model_files import write_sha256

    cfg, space = grid()
    store = StoreLayout(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "store.json").write_text(json.dumps(StoreRecord().to_dict()))
    shas = {}
    for k in space.phase1_seeds:
        slot = Phase1Slot(k, dataclasses.replace(cfg, phase1_seed=k), root / "unused")
        config, digest = phase1_unit_config(slot)
        ckpt = store.phase1_ckpt(k)
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(f"stand-in checkpoint {k}".encode() * 64)
        sha = hashlib.sha256(ckpt.read_bytes()).hexdigest()
        write_sha256(ckpt, sha)
        (ckpt.parent / "phase1_metrics.json").write_text(json.dumps(
            {"train_config": slot.cfg.to_dict(), "test": {"mean_stm": 50.0}}))
        Provenance(unit=ckpt.parent.name, kind="phase1", config=config, config_hash=digest,
                   phase1_sha256=sha).write(store.phase1_provenance(k))
        Stage1Record(config_hash=digest, sha256=sha, checkpoint=str(ckpt), phase1_seed=k,
                     metrics={"mean_stm": 50.0}).write(store.stage1_json(k))
        shas[k] = sha
    for trial in space.trials:
        tcfg = space.trial_config(cfg, trial)
        config = unit_config(tcfg.flat())
        Provenance(unit=trial.name, kind="trial", config=config, config_hash=config_hash(config),
                   phase1_sha256=shas[trial.phase1_seed]).write(store.provenance(trial))
        store.results_dir.mkdir(exist_ok=True)
        store.result(trial).write_text(json.dumps(
            {**trial.to_result(), "condition": trial.condition, "seed": trial.seed,
             "config": tcfg.flat(), "phase1_sha256": shas[trial.phase1_seed],
             "preset": "debug", "test": {"updated_ltm": 60.0}}, indent=2))
    return store


# -- the damages of issue 53 ------------------------------------------------------------------


def truncate_result(store: StoreLayout, name: str) -> Path:
    path = store.results_dir / f"{name}.json"
    path.write_bytes(path.read_bytes()[:40])
    return path


def change_checkpoint_bytes(store: StoreLayout, seed: int) -> Path:
    """A few bytes of `phase1.pt` changed in place, its `.sha256` and stage1.json kept."""
    path = store.phase1_ckpt(seed)
    data = bytearray(path.read_bytes())
    for i in (100, 101, 102, len(data) // 2):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def orphan_result(store: StoreLayout, name: str) -> Path:
    """The result names a Phase-1 sha256 no checkpoint of the store has."""
    path = store.results_dir / f"{name}.json"
    res = json.loads(path.read_text())
    res["phase1_sha256"] = "f" * 64
    path.write_text(json.dumps(res))
    return path


def amd_cpu() -> bool:
    """Whether this machine's CPU is an AMD one: there 1 and 2 torch threads round fp32
    Phase 1 differently (tests/test_train.py, `test_phase1_trained_twice_alike_is_byte_identical`),
    so a checkpoint trained alone and one trained in a wave of two differ in their bytes."""
    try:
        return "AuthenticAMD" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False
