"""Writes `pmnet/report/grid_map.py`: which grids run each condition in the default variant,
the table the report names under a table whose rows did not run (issue 35). `pmnet` may not
import `tune_spaces`, so the report keeps a generated copy of `grids.report_grid_map()`;
`test_the_report_grid_map_is_the_grids_own` fails when it is stale.

    .venv/bin/python -m tune_spaces.grid_map            # rewrite the copy
    .venv/bin/python -m tune_spaces.grid_map --check    # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tune_spaces.grids import report_grid_map

GRID_MAP = Path(__file__).resolve().parents[1] / "pmnet" / "report" / "grid_map.py"


def grid_map_source() -> str:
    """The text of pmnet/report/grid_map.py, from the grids themselves."""
    lines = []
    for c, grids in report_grid_map().items():
        names = [f'"{g}"' for g in grids]
        line = f'    "{c}": ({", ".join(names)}{"," if len(names) == 1 else ""}),'
        if len(line) > 100:
            line = f'    "{c}": (\n' + "".join(f"        {n},\n" for n in names) + "    ),"
        lines.append(line)
    return (
        '"""Which grids run each condition in the default variant (what the paper\'s tables\n'
        "read), for the report's notes on what did not run (issue 35).\n\n"
        "Generated from the grids (`tune_spaces.grids.report_grid_map`: each grid of `SPACES`\n"
        "read at the paper preset; `default`, the preset's own grid, left out) by\n"
        "`python -m tune_spaces.grid_map`; `pmnet` may not import `tune_spaces`, and\n"
        "`test_the_report_grid_map_is_the_grids_own` fails when this copy is stale.\n"
        '"""\n\n'
        "GRIDS_RUNNING: dict[str, tuple[str, ...]] = {\n" + "\n".join(lines) + "\n}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the copy is stale")
    args = parser.parse_args(argv)
    text = grid_map_source()
    if args.check:
        stale = GRID_MAP.read_text(encoding="utf-8") != text
        print(f"{GRID_MAP.name}: {'stale' if stale else 'current'}")
        return int(stale)
    GRID_MAP.write_text(text, encoding="utf-8")
    print(f"wrote {GRID_MAP}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
