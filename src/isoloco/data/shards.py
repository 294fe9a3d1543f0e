"""Token shards: a prepared dataset on disk, written once, validated, then memory-mapped.

A prepared dataset is a directory::

    meta.json       format version, dtype, vocab_size, eos_id, token and document counts
                    per split, tokenizer_id, source description
    train.bin       raw little-endian token ids of the train split, EOS after each document
    val.bin         the same for the validation split
    tokenizer.json  the tokenizer that wrote them (its hash is meta's tokenizer_id)

Token ids are uint16 when the vocabulary fits (<= 65535 ids: half the disk and page
cache of uint32), else uint32. Raw arrays need no library to read, and `numpy.memmap`
lets a training step touch only the pages of the windows it uses.

Writing streams documents through the tokenizer in chunks into a temporary sibling
directory that is renamed into place only when complete: a crash leaves no half dataset
under the final name, and two processes preparing the same dataset cannot corrupt it
(the loser of the final rename discards its copy and uses the winner's).

Reading validates everything that could make training silently wrong - missing files, an
empty split, a size that disagrees with meta.json (truncation), an unknown dtype, a
tokenizer.json that is not the one recorded, token ids outside the vocabulary - and
raises `DataError` naming the file and the fix.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from isoloco.data.batches import unigram_entropy
from isoloco.data.config import umask_mode
from isoloco.data.tokenizer import TOKENIZER_FILE, LoadedTokenizer, tokenizer_id_of
from isoloco.errors import DataError, first_line

FORMAT = "isoloco-token-shards"
VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
#: Tokens per chunk of the vocabulary scan at load: bounded memory for any dataset size.
SCAN_CHUNK = 1 << 24
#: Documents, and characters, encoded per call to the tokenizer while writing.
ENCODE_DOCUMENTS = 512
ENCODE_CHARS = 8 << 20


def split_file(split: str) -> str:
    return f"{split}.bin"


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest supported dtype that holds every token id below `vocab_size`."""
    if vocab_size <= np.iinfo(np.uint16).max + 1:
        return "uint16"
    if vocab_size <= np.iinfo(np.uint32).max + 1:
        return "uint32"
    raise DataError(f"vocab_size={vocab_size} does not fit in uint32 token ids; fix: use a smaller vocabulary")


@dataclass
class TokenData:
    """A validated prepared dataset: memory-mapped splits and the facts a trainer needs."""

    train: np.ndarray  # 1-D numpy.memmap of token ids
    val: np.ndarray
    vocab_size: int
    eos_id: int
    tokenizer_path: Path
    tokenizer_id: str
    directory: Path
    meta: dict[str, Any] = field(repr=False)

    @functools.cached_property
    def unigram_loss(self) -> float:
        """The unigram baseline in nats/token, comparable to a validation loss.

        Cross-entropy on the validation split of the train split's unigram distribution
        (add-one smoothed): the loss of a model that ignores context. Computed on first use.
        """
        return unigram_entropy(self.train, evaluate_on=self.val, vocab_size=self.vocab_size)


# ---------------------------------------------------------------------------------------
# Writing


