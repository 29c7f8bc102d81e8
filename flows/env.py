"""Environment defaults for a process that runs embedpipe flows, applied by an explicit call,
never on import: the ``embedpipe`` command (before it imports prefect), ``deployments/local.py``
(for the server and the workers it starts), the test harness (``tests/conftest.py``) and every
flow run (``flows.params.run_context``, for a worker started by hand; by then prefect's logging
is set up, so such a worker's environment must carry ``PREFECT_LOGGING_EXTRA_LOGGERS`` itself).

Each is a default: a value the user has set is never overridden.

``DO_NOT_TRACK``, ``PREFECT_SERVER_ANALYTICS_ENABLED``
    no telemetry from a pipeline that runs on users' data.
``PREFECT_LOGGING_EXTRA_LOGGERS``
    embed_core logs through the standard ``embedpipe`` logger; Prefect's run logs show it (read
    when prefect is first imported).
``PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW``
    the same logger outside a flow run (``embedpipe status``, a training rank other than 0, a
    library call) logs to the console only, without Prefect's warning that there is no run.
``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``
    the temporary server migrates its SQLite database on first start; on two busy cores that can
    exceed Prefect's 20 s default.
"""

from __future__ import annotations

import os
from typing import MutableMapping

DEFAULTS = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "embedpipe",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set each of :data:`DEFAULTS` that ``environ`` (default: this process's) lacks; returns it."""
    environ = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
    return environ
