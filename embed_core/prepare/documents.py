"""Documents of a corpus source (``kind: corpus``): a file or a folder of ``.txt``, ``.md``, ``.html``
and ``.jsonl`` files, gzipped or not, and ``.pdf`` files with the ``pdf`` extra (pypdf), each document
as one text with where it came from.

A document's text is what passages index (``source_ref`` spans): a text or markdown file's decoded
characters (UTF-8, a byte-order mark dropped, line breaks as ``\\n``: for a file with ``\\n`` line ends,
the file's own characters); an HTML file's visible text (scripts, styles and the head left out,
block elements separated by blank lines); a JSONL line's ``title`` and ``text`` fields joined by a
blank line (BEIR's corpus layout); a PDF's extracted text, pages separated by blank lines. Every text goes through ``cleaning.clean_text`` like any other
source's; a document that cannot be read (bad bytes, bad JSON, no text, a PDF that does not
parse or without pypdf, a FIFO or device where a document belongs) is one ``RowError`` with its
reason. A document is read under a byte bound before it is decoded (the source's
``limits.max_record_bytes``): a larger one is a quarantined row naming the file and the bound, and
running out of memory while reading one is an error line naming the file.
"""

from __future__ import annotations

import codecs
import io
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from embed_core.config_base import ReadLimits
from embed_core.errors import OUT_OF_MEMORY, RowError, SourceError
from embed_core.paths import file_problem
from embed_core.prepare.cleaning import UnusableText, clean_text
from embed_core.prepare.readers import DEFAULT_LIMITS, confine, open_binary, over_bound, read_jsonl
from embed_core.schema import is_blank

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
HTML_SUFFIXES = (".html", ".htm")
SUFFIXES = (*TEXT_SUFFIXES, *HTML_SUFFIXES, ".jsonl", ".pdf")
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


@dataclass(frozen=True)
class Document:
    file: str          # the file as configured (display path)
    line: int | None   # JSONL: its line; else None
    doc_id: str        # JSONL: the id field (or the line); else the file's path below the source
    text: str

    @property
    def ref(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


def corpus_files(path: Path, display: str, root: Path | None, suffixes: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(display, real path) of every document file: ``path`` itself, or the files below the folder
    whose names end in one of ``suffixes`` (sorted, each confined to ``root``)."""
    real = confine(path, display, root)
    if real.is_file():
        return [(display, real)]
    if not real.is_dir():
        raise SourceError(display, None, None, "missing_file", f"no such file or folder (resolved to {path})")
    out = []
    for f in sorted(p for p in path.rglob("*") if p.name.lower().removesuffix(".gz").endswith(suffixes)):
        shown = f"{display.rstrip('/')}/{f.relative_to(path).as_posix()}"
        target = confine(f, shown, root)
        if not target.is_dir():  # a FIFO or device of a document's name: read_documents quarantines it
            out.append((shown, target))
    return out


def read_documents(display: str, path: Path, *, text_field: str, title_field: str | None,
                   id_field: str | None, limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[Document | RowError]:
    name = display.lower().removesuffix(".gz")  # '.gz' is read transparently
    problem = file_problem(path)
    if problem is not None:
        yield RowError(display, None, None, "not_a_file", problem)
    elif name.endswith(".jsonl"):
        yield from _jsonl_documents(display, path, text_field, title_field, id_field, limits)
    else:
        try:
            data = _bounded_bytes(display, path, limits)
            if isinstance(data, RowError):
                yield data
            else:
                yield _pdf_document(display, data) if name.endswith(".pdf") else \
                    _file_document(display, data, html=name.endswith(HTML_SUFFIXES))
        except MemoryError:
            raise SourceError(display, None, None, "out_of_memory", "reading this document: " + OUT_OF_MEMORY) from None


def _bounded_bytes(display: str, path: Path, limits: ReadLimits) -> bytes | RowError:
    """A document's bytes, read no further than ``limits.max_record_bytes`` (then a RowError)."""
    with open_binary(path, display, None, limits) as fh:
        data = fh.read(limits.max_record_bytes + 1)
    if len(data) > limits.max_record_bytes:
        return RowError(display, None, None, "record_too_long", "document of " + over_bound(
            "max_record_bytes", None, limits.max_record_bytes))
    return data


def _decoded(data: bytes) -> str:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data[len(bom):].decode(encoding)
    return data.decode("utf-8")


def _file_document(display: str, data: bytes, *, html: bool) -> Document | RowError:
    try:
        text = _decoded(data)
    except UnicodeDecodeError as exc:
        return RowError(display, None, None, "encoding", f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}")
    if html:
        text = html_text(text)
    try:
        text = clean_text(text)
    except UnusableText as exc:
        return RowError(display, None, None, exc.reason, str(exc))
    if is_blank(text):
        return RowError(display, None, None, "empty_text", "the document has no text")
    return Document(display, None, display, text)


def _pdf_document(display: str, data: bytes) -> Document | RowError:
    """A PDF's text (pypdf's extraction, pages joined by blank lines)."""
    try:
        import pypdf
    except ImportError:
        return RowError(display, None, None, "unsupported_format", "PDF documents need the pdf extra "
                        "(pip install 'embedpipe[pdf]', which installs pypdf), or convert the PDF to text first")
    try:
        pages = [page.extract_text() or "" for page in pypdf.PdfReader(io.BytesIO(data)).pages]
    except Exception as exc:  # noqa: BLE001 - a damaged PDF raises many kinds; each is this document's problem
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        return RowError(display, None, None, "unreadable_pdf", f"cannot parse the PDF ({detail})")
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    try:
        text = clean_text(text)
    except UnusableText as exc:
        return RowError(display, None, None, exc.reason, str(exc))
    if is_blank(text):
        return RowError(display, None, None, "empty_text", "the PDF has no text to extract (a scan? run OCR first)")
    return Document(display, None, display, text)


def _jsonl_documents(display: str, path: Path, text_field: str, title_field: str | None,
                     id_field: str | None, limits: ReadLimits) -> Iterator[Document | RowError]:
    for raw in read_jsonl(path, display, None, limits=limits):
        if isinstance(raw, RowError):
            yield raw
            continue
        text = raw.values.get(text_field)
        if not isinstance(text, str) or is_blank(text):
            yield RowError(raw.file, raw.row, text_field, "empty_text" if isinstance(text, str) or text is None
                           else "wrong_type", "empty or missing text" if not text else "expected text")
            continue
        title = raw.values.get(title_field) if title_field else None
        full = f"{title.strip()}\n\n{text.strip()}" if isinstance(title, str) and title.strip() else text.strip()
        doc_id = raw.values.get(id_field) if id_field else None
        yield Document(raw.file, raw.row, str(doc_id) if doc_id is not None else str(raw.row), full)


class _TextOfHTML(HTMLParser):
    SKIP = frozenset({"script", "style", "head", "noscript", "template"})
    BLOCKS = frozenset({"p", "div", "section", "article", "li", "ul", "ol", "table", "tr", "h1", "h2", "h3", "h4",
                        "h5", "h6", "pre", "blockquote", "br", "hr", "header", "footer", "main", "title"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(" ".join(data.split()) if data.strip() else " ")


def html_text(html: str) -> str:
    """The visible text of an HTML document, blocks separated by blank lines."""
    parser = _TextOfHTML()
    parser.feed(html)
    parser.close()
    paragraphs = ["".join(p).strip() for p in "".join(parser.parts).split("\n\n")]
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())
