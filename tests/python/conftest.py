import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("ELASTIC_BUILD_DIR", ROOT / "build"))


@pytest.fixture(scope="session")
def build_dir():
    if not (BUILD / "driver" / "elastic-run").exists():
        pytest.fail(f"elastic-run is not built under {BUILD}; run scripts/test.sh")
    return BUILD


@pytest.fixture(scope="session")
def elastic_run(build_dir):
    return str(build_dir / "driver" / "elastic-run")


@pytest.fixture(scope="session")
def test_worker(build_dir):
    return str(build_dir / "tests" / "driver" / "test_worker")
