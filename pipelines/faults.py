"""Test hooks: SIGKILL the driver at a named point (PMNET_TEST_KILL_DRIVER_AT=<point>), and
pause after each training epoch (PMNET_TEST_EPOCH_PAUSE_S=<seconds>).

The fault tests (tests/test_faults.py) kill the driver at each of `POINTS` in turn, resume,
and check that the final tables equal an uninterrupted run's. The cluster tests
(tests/test_cluster_faults.py) and the random-kill soak pause each epoch of Phase 1 and of
the trials, so that a node or the driver can be killed while a task holds a checkpoint and
is still running; a pause changes no result. Without the variables the hooks do nothing;
they never run in a user's pipeline unless they set them.
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
    """Sleep PMNET_TEST_EPOCH_PAUSE_S seconds; unset: return at once. Called when a trial has
    written and reported an epoch's checkpoint, and before each Phase-1 epoch but the first
    (the previous epoch's checkpoint is written then)."""
    try:
        seconds = float(os.environ.get(PAUSE_ENV) or 0)
    except ValueError:
        return
    if seconds > 0:
        time.sleep(seconds)
