"""Prefect flows: composition of tasks only. Importing this package sets privacy defaults."""

import os

# No telemetry from a pipeline that runs on users' data (settable by the user, never overridden).
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# embed_core logs through the standard "embedpipe" logger; show it in Prefect's run logs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "embedpipe")
# The ephemeral server migrates its SQLite database on first start; on 2 busy cores that can
# exceed Prefect's 20 s default.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
