"""The driver's side of a Phase 1 (issue 52) or a trial (issue 61) in durable pieces: the
run's stop file, which a SIGTERM to the driver writes and every Phase-1 task and trial
polls at its epoch ends (`pmnet.train.StopAtEpochEnd`). The paused unit's progress in the
store is `pmnet.store_progress`; docs/pipeline.md, "A long Phase 1 in pieces" and "A long
trial in pieces", has the whole path.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.console import say

#: the run's file a SIGTERM writes, which every Phase-1 task of the run polls at epoch ends
STOP_FILENAME = "phase1-stop.request"


def stop_file(run_dir: Path) -> Path:
    return Path(run_dir) / STOP_FILENAME


# -- SIGTERM to the driver ------------------------------------------------------------------


@contextmanager
def sigterm_writes_stop_file(path: Path) -> Iterator[None]:
    """While the driver waits for its Phase-1 tasks or its trials (issue 61): the first
    SIGTERM writes the run's stop file (each task or trial stops at its next epoch end,
    `StopAtEpochEnd(stop_file=...)`) and
    restores the previous handler, so a second SIGTERM ends the driver as before. Outside
    (and off the main thread) SIGTERM keeps its usual effect."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:
        previous = signal.SIG_DFL

    def handler(signum, frame):
        Path(path).touch()
        signal.signal(signal.SIGTERM, previous)
        say("[pipeline] SIGTERM: training stops at its next epoch end and its progress "
            "goes into the store (a second SIGTERM ends the driver now)")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

