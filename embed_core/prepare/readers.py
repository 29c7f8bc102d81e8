"""Read raw source files row by row, keeping the file and line of every row.

Bad rows never stop a read: a malformed line, bad JSON or non-UTF-8 bytes come out as a
``RowError`` in the stream (the caller quarantines it) and reading goes on. Problems that make
the whole file unusable (missing file, a configured column absent from the header) raise
``SourceError`` before any row is produced.

Text is decoded as UTF-8 with ``surrogateescape`` so that one undecodable byte spoils only its
own field, which is reported by name. A byte-order mark is dropped, and a file that starts with a
UTF-16 or UTF-32 one (what editors and spreadsheets write as "Unicode text") is decoded as such;
any other encoding (cp1252, latin-1) is not guessed: its rows with non-UTF-8 bytes are quarantined.
Lines end in ``\n`` or ``\r\n``; a file with no ``\n`` is split at ``\r`` (old Mac) or at
U+2028/U+2029/U+0085, whichever it holds. Every text value of every row goes through
``cleaning.clean_text`` (one normalisation for every reader); a row with an unusable text comes out
as a ``RowError``.

Roots: every file is opened through ``confine``, which follows its symlinks and refuses a path
that ends outside its root (``data_root`` for configured paths, see ``root_for``), so a data
folder from someone else cannot make a run read ``~/.aws/credentials``. Files are streamed (a line or a Parquet batch at a time);
a file that is damaged (truncated gzip, not Parquet, unreadable) is a ``SourceError``, never a
silently shortened dataset.

CSV: by default a record is one line, and a quote left open at the end of its line quarantines
that line only (reason ``stray_quote``); ``multiline: true`` reads RFC 4180 quoted fields that span
lines, and a quote that never closes is reported at the line where it opened with the count of
lines it made unreadable.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import itertools
import json
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from embed_core.errors import RowError, SourceError, printable
from embed_core.paths import OutsideRootError, file_problem, resolve_within
from embed_core.prepare.cleaning import UnusableText, clean_text, is_clean

csv.field_size_limit(sys.maxsize)

FORMATS = ("csv", "tsv", "delimited", "jsonl", "parquet")


@dataclass
class RawRow:
    file: str  # path as the user wrote it (stable across machines, used in source_ref)
    row: int  # 1-based physical line (header included); 1-based data row for Parquet
    values: dict[str, Any]

    @property
    def ref(self) -> str:
        return f"{self.file}:{self.row}"


def infer_format(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    for suffix, fmt in ((".csv", "csv"), (".tsv", "tsv"), (".jsonl", "jsonl"), (".json", "jsonl"),
                        (".parquet", "parquet"), (".txt", "delimited")):
        if name.endswith(suffix):
            return fmt
    raise SourceError(str(path), None, None, "unknown_format",
                      "cannot infer the format from the file name; set 'format' in the source config")


# What a damaged file raises while it is read: gzip (bad header, truncated stream, bad CRC),
# zlib, the OS, and Arrow (not a Parquet file, truncated footer).
_READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)


EXCERPT_CHARS = 40


def excerpt(value: object) -> str:
    """What an error message may show of a file's content: at most ``EXCERPT_CHARS`` characters,
    escaped (``errors.printable``). A file that is not what the config says (a credentials file
    behind a symlink, a binary) must not end up in a terminal, a log or Prefect's database."""
    return printable(value, EXCERPT_CHARS)


def root_for(resolve: Callable[[str], Path], configured: str) -> Path:
    """The folder a configured path may not leave: ``data_root`` (``resolve(".")``) when the path
    lies in it, else the folder the config names it in (an absolute or ``../`` path)."""
    root = Path(os.path.normpath(resolve(".")))
    target = Path(os.path.normpath(resolve(configured)))
    return root if target.is_relative_to(root) else target.parent


