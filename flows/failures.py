"""How a flow run ends on an error of the user's input or machine (``embed_core.errors.user_error``):
exactly one ERROR line in its logs — the line the CLI prints — and a Failed state whose message is
that line. Anything else (a bug) keeps Prefect's traceback.

Prefect's engines log a failed run several times over, each with a traceback: the task run's
failure, its "Finished in state Failed(...)", the flow run's "Encountered exception", and, in a
worker's flow-run process, "Engine execution exited with unexpected exception". Here the first
record of a user error becomes its line; later records of the same error lose their ERROR level
(the traceback is kept only when the logger is at DEBUG, ``PREFECT_LOGGING_LEVEL=DEBUG``).

A caller of the flow gets the error itself back, or, when Prefect hands back a state without it,
Prefect's ``FailedRun`` with the line as its message; that is the same user error
(``reported_failure``). It happens when the answer to the run's Failed state is lost (a loaded server
answering after the client's timeout): the client sends the state again, the server refuses the
repeat (``PreventDuplicateTransitions``) and answers with the run's state as it stored it.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from typing import Any, Callable

from embed_core.errors import register_user_error, user_error

# Where Prefect's engines (and the process worker) log a run's failure.
_ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
_REPORTED_ATTR = "_embedpipe_reported"
_reported_lines: deque[str] = deque(maxlen=64)


def reports_user_errors(flow_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a flow function (under ``@flow``): a user error ends the run Failed with its line as the
    state message, logged once; calling the flow from Python still raises the error itself."""

    @functools.wraps(flow_fn)
    def flow_body(*args: Any, **kwargs: Any) -> Any:
        from prefect.logging import get_run_logger
        from prefect.states import Failed

        install_log_filter()
        register_user_error(reported_failure)
        try:
            return flow_fn(*args, **kwargs)
        except Exception as exc:
            line = user_error(exc)
            if line is None:
                raise
            logger = get_run_logger()
            if not _reported(exc):
                logger.error(line)
                _mark_reported(exc, line)
            logger.debug("the traceback of: %s", line, exc_info=exc)
            return Failed(message=line, data=exc)  # the caller's state.result() raises exc

    return flow_body


def reported_failure(exc: BaseException) -> str | None:
    """The line of a user error reported in a flow run of this process, when ``exc`` is Prefect's
    ``FailedRun`` for that run: its message is the line (the state's message), the error itself lost."""
    from prefect.exceptions import FailedRun

    if not isinstance(exc, FailedRun):
        return None
    line = str(exc)
    return line if line in _reported_lines else None


class _OneLinePerUserError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        line = user_error(exc) if exc is not None else None
        if line is not None:
            if not _reported(exc):  # the first record of this error: the line, no traceback
                _mark_reported(exc, line)
                record.msg, record.args, record.exc_info, record.exc_text = line, (), None, None
                return True
            return _demote(record, logging.DEBUG)  # its traceback, at DEBUG only
        if record.levelno >= logging.ERROR and any(seen in record.getMessage() for seen in _reported_lines):
            return _demote(record, logging.INFO)  # "Finished in state Failed('<the line>')"
        return True


def _demote(record: logging.LogRecord, level: int) -> bool:
    if not logging.getLogger(record.name).isEnabledFor(level):
        return False
    record.levelno, record.levelname = level, logging.getLevelName(level)
    return True


def _reported(exc: BaseException) -> bool:
    return bool(getattr(exc, _REPORTED_ATTR, False))


def _mark_reported(exc: BaseException, line: str) -> None:
    try:
        setattr(exc, _REPORTED_ATTR, True)
    except AttributeError:  # an exception type without a __dict__: its line still marks it
        pass
    _reported_lines.extend({line, repr(line)[1:-1]})  # as logged, and as a state's repr quotes it


_FILTER = _OneLinePerUserError()


def install_log_filter() -> None:
    """Put the filter on Prefect's engine loggers of this process (once; idempotent)."""
    for name in _ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
