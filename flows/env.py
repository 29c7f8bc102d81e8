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
``THP_MEM_ALLOC_ENABLE``
    torch's CPU tensors of 2 MiB and more on transparent huge pages (torch's own switch: its CPU
    allocator ``madvise``-s them; set here before torch loads, and child processes, launched ranks
    and stage subprocesses inherit it). torch caches no CPU memory, so every large activation of a
    training step is fresh memory the kernel faults in, 4 KiB at a time; on a 2-core AVX2 EPYC
    ``x * 1.1`` on a 100 MB tensor took 100 ms that way and 33 ms on huge pages (a whole MiniLM
    training step's gain from it was within that machine's run-to-run noise: docs/experiments.md).
    Where the kernel's THP setting is ``never`` it changes nothing.
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
    "THP_MEM_ALLOC_ENABLE": "1",
}


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set each of :data:`DEFAULTS` that ``environ`` (default: this process's) lacks; returns it."""
    environ = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
    return environ
