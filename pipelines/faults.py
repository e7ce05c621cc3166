"""Test hooks, inert unless their variables are set: SIGKILL the driver at a named point
(PMNET_TEST_KILL_DRIVER_AT=<point>, tests/test_faults.py), and pause after each training
epoch (PMNET_TEST_EPOCH_PAUSE_S=<seconds>, so that a test can kill a node or the driver while
a task holds a checkpoint and is still running; a pause changes no result).
"""

from __future__ import annotations

import os
import signal
import time

KILL_ENV = "PMNET_TEST_KILL_DRIVER_AT"
PAUSE_ENV = "PMNET_TEST_EPOCH_PAUSE_S"
POINTS = (
    "start",                  # lock held, pipeline.json written, Ray not started
    "stage1-submitted",       # the first Phase-1 trial started (Tune), nothing of it landed
    "stage1-recorded",        # a Phase-1 unit landed (stage1.json), its MLflow run not logged
    "stage2-trial-started",   # the first trial started
    "stage2-first-result",    # the first trial finished
    "stage2-last-result",     # the last trial finished, Tune's final state not saved
    "stage2-done",            # Tuner.fit returned, pipeline status not written
    "stage3-start",           # status written, the report not started
    "stage3-report-written",  # the report written, not logged to MLflow
    "end",                    # everything written, the driver about to exit
)


def kill_point(point: str) -> None:
    """SIGKILL this process when PMNET_TEST_KILL_DRIVER_AT names `point` ('' never)."""
    if not point:
        return
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}")
    if os.environ.get(KILL_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def epoch_pause() -> None:
    """Sleep PMNET_TEST_EPOCH_PAUSE_S seconds (after an epoch's checkpoint is written)."""
    try:
        seconds = float(os.environ.get(PAUSE_ENV) or 0)
    except ValueError:
        return
    if seconds > 0:
        time.sleep(seconds)
