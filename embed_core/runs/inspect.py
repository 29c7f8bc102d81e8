"""``embedpipe inspect PATH``: schema, counts per dataset/task/origin and sample rows of record files.

Everything printed that comes from a file (texts, ids, names, paths) goes through
``errors.printable``: a record file from someone else cannot write terminal escapes or bidi
overrides (shown as ``\x1b``, ``\u202e``) to the terminal."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from embed_core.manifests import MANIFEST, Manifest
from embed_core.errors import EmbedpipeError, printable
from embed_core.schema import SCHEMA_VERSION_KEY


def _record_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        if (path / MANIFEST).exists():
            return [path / name for name in Manifest.read(path.parent, path.name).hashes("records")]
        files = sorted(p for p in path.rglob("*.parquet") if not p.name.startswith(("_", ".")))
        if files:
            return files
    raise EmbedpipeError(f"{path}: no Parquet record files found")


def _short(text: object, n: int = 70) -> str:
    """``text`` on one line, escaped (``printable``), at most ``n`` characters."""
    return printable(" ".join(str(text).split()), n)


def inspect_path(path: str | Path, samples: int = 3) -> str:
    path = Path(path)
    out: list[str] = []
    for file in _record_files(path):
        try:
            pf = pq.ParquetFile(file)
            table = pf.read()
        except (pa.ArrowException, OSError) as exc:
            raise EmbedpipeError(f"{file}: not a readable Parquet file: {exc}") from None
        meta = pf.schema_arrow.metadata or {}
        version = meta.get(SCHEMA_VERSION_KEY, b"?").decode("utf-8", "surrogateescape")
        out.append(f"== {printable(file)}  ({table.num_rows} rows, schema version {_short(version, 20)})")
        out.append("schema: " + printable(", ".join(f"{f.name}: {f.type}" for f in table.schema)))
        if {"dataset", "task", "origin"} <= set(table.column_names):
            combos = Counter(zip(table.column("dataset").to_pylist(), table.column("task").to_pylist(),
                                 table.column("origin").to_pylist()))
            out.append("counts (dataset / task / origin):")
            out += [f"  {_short(d)} / {_short(t)} / {_short(o)}: {n}" for (d, t, o), n in sorted(combos.items())]
        for row in table.slice(0, samples).to_pylist():
            if "query" in row:
                out.append(f"  [{_short(row['id'])}] q: {_short(row['query'])}")
                out.append(f"      +{len(row['positives'])} {_short(row['positives'][0]) if row['positives'] else ''}"
                           f" scores={_short(row['positive_scores'][:3])} -{len(row['negatives'])}"
                           f" label={_short(row['label'])}")
            else:
                out.append("  " + _short(json.dumps(row, default=str), 150))
    return "\n".join(out)
