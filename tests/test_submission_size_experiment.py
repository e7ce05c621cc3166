"""experiments/submission_size.py: a submission's size counted as the landing rules count it,
on a throwaway repository whose sizes are known: a file added and later removed counts
twice in the diffs, the packed size holds its bytes once, a total over its limit exits 1,
and a base that is not a commit exits 2."""

import os
import subprocess

import pytest

from tests.support.experiments import load_experiment

MIB = 1 << 20


@pytest.fixture(scope="module")
def size():
    return load_experiment("submission_size")


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q", "-b", "main")
    (tmp_path / "notes.md").write_text("start\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "base")
    (tmp_path / "progress.ckpt").write_bytes(os.urandom(MIB))  # incompressible, like weights
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "a paused unit's progress")
    (tmp_path / "progress.ckpt").unlink()
    (tmp_path / "notes.md").write_text("start\nlanded\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "its progress removed")
    return tmp_path


def test_a_file_added_then_removed_counts_twice_and_an_overshoot_exits_1(size, repo, capsys):
    base = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()
    cs = size.commits(repo, base)
    assert [c.subject for c in cs] == ["a paused unit's progress", "its progress removed"]
    assert all(c.diff_bytes > MIB for c in cs)  # the add and the removal each hold the bytes
    assert sum(c.diff_bytes for c in cs) > 2 * MIB
    assert MIB < size.packed_bytes(repo, base) < 1.5 * MIB  # packed once
    assert size.main(["--repo", str(repo), "--base", base, "--diff-mib", "100"]) == 0
    assert size.main(["--repo", str(repo), "--base", base, "--diff-mib", "2"]) == 1
    out = capsys.readouterr().out
    assert "OVER: this submission would be refused" in out and "its progress removed" in out
    assert size.main(["--repo", str(repo), "--base", base, "--pack-mib", "0.5"]) == 1


def test_the_default_base_is_where_the_branch_began_and_a_bad_base_exits_2(size, repo, capsys):
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert size.default_base(repo) == first
    assert size.main(["--repo", str(repo), "--base", "no-such-rev"]) == 2
    assert "error: git rev-parse" in capsys.readouterr().err
