import os

# Plain `pytest` runs its workers (pyproject's -n auto) with one torch (OpenMP) thread each, as
# `make test` does (TEST_THREADS): tiny models, and two threads per worker would fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

from flows.env import apply_defaults  # noqa: E402
from tests.helpers import schedule, shared_prefect, tiers  # noqa: E402
from tests.helpers.repo import REPO, SHARED_DATA  # noqa: E402

# Before anything imports prefect: the defaults every process that runs flows gets (no telemetry,
# embed_core's logs in the run logs), and a private Prefect home so result persistence (task
# caching) never touches the user's ~/.prefect.
apply_defaults()
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="embedpipe-prefect-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# embedpipe's machine-wide cache (embeddings, file-hash memo) never reaches the user's ~/.cache from a
# test; each test also gets its own below, so what one test encodes never changes another's counts.
os.environ["EMBEDPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="embedpipe-cache-")
# A `make serve` stack running in this checkout is never a test's server: the commands tests run
# without PREFECT_API_URL look for its state file here, where there is none unless a test puts one.
os.environ["EMBEDPIPE_STACK_HOME"] = os.path.join(os.environ["PREFECT_HOME"], "no-stack")
# Both are this process's (each pytest-xdist worker has its own) and go when it ends.
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
atexit.register(shutil.rmtree, os.environ["EMBEDPIPE_CACHE_DIR"], ignore_errors=True)

# Property-based tests (hypothesis) draw the same examples on every run and keep no example
# database: a failure in CI reproduces on any machine, and nothing is written into the checkout.
# HYPOTHESIS_PROFILE=explore draws fresh examples for a longer search.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, database=None)
_hypothesis_settings.register_profile("explore", max_examples=500, database=None)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))



def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help="write each test file's seconds into tests/durations.json (the longest-first order)")


def pytest_configure(config):
    tiers.select_default_tier(config)  # plain `pytest`: the fast tier (tests/helpers/tiers.py)
    config._embedpipe_durations = schedule.Recorder() if config.getoption("--store-durations") else None
    # pytest-xdist's controlling process, with workers to come: one Prefect server for all of them,
    # unless the marker expression leaves every Prefect test out (plain pytest, the fast tier)
    if (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
            and shared_prefect.selected(config.option.markexpr, markers_of("prefect"))):
        config._embedpipe_shared_prefect = shared_prefect.start()


def pytest_unconfigure(config):
    shared = getattr(config, "_embedpipe_shared_prefect", None)
    if shared is not None:
        shared_prefect.stop(shared)


def pytest_xdist_auto_num_workers(config):
    """pyproject's ``-n auto``: a command that names paths runs in one process (no workers to
    start for one file; ``-n N`` asks for workers); without paths, one worker per core."""
    return 0 if config.args_source == pytest.Config.ArgsSource.ARGS else None


# Tests that start a real server (Prefect, llama.cpp) are slow by nature: marked slow at collection.
SLOW_BY_NATURE = ("prefect", "llama_server")


def markers_of(marker: str) -> set[str]:
    """The markers a test marked ``marker`` carries once collected."""
    return {marker, "slow"} if marker in SLOW_BY_NATURE else {marker}


def pytest_collection_modifyitems(config, items):
    """Tests that start a real server are slow by nature (``SLOW_BY_NATURE``): the fast tier
    leaves them out with the ones marked slow by hand, and every test under tests/integration
    (marked ``integration``). The longest files run first (tests/helpers/schedule.py)."""
    for item in items:
        tiers.mark_integration(item, config.rootpath)
        if any(item.get_closest_marker(name) for name in SLOW_BY_NATURE):
            item.add_marker(pytest.mark.slow)
    schedule.longest_files_first(items, schedule.load())


def pytest_runtest_logreport(report):
    recorder = _RECORDER.get("recorder")
    if recorder is not None:
        recorder.add(report)


def pytest_sessionstart(session):
    _RECORDER["recorder"] = session.config._embedpipe_durations


def pytest_sessionfinish(session, exitstatus):
    recorder = _RECORDER.pop("recorder", None)
    if recorder is not None and not hasattr(session.config, "workerinput"):  # the controlling process only
        recorder.store()


_RECORDER: dict = {}


@pytest.fixture(autouse=True)
def no_log_handler_left_on_a_closed_stream():
    """A test that captures output (capfd) can leave a log handler (Prefect's console handler, set
    up while it ran) writing to its capture file, which pytest closes after the test; the next
    test's logging would then fail, and Prefect's print patch turns that failure into a recursion.
    After each test such a handler follows stdout instead."""
    yield
    from flows.console import CURRENT_STDOUT, _point, stream_handlers

    for handler in stream_handlers():
        if getattr(handler.stream, "closed", False):
            _point(handler, CURRENT_STDOUT)


@pytest.fixture(autouse=True)
def private_embedpipe_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("embedpipe-cache")))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "MANIFEST.md").exists():
        pytest.skip(f"real-data test: {SHARED_DATA} is absent (set EMBEDPIPE_SHARED_DATA to its location)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def prefect_harness():
    """A Prefect server for the session: the run's shared one under pytest-xdist
    (tests/helpers/shared_prefect.py), else Prefect's own test harness."""
    api_url = os.environ.get(shared_prefect.ENV)
    if not api_url:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            yield
        return
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    shared_prefect.wait_until_healthy(api_url)
    with temporary_settings(updates={PREFECT_API_URL: api_url}), \
            _temporary_global_settings_context(get_settings_context()):
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny randomly initialised BERT built in code (one per test session)."""
    from tests.helpers.tiny_model import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def demo_copy(tmp_path):
    """The demo config on a private copy of data/ (so a test can edit a source)."""
    shutil.copytree(REPO / "data", tmp_path / "data")
    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg["data_root"] = str(tmp_path / "data")
    cfg["run_root"] = str(tmp_path / "runs")
    cfg.pop("synthesize", None)  # tests that synthesize start their own LLM server
    cfg.pop("mine", None)  # tests that mine, train or evaluate set a tiny model built in code
    cfg.pop("evaluate", None)
    cfg.pop("train", None)
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
