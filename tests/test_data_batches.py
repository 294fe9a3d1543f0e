"""Batches: stateless, deterministic, worker shares add up to the global batch; budget and validation."""

import math
import re
import os

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from isoloco.errors import ConfigError  # noqa: E402
from isoloco.data import Batches, DataConfig, DataError, check_run_data, unigram_entropy, validation_batches  # noqa: E402

SEQ = 7  # windows of 8 tokens


@pytest.fixture
def tokens():
    # Token t at position p is p itself (mod 2**16), so a window identifies where it came from.
    return np.arange(8 * 50 + 5, dtype=np.uint16)  # 50 windows and a 5-token remainder


def test_rows_are_deterministic_and_stateless(tokens):
    a, b = Batches(tokens, SEQ, 8, seed=3), Batches(tokens, SEQ, 8, seed=3)
    for step in (0, 9, 4, 0, 30):  # any order: no hidden state
        assert torch.equal(a.global_batch_at(step), b.global_batch_at(step))
    assert a.global_batch_at(0).dtype == torch.long and a.global_batch_at(0).shape == (8, SEQ + 1)
    assert not torch.equal(a.global_batch_at(0), Batches(tokens, SEQ, 8, seed=4).global_batch_at(0))


def test_windows_are_aligned_slices_that_do_not_repeat_within_an_epoch(tokens):
    batches = Batches(tokens, SEQ, 5, seed=0)
    assert batches.num_windows == 50
    seen = np.concatenate([batches.window_indices(step) for step in range(10)])  # 10 x 5 = exactly one epoch
    assert sorted(seen.tolist()) == list(range(50))
    for step in range(10):
        rows = batches.global_batch_at(step)
        starts = rows[:, 0].numpy()
        assert np.all(starts % 8 == 0)
        assert torch.equal(rows, torch.from_numpy(starts[:, None] + np.arange(8)))
    # The next epoch is another permutation of the same windows.
    second = np.concatenate([batches.window_indices(step) for step in range(10, 20)])
    assert sorted(second.tolist()) == list(range(50)) and not np.array_equal(seen, second)


def test_a_step_may_straddle_two_epochs(tokens):
    batches = Batches(tokens, SEQ, 8, seed=1)  # 50 windows: step 6 holds positions 48..55
    indices = batches.window_indices(6)
    assert indices[:2].tolist() == batches.permutation(0)[48:50].tolist()
    assert indices[2:].tolist() == batches.permutation(1)[:6].tolist()


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_worker_batches_concatenate_to_the_global_batch(tokens, workers):
    batches = Batches(tokens, SEQ, 8, seed=2)
    for step in (0, 5, 6, 17):
        parts = [batches.worker_batch(step, r, workers) for r in range(workers)]
        assert all(p.shape == (8 // workers, SEQ + 1) for p in parts)
        assert torch.equal(torch.cat(parts), batches.global_batch_at(step))


def test_workers_must_divide_the_global_batch(tokens):
    batches = Batches(tokens, SEQ, 8)
    with pytest.raises(ConfigError, match=r"global_batch=8 is not divisible by workers=3"):
        batches.worker_batch(0, 0, 3)
    with pytest.raises(ValueError):
        batches.worker_batch(0, 4, 4)
    with pytest.raises(ValueError):
        batches.rows(0, 6, 4)


def test_budget(tokens):
    batches = Batches(tokens, SEQ, 5)
    assert batches.overrun(10) is None and batches.epochs(10) == 1.0
    assert re.fullmatch(r"11 steps x global_batch 5 = 55 sequences .*only 50 .*: 1\.10 epochs", batches.overrun(11))
    val = tokens[:SEQ + 1]
    with pytest.raises(DataError, match=r"11 steps x global_batch 5 = 55 sequences.*only 50.*allow_repeat=true"):
        check_run_data(tokens, val, SEQ, 5, 11, SEQ, allow_repeat=False)
    assert "repeating the data" in check_run_data(tokens, val, SEQ, 5, 20, SEQ, allow_repeat=True)


def test_too_little_data_for_one_window():
    with pytest.raises(DataError, match="fewer than one sequence"):
        Batches(np.arange(5, dtype=np.uint16), SEQ, 2)


def test_validation_batches_are_the_first_windows(tokens):
    batches = validation_batches(tokens, SEQ, num_tokens=30, batch_size=2)  # ceil(30/7) = 5 windows
    assert [b.shape[0] for b in batches] == [2, 2, 1]
    stacked = torch.cat(batches)
    assert stacked.dtype == torch.long
    assert torch.equal(stacked.flatten(), torch.arange(5 * 8))
    assert stacked[:, 1:].numel() >= 30
    with pytest.raises(DataError, match=r"validation split has 405 tokens.*val_tokens<=350"):
        validation_batches(tokens, SEQ, num_tokens=400, batch_size=2)


def test_unigram_entropy():
    uniform = np.tile(np.arange(16, dtype=np.uint16), 100)
    assert unigram_entropy(uniform) == pytest.approx(math.log(16))
    assert unigram_entropy(uniform, chunk=7) == pytest.approx(math.log(16))
    skewed = np.array([0] * 90 + [1] * 10, dtype=np.uint16)
    assert unigram_entropy(skewed) == pytest.approx(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))
    # Held out: add-one smoothing over the vocabulary keeps unseen tokens finite.
    held_out = np.array([0, 1, 2], dtype=np.uint16)
    expected = -(math.log(91 / 103) + math.log(11 / 103) + math.log(1 / 103)) / 3
    assert unigram_entropy(skewed, held_out, vocab_size=3) == pytest.approx(expected)


def test_data_config_validation():
    DataConfig().validate()
    for bad, pattern in ((dict(val_fraction=0.5), r"data\.val_fraction=0\.5 .* \(0\.0, 0\.5\)"),
                         (dict(val_fraction=0.0), r"data\.val_fraction"),
                         (dict(vocab_size=256), r"data\.vocab_size=256 .* >= 257"),
                         (dict(val_tokens=0), r"data\.val_tokens"),
                         (dict(source=""), r"data\.source"),
                         (dict(tokenizer=""), r"data\.tokenizer")):
        with pytest.raises(ConfigError, match=pattern):
            DataConfig(**bad).validate()
