"""How large this checkout's submission is, counted as the landing rules count it, before the
session stops: the diffs of all its commits added up as text (at most 256 MiB; a file added
in one commit and removed in a later one counts twice) and the new objects packed (at most
512 MiB). Stop 75's whole sitting was refused for size: a paused Phase-1 unit (86 MB)
committed and then removed counted twice beside the progress it replaced.

    .venv/bin/python experiments/submission_size.py [--base REV] [--diff-mib 256]
        [--pack-mib 512]

`--base`: the commit the submission starts from; by default the oldest entry of the
branch's reflog (the commit this checkout began at). Prints each commit's diff size, the
largest first, and the totals; exits 1 when a total is over its limit, 2 on bad input.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
DIFF_MIB, PACK_MIB = 256, 512


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str
    diff_bytes: int  # `git diff --binary` against its first parent, as text


def _git(*args: str, cwd: Path) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise ValueError(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def _count(cmd: list[str], cwd: Path, stdin: bytes | None = None) -> int:
    """Bytes a git command writes, streamed (a diff of a large file is not held)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE if stdin is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.close()
    n = 0
    while chunk := proc.stdout.read(1 << 20):
        n += len(chunk)
    if proc.wait():
        raise ValueError(f"{' '.join(cmd)} exited {proc.returncode}")
    return n


def default_base(repo: Path) -> str:
    """The commit the checkout's branch began at: the oldest entry of its reflog."""
    entries = _git("reflog", "show", "--format=%H", "HEAD@{0}", cwd=repo).splitlines()
    branch = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=repo)
    if branch != "HEAD":
        entries = _git("reflog", "show", "--format=%H", branch, cwd=repo).splitlines() or entries
    if not entries:
        raise ValueError("no reflog to find the base in; give --base REV")
    return entries[-1]


def commits(repo: Path, base: str) -> list[Commit]:
    """Every commit after `base` up to HEAD, merged branches' included, with the size of its
    diff against its first parent (a merge's counts again what it brings: an upper bound)."""
    shas = _git("rev-list", "--reverse", f"{base}..HEAD", cwd=repo).split()
    out = []
    for sha in shas:
        subject = _git("log", "-1", "--format=%s", sha, cwd=repo)
        size = _count(["git", "diff", "--binary", f"{sha}^", sha], repo)
        out.append(Commit(sha, subject, size))
    return out


def packed_bytes(repo: Path, base: str) -> int:
    """The objects HEAD has that `base` has not, packed as a push would send them."""
    objects = _git("rev-list", "--objects", "HEAD", f"^{base}", cwd=repo)
    if not objects:
        return 0
    return _count(["git", "pack-objects", "--stdout", "-q"], repo,
                  stdin=(objects + "\n").encode())


def report(repo: Path, base: str, diff_mib: float = DIFF_MIB,
           pack_mib: float = PACK_MIB) -> tuple[bool, str]:
    """(within both limits, the lines to print)."""
    base = _git("rev-parse", "--verify", f"{base}^{{commit}}", cwd=repo)
    cs = commits(repo, base)
    diff, pack = sum(c.diff_bytes for c in cs), packed_bytes(repo, base)
    lines = [f"{len(cs)} commit(s) after {base[:12]}"]
    for c in sorted(cs, key=lambda c: -c.diff_bytes)[:8]:
        lines.append(f"  {c.diff_bytes / MIB:9.2f} MiB  {c.sha[:10]} {c.subject[:70]}")
    ok_diff, ok_pack = diff <= diff_mib * MIB, pack <= pack_mib * MIB
    lines.append(f"diffs as text: {diff / MIB:.2f} MiB of {diff_mib:g} MiB"
                 + ("" if ok_diff else "  OVER: this submission would be refused"))
    lines.append(f"packed: {pack / MIB:.2f} MiB of {pack_mib:g} MiB"
                 + ("" if ok_pack else "  OVER: this submission would be refused"))
    return ok_diff and ok_pack, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT)
    ap.add_argument("--base", help="the commit the submission starts from (default: the "
                    "oldest reflog entry of the branch)")
    ap.add_argument("--diff-mib", type=float, default=DIFF_MIB)
    ap.add_argument("--pack-mib", type=float, default=PACK_MIB)
    a = ap.parse_args(argv)
    try:
        ok, text = report(a.repo, a.base or default_base(a.repo), a.diff_mib, a.pack_mib)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
