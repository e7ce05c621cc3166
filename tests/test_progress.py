"""Stage-1 progress: the Phase-1 callback's file, the driver's lines and live MLflow logging."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pipelines import stages
from pipelines.progress import PROGRESS_FILE, Phase1Progress, describe
from pipelines.records import Progress
from pipelines.tracking import Runs


def test_phase1_callback_writes_progress_with_history(tmp_path):
    from pipelines.trial import quiet_training_logs

    quiet_training_logs()
    import torch

    from pmnet.train import TrainConfig, run_phase1

    threads = torch.get_num_threads()
    cfg = TrainConfig.from_name("debug", threads=1)
    path = tmp_path / "p1" / PROGRESS_FILE
    try:
        res = run_phase1(cfg, tmp_path / "p1", progress=False,
                         callbacks=[Phase1Progress(path, every_s=0.0)])
    finally:
        torch.set_num_threads(threads)
    info = json.loads(path.read_text())
    meta = json.loads((tmp_path / "p1" / "phase1_metrics.json").read_text())
    assert info["done"] and info["step"] == info["total_steps"] > 0
    assert [r["epoch"] for r in info["history"]] == [r["epoch"] for r in meta["history"]]
    assert info["history"][-1]["val/mean_stm"] == pytest.approx(meta["history"][-1]["val/mean_stm"])
    assert res["sha256"]
    line = describe(Progress.from_dict(info), 125.0)
    assert re.search(rf"epoch \d+/{cfg.phase1_max_epochs}, step {info['step']}/"
                     rf"{info['total_steps']} \(100%\), val mean_stm [\d.]+; 2\.1 min", line)


class _FakeRay:
    """ray.wait/ray.get over a task that ends when `done` is set."""

    def __init__(self, done: threading.Event, result: dict):
        self.done, self.result = done, result

    def wait(self, refs, num_returns, timeout):
        return ([refs[0]], []) if self.done.wait(timeout) else ([], refs)

    def get(self, ref):
        return self.result


class _Tracker:
    def __init__(self):
        self.calls: list[tuple[int, dict]] = []

    def logged_steps(self, rid, key):
        return {0}  # epoch 0 was logged by an earlier driver

    def log_metrics(self, rid, metrics, step=None):
        self.calls.append((step, metrics))


def test_driver_prints_progress_and_logs_each_epoch_once_while_phase1_runs(tmp_path, monkeypatch,
                                                                          capsys):
    from pipelines.plan import plan_new

    monkeypatch.setenv("PMNET_PROGRESS_EVERY_S", "0.5")
    plan = plan_new(root=tmp_path / "runs", name="p", preset="debug", grid="tiny")
    plan.layout.phase1_dir.mkdir(parents=True)
    path = plan.layout.phase1_dir / PROGRESS_FILE
    done = threading.Event()
    job = stages.Stage1Job(slot=plan.phase1_slots[0], ref="task", t0=time.time(), rid="rid")

    def phase1():  # three epochs, one every ~0.7 s, then the task ends
        hist = []
        for epoch in range(3):
            time.sleep(0.7)
            hist.append({"epoch": epoch, "val/mean_stm": 10.0 + epoch})
            path.write_text(json.dumps({"step": 10 * (epoch + 1), "total_steps": 30,
                                        "epoch": epoch, "max_epochs": 3, "eta_s": 60.0,
                                        "time": time.time(), "history": hist}))
        time.sleep(0.7)
        done.set()

    worker = threading.Thread(target=phase1)
    worker.start()
    tracker = _Tracker()
    runs = replace(Runs(), tracker=tracker)
    recorded = []
    stages._wait_phase1(plan, _FakeRay(done, {"ok": 1}), [job], runs,
                        lambda j, res: recorded.append((j, res)))
    worker.join()
    assert recorded == [(job, {"ok": 1})]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "[stage 1/3] Phase 1" in ln]
    assert len(lines) >= 3, lines  # a line at a steady rate while it trains
    assert any("val mean_stm 11.00" in ln and "min left at most" in ln for ln in lines)
    # epochs 1 and 2 logged once each, while training; epoch 0 was already there
    assert [step for step, _ in tracker.calls] == [1, 2]
    assert tracker.calls[0][1] == {"val/mean_stm": 11.0}
    assert job.logged == {0, 1, 2}


def test_progress_line_without_a_file_says_how_long_it_has_waited():
    assert "running for 1.5 min" in describe(None, 90.0)
    assert Path(PROGRESS_FILE).suffix == ".json"
