"""Stage-1 progress: the Phase-1 callback's file and report, and the driver's lines."""

from __future__ import annotations

import json
import re
import time

import pytest

from pipelines import stages
from pipelines.progress import PROGRESS_FILE, Phase1Progress, describe
from pipelines.records import Progress


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
    line = describe(Progress.from_dict(info))
    assert re.search(rf"epoch \d+/{cfg.phase1_max_epochs}, step {info['step']}/"
                     rf"{info['total_steps']} \(100%\), val mean_stm [\d.]+; [\d.]+ min so "
                     "far; training done", line)


class _Trial:
    def __init__(self, unit: str, status: str = "RUNNING"):
        self.config, self.status, self.last_result = {"unit": unit}, status, {}


def test_driver_prints_a_progress_line_per_unit_at_each_validation(tmp_path, capsys):
    """TrialConsole in Stage 1: what a Phase-1 trial reports at a validation (Phase1Progress's
    `report`, one JSON string) becomes one line of its unit; the rate-bounded writes of
    progress.json in between report nothing."""
    from pipelines.progress import REPORT_KEY

    reports = []
    cb = Phase1Progress(tmp_path / PROGRESS_FILE, report=reports.append)
    history = [{"epoch": 0, "val/mean_stm": 10.0}, {"epoch": 1, "val/mean_stm": 11.0}]
    module = type("M", (), {"history": history})()
    trainer = type("T", (), {"global_step": 20, "estimated_stepping_batches": 30,
                             "current_epoch": 1, "max_epochs": 3})()
    cb._t0 = time.time() - 20.0
    cb._write(trainer, module)
    assert not reports  # a rate-bounded write: progress.json only
    cb._write(trainer, module, report=True)
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["history"] == history
    [sent] = reports
    assert list(sent) == [REPORT_KEY]  # one string: no key of Tune's own ("done") is set
    assert json.loads(sent[REPORT_KEY])["history"] == history[-1:]
    console = stages.TrialConsole(1, 2)
    a, b = _Trial("phase1-p1s0"), _Trial("phase1-p1s1")
    console.on_trial_start(0, [a, b], a)
    console.on_trial_start(0, [a, b], b)
    console.on_trial_result(0, [a, b], a, sent)
    console.on_trial_result(0, [a, b], b, {"test/mean_stm": 1.0})  # not a progress report
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "[stage 1/3]" in ln]
    assert len(lines) == 1, lines
    assert re.search(r"phase1-p1s0: Phase 1 epoch 2/3, step 20/30 \(67%\), val mean_stm "
                     r"11\.00; 0\.3 min so far, .*min left at most", lines[0]), lines[0]


def test_stage2_lines_follow_each_trials_last_report(capsys):
    """TrialConsole in Stage 2: a line per ended trial, keyed on its last report: its result
    with the best so far, or why it ended without one (here its configuration)."""
    from pipelines.trial import CONFIG_ERROR
    from pmnet.trial_id import TrialId

    def ended(condition, seed, last):
        trial = _Trial("")
        trial.config, trial.status = TrialId(condition, seed).to_config(), "TERMINATED"
        trial.last_result = last
        return trial

    console = stages.TrialConsole(2, 3)
    for trial in (ended("consolidator_only", 42, {"test/updated_ltm": 50.0, "finished": 1}),
                  ended("learned_full", 42, {"test/updated_ltm": 60.0, "best/select": 40.0,
                                             "train_time_s": 3.0, "finished": 1}),
                  ended("learned_full", 43, {CONFIG_ERROR: "ValueError: bad\nmore"})):
        console.on_trial_complete(0, [], trial)
    lines = [ln.split("] ", 1)[1] for ln in capsys.readouterr().out.splitlines()]
    assert lines[0].endswith("1/3 done: consolidator_only-s42 test updated_ltm 50.00, best "
                             "val select n/a, train n/a s; best so far 50.00 "
                             "(consolidator_only-s42)"), lines
    assert lines[1].endswith("2/3 done: learned_full-s42 test updated_ltm 60.00, best val "
                             "select 40.00, train 3.0 s; best so far 60.00 (learned_full-s42)")
    assert lines[2].endswith("learned_full-s43 failed, not retried (its configuration cannot "
                             "run): ValueError: bad"), lines

