"""Data: corpus -> tokenizer -> token shards -> per-worker batches.

What a trainer does with it::

    data = load_token_data(cfg.data)                      # validated, memory-mapped splits
    notice = check_run_data(data.train, data.val, seq_len, global_batch, steps,   # every problem at once
                            cfg.data.val_tokens, cfg.data.allow_repeat)
    batches = Batches(data.train, seq_len, global_batch, seed)
    x = batches.worker_batch(step, worker, num_workers)   # LongTensor [B/R, seq_len+1]
    held_out = validation_batches(data.val, seq_len, cfg.data.val_tokens, eval_batch)
    data.unigram_loss                                     # the context-free baseline to beat

Modules, one concept each: `config` (DataConfig, cache location), `corpus`
(document streams and the train/validation split), `tokenizer` (BPE training, loading,
ids), `shards` (the on-disk format, writing and validation), `prepare` (the pipeline and
the cache), `batches` (which windows each worker sees at each step), `cli` (`isoloco data`).
"""

from isoloco.data.batches import Batches, check_run_data, unigram_entropy, validation_batches
from isoloco.data.config import DataConfig, cache_root
from isoloco.data.corpus import Corpus, is_validation, open_corpus
from isoloco.data.prepare import load_token_data, prepare
from isoloco.data.shards import TokenData, open_shards, read_meta
from isoloco.data.tokenizer import LoadedTokenizer, load_tokenizer_file, pretrained_tokenizer, tokenizer_id_of
from isoloco.errors import DataError

__all__ = [
    "Batches",
    "check_run_data",
    "Corpus",
    "DataConfig",
    "DataError",
    "LoadedTokenizer",
    "TokenData",
    "cache_root",
    "is_validation",
    "load_token_data",
    "load_tokenizer_file",
    "open_corpus",
    "open_shards",
    "prepare",
    "pretrained_tokenizer",
    "read_meta",
    "tokenizer_id_of",
    "unigram_entropy",
    "validation_batches",
]
