"""Test hook: SIGKILL the driver at a named point (PMNET_TEST_KILL_DRIVER_AT=<point>).

The fault tests (tests/test_faults.py) kill the driver at each of `POINTS` in turn, resume,
and check that the final tables equal an uninterrupted run's. Without the variable the hook
does nothing; it never runs in a user's pipeline unless they set it.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "PMNET_TEST_KILL_DRIVER_AT"
POINTS = (
    "start",                  # lock held, pipeline.json written, Ray not started
    "stage1-submitted",       # the Phase-1 task submitted, the MLflow store not yet opened
    "stage1-recorded",        # stage1.json written, Stage-1 MLflow run not finished
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
