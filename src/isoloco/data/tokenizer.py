"""Tokenizers: train a byte-level BPE on the corpus, or load one, and name it by its contents.

Three kinds, chosen by the `tokenizer` setting:

* ``bpe`` - a byte-level BPE trained with Hugging Face `tokenizers` on the *train* split
  of the corpus (validation text never shapes the vocabulary), with one special token,
  ``<|endoftext|>``, used as end-of-document. Byte-level means every string encodes, with
  no unknown token. Training is cached on disk under ``$ISOLOCO_CACHE/tokenizers/``,
  keyed by a hash of (corpus identity, split, vocab size, algorithm), and reused.
* a path to a ``tokenizer.json`` (or a directory holding one) - used as is.
* a Hugging Face tokenizer name (e.g. ``meta-llama/Llama-2-7b-hf``) - loaded through
  `transformers.AutoTokenizer` (needs the hub or its local cache) and stored as
  tokenizer.json.

Whatever the kind, a tokenizer is identified by `tokenizer_id`: a shortened SHA-256 of its
tokenizer.json bytes. Token shards record it, so shards can never silently be read with a
different vocabulary than the one that wrote them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from isoloco.data.config import MIN_BPE_VOCAB, cache_root, umask_mode
from isoloco.errors import DataError, first_line

EOS_TOKEN = "<|endoftext|>"
#: End-of-document tokens recognised in a user's tokenizer.json, in order of preference.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
#: Version tag of the training recipe below; changing the recipe must change the cache key.
BPE_ALGORITHM = "byte-level-bpe-v1"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class LoadedTokenizer:
    """A tokenizer ready to encode documents, with the facts token shards record about it."""

    backend: "tokenizers.Tokenizer"  # noqa: F821 - imported lazily
    path: Path
    tokenizer_id: str
    eos_id: int
    eos_token: str
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (the caller appends EOS)."""
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]


