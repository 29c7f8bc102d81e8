"""Rebuild the demo samples in data/ from ../shared/data (run from the repository root).

Deterministic: every sample is a fixed stride through the source file, so labels and genres
stay mixed. Licences and sources: data/README.md.
"""

from __future__ import annotations

import csv
import gzip
import io
import shutil
from pathlib import Path

SHARED = Path("../shared/data")
OUT = Path("data")


def stride_lines(src: Path, dst: Path, n: int, header: bool) -> None:
    """Every k-th record. CSV files are split with the csv module: a quoted field may hold a newline."""
    text = src.read_text(encoding="utf-8")
    if src.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(text, newline="")))
        out = io.StringIO(newline="")
        writer = csv.writer(out, lineterminator="\n")
        head, body = (rows[:1], rows[1:]) if header else ([], rows)
        writer.writerows(head + body[:: max(1, len(body) // n)][:n])
        records = out.getvalue()
    else:
        lines = text.splitlines(keepends=True)
        head, body = (lines[:1], lines[1:]) if header else ([], lines)
        records = "".join(head + body[:: max(1, len(body) // n)][:n])
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(records, encoding="utf-8")


def copy(src: Path, dst: Path, compress: bool = False) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with open(src, "rb") as fi, gzip.GzipFile(dst, "wb", mtime=0) as fo:
            shutil.copyfileobj(fi, fo)
    else:
        shutil.copyfile(src, dst)


def main() -> None:
    stride_lines(SHARED / "stsb_en/stsb-en-train.csv", OUT / "stsb/train.csv", 1000, header=False)
    copy(SHARED / "stsb_en/stsb-en-test.csv", OUT / "stsb/test.csv")
    copy(SHARED / "stsb_en/LICENSE.txt", OUT / "stsb/LICENSE.txt")
    stride_lines(SHARED / "sick/SICK_train.txt", OUT / "sick/train.tsv", 1000, header=True)
    copy(SHARED / "sick/readme.txt", OUT / "sick/readme.txt")
    sci = SHARED / "beir/scifact"
    copy(sci / "corpus.jsonl", OUT / "scifact/corpus.jsonl.gz", compress=True)
    copy(sci / "queries.jsonl", OUT / "scifact/queries.jsonl")
    copy(sci / "qrels/train.tsv", OUT / "scifact/qrels/train.tsv")
    copy(sci / "qrels/test.tsv", OUT / "scifact/qrels/test.tsv")
    stride_lines(SHARED / "banking77/train.csv", OUT / "banking77/train.csv", 1000, header=True)
    copy(SHARED / "banking77/test.csv", OUT / "banking77/test.csv")
    copy(SHARED / "banking77/LICENSE.txt", OUT / "banking77/LICENSE.txt")
    fe = SHARED / "flagembedding_examples"
    copy(fe / "toy_finetune_data.jsonl", OUT / "flagembedding/toy_finetune_data.jsonl")
    copy(fe / "embedder/retrieval/msmarco.jsonl", OUT / "flagembedding/msmarco.jsonl")


if __name__ == "__main__":
    main()
