"""A run directory's paths (`Layout`), pipeline names and the small JSON helpers.

A run has one store (`Layout.units`): the `--store DIR` it was given, or by default its own
directory. Its units (Phase-1 checkpoints, trials) land there once, laid out by
`pmnet.store_layout.StoreLayout`; everything else is the run's scratch in its own directory
(logs, Phase 1's training directory `phase1[-p1s<k>]/`, `trials/<trial>/`, Tune's
`stage2*/`, the run's records). Without a store a Phase-1 unit and its training directory
are one directory. docs/pipeline.md, "Storage layout", draws the whole tree. `<trial>` is a
`TrialId`'s name (pmnet.trial_id).
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pmnet.conditions import PHASE2_ONLY_FIELDS  # noqa: F401  (re-exported)
from pmnet.io import atomic_write_json, read_json  # noqa: F401  (read_json re-exported)
from pmnet.store_layout import StoreLayout, unit_name
from pmnet.trial_id import TrialId

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
EXPERIMENT_DIRNAME = "stage2"


class PipelineError(RuntimeError):
    """A pipeline cannot start or continue; the message says why and what to do."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise PipelineError(f"invalid pipeline name {name!r}: use letters, digits, '.', '_' "
                            "and '-' (at most 100 characters, not starting with a dot)")
    return name


def trial_key(name: str, trial: TrialId) -> str:
    """The MLflow tag that identifies a trial's run across retries and resumes."""
    return f"{name}/{trial.name}"


@dataclass(frozen=True)
class Layout:
    root: Path
    name: str
    # the Tune experiment's directory name: `stage2`, or one per wave of Phase-1 checkpoints
    # when the run's checkpoints train in several waves (`stage2-p1s<k>[-<k'>...]`,
    # `pipelines.driver.wave_plan`)
    experiment: str = EXPERIMENT_DIRNAME
    # the run's one store: `--store DIR`, by default (None) the run's own directory
    store: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).expanduser().absolute())
        object.__setattr__(self, "store", Path(self.store or self.run_dir).expanduser()
                           .absolute())
        check_name(self.name)

    # per root --------------------------------------------------------------------------
    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlartifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def last_file(self) -> Path:
        return self.root / "LAST"

    @property
    def compile_cache(self) -> Path:
        """torch.compile's on-disk cache, shared by every process of every pipeline under
        this root (`pmnet.train.use_compile_cache`): a graph compiles once per root."""
        return self.root / "compile-cache"

    # per pipeline -------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return self.root / self.name

    @property
    def pipeline_json(self) -> Path:
        return self.run_dir / "pipeline.json"

    @property
    def config_json(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def tracking_json(self) -> Path:
        return self.run_dir / "tracking.json"

    @property
    def timing_json(self) -> Path:
        return self.run_dir / "timing.json"

    @property
    def units(self) -> StoreLayout:
        """The run's one store, where its units land (pmnet.store_layout): `--store`, else
        the run directory."""
        return StoreLayout(self.store)

    @property
    def store_elsewhere(self) -> bool:
        """Whether the run's store is a `--store` of its own, not the run directory (it then
        has its own report of every unit it holds)."""
        return self.store != self.run_dir

    def phase1_scratch(self, phase1_seed: int | None) -> Path:
        """Where Phase 1 of a checkpoint trains (Lightning's `phase1_ckpt/`, its logs, the
        files the unit lands from): `<run>/phase1[-p1s<k>]/`, the unit's own directory when
        the run is its own store."""
        return self.run_dir / unit_name(phase1_seed)

    @property
    def phase1_dir(self) -> Path:
        return self.units.phase1_dir(None)

    def phase1_dir_for(self, phase1_seed: int | None) -> Path:
        """The unit directory of one Phase-1 checkpoint: `phase1/` for the pipeline's
        single checkpoint (None), `phase1-p1s<k>/` for Phase-1 seed k of a grid with several
        Phase-1 seeds (issue 11, part 3)."""
        return self.units.phase1_dir(phase1_seed)

    @property
    def phase1_ckpt(self) -> Path:
        return self.units.phase1_ckpt(None)

    @property
    def stage1_json(self) -> Path:
        return self.units.stage1_json(None)

    @property
    def experiment_dir(self) -> Path:
        return self.run_dir / self.experiment

    @property
    def trials_dir(self) -> Path:
        return self.run_dir / "trials"

    def trial_dir(self, trial: TrialId) -> Path:
        return self.trials_dir / trial.name

    @property
    def results_dir(self) -> Path:
        return self.units.results_dir

    def result_path(self, trial: TrialId) -> Path:
        return self.units.result(trial)

    @property
    def report_dir(self) -> Path:
        return self.run_dir / "report"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"


def run_layout(root: str | os.PathLike, name: str) -> Layout:
    """The layout of an existing run: its store is the one its pipeline.json records (none
    recorded: the run directory)."""
    meta = read_json(Layout(root, name).pipeline_json)
    return Layout(root, name, store=meta.get("store") if isinstance(meta, dict) else None)


def list_pipelines(root: str | os.PathLike) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and (p / "pipeline.json").is_file())


def last_pipeline(root: str | os.PathLike) -> str:
    """The name in `<root>/LAST`, or the newest pipeline directory; PipelineError if none."""
    root = Path(root).expanduser().absolute()
    last = root / "LAST"
    if last.is_file():
        name = last.read_text().strip()
        if name and (root / name / "pipeline.json").is_file():
            return name
    names = list_pipelines(root)
    if not names:
        raise PipelineError(f"no pipeline under {root}: start one with `make pipeline` "
                            "(python -m pipelines.run start)")
    return max(names, key=lambda n: (root / n / "pipeline.json").stat().st_mtime)


# -----------------------------------------------------------------------------------------
# Small JSON files, written atomically (a crash never leaves half a file)
# -----------------------------------------------------------------------------------------


write_json = atomic_write_json


def check_writable(root: str | os.PathLike, *, what: str = "storage root",
                   hint: str = "pass a writable --root (RUNS=... for make)") -> Path:
    """Prove `root` can hold a pipeline without creating it; PipelineError if it cannot.

    An existing root must be a directory where a file can be written (a temporary file is
    made and removed); a missing root needs its nearest existing ancestor to be a writable
    directory (the driver creates the root later, after validation).
    """
    root = Path(root).expanduser().absolute()
    where = root  # the directory the OS refused
    try:
        if root.exists():
            if not root.is_dir():
                raise PipelineError(f"{what} {root} is not a directory; {hint}")
            try:
                fd, tmp = tempfile.mkstemp(dir=root, prefix=".write-test-")
                os.close(fd)
                os.unlink(tmp)
            except OSError as e:
                raise PipelineError(f"{what} {root} is not writable "
                                    f"({e.strerror or e}); {hint}") from e
            return root
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise PipelineError(f"{what} {root} cannot be created: {parent} is not a "
                                f"writable directory; {hint}")
        # prove it (issue 37): a directory made and removed where the root's first missing
        # part goes. A virtual or read-only file system, a name too long, or no permission
        # (the kernel's answer, not os.access's guess) fails here with the OS's reason
        where = parent
        try:
            name_max = os.pathconf(parent, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        if (any(len(part) > name_max for part in root.relative_to(parent).parts)
                or len(str(root)) >= 4096):
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        tmp = tempfile.mkdtemp(dir=parent, prefix=".root-test-")
        os.rmdir(tmp)
    except OSError as e:
        raise PipelineError(f"{what} {root} cannot be created or written "
                            f"({e.strerror or e} in {where}); {hint}") from e
    return root