def confine(path: Path, display: str, root: Path | None) -> Path:
    """``path`` with every symlink followed, when that stays inside ``root`` (itself resolved:
    ``paths.resolve_within``); otherwise a ``SourceError`` naming the path. ``root`` None: the path's
    own folder. The one check every reader (and a directory walk, file by file) makes before it
    opens anything."""
    root = Path(os.path.normpath(path)).parent if root is None else root
    try:  # both absolute: a data_root relative to the working directory ("data") is not joined twice
        return resolve_within(os.path.abspath(root), os.path.abspath(path))
    except OutsideRootError:
        raise SourceError(display, None, None, "outside_root",
                          f"leaves data_root: it is or passes through a symlink to a place outside {root}; "
                          "copy the file into data_root, or name the target's own path in the config if you "
                          "trust it") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise SourceError(display, None, None, "unreadable", f"cannot resolve the path: {exc}") from None


def _check_file(path: Path, display: str) -> None:
    problem = file_problem(path)  # the rule every reader of a given file applies (embed_core.paths)
    if problem == "not found":
        raise SourceError(display, None, None, "missing_file", f"file not found (resolved to {path})")
    if problem is not None:
        raise SourceError(display, None, None, "not_a_file", f"{problem} (resolved to {path})")


def _damaged(display: str, line: int | None, exc: BaseException) -> SourceError:
    kind = "gzip stream" if display.endswith(".gz") else "file"
    detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    at = f" after line {line}" if line else ""
    return SourceError(display, None, None, "unreadable", f"cannot read the {kind}{at}: {detail}")


@contextmanager
def open_binary(path: Path, display: str, root: Path | None = None) -> Iterator[BinaryIO]:
    """The file's bytes as a stream ('.gz' decompressed on the fly); opening problems (and a path
    that leaves ``root``, see ``confine``) are ``SourceError`` naming the file."""
    gz = path.name.endswith(".gz")  # the name configured, not the target's
    path = confine(path, display, root)
    _check_file(path, display)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise SourceError(display, None, None, "unreadable", f"cannot open: {exc.strerror}") from None
    try:
        yield gzip.GzipFile(fileobj=fh, mode="rb") if gz else fh  # type: ignore[misc]
    finally:
        fh.close()


_CHUNK = 1 << 20
# Byte-order marks, longest first (UTF-32 LE starts like UTF-16 LE).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
# Line ends by the file's convention: (pattern, longest separator in bytes). A file holding "\n"
# uses "\n" or "\r\n"; one with no "\n" but "\r" is old Mac; else U+2028/U+2029/U+0085 (in UTF-8).
_LF = (re.compile(rb"\r?\n"), 2)
_CR = (re.compile(rb"\r"), 1)
_UNICODE_BREAKS = (re.compile(rb"\xe2\x80[\xa8\xa9]|\xc2\x85"), 3)


def _utf8_chunks(stream: BinaryIO, display: str) -> Iterator[bytes]:
    """The file's text as UTF-8 bytes, byte-order mark dropped; a UTF-16/32 file (by its BOM) is
    decoded on the fly (a lone surrogate passes through, to be quarantined with its row)."""
    head = stream.read(_CHUNK)
    encoding = next((enc for bom, enc in _BOMS if head.startswith(bom)), None)
    rest = iter(lambda: stream.read(_CHUNK), b"")
    if encoding is None or encoding == "utf-8":
        yield head.removeprefix(codecs.BOM_UTF8)
        yield from rest
        return
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    bom = next(bom for bom, enc in _BOMS if enc == encoding)
    for data in itertools.chain([head[len(bom):]], rest):
        yield decoder.decode(data).encode("utf-8", "surrogatepass")
    try:
        yield decoder.decode(b"", final=True).encode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise SourceError(display, None, None, "encoding",
                          f"starts with a {encoding.upper()} byte-order mark but ends inside a character "
                          "(truncated file?)") from None