def tokenizer_id_of(path: str | os.PathLike) -> str:
    """Shortened SHA-256 of a tokenizer.json file: equal ids mean identical tokenizers."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({first_line(error)}); fix: check the tokenizer path") from None
    return hashlib.sha256(data).hexdigest()[:16]


def tokenizer_kind(spec: str) -> str:
    """``bpe``, ``file`` (a tokenizer.json or a directory with one) or ``hub`` (a Hugging Face name)."""
    if spec == "bpe":
        return "bpe"
    path = Path(spec).expanduser()
    if path.suffix == ".json" or path.is_file() or (path.is_dir() and (path / TOKENIZER_FILE).is_file()):
        return "file"
    if spec.startswith((".", "/", "~")) or spec.endswith("/"):
        return "file"  # meant as a path, which load_tokenizer_file reports as missing
    return "hub"


# ---------------------------------------------------------------------------------------
# Byte-level BPE


def train_bpe(documents: Iterable[str], vocab_size: int, progress: bool = False):
    """Train a byte-level BPE with `<|endoftext|>` on a stream of documents.

    The 256 byte symbols are always in the vocabulary, so `vocab_size` must be at least
    257; a corpus too small to support `vocab_size` merges yields a smaller vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"vocab_size={vocab_size} is too small for byte-level BPE; fix: use at least {MIN_BPE_VOCAB}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def bpe_cache_path(corpus_identity: str, vocab_size: int) -> Path:
    """Where the BPE trained on a corpus (its identity includes the split) is cached."""
    key = json.dumps({"algorithm": BPE_ALGORITHM, "corpus": corpus_identity, "vocab_size": vocab_size},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root() / "tokenizers" / f"bpe-{vocab_size}-{digest}" / TOKENIZER_FILE


def cached_bpe(corpus_identity: str, train_documents, vocab_size: int, progress: bool = False) -> LoadedTokenizer:
    """The BPE for this corpus from the cache, training it (on `train_documents()`) only when absent.

    The file is written to a temporary name and renamed, so two processes training at once
    both end with a complete file (the last rename wins; both trained the same recipe).
    """
    path = bpe_cache_path(corpus_identity, vocab_size)
    if not path.is_file():
        tokenizer = train_bpe(train_documents(), vocab_size, progress)
        _write_atomically(path, tokenizer.to_str(pretty=True).encode("utf-8"))
    return load_tokenizer_file(path)


# ---------------------------------------------------------------------------------------
# Loading


def load_tokenizer_file(path: str | os.PathLike, eos_token: str | None = None) -> LoadedTokenizer:
    """A tokenizer.json (or a directory containing one); EOS is `eos_token` or the first known EOS token."""
    from tokenizers import Tokenizer

    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found; fix: pass an existing tokenizer.json, bpe, or a hub name")
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise DataError(f"{path}: not a valid tokenizer.json ({first_line(error)}); "
                        f"fix: save it with tokenizers' Tokenizer.save") from None
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    for token in candidates:
        eos_id = backend.token_to_id(token)
        if eos_id is not None:
            return LoadedTokenizer(backend, path, tokenizer_id_of(path), eos_id, token,
                                   backend.get_vocab_size(with_added_tokens=True))
    raise DataError(f"{path}: no end-of-document token (looked for {', '.join(candidates)}); "
                    f"fix: add {EOS_TOKEN!r} as a special token")


def load_hub_tokenizer(name: str) -> LoadedTokenizer:
    """A Hugging Face tokenizer by name, stored as tokenizer.json under the cache.

    Needs the hub (or the files already in the Hugging Face cache); only fast tokenizers
    have a tokenizer.json, so slow-only tokenizers are refused.
    """
    try:
        from transformers import AutoTokenizer

        hub_tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as error:  # OSError offline / unknown name, ValueError, ImportError, ...
        raise DataError(f"could not load the Hugging Face tokenizer {name!r} ({first_line(error)}); the hub may be "
                        f"unreachable (offline or HF_HUB_OFFLINE=1): fix: connect, or pass a local tokenizer.json "
                        f"path, or use tokenizer=bpe") from None
    if not getattr(hub_tokenizer, "is_fast", False):
        raise DataError(f"the Hugging Face tokenizer {name!r} has no fast (tokenizer.json) version; "
                        f"fix: convert it, or use tokenizer=bpe")
    eos_token = hub_tokenizer.eos_token
    if eos_token is None:
        raise DataError(f"the Hugging Face tokenizer {name!r} has no eos_token; fix: pick another tokenizer")
    digest = hashlib.sha256(name.encode()).hexdigest()[:20]
    path = cache_root() / "tokenizers" / f"hub-{digest}" / TOKENIZER_FILE
    _write_atomically(path, hub_tokenizer.backend_tokenizer.to_str(pretty=True).encode("utf-8"))
    loaded = load_tokenizer_file(path, eos_token=eos_token)
    loaded.vocab_size = max(loaded.vocab_size, len(hub_tokenizer))
    return loaded


def resolve_tokenizer(spec: str, corpus_identity: str, train_documents, vocab_size: int,
                      progress: bool = False) -> LoadedTokenizer:
    """The tokenizer a `tokenizer` setting names; `train_documents()` streams the train split for `bpe`."""
    kind = tokenizer_kind(spec)
    if kind == "bpe":
        return cached_bpe(corpus_identity, train_documents, vocab_size, progress)
    if kind == "file":
        return load_tokenizer_file(spec)
    return load_hub_tokenizer(spec)


def pretrained_tokenizer(path: str | os.PathLike, eos_token: str | None = None):
    """A `transformers.PreTrainedTokenizerFast` for a tokenizer.json, for export with `save_pretrained`."""
    from transformers import PreTrainedTokenizerFast

    loaded = load_tokenizer_file(path, eos_token)
    specials = {"eos_token": loaded.eos_token}
    if loaded.eos_token == EOS_TOKEN:
        # Our BPE has one special token; like GPT-2 it doubles as BOS and padding.
        specials.update(bos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    return PreTrainedTokenizerFast(tokenizer_file=str(loaded.path), **specials)


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.chmod(temporary, umask_mode(0o666))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
