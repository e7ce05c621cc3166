"""Bad input to `python -m pipelines.run`: a clear error and exit code 2, before any compute
and before anything is written.

`CASES` is the table of docs/pipeline.md ("Bad input"): each row is a command line, an
environment, and a prepared storage root; the test runs `pipelines.run.main` in-process and
checks the exit code, the message, that no Ray / MLflow / training started (the run takes a
few seconds at most) and that the storage root is byte-for-byte as before (nothing created,
nothing changed). `python -m tests.test_bad_inputs` prints the table as markdown from the
observed messages; `test_docs_table_is_current` keeps docs/pipeline.md equal to it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipelines import run
from tests.support.net import free_port

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "pipeline.md"
BEGIN, END = "<!-- bad-inputs:begin -->", "<!-- bad-inputs:end -->"
CLEAN_ENV = ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")


# -- prepared storage roots -----------------------------------------------------------------


def _existing(root: Path) -> None:
    """A pipeline `p` (debug preset, tiny grid) that has been planned and recorded."""
    from pipelines.plan import plan_new
    from pipelines.stages import write_meta

    write_meta(plan_new(root=root, name="p", preset="debug", grid="tiny"), status="finished")


def _edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def _unknown_config_key(root: Path) -> None:
    _existing(root)
    _edit_json(root / "p" / "config.json", lambda d: d.update(not_a_field=1))


def _no_space_record(root: Path) -> None:
    _existing(root)
    _edit_json(root / "p" / "pipeline.json", lambda d: d.pop("space"))


def _variant_with_a_phase1_field(root: Path) -> None:
    _existing(root)
    _edit_json(root / "p" / "pipeline.json", lambda d: d["space"].update(
        variants=[{"name": "hi", "overrides": {"phase1_lr": 0.1}}]))


def _broken_pipeline_json(root: Path) -> None:
    _existing(root)
    (root / "p" / "pipeline.json").write_text("{not json")


def _phase1(root: Path, garbage: bool) -> None:
    """A finished Stage 1 of `p`: checkpoint, sidecar and stage1.json. `garbage`: the
    checkpoint's bytes are random but its sidecar and record match them; else the sidecar
    and record are right and the file was altered afterwards."""
    import hashlib

    from pipelines.layout import Layout
    from pipelines.phase1 import phase1_config_hash
    from pmnet.train import TrainConfig

    _existing(root)
    lay = Layout(root, "p")
    lay.phase1_dir.mkdir(parents=True)
    data = os.urandom(4096) if garbage else b"PK\x03\x04 a real checkpoint would be here"
    digest = hashlib.sha256(data).hexdigest()
    lay.phase1_ckpt.write_bytes(data if garbage else data + b"altered")
    Path(f"{lay.phase1_ckpt}.sha256").write_text(f"{digest}  phase1.pt\n")
    cfg = TrainConfig.from_name("debug")
    lay.stage1_json.write_text(json.dumps({"config_hash": phase1_config_hash(cfg),
                                             "sha256": digest}))


def _bare_checkpoint(root: Path) -> None:
    """A file named phase1.pt with no sha256 sidecar beside it (not from Stage 1)."""
    (root / "src").mkdir(parents=True)
    (root / "src" / "phase1.pt").write_bytes(b"weights of unknown origin")


def _a_file(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "a-file").write_text("not a directory")


NOBODY = 65534  # an unprivileged uid (root's permissions bypass every mode bit)


def _roots_dir(root: Path) -> None:
    """A directory of root's, mode 0755: another user may enter it but not write in it."""
    root.mkdir(parents=True)
    root.chmod(0o755)


def _mount(args: list[str], root: Path) -> None:
    import subprocess

    r = subprocess.run(["mount", *args, str(root)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip() or r.returncode}): needs root "
                    "and a mount namespace that allows it")


