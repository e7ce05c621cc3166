"""The driver's console: one-line progress messages, copied to `<run>/logs/driver.log`."""

from __future__ import annotations

import time
from pathlib import Path


class Console:
    def __init__(self):
        self.log_path: Path | None = None

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        if self.log_path is not None:
            try:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                pass


say = Console()
