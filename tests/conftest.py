import os

import torch

# Triton kernels run on CPU tensors through Triton's interpreter when no GPU is present.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def postgres_cluster():
    """A throwaway PostgreSQL server (tests/postgres.py); skipped with the reason where the binaries
    are missing, a failure where $SPECTUNE_REQUIRE_POSTGRES is set (CI)."""
    from tests import postgres

    reason = postgres.missing()
    if reason is not None:
        if os.environ.get(postgres.REQUIRE_ENV):
            pytest.fail(f"{postgres.REQUIRE_ENV} is set but {reason}")
        pytest.skip(reason)
    cluster = postgres.Cluster()
    try:
        cluster.start()
    except Exception as exc:
        cluster.stop()
        if os.environ.get(postgres.REQUIRE_ENV):
            raise
        pytest.skip(f"PostgreSQL did not start: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster):
    """A fresh database on the session's cluster."""
    return postgres_cluster.create_database()