def write_shards(out_dir: str | os.PathLike, tokenizer: LoadedTokenizer, documents: Iterable[tuple[str, str]],
                 *, source: str, extra_meta: dict[str, Any] | None = None, progress: bool = True,
                 total_documents: int | None = None, max_tokens: int | None = None,
                 replace: bool = False) -> dict[str, Any]:
    """Tokenize `(split, text)` pairs into a prepared dataset at `out_dir`; return its meta.

    Each document is followed by EOS. With `max_tokens`, writing stops after the document
    that reaches that many tokens (both splits counted). `replace` overwrites an existing
    `out_dir`; without it an existing complete dataset there is kept (a concurrent writer
    won) and returned instead. Raises `DataError` when a split ends up empty.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir).expanduser()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    dtype_name = dtype_for_vocab(tokenizer.vocab_size)
    dtype = DTYPES[dtype_name]
    temporary = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    os.chmod(temporary, umask_mode(0o777))
    try:
        tokens = dict.fromkeys(SPLITS, 0)
        counts = dict.fromkeys(SPLITS, 0)
        files = {split: open(temporary / split_file(split), "wb") for split in SPLITS}
        bar = tqdm(total=total_documents, unit="doc", desc=f"tokenizing {out_dir.name}", disable=not progress,
                   dynamic_ncols=True)
        try:
            done = False
            for chunk in _chunks(documents):
                buffers: dict[str, list[int]] = {split: [] for split in SPLITS}
                encoded = tokenizer.encode_batch([text for _, text in chunk])
                for (split, _), ids in zip(chunk, encoded):
                    buffers[split].extend(ids)
                    buffers[split].append(tokenizer.eos_id)
                    tokens[split] += len(ids) + 1
                    counts[split] += 1
                    bar.update(1)
                    if max_tokens is not None and tokens["train"] + tokens["val"] >= max_tokens:
                        done = True
                        break
                for split, ids in buffers.items():
                    np.array(ids, dtype=dtype).tofile(files[split])  # overflow raises, never wraps
                bar.set_postfix(train_tokens=tokens["train"], val_tokens=tokens["val"], refresh=False)
                if done:
                    break
        finally:
            bar.close()
            for handle in files.values():
                handle.close()
        for split, name in (("train", "train"), ("val", "validation")):
            if counts[split] == 0:
                raise DataError(f"{source}: the {name} split is empty ({counts['train'] + counts['val']} documents "
                                f"in all); fix: add documents or change the validation fraction")
        shutil.copyfile(tokenizer.path, temporary / TOKENIZER_FILE)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype_name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "eos_token": tokenizer.eos_token,
            "tokens": tokens,
            "documents": counts,
            "tokenizer_id": tokenizer_id_of(temporary / TOKENIZER_FILE),
            "source": source,
            **(extra_meta or {}),
        }
        (temporary / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if not publish(temporary, out_dir, replace):
            return read_meta(out_dir)
        return meta
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def publish(temporary: Path, out_dir: Path, replace: bool) -> bool:
    """Rename a finished temporary directory to `out_dir`; False if a complete one was already there."""
    if replace and out_dir.exists():
        trash = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.replace(out_dir, trash / "old")
        os.replace(temporary, out_dir)
        shutil.rmtree(trash, ignore_errors=True)
        return True
    try:
        os.rename(temporary, out_dir)  # replaces only an empty directory: never a finished dataset
        return True
    except OSError:
        if (out_dir / META_FILE).is_file():
            return False  # another process finished first; its dataset is equivalent
        raise DataError(f"{out_dir}: exists and is not a prepared dataset; fix: remove it or choose another "
                        f"directory") from None


def _chunks(documents: Iterable[tuple[str, str]]):
    """Group documents so each tokenizer call gets enough text to use its threads."""
    chunk, chars = [], 0
    for item in documents:
        chunk.append(item)
        chars += len(item[1])
        if len(chunk) >= ENCODE_DOCUMENTS or chars >= ENCODE_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------------------
# Reading


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a prepared dataset, checked for format, version and required keys."""
    directory = Path(directory).expanduser()
    fix = "fix: prepare it again with `isoloco data prepare SOURCE --out DIR`"
    if not directory.is_dir():
        raise DataError(f"{directory}: no such directory; {fix}")
    path = directory / META_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing, so {directory} is not a prepared dataset; {fix}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: unreadable ({first_line(error)}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not an isoloco token-shard header; {fix}")
    if meta.get("version") != VERSION:
        raise DataError(f"{path}: format version {meta.get('version')!r} is not the supported {VERSION}; {fix}")
    for key in ("dtype", "vocab_size", "eos_id", "tokens", "tokenizer_id"):
        if key not in meta:
            raise DataError(f"{path}: no {key!r} entry; {fix}")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{path}: unknown dtype {meta['dtype']!r} (supported: {', '.join(DTYPES)}); {fix}")
    if not isinstance(meta["tokens"], dict) or any(not isinstance(meta["tokens"].get(s), int) for s in SPLITS):
        raise DataError(f"{path}: 'tokens' must give an integer count for {' and '.join(SPLITS)}; {fix}")
    if not (isinstance(meta["vocab_size"], int) and isinstance(meta["eos_id"], int)
            and 0 <= meta["eos_id"] < meta["vocab_size"]):
        raise DataError(f"{path}: vocab_size {meta['vocab_size']!r} / eos_id {meta['eos_id']!r} are inconsistent; "
                        f"{fix}")
    return meta


def open_shards(directory: str | os.PathLike) -> TokenData:
    """Open and validate a prepared dataset; every fault raises `DataError` naming the file."""
    directory = Path(directory).expanduser()
    meta = read_meta(directory)
    fix = "fix: prepare it again with `isoloco data prepare SOURCE --out DIR`"
    tokenizer_path = directory / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise DataError(f"{tokenizer_path}: missing; {fix}")
    actual_id = tokenizer_id_of(tokenizer_path)
    if actual_id != meta["tokenizer_id"]:
        raise DataError(f"{tokenizer_path}: tokenizer id {actual_id} does not match {meta['tokenizer_id']} recorded "
                        f"in {META_FILE}, so the shards were written by another tokenizer; fix: restore the original "
                        f"tokenizer.json or prepare the dataset again")
    dtype = DTYPES[meta["dtype"]]
    arrays = {}
    for split in SPLITS:
        path = directory / split_file(split)
        expected = meta["tokens"][split]
        if not path.is_file():
            raise DataError(f"{path}: missing; {fix}")
        if expected <= 0:
            raise DataError(f"{path}: the {split} split is empty ({META_FILE} records {expected} tokens); {fix}")
        size = path.stat().st_size
        if size != expected * dtype.itemsize:
            raise DataError(f"{path}: {size} bytes, but {META_FILE} records {expected} {meta['dtype']} tokens "
                            f"({expected * dtype.itemsize} bytes), so the file is truncated or corrupt; {fix}")
        arrays[split] = np.memmap(path, dtype=dtype, mode="r", shape=(expected,))
        largest = max_token(arrays[split])
        if largest >= meta["vocab_size"]:
            raise DataError(f"{path}: token id {largest} is outside the vocabulary (vocab_size {meta['vocab_size']} "
                            f"in {META_FILE}); the file is corrupt or from another tokenizer; {fix}")
    return TokenData(train=arrays["train"], val=arrays["val"], vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
                     tokenizer_path=tokenizer_path, tokenizer_id=meta["tokenizer_id"], directory=directory, meta=meta)


def max_token(tokens: np.ndarray) -> int:
    """The largest token id, scanned in chunks so a memmap is never read into memory at once."""
    return max(int(tokens[start:start + SCAN_CHUNK].max()) for start in range(0, len(tokens), SCAN_CHUNK))
