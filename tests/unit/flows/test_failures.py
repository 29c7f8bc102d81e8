"""The log filter that makes a user error one line in a flow run's logs, on plain loggers."""

import logging
import sys

import pytest

from embed_core.errors import ConfigError


@pytest.fixture
def engine_logger():
    from flows.failures import install_log_filter

    install_log_filter()
    logger = logging.getLogger("prefect.flow_runs")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield logger, records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _exc_info(exc):
    try:
        raise exc
    except type(exc):
        return sys.exc_info()


def test_the_first_record_of_a_user_error_is_its_line_and_later_ones_are_dropped(engine_logger):
    logger, records = engine_logger
    info = _exc_info(ConfigError("c.yaml: train.setps: Extra inputs are not permitted"))
    logger.error("Encountered exception during execution: %r", info[1], exc_info=info)
    logger.error("Engine execution exited with unexpected exception", exc_info=info)
    logger.error("Finished in state Failed('Flow run encountered an exception: ConfigError: %s')", info[1])
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in records] == [
        (logging.ERROR, "c.yaml: train.setps: Extra inputs are not permitted", None),
        (logging.INFO, "Finished in state Failed('Flow run encountered an exception: ConfigError: c.yaml: "
                       "train.setps: Extra inputs are not permitted')", None)]


def test_at_debug_the_later_records_keep_the_traceback_at_debug_level(engine_logger):
    logger, records = engine_logger
    logger.setLevel(logging.DEBUG)
    info = _exc_info(ConfigError("c.yaml: mine.k: Input should be a valid integer"))
    logger.error("Encountered exception during execution: %r", info[1], exc_info=info)
    logger.error("Engine execution exited with unexpected exception", exc_info=info)
    assert [(r.levelno, r.exc_info is not None) for r in records] == [(logging.ERROR, False), (logging.DEBUG, True)]


def test_a_bug_keeps_its_traceback_and_its_level(engine_logger):
    logger, records = engine_logger
    info = _exc_info(KeyError("stage"))
    logger.error("Encountered exception during execution: %r", info[1], exc_info=info)
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.ERROR, info)]


def test_prefects_failed_run_carrying_a_reported_line_is_that_user_error_and_any_other_is_not(engine_logger):
    """What Prefect raises when the server's answer to a run's Failed state was lost: its
    ``FailedRun`` with the state's message (tests/integration/cli/test_prefect_server_faults.py
    loses that answer for real)."""
    from prefect.exceptions import FailedRun

    from embed_core.errors import register_user_error, user_error
    from flows.failures import reported_failure

    register_user_error(reported_failure)
    logger, _ = engine_logger
    line = "s.parquet: not a readable Parquet file: magic bytes not found"
    info = _exc_info(ConfigError(line))
    logger.error("Task run failed", exc_info=info)  # reported: the run's one line
    assert user_error(FailedRun(line)) == line
    assert user_error(FailedRun("Flow run encountered an exception: KeyError: 'x'")) is None  # a bug
    assert reported_failure(RuntimeError(line)) is None  # only Prefect's FailedRun stands for the error