def _read_only_tmpfs(root: Path) -> None:
    """ROOT is an empty tmpfs mounted read-only."""
    root.mkdir(parents=True)
    _mount(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"], root)


def _read_only_pipeline(root: Path) -> None:
    """A recorded pipeline `p` whose root was then bind-mounted read-only over itself."""
    _existing(root)
    _mount(["--bind", str(root)], root)
    _mount(["-o", "remount,bind,ro"], root)


def _unmount(root: Path) -> None:
    import subprocess

    while subprocess.run(["umount", str(root)], capture_output=True).returncode == 0:
        pass  # a bind mount of a bind mount: until nothing is mounted there


# -- the table ------------------------------------------------------------------------------


@dataclass
class Case:
    what: str  # the row's first column
    argv: list[str]  # after `python -m pipelines.run`; ROOT is replaced by the root
    message: str  # regex the error must match
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    kind: str = "flag"  # flag | --set | environment | path | record
    user: int | None = None  # run the command as this uid (in a forked child)
    teardown: Callable[[Path], None] | None = None  # after the case (unmount what setup mounted)

    def args(self, root: Path) -> list[str]:
        return [a.replace("ROOT", str(root)) for a in self.argv]


S = ["start", "--preset", "debug", "--grid", "tiny", "--root", "ROOT"]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the same refusal on a machine with a GPU
CASES = [
    Case("unknown preset", ["start", "--preset", "huge", "--root", "ROOT"], "unknown preset"),
    Case("unknown grid", [*S, "--grid", "nope"], "unknown grid"),
    Case("unknown condition", [*S, "--conditions", "learned_full,bogus"],
         r"unknown condition\(s\) \['bogus'\]"),
    Case("seed that is not a number", [*S, "--seeds", "42,x"], "list of int"),
    Case("empty seed list", [*S, "--seeds", ""], "seed list is empty"),
    Case("zero CPUs per trial", [*S, "--cpus-per-trial", "0"], "cpus_per_trial"),
    Case("more than one GPU per trial", [*S, "--gpus-per-trial", "1.5"], "fraction of one GPU"),
    Case("negative retries", [*S, "--max-failures", "-1"], "max_failures"),
    Case("more CPUs per trial than any node has", [*S, "--cpus-per-trial", "1000"],
         r"asks 1000 CPUs per trial but the largest node of this machine has"),
    Case("a GPU share on a machine without a GPU", [*S, "--gpus-per-trial", "0.5"],
         "asks 0.5 GPU per trial but no node of this machine has a GPU",
         env=NO_GPU),
    Case("more Stage-1 CPUs than any node has", [*S, "--stage1-cpus", "1000"],
         r"--stage1-cpus 1000: Stage 1 runs on one node and the largest"),
    Case("GPU memory that is not a size", [*S, "--gpu-mem", "0"], "--gpu-mem must be"),
    Case("the paper preset where no node has a GPU", ["start", "--preset", "paper", "--root",
                                                        "ROOT"],
         r"the paper preset is built for a GPU.*would take at least .* days",
         env=NO_GPU),
    Case("pipeline name with a path", [*S, "--name", "../escape"], "invalid pipeline name"),
    Case("zero local CPUs", [*S, "--num-cpus", "0"], "--num-cpus must be a positive integer"),
    Case("zero Stage-1 CPUs", [*S, "--stage1-cpus", "0"], "--stage1-cpus must be > 0"),
    Case("unknown flag", [*S, "--epochs", "3"], "unrecognized arguments: --epochs"),
    Case("unknown variant of the grid", [*S, "--grid", "segments", "--variants", "T3-full"],
         r"unknown variant\(s\) \['T3-full'\]; known variants: 'T2-full'"),
    Case("--max-failures on resume (stored with the run)",
         ["resume", "--root", "ROOT", "--max-failures", "3"],
         "unrecognized arguments: --max-failures", setup=_existing),
    Case("a number given as a string", [*S, "--set", 'lr="0.001"'],
         "lr must be a number, got '0.001'", kind="--set"),
    Case("a number given as a boolean", [*S, "--set", "lr=true"],
         "lr must be a number, got True", kind="--set"),
    Case("overriding the preset's name", [*S, "--set", "preset=paper"], "preset", kind="--set"),
    Case("unknown key", [*S, "--set", "no_such_key=1"], "no_such_key", kind="--set"),
    Case("unknown model key", [*S, "--set", "model.widht=4"], "widht", kind="--set"),
    Case("out-of-range value", [*S, "--set", "max_epochs=0"], "max_epochs", kind="--set"),
    Case("unknown condition in a list", [*S, "--set", "conditions=learned_full,nope"],
         "unknown condition 'nope'", kind="--set"),
    Case("no '='", [*S, "--set", "oops"], "KEY=VALUE", kind="--set"),
    Case("a field the grid's variants set", [*S, "--grid", "segments", "--set", "segments=4"],
         "--set segments: grid 'segments' sets this field in its variants", kind="--set"),
    Case("a value that makes a variant's configuration invalid",
         [*S, "--grid", "segments", "--set", "detach_ltm=true"],
         "variant T2-truncated .* gives an invalid training configuration", kind="--set"),
    Case("MLFLOW_TRACKING_URI that is not a URI", S, "path / file: store",
         env={"MLFLOW_TRACKING_URI": "not a uri"}, kind="environment"),
    Case("MLFLOW_TRACKING_URI file: store (refused by MLflow 3)", S, "file: store",
         env={"MLFLOW_TRACKING_URI": "file:///tmp/mlruns"}, kind="environment"),
    Case("MLFLOW_TRACKING_URI unknown scheme", S, "not one MLflow can use",
         env={"MLFLOW_TRACKING_URI": "foo://bar"}, kind="environment"),
    Case("MLFLOW_TRACKING_URI sqlite file in a missing directory", S, "does not exist",
         env={"MLFLOW_TRACKING_URI": "sqlite:////no/such/dir/mlflow.db"}, kind="environment"),
    Case("MLFLOW_TRACKING_URI in-memory sqlite", S, "in-memory SQLite",
         env={"MLFLOW_TRACKING_URI": "sqlite://"}, kind="environment"),
    Case("MLFLOW_TRACKING_URI server that is down", S, "unreachable",
         env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:CLOSED"}, kind="environment"),
    Case("RAY_ADDRESS with nothing listening", S, "no Ray cluster answers at 127.0.0.1:1",
         env={"RAY_ADDRESS": "127.0.0.1:1"}, kind="environment"),
    Case("RAY_ADDRESS that is not HOST:PORT", S, "is not HOST:PORT",
         env={"RAY_ADDRESS": "my-cluster"}, kind="environment"),
    Case("--root below a file", ["start", "--preset", "debug", "--root", "ROOT/a-file/runs"],
         "not a writable directory", setup=_a_file, kind="path"),
    Case("--root that is a file", ["start", "--preset", "debug", "--root", "ROOT/a-file"],
         "is not a directory", setup=_a_file, kind="path"),
    Case("--root in a virtual file system", ["start", "--preset", "debug", "--root",
                                             "/proc/pmnet-runs"],
         "cannot be created or written .No such file or directory", kind="path"),
    Case("--root with a name too long", ["start", "--preset", "debug", "--root",
                                         "ROOT/" + "r" * 300],
         "cannot be created or written .File name too long", kind="path"),
    Case("--root where the user may not create it", ["start", "--preset", "debug", "--root",
                                                     "ROOT/runs"],
         r"cannot be created or written .Permission denied in \S+/root\)", setup=_roots_dir,
         user=NOBODY, kind="path"),
    Case("an existing --root the user may not write", ["start", "--preset", "debug", "--root",
                                                       "ROOT"],
         r"storage root \S+/root is not writable .Permission denied", setup=_roots_dir,
         user=NOBODY, kind="path"),
    Case("--root on a read-only file system", ["start", "--preset", "debug", "--root",
                                              "ROOT/runs"],
         r"cannot be created or written .Read-only file system in \S+/root\)",
         setup=_read_only_tmpfs, teardown=_unmount, kind="path"),
    Case("resume with the root on a read-only file system",
         ["resume", "--root", "ROOT", "--name", "p"],
         r"storage root \S+/root is not writable .Read-only file system",
         setup=_read_only_pipeline, teardown=_unmount, kind="path"),
    Case("a Phase-1 seed listed twice", [*S, "--phase1-seeds", "1,1"], "listed twice"),
    Case("a seed beyond numpy's range", [*S, "--seeds", "42,99999999999999999999"],
         r"seed 99999999999999999999 is outside 0\.\.4294967295"),
    Case("a Phase-1 seed beyond numpy's range", [*S, "--phase1-seeds", "0,4294967296"],
         r"Phase-1 seed 4294967296 is outside 0\.\.4294967295"),
    Case("phase1_seed beyond numpy's range", [*S, "--set", "phase1_seed=4294967296"],
         r"TrainConfig.phase1_seed 4294967296 is outside 0\.\.4294967295", kind="--set"),
    Case("--set phase1_seed with Phase-1 seeds",
         [*S, "--phase1-seeds", "1,2", "--set", "phase1_seed=3"], "--set phase1_seed",
         kind="--set"),
    Case("--phase1-from with no checkpoint there", [*S, "--phase1-from", "ROOT/nowhere"],
         "no Phase-1 checkpoint there", kind="path"),
    Case("--phase1-from a checkpoint without its sha256",
         [*S, "--phase1-from", "ROOT/src/phase1.pt"], "no recorded sha256",
         setup=_bare_checkpoint, kind="path"),
    Case("resume with no pipeline", ["resume", "--root", "ROOT"], "no pipeline under",
         kind="path"),
    Case("resume of an unknown name", ["resume", "--root", "ROOT", "--name", "q"],
         "no pipeline 'q'", setup=_existing, kind="path"),
    Case("status of an unknown name", ["status", "--root", "ROOT", "--name", "q"],
         "no pipeline 'q'", setup=_existing, kind="path"),
    Case("same name, different configuration", [*S, "--name", "p", "--set", "max_epochs=3"],
         "different configuration", setup=_existing, kind="record"),
    Case("config.json with an unknown key", ["resume", "--root", "ROOT"],
         "not a valid TrainConfig", setup=_unknown_config_key, kind="record"),
    Case("pipeline.json without its space", ["resume", "--root", "ROOT", "--name", "p"],
         "no 'space' record", setup=_no_space_record, kind="record"),
    Case("pipeline.json with a variant that sets a Phase-1 field",
         ["resume", "--root", "ROOT", "--name", "p"],
         "variant 'hi' sets 'phase1_lr', which is not a Phase-2-only TrainConfig field",
         setup=_variant_with_a_phase1_field, kind="record"),
    Case("pipeline.json that is not JSON", ["resume", "--root", "ROOT", "--name", "p"],
         "not a JSON object", setup=_broken_pipeline_json, kind="record"),
    Case("Phase-1 checkpoint altered after Stage 1", ["resume", "--root", "ROOT", "--name", "p"],
         "does not match its recorded sha256", setup=lambda r: _phase1(r, False),
         kind="record"),
    Case("garbage Phase-1 checkpoint with a matching sidecar",
         ["resume", "--root", "ROOT", "--name", "p"], "not a loadable Phase-1 model file",
         setup=lambda r: _phase1(r, True), kind="record"),
]


def _snapshot(root: Path) -> dict[str, tuple]:
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def _main(argv: list[str]) -> int:
    try:
        return run.main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)


def _main_as(uid: int, argv: list[str]) -> tuple[int, str]:
    """`main(argv)` in a forked child that dropped to `uid` (and its gid, no groups), as an
    unprivileged user runs the CLI: root would bypass the permissions under test."""
    import pipelines.plan  # noqa: F401  (imported here, not by the child as `uid`)

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        rc = 99
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with os.fdopen(w, "w") as f:
                with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                    rc = _main(argv)
        except BaseException:  # noqa: BLE001 - reported through the exit code
            rc = 99
        finally:
            os._exit(rc)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def run_case(case: Case, root: Path) -> tuple[int, str, float]:
    """(exit code, stderr+stdout, seconds) of `main(case.argv)` in this process (as
    `case.user` in a forked child when set)."""
    if case.setup is not None:
        case.setup(root)
    env = {k: v.replace("CLOSED", str(free_port())) for k, v in case.env.items()}
    saved = {k: os.environ.get(k) for k in (*CLEAN_ENV, *env)}
    for k in CLEAN_ENV:
        os.environ.pop(k, None)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    t0 = time.time()
    try:
        if case.user is not None:
            rc, text = _main_as(case.user, case.args(root))
            err.write(text)
        else:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = _main(case.args(root))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, err.getvalue() + out.getvalue(), time.time() - t0


@contextlib.contextmanager
def case_base(case: Case, base: Path):
    """Where the case's ROOT goes: `base`, or for a case run as another user a fresh
    directory in the system's temporary directory that this user may enter (pytest's own
    temporary directories are private to root); the case's teardown runs on exit."""
    import shutil
    import tempfile

    made = None
    if case.user is not None:
        made = base = Path(tempfile.mkdtemp(prefix="pmnet-bad-input-"))
        base.chmod(0o755)
    try:
        yield base
    finally:
        if case.teardown is not None:
            case.teardown(base / "root")
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_bad_input_fails_before_any_compute_or_write(case, tmp_path):
    with case_base(case, tmp_path) as base:
        root = base / "root"
        if case.setup is not None:
            case.setup(root)
        before = _snapshot(root)
        rc, text, seconds = run_case(Case(**{**case.__dict__, "setup": None}), root)
        assert rc == run.Exit.BAD_INPUT, text
        assert re.search(case.message, text), text
        assert _snapshot(root) == before, "the storage root changed"
        assert not (Path.cwd() / "not a uri").exists()
        assert seconds < 15, f"took {seconds:.1f} s: something started"
        if case.user is not None:  # the permission refused it: root may write there
            from pipelines.layout import check_writable

            check_writable(case.args(root)[case.argv.index("--root") + 1])


def test_there_are_at_least_25_cases_of_every_kind():
    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 25 and kinds == {"flag", "--set", "environment", "path", "record"}


def render_table() -> str:
    import tempfile

    rows = ["| kind | bad input | command (after `python -m pipelines.run`) | exit | message |",
            "|---|---|---|---|---|"]
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp, case_base(case, Path(tmp)) as base:
            root = base / "root"
            rc, text, _ = run_case(case, root)
            tmp = str(base)
            lines = [ln for ln in text.splitlines() if ln.strip()]
            msg = next((ln for ln in lines if "error" in ln), lines[-1] if lines else "")
            msg = msg.replace(str(root), "ROOT").replace(tmp, "TMP")
            msg = re.sub(r"127\.0\.0\.1:\d{4,5}", "127.0.0.1:PORT", msg)
        cmd = shlex.join(case.argv)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in case.env.items())
        cmd = f"{env} {cmd}".strip().replace("|", "\\|")
        if case.user is not None:
            cmd = f"(as uid {case.user}) {cmd}"
        msg = msg[:240].replace("|", "\\|")
        rows.append(f"| {case.kind} | {case.what} | `{cmd}` | {rc} | {msg} |")
    return "\n".join(rows)


def _docs_block() -> str:
    text = DOCS.read_text()
    if BEGIN not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_docs_table_is_current():
    """docs/pipeline.md lists every case with its exit code (regenerate with
    `python -m tests.test_bad_inputs --write-docs`)."""
    block = _docs_block()
    for case in CASES:
        row = next((ln for ln in block.splitlines() if f"| {case.what} |" in ln), None)
        assert row is not None, f"docs/pipeline.md lacks the row {case.what!r}"
        assert f"| {int(run.Exit.BAD_INPUT)} |" in row, row


if __name__ == "__main__":
    table = render_table()
    if "--write-docs" in sys.argv:
        text = DOCS.read_text()
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        DOCS.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(table)
