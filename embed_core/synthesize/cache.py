"""Content-addressed cache of LLM requests (SQLite in the run directory).

Key = sha256 over (model, mode, prompt name and version, rendered prompt, sampling parameters,
attempt number). Each answer is committed as soon as it arrives, so an interrupted run resumes
without repeating finished calls and an unchanged rerun makes no calls at all. The attempt number
is part of the key because a malformed answer is retried with a fresh request: replaying the same
attempts from the cache gives the same outcome without the server.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any


def request_key(*, model: str, mode: str, prompt: str, prompt_version: str, rendered: Any,
                sampling: dict[str, Any], attempt: int) -> str:
    blob = json.dumps({"model": model, "mode": mode, "prompt": prompt, "version": prompt_version,
                       "rendered": rendered, "sampling": sampling, "attempt": attempt},
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class RequestCache:
    """``get(key)`` → the stored answer (text, token counts) or None; ``put`` commits at once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, text TEXT NOT NULL, "
                         "prompt_tokens INTEGER, completion_tokens INTEGER, created REAL)")
        self._db.commit()

    def get(self, key: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT text, prompt_tokens, completion_tokens FROM answers WHERE key = ?",
                               (key,)).fetchone()
        if row is None:
            return None
        return {"text": row[0], "prompt_tokens": row[1] or 0, "completion_tokens": row[2] or 0}

    def put(self, key: str, text: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)",
                         (key, text, prompt_tokens, completion_tokens, time.time()))
        self._db.commit()

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        self._db.close()