def _split_lines(chunks: Iterable[bytes], pattern: re.Pattern[bytes], longest: int) -> Iterator[bytes]:
    """Lines of a chunked byte stream, without their line ends; linear in the size however long a line."""
    parts: list[bytes] = []  # the current line so far
    carry = b""  # the last bytes of a chunk, which may begin a line end the next chunk completes
    for chunk in chunks:
        pieces = pattern.split(carry + chunk)
        if len(pieces) > 1:
            yield b"".join((*parts, pieces[0]))
            parts = []
            yield from pieces[1:-1]
        last = pieces[-1]
        keep = min(longest - 1, len(last))
        carry = last[len(last) - keep:] if keep else b""
        parts.append(last[:len(last) - keep])
    tail = b"".join((*parts, carry))
    if tail:
        yield tail.removesuffix(b"\r") if pattern is _LF[0] else tail


def _line_ends(chunks: Iterator[bytes], unicode_breaks: bool) -> tuple[tuple[re.Pattern[bytes], int], Iterator[bytes]]:
    """The file's line-end convention, by the first chunk that holds a line end (and the one after
    it, for a "\r\n" split between them), and the chunks again from the start."""
    seen: list[bytes] = []
    for chunk in chunks:
        seen.append(chunk)
        if b"\n" in chunk:
            return _LF, itertools.chain(seen, chunks)
        if b"\r" in chunk:
            seen.append(next(chunks, b""))
            return (_LF if b"\n" in seen[-1] else _CR), itertools.chain(seen, chunks)
        if len(seen) == 1 and unicode_breaks and _UNICODE_BREAKS[0].search(chunk):
            return _UNICODE_BREAKS, itertools.chain(seen, chunks)
    return _LF, iter(seen)


def read_lines(path: Path, display: str, root: Path | None = None, *,
               unicode_breaks: bool = True) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its line break) in constant memory, as UTF-8 bytes. A
    file that turns out damaged part-way (truncated gzip, I/O error) raises ``SourceError`` naming
    the file and the last line read: the stage stops rather than writing a silently shortened dataset.
    ``unicode_breaks`` False: U+2028/U+2029/U+0085 never end a line (JSON strings may hold them raw)."""
    with open_binary(path, display, root) as stream:
        line_no = 0
        try:
            (pattern, longest), chunks = _line_ends(_utf8_chunks(stream, display), unicode_breaks)
            for line_no, raw in enumerate(_split_lines(chunks, pattern, longest), start=1):
                yield line_no, raw
        except _READ_ERRORS as exc:
            raise _damaged(display, line_no, exc) from None


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")


def _bad_bytes(value: str) -> str | None:
    """Describe the first undecodable byte in ``value`` (surrogate-escaped), or None."""
    for ch in value:
        if "\udc80" <= ch <= "\udcff":
            return f"non-UTF-8 byte 0x{ord(ch) - 0xDC00:02x}"
    return None


def column_label(column: str | int) -> str:
    return f"#{column}" if isinstance(column, int) else column


def _clean_values(display: str, row: int, values: dict[Any, Any]) -> RawRow | RowError:
    """The row with ``clean_text`` applied to every text in it (nested lists and objects included),
    or the RowError of its first unusable text, naming the field."""
    texts = [v for v in values.values() if type(v) is str]
    if len(texts) == len(values) and is_clean("".join(texts)):  # the common case: a row of clean texts
        return RawRow(display, row, values)

    def clean(value: Any, where: str) -> Any:
        if isinstance(value, str):
            try:
                return clean_text(value)
            except UnusableText as exc:
                raise RowError(display, row, where, exc.reason, str(exc)) from None
        if isinstance(value, list):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}") for k, v in value.items()}
        return value

    try:
        return RawRow(display, row, {k: clean(v, column_label(k)) for k, v in values.items()})
    except RowError as err:
        return err


class _ChunkStream(io.RawIOBase):
    """A readable binary stream over an iterator of byte chunks (for ``io.TextIOWrapper``)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            self._pending = next(self._chunks, b"")
            if not self._pending:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _csv_records_by_line(path: Path, display: str, delimiter: str, quoting: int,
                         root: Path | None) -> Iterator[tuple[int, list[str] | RowError]]:
    """One CSV record per physical line. A quote still open at the end of its line is a stray
    quote: that line is reported and the next line starts a new record, so one bad quote costs
    exactly one row (csv's own reader would merge every line up to the next quote into it)."""
    for line_no, raw in read_lines(path, display, root):
        line = _decode(raw)
        try:
            yield line_no, next(csv.reader([line], delimiter=delimiter, quoting=quoting, strict=True))
        except StopIteration:
            yield line_no, []
        except csv.Error as exc:
            if str(exc) == "unexpected end of data":
                yield line_no, RowError(display, line_no, None, "stray_quote",
                                        "a quote opened on this line is not closed on it (stray quote; if quoted "
                                        "fields span lines in this file, set multiline: true on the source)")
            else:
                yield line_no, RowError(display, line_no, None, "malformed_line", f"malformed line: {exc}")


