"""Run a command (the embedded MLflow server) and stop it when the pipeline driver dies.

    python -m pipelines.mlflow_guard --parent PID -- CMD ARGS...

The driver starts this guard in a new session; the guard starts CMD in its own process
group and polls once a second. When the driver is gone (even after SIGKILL, where no
cleanup code runs) or when the guard gets SIGTERM/SIGINT, the guard terminates the whole
group (the `mlflow server` CLI and the uvicorn process it spawns), so no server is left
holding the SQLite store or a port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # let uvicorn finish its shutdown
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # anything left, the guard included
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    if "--" not in argv or "--parent" not in argv:
        print("usage: python -m pipelines.mlflow_guard --parent PID -- CMD ...", file=sys.stderr)
        return 2
    sep = argv.index("--")
    parent = int(argv[argv.index("--parent") + 1])
    cmd = argv[sep + 1:]
    if os.getpgrp() != os.getpid():
        os.setpgrp()  # the group the guard cleans up is its own
    proc = subprocess.Popen(cmd)
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        code = proc.poll()
        if code is not None:
            return code
        if stop["flag"] or os.getppid() != parent:
            _stop_group(proc)
            return 0
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
