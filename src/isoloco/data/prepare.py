"""Preparing a corpus into token shards, and loading the tokens a run's `DataConfig` names.

`prepare` is the whole pipeline - corpus -> split -> tokenizer -> shards - for one
source. `load_token_data` is what a trainer calls: it opens a prepared directory, or
prepares the embedded corpus (or a local corpus) into the cache once and reuses it.

Cache layout under ``$ISOLOCO_CACHE`` (default ``~/.cache/isoloco``)::

    tokenizers/bpe-<vocab>-<hash>/tokenizer.json   trained BPEs, keyed by corpus + split + vocab
    datasets/<name>-<hash>/                        prepared datasets, keyed by corpus identity,
                                                   tokenizer, vocab, val_fraction, split seed

Both are written under temporary names and renamed into place, so concurrent runs that
need the same entry cannot see a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

from isoloco.configbase import check_at_least, check_range
from isoloco.data.config import MIN_BPE_VOCAB, DataConfig, cache_root
from isoloco.data.corpus import (EMBEDDED, is_validation, looks_like_path, nonempty, open_corpus,
                                 split_documents)
from isoloco.data.shards import META_FILE, SPLITS, VERSION, TokenData, open_shards, split_file, write_shards
from isoloco.data.tokenizer import BPE_ALGORITHM, TOKENIZER_FILE, resolve_tokenizer, tokenizer_id_of, tokenizer_kind
from isoloco.errors import ConfigError, DataError

#: With only a token limit, the BPE is trained on at most this many characters per allowed
#: token (English BPE averages ~4 characters per token, so this covers the whole limit).
BPE_CHARS_PER_TOKEN = 8


def prepare(source: str, out_dir: str | os.PathLike, tokenizer: str = "bpe", vocab_size: int = 8192,
            val_fraction: float = 0.05, progress: bool = True, *, text_field: str = "text", split: str = "train",
            max_documents: int | None = None, max_tokens: int | None = None, force: bool = False,
            split_seed: int = 0) -> dict[str, Any]:
    """Tokenize `source` into a prepared dataset at `out_dir` and return its meta.json contents.

    `source` is ``embedded``, a local .txt/.jsonl/.parquet file or directory, or a Hugging
    Face dataset name (streamed; `split` picks its split). `max_documents` keeps the first
    documents of the source, `max_tokens` stops once that many tokens are written (both
    limits apply before the train/validation split). An existing non-empty `out_dir` is
    an error unless `force`.
    """
    check_range("val_fraction", val_fraction, 0.0, 0.5, low_open=True, high_open=True)
    if tokenizer_kind(tokenizer) == "bpe":
        check_at_least("vocab_size", vocab_size, MIN_BPE_VOCAB)
    for key, limit in (("max_documents", max_documents), ("max_tokens", max_tokens)):
        if limit is not None:
            check_at_least(key, limit, 1)
    if split_seed < 0:
        raise ConfigError(f"split_seed={split_seed} is not allowed: it must be >= 0")
    out_dir = Path(out_dir).expanduser()
    if not force and out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"{out_dir}: already exists and is not empty; fix: choose another --out directory "
                        f"or pass --force to replace it")

    corpus = open_corpus(source, text_field, split)

    def stream() -> Iterator[str]:
        return nonempty(corpus.documents(), max_documents)

    probe = stream()
    empty = next(probe, None) is None
    probe.close()  # release the file (or connection) the first pass opened
    if empty:
        raise DataError(f"{source}: no documents (the corpus is empty); fix: point at files that contain text")

    limits = {"max_documents": max_documents, "max_tokens": max_tokens}
    split_rule = {"val_fraction": val_fraction, "split_seed": split_seed}
    train_identity = json.dumps({"corpus": corpus.identity(), "split": "train", **split_rule, **limits},
                                sort_keys=True)

    def train_documents() -> Iterator[str]:
        documents: Iterable[str] = stream()
        if max_tokens is not None:
            documents = _limit_chars(documents, max_tokens * BPE_CHARS_PER_TOKEN)
        return split_documents(documents, "train", val_fraction, split_seed)

    loaded = resolve_tokenizer(tokenizer, train_identity, train_documents, vocab_size, progress)
    labelled = (("val" if is_validation(text, val_fraction, split_seed) else "train", text) for text in stream())
    total = corpus.size_hint()
    if total is not None and max_documents is not None:
        total = min(total, max_documents)
    extra = {"corpus_identity": corpus.identity(), "tokenizer_spec": tokenizer,
             "bpe_vocab_size": vocab_size if tokenizer_kind(tokenizer) == "bpe" else None,
             "text_field": text_field, **split_rule, **limits}
    return write_shards(out_dir, loaded, labelled, source=corpus.description, extra_meta=extra, progress=progress,
                        total_documents=total, max_tokens=max_tokens, replace=force)


def load_token_data(cfg: DataConfig, progress: bool | None = None) -> TokenData:
    """The validated token data a `DataConfig` names, preparing it into the cache when needed.

    * a directory made by `prepare` is opened as is (its own tokenizer; `tokenizer`,
      `vocab_size` and `val_fraction` are not used);
    * ``embedded`` or a local corpus path is prepared once into
      ``$ISOLOCO_CACHE/datasets/`` and reused by every later run with the same settings;
    * a Hugging Face dataset must be prepared first (it is unbounded): the error says how.

    `progress` (default: when stderr is a terminal) shows progress bars while preparing.
    """
    cfg.validate()
    if progress is None:
        progress = sys.stderr.isatty()
    path = Path(cfg.source).expanduser()
    if cfg.source != EMBEDDED:
        if is_prepared_directory(path):
            return open_shards(path)
        if not path.exists() and not looks_like_path(cfg.source):
            raise DataError(f"data.source={cfg.source!r} is not embedded, a prepared directory or a local path; "
                            f"a Hugging Face dataset must be prepared first: fix: run `isoloco data prepare "
                            f"{cfg.source} --out DIR --max-tokens N` and set data.source=DIR")
    directory = dataset_cache_dir(cfg)
    if not (directory / META_FILE).is_file():
        try:
            prepare(cfg.source, directory, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction, progress,
                    text_field=cfg.text_field)
        except DataError:
            if not (directory / META_FILE).is_file():
                raise
            # Another process published this cache entry while we were starting: use theirs.
    try:
        return open_shards(directory)
    except DataError as error:
        raise DataError(f"{error} (this is a cache entry: delete {directory} and run again to rebuild it)") from None


def is_prepared_directory(path: Path) -> bool:
    """Whether `path` holds (or claims to hold) a prepared dataset rather than corpus files.

    A directory with any file of the shard layout counts, so a damaged dataset is reported
    by `open_shards` instead of being mistaken for a corpus.
    """
    if not path.is_dir():
        return False
    names = (META_FILE, TOKENIZER_FILE, *(split_file(split) for split in SPLITS))
    return any((path / name).exists() for name in names)


def dataset_cache_dir(cfg: DataConfig) -> Path:
    """The cache directory of the dataset `cfg` describes (embedded or a local corpus)."""
    corpus = open_corpus(cfg.source, cfg.text_field)
    kind = tokenizer_kind(cfg.tokenizer)
    if kind == "bpe":
        tokenizer_key = f"{BPE_ALGORITHM}:{cfg.vocab_size}"
    elif kind == "file":
        tokenizer_path = Path(cfg.tokenizer).expanduser()
        if tokenizer_path.is_dir():
            tokenizer_path = tokenizer_path / TOKENIZER_FILE
        tokenizer_key = f"file:{tokenizer_id_of(tokenizer_path)}"
    else:
        tokenizer_key = f"hub:{cfg.tokenizer}"
    key = json.dumps({"corpus": corpus.identity(), "tokenizer": tokenizer_key, "val_fraction": cfg.val_fraction,
                      "split_seed": 0, "text_field": cfg.text_field, "format": VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    name = EMBEDDED if cfg.source == EMBEDDED else Path(cfg.source).name or "local"
    return cache_root() / "datasets" / f"{name}-{digest}"


def _limit_chars(documents: Iterable[str], max_chars: int) -> Iterator[str]:
    """Documents until `max_chars` characters have been yielded (the one crossing it included)."""
    seen = 0
    for text in documents:
        if seen >= max_chars:
            return
        seen += len(text)
        yield text