def _csv_records_multiline(path: Path, display: str, delimiter: str, quoting: int,
                           root: Path | None) -> Iterator[tuple[int, list[str] | RowError]]:
    """RFC 4180 records whose quoted fields may span lines (ended by \n, \r\n or \r); each is
    numbered by the line it starts on."""
    with open_binary(path, display, root) as stream:
        text = io.TextIOWrapper(io.BufferedReader(_ChunkStream(_utf8_chunks(stream, display))), encoding="utf-8",
                                errors="surrogateescape", newline="")
        reader = csv.reader(text, delimiter=delimiter, quoting=quoting, strict=True)
        while True:
            start = reader.line_num + 1
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                if str(exc) == "unexpected end of data":  # a quote opened at `start` never closes
                    lost = reader.line_num - start + 1
                    yield start, RowError(display, start, None, "unterminated_quote",
                                          f"a quoted field opened on this line is never closed: lines {start}-"
                                          f"{reader.line_num} ({lost} lines) could not be read as rows")
                    return
                yield start, RowError(display, start, None, "malformed_line", f"malformed line: {exc}")
                continue
            except _READ_ERRORS as exc:
                raise _damaged(display, reader.line_num, exc) from None
            # A record that spans lines starts on the first line that holds any of it.
            yield start, fields


def read_delimited(path: Path, display: str, *, delimiter: str, header: bool, quoting: str,
                   required: Sequence[str | int], multiline: bool = False,
                   root: Path | None = None) -> Iterator[RawRow | RowError]:
    quote = csv.QUOTE_NONE if quoting == "none" else csv.QUOTE_MINIMAL
    records = (_csv_records_multiline if multiline and quote != csv.QUOTE_NONE else _csv_records_by_line)(
        path, display, delimiter, quote, root)
    names: list[str] | None = None
    expected_fields: int | None = None
    for line, fields in records:
        if isinstance(fields, RowError):
            yield fields
            continue
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue  # blank line
        if header and names is None:
            names = [_header_name(f) for f in fields]
            first_at: dict[str, int] = {}
            for i, name in enumerate(names):
                if name in first_at:
                    raise SourceError(display, line, name, "duplicate_column",
                                      f"column appears twice in the header (columns {first_at[name] + 1} and {i + 1})")
                first_at[name] = i
            missing = [c for c in required if isinstance(c, str) and c not in names]
            if missing:
                raise SourceError(display, line, missing[0], "missing_column",
                                  f"column not in header (header has: {excerpt(', '.join(names))})")
            expected_fields = len(names)
            continue
        if expected_fields is None:
            expected_fields = len(fields)
            too_high = [c for c in required if isinstance(c, int) and c >= expected_fields]
            if too_high:
                raise SourceError(display, line, column_label(too_high[0]), "missing_column",
                                  f"column index out of range (first row has {expected_fields} fields)")
        if len(fields) != expected_fields:
            yield RowError(display, line, None, "malformed_line",
                           f"malformed line: expected {expected_fields} fields, got {len(fields)}")
            continue
        keys = names if names is not None else list(range(len(fields)))
        values = dict(zip(keys, fields))
        bad = next(((k, d) for k, v in values.items() if (d := _bad_bytes(v))), None)
        if bad is not None:
            yield RowError(display, line, column_label(bad[0]), "encoding", bad[1])
            continue
        yield _clean_values(display, line, values)


