import os
import tempfile
from pathlib import Path

import pytest

# Before anything imports prefect: no telemetry, and a private Prefect home so result
# persistence (task caching) never touches the user's ~/.prefect.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="embedpipe-prefect-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("EMBEDPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "MANIFEST.md").exists():
        pytest.skip(f"real-data test: {SHARED_DATA} is absent (set EMBEDPIPE_SHARED_DATA to its location)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
