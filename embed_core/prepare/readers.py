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

CSV and TSV: by default quoted fields may span lines (RFC 4180: what pandas, Excel and Python's
csv write, read into the records pandas reads); a record is numbered by the line it starts on. A
broken record costs only its first line, as pandas' ``on_bad_lines`` keeps the good rows: a quote
that never closes (``unterminated_quote``), a record that does not parse into the file's number of
fields (``malformed_line``), or a quoted field whose inner lines are each a row of the file's shape
(``stray_quote``: what a stray quote swallows) quarantines the line it started on, and the lines
after it are read again as rows. ``multiline: false`` makes a record one line: a quote left open
at the end of its line quarantines that line only (reason ``stray_quote``).

Bounds (``ReadLimits``, a source's ``limits``): a line, a field, a record and the decompressed file
have a size past which the row is quarantined (``line_too_long``, ``field_too_long``,
``record_too_long``) or the file refused (``too_large``), always before the oversized thing is
held in memory: a line is dropped chunk by chunk once past its bound, a record's lines once past
its bound, a Parquet cell is measured in Arrow (or judged from the file's metadata).
"""

from __future__ import annotations

import codecs
import csv
import gzip
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
from typing import Any, BinaryIO, NamedTuple

from embed_core.config_base import ReadLimits
from embed_core.errors import RowError, SourceError, printable
from embed_core.paths import OutsideRootError, file_problem, resolve_within
from embed_core.prepare.cleaning import UnusableText, clean_text, is_clean

csv.field_size_limit(sys.maxsize)

FORMATS = ("csv", "tsv", "delimited", "jsonl", "parquet")
DEFAULT_LIMITS = ReadLimits()


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


def size_text(n: int) -> str:
    """``n`` bytes for a message: in GiB, MiB or KiB when it is a whole number of them."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def over_bound(bound: str, size: int | None, limit: int) -> str:
    """The message part that names a bound of ``ReadLimits`` passed, and how to raise it."""
    was = f"{size_text(size)}, " if size is not None else ""
    return (f"{was}more than limits.{bound} ({size_text(limit)}); raise limits.{bound} in the config if the file "
            "really holds that")


class _ExpansionBound:
    """A decompressing stream that refuses to give more than ``limit`` bytes: a compression bomb is
    one error line once the bound is passed, not minutes of decompression."""

    def __init__(self, stream: BinaryIO, display: str, limit: int):
        self._stream, self._display, self._limit, self._seen = stream, display, limit, 0

    def read(self, n: int = 1 << 20) -> bytes:
        data = self._stream.read(n)
        self._seen += len(data)
        if self._seen > self._limit:
            raise SourceError(self._display, None, None, "too_large",
                              "expands when decompressed to " + over_bound("max_decompressed_bytes", None, self._limit))
        return data


@contextmanager
def open_binary(path: Path, display: str, root: Path | None = None,
                limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[BinaryIO]:
    """The file's bytes as a stream ('.gz' decompressed on the fly, to at most
    ``limits.max_decompressed_bytes``); opening problems (and a path that leaves ``root``, see
    ``confine``) are ``SourceError`` naming the file."""
    gz = path.name.endswith(".gz")  # the name configured, not the target's
    path = confine(path, display, root)
    _check_file(path, display)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise SourceError(display, None, None, "unreadable", f"cannot open: {exc.strerror}") from None
    try:
        if gz:
            yield _ExpansionBound(gzip.GzipFile(fileobj=fh, mode="rb"), display,  # type: ignore[misc]
                                  limits.max_decompressed_bytes)
        else:
            yield fh
    finally:
        fh.close()


_CHUNK = 1 << 20
# Byte-order marks, longest first (UTF-32 LE starts like UTF-16 LE).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
class _Breaks(NamedTuple):
    """A line-end convention: its pattern (one group: the line end), the longest line end in bytes,
    and byte strings one of which a chunk holds whenever it holds a line end (a fast test)."""

    pattern: re.Pattern[bytes]
    longest: int
    markers: tuple[bytes, ...]


# Line ends by the file's convention. A file holding "\n" uses "\n" or "\r\n"; one with no "\n"
# but "\r" is old Mac; else U+2028/U+2029/U+0085 (in UTF-8).
_LF = _Breaks(re.compile(rb"(\r?\n)"), 2, (b"\n",))
_CR = _Breaks(re.compile(rb"(\r)"), 1, (b"\r",))
_UNICODE_BREAKS = _Breaks(re.compile(rb"(\xe2\x80[\xa8\xa9]|\xc2\x85)"), 3, (b"\xe2\x80", b"\xc2\x85"))


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


def _split_lines(chunks: Iterable[bytes], breaks: _Breaks, max_line: int) -> Iterator[tuple[bytes | None, bytes]]:
    """(line, its line end) of a chunked byte stream; linear in the size however long a line. A line
    of more than ``max_line`` bytes comes out as (None, its end): its bytes are dropped as they
    arrive, so however long it is, at most ``max_line`` bytes of it are held."""
    parts: list[bytes] = []  # the current line so far
    size, over = 0, False  # its bytes so far; whether it passed max_line
    carry = b""  # the last bytes of a chunk, which may begin a line end the next chunk completes
    for chunk in chunks:
        data = carry + chunk
        last = data
        if any(marker in data for marker in breaks.markers):
            pieces = breaks.pattern.split(data)  # [line, end, line, end, ..., rest]
            if len(pieces) > 1:
                first = pieces[0]
                yield (None if over or size + len(first) > max_line else b"".join((*parts, first))), pieces[1]
                parts, size, over = [], 0, False
                for i in range(2, len(pieces) - 1, 2):
                    yield (None if len(pieces[i]) > max_line else pieces[i]), pieces[i + 1]
                last = pieces[-1]
        keep = min(breaks.longest - 1, len(last))
        carry = last[len(last) - keep:] if keep else b""
        body = last[:len(last) - keep]
        if body and not over:
            size += len(body)
            over = size > max_line
            if over:
                parts = []
            else:
                parts.append(body)
    if over or size + len(carry) > max_line:
        yield None, b""
    elif parts or carry:
        tail = b"".join((*parts, carry))
        if breaks is _LF and tail.endswith(b"\r"):
            yield tail[:-1], b"\r"
        else:
            yield tail, b""


def _line_ends(chunks: Iterator[bytes], unicode_breaks: bool, max_line: int) -> tuple[_Breaks, Iterator[bytes]]:
    """The file's line-end convention, by the first chunk that holds a line end (and the one after
    it, for a "\r\n" split between them), and the chunks again from the start. A first line over
    ``max_line`` bytes decides "\n" (it is quarantined anyway), so no more than that is held."""
    seen: list[bytes] = []
    held = 0
    for chunk in chunks:
        seen.append(chunk)
        held += len(chunk)
        if b"\n" in chunk:
            return _LF, itertools.chain(seen, chunks)
        if b"\r" in chunk:
            seen.append(next(chunks, b""))
            return (_LF if b"\n" in seen[-1] else _CR), itertools.chain(seen, chunks)
        if len(seen) == 1 and unicode_breaks and _UNICODE_BREAKS.pattern.search(chunk):
            return _UNICODE_BREAKS, itertools.chain(seen, chunks)
        if held > max_line:
            return _LF, itertools.chain(seen, chunks)
    return _LF, iter(seen)


def read_lines_with_ends(path: Path, display: str, root: Path | None = None, *, unicode_breaks: bool = True,
                         limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[tuple[int, bytes | None, bytes]]:
    """(1-based line number, line without its line end, the line end) in constant memory, as UTF-8
    bytes; a line over ``limits.max_line_bytes`` is None (its bytes never held). A file that turns
    out damaged part-way (truncated gzip, I/O error) raises ``SourceError`` naming the file and the
    last line read: the stage stops rather than writing a silently shortened dataset.
    ``unicode_breaks`` False: U+2028/U+2029/U+0085 never end a line (JSON strings may hold them raw)."""
    with open_binary(path, display, root, limits) as stream:
        line_no = 0
        try:
            breaks, chunks = _line_ends(_utf8_chunks(stream, display), unicode_breaks, limits.max_line_bytes)
            for line_no, (raw, end) in enumerate(_split_lines(chunks, breaks, limits.max_line_bytes), start=1):
                yield line_no, raw, end
        except _READ_ERRORS as exc:
            raise _damaged(display, line_no, exc) from None


def read_lines(path: Path, display: str, root: Path | None = None, *, unicode_breaks: bool = True,
               limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, line without its line break): ``read_lines_with_ends`` without the ends."""
    for line_no, raw, _ in read_lines_with_ends(path, display, root, unicode_breaks=unicode_breaks, limits=limits):
        yield line_no, raw


def line_too_long(display: str, line: int, limits: ReadLimits) -> RowError:
    return RowError(display, line, None, "line_too_long",
                    "line of " + over_bound("max_line_bytes", None, limits.max_line_bytes))


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # an undecodable byte, as surrogateescape decodes it


def _bad_bytes(value: str) -> str | None:
    """Describe the first undecodable byte in ``value`` (surrogate-escaped), or None."""
    found = _ESCAPED_BYTE.search(value)
    return None if found is None else f"non-UTF-8 byte 0x{ord(found.group()) - 0xDC00:02x}"


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


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _field_too_long(display: str, row: int, values: dict[Any, Any], limit: int) -> RowError | None:
    """The RowError of the first text value over ``limit`` bytes (UTF-8), naming its field; else None."""
    for key, value in values.items():
        if isinstance(value, (str, bytes)) and len(value) * (4 if isinstance(value, str) else 1) > limit:
            size = utf8_size(value) if isinstance(value, str) else len(value)
            if size > limit:
                return RowError(display, row, column_label(key), "field_too_long",
                                "field of " + over_bound("max_field_bytes", size, limit))
    return None


_QUOTE_RUN = re.compile(r'"+')


def _quote_open_after(line: str, delimiter: str, in_quotes: bool) -> bool:
    """Whether a quoted field is still open at the end of ``line`` (RFC 4180 as Python's csv and
    pandas read it: a quote opens a field only where the field starts; inside, ``""`` is a quote
    and an odd run of quotes closes it), given whether one was open at its start."""
    if '"' not in line:
        return in_quotes
    pos = 0
    while True:
        if in_quotes:
            run = _QUOTE_RUN.search(line, pos)
            while run is not None and (run.end() - run.start()) % 2 == 0:
                run = _QUOTE_RUN.search(line, run.end())
            if run is None:
                return True
            nxt = line.find(delimiter, run.end())  # the rest of this field is text (or malformed)
            if nxt < 0:
                return False
            pos, in_quotes = nxt + 1, False
        if line.startswith('"', pos):
            pos, in_quotes = pos + 1, True
            continue
        opens = line.find(delimiter + '"', pos)
        if opens < 0:
            return False
        pos, in_quotes = opens + 2, True


def _parse_record(display: str, start: int, lines: list[str], delimiter: str, quoting: int) -> list[str] | RowError:
    """The fields of one record from its lines (line ends inside quoted fields as separate items)."""
    try:
        return next(csv.reader(lines, delimiter=delimiter, quoting=quoting, strict=True))
    except StopIteration:
        return []
    except csv.Error as exc:
        if str(exc) == "unexpected end of data":
            return RowError(display, start, None, "stray_quote",
                            "a quote opened on this line is not closed on it (stray quote; quoted fields may span "
                            "lines only with multiline: true, the default)")
        return RowError(display, start, None, "malformed_line", f"malformed line: {exc}")


def _csv_records_by_line(lines: Iterable[tuple[int, bytes | None, bytes]], display: str, delimiter: str,
                         quoting: int, limits: ReadLimits) -> Iterator[tuple[int, list[str] | RowError]]:
    """One CSV record per physical line. A quote still open at the end of its line is a stray
    quote: that line is reported and the next line starts a new record, so one bad quote costs
    exactly one row (csv's own reader would merge every line up to the next quote into it)."""
    for line_no, raw, _ in lines:
        if raw is None:
            yield line_no, line_too_long(display, line_no, limits)
        elif len(raw) > limits.max_record_bytes:
            yield line_no, RowError(display, line_no, None, "record_too_long", "record of " + over_bound(
                "max_record_bytes", len(raw), limits.max_record_bytes))
        else:
            yield line_no, _parse_record(display, line_no, [_decode(raw)], delimiter, quoting)


class _Lines:
    """(line number, bytes, line end) of a file, into which lines can be put back to be read again."""

    def __init__(self, lines: Iterable[tuple[int, bytes | None, bytes]]):
        self._lines, self._back = iter(lines), []

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> tuple[int, bytes | None, bytes]:
        return self._back.pop() if self._back else next(self._lines)

    def put_back(self, held: list[tuple[int, bytes | None, bytes]]) -> None:
        self._back.extend(reversed(held))


def _csv_records_multiline(lines: Iterable[tuple[int, bytes | None, bytes]], display: str, delimiter: str,
                           quoting: int, limits: ReadLimits,
                           width: Callable[[], int | None] = lambda: None) -> Iterator[tuple[int, list[str] | RowError]]:
    """RFC 4180 records whose quoted fields may span lines, each numbered by the line it starts on,
    recovering from a broken quote as pandas' ``on_bad_lines`` keeps the good rows: a record whose
    quote never closes, that does not parse into the file's ``width()`` fields, or whose quoted
    field holds lines that are rows of the file's shape (``_holds_rows``) costs only its first line
    (quarantined), and the lines after it are read again. A record is cut into lines by
    ``_quote_open_after`` (one bit of state a line) and held only up to ``limits.max_record_bytes``:
    a larger one is quarantined whole (``record_too_long``), its lines never held."""
    source = _Lines(lines)
    for start, raw, end in source:
        if raw is None:
            yield start, line_too_long(display, start, limits)
            continue
        text = _decode(raw)
        if not _quote_open_after(text, delimiter, False):
            yield start, (_dropped(display, start, start, "record_too_long", len(raw), limits)
                          if len(raw) > limits.max_record_bytes else
                          _parse_record(display, start, [text], delimiter, quoting))
            continue
        yield from _quoted_record(source, (start, raw, end), display, delimiter, quoting, limits, width())


def _quoted_record(source: _Lines, first: tuple[int, bytes, bytes], display: str, delimiter: str, quoting: int,
                   limits: ReadLimits, width: int | None) -> Iterator[tuple[int, list[str] | RowError]]:
    """The record a quote opened on ``first`` starts, read from ``source`` until the quote closes;
    when it is broken, its first line quarantined and the other lines put back into ``source``."""
    start = first[0]
    held, size, last = [first], len(first[1]) + len(first[2]), start
    for last, raw, end in source:
        if raw is None:  # an over-long line: its quotes are unknown, so the next line starts a record
            yield start, _dropped(display, start, last, "line_too_long", size, limits)
            return
        held.append((last, raw, end))
        size += len(raw) + len(end)
        if size > limits.max_record_bytes:
            yield start, _skip_record(source, held, display, delimiter, limits)
            return
        if not _quote_open_after(_decode(raw), delimiter, True):
            break
    else:
        yield start, _recover(source, held, display, "unterminated_quote", "a quoted field opened on this line is "
                              "never closed")
        return
    yield start, _closed_record(source, held, display, delimiter, quoting, width)


def _closed_record(source: _Lines, held: list[tuple[int, bytes, bytes]], display: str, delimiter: str, quoting: int,
                   width: int | None) -> list[str] | RowError:
    """The fields of a record whose quote closed on its last held line, unless it is broken."""
    lines = [part for _, raw, end in held for part in (_decode(raw), _decode(end))][:-1]
    fields = _parse_record(display, held[0][0], lines, delimiter, quoting)
    if isinstance(fields, RowError):
        return _recover(source, held, display, fields.reason, fields.detail)
    if width is not None and len(fields) != width:
        return _recover(source, held, display, "malformed_line", f"malformed record: expected {width} fields, got "
                        f"{len(fields)} from lines {held[0][0]}-{held[-1][0]}")
    if len(held) > 2 and _holds_rows(held, delimiter, quoting, width):
        return _recover(source, held, display, "stray_quote", f"a quote opened on this line holds lines {held[1][0]}-"
                        f"{held[-2][0]}, which read as rows of this file")
    return fields


def _holds_rows(held: list[tuple[int, bytes, bytes]], delimiter: str, quoting: int, width: int | None) -> bool:
    """Whether a closed record is what a stray quote swallows: its first and last lines are each a
    row of the file's ``width`` fields with their quote read as text, and every non-blank line
    between them a row of that width on its own. A real quoted field's first and last lines
    together make one row, so both have that width only in a file of one column."""
    if width is None or width < 2:
        return False
    first, *middle, last = [_decode(raw) for _, raw, _ in held]
    literal = [next(csv.reader([line], delimiter=delimiter, quoting=csv.QUOTE_NONE)) for line in (first, last)]
    if any(len(fields) != width for fields in literal):
        return False
    for line in (line for line in middle if line.strip()):
        if _quote_open_after(line, delimiter, False):
            return False
        try:
            if len(next(csv.reader([line], delimiter=delimiter, quoting=quoting, strict=True))) != width:
                return False
        except (csv.Error, StopIteration):
            return False
    return True


def _recover(source: _Lines, held: list[tuple[int, bytes, bytes]], display: str, reason: str, why: str) -> RowError:
    """``held``'s first line quarantined, the lines after it put back to be read again as rows."""
    source.put_back(held[1:])
    after = len(held) - 1
    return RowError(display, held[0][0], None, reason, why + (
        f": this line is quarantined and the {after} line{'s' if after > 1 else ''} after it read again as rows"
        if after else ""))


def _skip_record(source: _Lines, held: list[tuple[int, bytes, bytes]], display: str, delimiter: str,
                 limits: ReadLimits) -> RowError:
    """A record past ``limits.max_record_bytes`` that holds no rows: its lines read to the closing
    quote without being held, and quarantined as one row."""
    start, last, size = held[0][0], held[-1][0], sum(len(raw) + len(end) for _, raw, end in held)
    open_quote = _quote_open_after(_decode(held[-1][1]), delimiter, True)
    held.clear()
    for last, raw, end in source:
        if raw is None:
            return _dropped(display, start, last, "line_too_long", size, limits)
        size += len(raw) + len(end)
        open_quote = _quote_open_after(_decode(raw), delimiter, open_quote)
        if not open_quote:
            break
    return _dropped(display, start, last, "record_too_long", size, limits)


def _dropped(display: str, start: int, last: int, reason: str, size: int, limits: ReadLimits) -> RowError:
    lines = f" (lines {start}-{last}, {last - start + 1} lines)" if last > start else ""
    if reason == "line_too_long":
        what = f"record{lines} with a line of " if lines else "line of "
        return RowError(display, start, None, reason, what + over_bound("max_line_bytes", None, limits.max_line_bytes))
    return RowError(display, start, None, reason, f"record{lines} of " + over_bound(
        "max_record_bytes", size, limits.max_record_bytes))


def read_delimited(path: Path, display: str, *, delimiter: str, header: bool, quoting: str,
                   required: Sequence[str | int], multiline: bool = True, root: Path | None = None,
                   limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[RawRow | RowError]:
    """Rows of a delimited text file. A line that cannot be the header (too long, a quote that
    never closes) refuses the file: without its header no row can be read."""
    quote = csv.QUOTE_NONE if quoting == "none" else csv.QUOTE_MINIMAL
    lines = read_lines_with_ends(path, display, root, limits=limits)
    names: list[str] | None = None
    expected_fields: int | None = None
    if multiline and quote != csv.QUOTE_NONE:  # the file's shape, once known, tells a broken quote apart
        records = _csv_records_multiline(lines, display, delimiter, quote, limits, width=lambda: expected_fields)
    else:
        records = _csv_records_by_line(lines, display, delimiter, quote, limits)
    for line, fields in records:
        if isinstance(fields, RowError):
            if header and names is None:
                raise SourceError(display, fields.row, fields.field, fields.reason,
                                  f"cannot read the header: {fields.detail}")
            yield fields
            continue
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue  # blank line
        if header and names is None:
            names = _header(display, line, fields, required)
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
        too_long = None if sum(map(len, fields)) * 4 <= limits.max_field_bytes else \
            _field_too_long(display, line, values, limits.max_field_bytes)
        if too_long is not None:
            yield too_long
            continue
        bad = next(((k, d) for k, v in values.items() if (d := _bad_bytes(v))), None)
        if bad is not None:
            yield RowError(display, line, column_label(bad[0]), "encoding", bad[1])
            continue
        yield _clean_values(display, line, values)


def _header(display: str, line: int, fields: list[str], required: Sequence[str | int]) -> list[str]:
    """The column names of a header line; a name given twice, or a required column it lacks, refuses the file."""
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
    return names


def _header_name(field: str) -> str:
    """A header cell as a column name: cleaned like any text (an unusable one is kept as written,
    so the missing-column error shows it escaped)."""
    try:
        return clean_text(field).strip()
    except UnusableText:
        return field.strip()


def read_jsonl(path: Path, display: str, root: Path | None = None,
               limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[RawRow | RowError]:
    for line_no, raw in read_lines(path, display, root, unicode_breaks=False, limits=limits):
        if raw is None:
            yield line_too_long(display, line_no, limits)
            continue
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
        yield _field_too_long(display, line_no, obj, limits.max_field_bytes) or _clean_values(display, line_no, obj)


# What a Parquet record batch decodes to, by its row group's average row: rows per batch are chosen
# so that a batch is about this size (at most 8,192 rows, at least one).
_BATCH_BYTES = 16 << 20
# Page headers and levels a column chunk holds besides its values: a one-row chunk is judged over
# max_field_bytes from its metadata only past the bound by this much (closer cases are measured).
_CHUNK_OVERHEAD = 1 << 20


def read_parquet(path: Path, display: str, required: Sequence[str | int], root: Path | None = None,
                 limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[RawRow | RowError]:
    """Rows of a Parquet file, one record batch at a time (memory bounded by the batch, not the
    file). Its metadata are judged first: pages that expand past ``limits.max_decompressed_bytes``
    refuse the file, and a one-row row group with a column past ``max_field_bytes`` is quarantined
    without being decoded. Other cells are measured in Arrow (``_oversized_rows``) before any row
    becomes Python objects."""
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
    meta = parquet.metadata
    expanded = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    if expanded > limits.max_decompressed_bytes:
        raise SourceError(display, None, None, "too_large", "its pages expand to " + over_bound(
            "max_decompressed_bytes", expanded, limits.max_decompressed_bytes))
    row = 0
    try:
        for group in range(meta.num_row_groups):
            for item in _parquet_row_group(parquet, group, display, row, limits):
                row += 1
                yield item
    except (pa.ArrowException, *_READ_ERRORS) as exc:
        raise SourceError(display, row + 1, None, "unreadable", f"cannot read the Parquet file: {exc}") from None


def _parquet_row_group(parquet: Any, group: int, display: str, before: int,
                       limits: ReadLimits) -> Iterator[RawRow | RowError]:
    """The rows of one row group (``before``: rows of the file before it), in batches sized by its average row."""
    meta = parquet.metadata.row_group(group)
    if meta.num_rows == 1:
        for j in range(meta.num_columns):
            column = meta.column(j)
            if column.total_uncompressed_size > limits.max_field_bytes + _CHUNK_OVERHEAD:
                yield RowError(display, before + 1, column.path_in_schema.split(".")[0], "field_too_long",
                               "field of " + over_bound("max_field_bytes", column.total_uncompressed_size,
                                                        limits.max_field_bytes) + " (by the file's metadata)")
                return
    rows = max(1, min(8192, _BATCH_BYTES * meta.num_rows // max(1, meta.total_byte_size)))
    for batch in parquet.iter_batches(batch_size=rows, row_groups=[group]):
        bad = {} if batch.nbytes <= min(limits.max_field_bytes, limits.max_record_bytes) else \
            _oversized_rows(batch, display, before, limits)
        good = iter((batch.filter([i not in bad for i in range(batch.num_rows)]) if bad else batch).to_pylist())
        for i in range(batch.num_rows):
            before += 1
            yield bad[i] if i in bad else _clean_values(display, before, next(good))


def _oversized_rows(batch: Any, display: str, before: int, limits: ReadLimits) -> dict[int, RowError]:
    """Rows of a record batch (by index) with a cell over ``max_field_bytes`` or a total over
    ``max_record_bytes``, measured in Arrow without making Python objects of the cells."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    record = [0] * n
    bad: dict[int, RowError] = {}
    for name, column in zip(batch.schema.names, batch.columns):
        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
                or pa.types.is_large_binary(kind):
            sizes = pc.fill_null(pc.binary_length(column), 0).to_pylist()
        elif column.nbytes <= limits.max_field_bytes:
            sizes = [column.nbytes // n] * n  # no cell of it can pass the bound: its share of the record
        else:
            sizes = [column.slice(i, 1).nbytes for i in range(n)]
        for i, size in enumerate(sizes):
            record[i] += size
            if size > limits.max_field_bytes and i not in bad:
                bad[i] = RowError(display, before + i + 1, name, "field_too_long",
                                  "field of " + over_bound("max_field_bytes", size, limits.max_field_bytes))
    for i, size in enumerate(record):
        if size > limits.max_record_bytes and i not in bad:
            bad[i] = RowError(display, before + i + 1, None, "record_too_long",
                              "record of " + over_bound("max_record_bytes", size, limits.max_record_bytes))
    return bad


def read_rows(path: Path, display: str, *, fmt: str | None = None, delimiter: str | None = None,
              header: bool = True, quoting: str = "auto", multiline: bool = True,
              required: Sequence[str | int] = (), root: Path | None = None,
              limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[RawRow | RowError]:
    """Rows of one file as ``RawRow`` (or ``RowError`` for a bad row), in file order; ``root``: the
    folder the file may not leave (``root_for``; None: its own folder); ``limits``: what one line,
    field and record, and the decompressed file, may hold (``ReadLimits``)."""
    fmt = fmt or infer_format(path)
    if fmt == "jsonl":
        return read_jsonl(path, display, root, limits)
    if fmt == "parquet":
        return read_parquet(path, display, required, root, limits)
    if fmt in ("csv", "tsv", "delimited"):
        delim = delimiter or {"csv": ",", "tsv": "\t"}.get(fmt)
        if delim is None:
            raise SourceError(display, None, None, "config", "format 'delimited' needs a 'delimiter'")
        # TSV and custom-delimited text rarely quote, and their texts contain bare quotes
        # (MRPC: "the witness"); csv's quote handling would merge lines there.
        q = quoting if quoting != "auto" else ("minimal" if fmt == "csv" else "none")
        return read_delimited(path, display, delimiter=delim, header=header, quoting=q, required=required,
                              multiline=multiline, root=root, limits=limits)
    raise SourceError(display, None, None, "unknown_format", f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