def _header_name(field: str) -> str:
    """A header cell as a column name: cleaned like any text (an unusable one is kept as written,
    so the missing-column error shows it escaped)."""
    try:
        return clean_text(field).strip()
    except UnusableText:
        return field.strip()


def read_jsonl(path: Path, display: str, root: Path | None = None) -> Iterator[RawRow | RowError]:
    for line_no, raw in read_lines(path, display, root, unicode_breaks=False):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield RowError(display, line_no, None, "encoding",
                           f"non-UTF-8 byte 0x{raw[exc.start]:02x} at column {exc.start + 1}")
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield RowError(display, line_no, None, "malformed_json", f"malformed JSON: {exc.msg} at column {exc.colno}")
            continue
        except (RecursionError, ValueError) as exc:  # nesting depth, integers over the digit limit
            yield RowError(display, line_no, None, "malformed_json", f"malformed JSON: {type(exc).__name__}: {exc}"[:300])
            continue
        if not isinstance(obj, dict):
            yield RowError(display, line_no, None, "malformed_json", f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield _clean_values(display, line_no, obj)


def read_parquet(path: Path, display: str, required: Sequence[str | int],
                 root: Path | None = None) -> Iterator[RawRow | RowError]:
    """Rows of a Parquet file, one record batch at a time (memory bounded by the batch, not the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = confine(path, display, root)
    _check_file(path, display)
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, *_READ_ERRORS) as exc:
        raise SourceError(display, None, None, "unreadable", f"not a readable Parquet file: {exc}") from None
    names = parquet.schema_arrow.names
    missing = [c for c in required if isinstance(c, str) and c not in names]
    if missing:
        raise SourceError(display, None, missing[0], "missing_column",
                          f"column not in file (it has: {excerpt(', '.join(names))})")
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=8192):
            for values in batch.to_pylist():
                row += 1
                yield _clean_values(display, row, values)
    except (pa.ArrowException, *_READ_ERRORS) as exc:
        raise SourceError(display, row + 1, None, "unreadable", f"cannot read the Parquet file: {exc}") from None


def read_rows(path: Path, display: str, *, fmt: str | None = None, delimiter: str | None = None,
              header: bool = True, quoting: str = "auto", multiline: bool = False,
              required: Sequence[str | int] = (), root: Path | None = None) -> Iterator[RawRow | RowError]:
    """Rows of one file as ``RawRow`` (or ``RowError`` for a bad row), in file order; ``root``: the
    folder the file may not leave (``root_for``; None: its own folder)."""
    fmt = fmt or infer_format(path)
    if fmt == "jsonl":
        return read_jsonl(path, display, root)
    if fmt == "parquet":
        return read_parquet(path, display, required, root)
    if fmt in ("csv", "tsv", "delimited"):
        delim = delimiter or {"csv": ",", "tsv": "\t"}.get(fmt)
        if delim is None:
            raise SourceError(display, None, None, "config", "format 'delimited' needs a 'delimiter'")
        # TSV and custom-delimited text rarely quote, and their texts contain bare quotes
        # (MRPC: "the witness"); csv's quote handling would merge lines there.
        q = quoting if quoting != "auto" else ("minimal" if fmt == "csv" else "none")
        return read_delimited(path, display, delimiter=delim, header=header, quoting=q, required=required,
                              multiline=multiline, root=root)
    raise SourceError(display, None, None, "unknown_format", f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
