"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def no_mlruns_in_the_repository():
    """A test that makes an MLflow experiment without an artifact location writes its
    artifacts into `./mlruns` of the directory it runs in, here the repository: the session
    ends with an error naming it (the driver always gives one, `addresses.artifact_location`)."""
    mlruns = REPO / "mlruns"
    before = mlruns.exists()
    yield
    if not before and mlruns.exists():
        pytest.fail(f"a test left {mlruns}: give MLflow experiments an artifact location "
                    "(pipelines.addresses.artifact_location), as the driver does; delete "
                    "it before the next run", pytrace=False)


@pytest.fixture
def one_thread():
    """One torch thread for the test (two threads contend badly on a busy 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault tests' uninterrupted debug pipeline (`tests.support.faults.reference_run`),
    once per module that asks for it (tests/test_faults.py, tests/test_cluster_faults.py)."""
    from tests.support.faults import reference_run

    return reference_run(tmp_path_factory.mktemp("reference") / "runs")


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL cluster on 127.0.0.1 with a database `mlflow`
    (`tests.support.postgres.Cluster`), started once per session and removed at its end;
    the test is skipped, saying why, only where no PostgreSQL server programs exist."""
    from tests.support.postgres import missing_reason, start_cluster

    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.remove()
