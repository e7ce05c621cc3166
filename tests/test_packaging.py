"""pyproject.toml (issue 47): metadata that setuptools will keep building after its
deprecation deadlines, and the Python the tested dependencies need."""

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_is_an_spdx_expression_with_its_file():
    """A TOML-table `license` is deprecated by setuptools, which stops building it on
    2027-02-18; PEP 639's SPDX string needs setuptools >= 77 and names its files."""
    meta = PROJECT["project"]
    assert meta["license"] == "MIT"
    assert all((ROOT / f).is_file() for f in meta["license-files"])
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    build = PROJECT["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in build), build


def test_requires_python_is_what_the_tested_stack_needs():
    """pandas 3.1 and numpy 2.4 (the tested versions, docker/constraints.txt) need 3.11: a
    lower bound below it would let pip pick untested releases; ruff targets the same."""
    assert PROJECT["project"]["requires-python"] == ">=3.11"
    assert PROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert sys.version_info >= (3, 11)


def _tested() -> dict[str, str]:
    """docker/constraints.txt: the exact versions the repository is tested with."""
    out = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower()] = version.strip()
    return out


def test_lower_bounds_are_the_tested_release_lines():
    """Every dependency's lower bound is the major.minor of the version it is tested with
    (docker/constraints.txt), and this environment has that version: an older release,
    e.g. Ray before token authentication (2.59), is not claimed to work."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    tested = _tested()
    meta = PROJECT["project"]
    reqs = [Requirement(r) for r in (*meta["dependencies"],
                                     *meta["optional-dependencies"]["dev"],
                                     *meta["optional-dependencies"]["postgres"])]
    for req in reqs:
        name = req.name.lower()
        assert name in tested, f"{name} has no tested version in docker/constraints.txt"
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{req}: one lower bound (>=)"
        pinned = Version(tested[name])
        assert Version(lower[0]).release[:2] == pinned.release[:2], (
            f"{req}: the lower bound is not the tested release line {pinned}")
        assert Version(version(req.name)).release == pinned.release, (
            f"{name}: installed {version(req.name)}, tested {pinned}")
    assert any(r.name == "ray" and Version("2.59") not in r.specifier for r in reqs)


def _build_metadata(tmp_path: Path, pyproject: str) -> tuple[int, str]:
    """setuptools' metadata build (what `pip install -e .` runs first) of this pyproject, in
    a copy with empty packages (nothing is written in the checkout): (exit code, output)."""
    import shutil
    import subprocess

    for f in ("README.md", "LICENSE"):
        shutil.copy(ROOT / f, tmp_path / f)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    for pkg in ("pmnet", "pipelines", "tune_spaces"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "out").mkdir()
    r = subprocess.run([sys.executable, "-W", "default", "-c",
                        "import setuptools.build_meta as b; "
                        "print(b.prepare_metadata_for_build_wheel('out'))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_the_build_prints_no_deprecation(tmp_path):
    """The license deprecation went unseen for this: setuptools prints it during the build,
    outside the tests. The installed setuptools (the newest the environment has) builds the
    metadata with no deprecation; the old TOML-table license shows the check can fail."""
    import setuptools

    text = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "now").mkdir()
    rc, out = _build_metadata(tmp_path / "now", text)
    assert rc == 0, out
    assert "deprecat" not in out.lower(), f"setuptools {setuptools.__version__}:\n{out}"
    old = text.replace('license = "MIT"\nlicense-files = ["LICENSE"]\n',
                       'license = {text = "MIT"}\n')
    assert old != text
    (tmp_path / "old").mkdir()
    rc, out = _build_metadata(tmp_path / "old", old)
    assert "deprecat" in out.lower() and "license" in out.lower(), out


def test_make_install_installs_the_postgres_driver():
    """A `postgresql://` tracking URI needs SQLAlchemy's default driver for that scheme
    (psycopg 3 under SQLAlchemy 2.1): the `postgres` extra names it, `make install` (and so
    `make test` and CI on a fresh clone) installs it, and it is importable here, so the
    tests against a real PostgreSQL server run rather than skip (issue 53)."""
    from sqlalchemy.engine import make_url

    extra = PROJECT["project"]["optional-dependencies"]["postgres"]
    assert [r.split(">=")[0] for r in extra] == ["psycopg[binary]"], extra
    makefile = (ROOT / "Makefile").read_text()
    assert '-m pip install -q -c $(VENV)/constraints.txt -e ".[dev,postgres]"' in makefile
    dialect = make_url("postgresql://u@127.0.0.1/db").get_dialect()
    assert dialect.driver == "psycopg", dialect
    dialect.import_dbapi()  # ImportError without the extra


def test_make_install_installs_the_tested_versions_not_the_newest(tmp_path):
    """`make install` installs under docker/constraints.txt, as the image does, less torch's
    line (torch is installed first, or is a GPU machine's own CUDA build, which a pin would
    make pip replace). Unconstrained, a fresh clone took each package's newest release, and
    mlflow 3.18.0 (tested: 3.17.2) failed CI in stop 76; a pin change reinstalls."""
    import subprocess

    from tests.support.make import make_dry_run

    venv = tmp_path / "venv"
    out = make_dry_run("-B", "install", f"VENV={venv}")
    lines = out.splitlines()
    grep = next(ln for ln in lines if "constraints.txt >" in ln)
    assert f'-m pip install -q -c {venv}/constraints.txt -e ".[dev,postgres]"' in out
    assert lines.index(grep) < next(i for i, ln in enumerate(lines) if "-e \".[dev" in ln)
    venv.mkdir()
    subprocess.run(["bash", "-c", grep], cwd=ROOT, check=True)  # the Makefile's own line
    written = (venv / "constraints.txt").read_text().splitlines()
    pins = [ln for ln in (ROOT / "docker" / "constraints.txt").read_text().splitlines()
            if "==" in ln]
    assert [ln for ln in pins if not ln.startswith("torch==")] == [
        ln for ln in written if "==" in ln]
    assert not any(ln.startswith("torch==") for ln in written) and len(pins) > 10
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VENV)/.installed: pyproject.toml docker/constraints.txt" in makefile
