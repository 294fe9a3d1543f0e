"""The embedded King James Bible, prepared once for this module with the default settings."""

import os
import sys
import time

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from isoloco.data import Batches, DataConfig, load_token_data, unigram_entropy, validation_batches  # noqa: E402
from isoloco.data.corpus import EmbeddedBible  # noqa: E402


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ISOLOCO_CACHE", str(tmp_path_factory.mktemp("embedded-cache")))
        started = time.perf_counter()
        data = load_token_data(DataConfig(), progress=False)
        prepared_in = time.perf_counter() - started
        started = time.perf_counter()
        again = load_token_data(DataConfig(), progress=False)
        reopened_in = time.perf_counter() - started
        yield data, again, prepared_in, reopened_in


def test_embedded_corpus_text():
    documents = list(EmbeddedBible().documents())
    assert len(documents) == 1189
    assert sum(len(d) for d in documents) >= 4_000_000
    assert documents[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert "bible" not in sys.modules  # the package's own module is broken; it must never be imported


@pytest.mark.slow
def test_embedded_dataset_is_prepared_once_and_reused(embedded):
    data, again, prepared_in, reopened_in = embedded
    meta = data.meta
    assert again.directory == data.directory and again.tokenizer_id == data.tokenizer_id
    assert reopened_in < prepared_in
    assert sum(meta["documents"].values()) == 1189
    assert meta["dtype"] == "uint16" and data.vocab_size == 8192 and data.eos_id == 0
    assert 800_000 < len(data.train) < 1_200_000
    assert int((np.asarray(data.val) == data.eos_id).sum()) == meta["documents"]["val"]
    # The defaults must work together: the validation split holds the default val_tokens.
    for seq_len in (128, 2048):
        held_out = validation_batches(data.val, seq_len, DataConfig().val_tokens, 16)
        assert sum(b.shape[0] for b in held_out) * seq_len >= DataConfig().val_tokens
    baseline = data.unigram_loss
    assert baseline == unigram_entropy(data.train, data.val, data.vocab_size)
    assert unigram_entropy(data.train) < baseline < 7.0 < np.log(data.vocab_size)
    batches = Batches(data.train, 128, 32, seed=0)
    assert batches.overrun(200) is None
    assert batches.worker_batch(199, 3, 4).shape == (8, 129)
