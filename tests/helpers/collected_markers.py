"""A pytest plugin for tests of test selection (``-p tests.helpers.collected_markers``): writes each
selected test's node id and marker names as JSON to the file named by ``EMBEDPIPE_COLLECTED_OUT``."""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "EMBEDPIPE_COLLECTED_OUT"


def pytest_collection_finish(session) -> None:
    out = os.environ.get(ENV)
    if out and not hasattr(session.config, "workerinput"):
        Path(out).write_text(json.dumps({item.nodeid: sorted({m.name for m in item.iter_markers()})
                                         for item in session.items}))
