"""Batches: which token windows every worker trains on at every step, as a pure function of the step.

The train split is cut into N non-overlapping windows of seq_len + 1 tokens (inputs are
the first seq_len, targets the last seq_len). Sequence i (0 <= i < B) of global step s is

    g = s*B + i,   epoch e = g // N,   window perm_e[g mod N]

where perm_e is a permutation of the N windows drawn from a numpy Generator seeded with
(seed, e). So within an epoch no window repeats, each epoch is shuffled differently, and
nothing depends on what was read before: resuming at step s needs only s.

Worker r of R takes sequences [r*B/R, (r+1)*B/R) of each global batch, so
the R workers of a DiLoCo run together see exactly the tokens the data-parallel baseline
sees at the same step - the invariant that makes DiLoCo (H=1, outer SGD lr 1, inner SGD)
equal to data-parallel SGD.
"""

from __future__ import annotations

import numpy as np
import torch

from isoloco.errors import ConfigError, DataError


class Batches:
    """Deterministic, stateless batches of `global_batch` windows of `seq_len + 1` tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int = 0) -> None:
        if seq_len < 1 or global_batch < 1:
            raise ConfigError(f"seq_len={seq_len} and global_batch={global_batch} must both be >= 1")
        if seed < 0:
            raise ConfigError(f"seed={seed} is not allowed: it must be >= 0")
        self.tokens = tokens
        self.seq_len = seq_len
        self.window = seq_len + 1
        self.global_batch = global_batch
        self.seed = seed
        self.num_windows = len(tokens) // self.window
        if self.num_windows == 0:
            raise DataError(_too_short_for_one_window(len(tokens), seq_len))
        self._permutations: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of one epoch (the last two are kept: a step spans at most two epochs)."""
        order = self._permutations.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = order
        return order

    def window_indices(self, step: int, start: int = 0, count: int | None = None) -> np.ndarray:
        """Indices of the windows forming sequences [start, start+count) of a step's global batch."""
        count = self.global_batch - start if count is None else count
        if step < 0 or start < 0 or count < 0 or start + count > self.global_batch:
            raise ValueError(f"rows [{start}, {start + count}) of step {step} are outside a global batch of "
                             f"{self.global_batch}")
        positions = step * self.global_batch + start + np.arange(count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_windows)
        indices = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            indices[mask] = self.permutation(int(epoch))[offsets[mask]]
        return indices

    def rows(self, step: int, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Sequences [start, start+count) of a step's global batch: LongTensor [count, seq_len+1].

        Only the needed windows are read from the (memory-mapped) token array.
        """
        indices = self.window_indices(step, start, count)
        offsets = indices[:, None] * self.window + np.arange(self.window, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.tokens[offsets], dtype=np.int64))

    def global_batch_at(self, step: int) -> torch.Tensor:
        """The whole global batch of a step (what the data-parallel baseline trains on)."""
        return self.rows(step, 0, self.global_batch)

    def worker_batch(self, step: int, worker: int, num_workers: int) -> torch.Tensor:
        """Worker `worker`'s share of step `step`: part `worker` of `num_workers` of the global batch."""
        if num_workers < 1 or self.global_batch % num_workers:
            raise ConfigError(f"global_batch={self.global_batch} is not divisible by workers={num_workers}: each "
                              f"worker takes global_batch/workers sequences per step; pick a global_batch that is "
                              f"a multiple of {num_workers}")
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} does not exist among {num_workers} workers")
        share = self.global_batch // num_workers
        return self.rows(step, worker * share, share)

    def epochs(self, steps: int) -> float:
        """How many passes over the train windows `steps` steps make."""
        return steps * self.global_batch / self.num_windows

    def overrun(self, steps: int) -> str | None:
        """Why `steps` steps need more windows than the train split has (None when they do not)."""
        needed = steps * self.global_batch
        if needed <= self.num_windows:
            return None
        return (f"{steps} steps x global_batch {self.global_batch} = {needed} sequences of {self.window} tokens, "
                f"but the train split has only {self.num_windows} ({len(self.tokens)} tokens): "
                f"{self.epochs(steps):.2f} epochs")


def _too_short_for_one_window(tokens: int, seq_len: int) -> str:
    return (f"the train split has {tokens} tokens, fewer than one sequence of seq_len+1 = {seq_len + 1}; "
            "fix: use a shorter seq_len or more data")


def _validation_shortfall(val_tokens: int, seq_len: int, num_tokens: int) -> str | None:
    """Why the validation split cannot score `num_tokens` tokens at `seq_len` (None when it can)."""
    window = seq_len + 1
    count = -(-num_tokens // seq_len)
    if count * window <= val_tokens:
        return None
    available = val_tokens // window * seq_len
    return (f"the validation split has {val_tokens} tokens, fewer than the {count} windows x {window} tokens "
            f"needed to score val_tokens={num_tokens} at seq_len={seq_len}; fix: set data.val_tokens<={available}, "
            "or prepare with a larger val_fraction")


def check_run_data(train: np.ndarray, val: np.ndarray, seq_len: int, global_batch: int, steps: int,
                   val_tokens: int, allow_repeat: bool) -> str | None:
    """Every problem of a run's data at once: a DataError with one line each. Returns the notice
    of a run that repeats the data (data.allow_repeat=true), if it does."""
    problems = []
    notice = None
    if len(train) < seq_len + 1:
        problems.append(_too_short_for_one_window(len(train), seq_len))
    else:
        overrun = Batches(train, seq_len, global_batch).overrun(steps)
        if overrun and not allow_repeat:
            problems.append(f"{overrun}; fix: fewer steps, a smaller global_batch or seq_len, more data, "
                            "or data.allow_repeat=true")
        elif overrun:
            notice = f"{overrun}; repeating the data (data.allow_repeat=true)"
    shortfall = _validation_shortfall(len(val), seq_len, val_tokens)
    if shortfall:
        problems.append(shortfall)
    if problems:
        raise DataError("\n".join(problems))
    return notice


def validation_batches(val_tokens: np.ndarray, seq_len: int, num_tokens: int, batch_size: int) -> list[torch.Tensor]:
    """The fixed held-out set: the first windows of the validation split, in batches.

    ceil(num_tokens / seq_len) windows of seq_len + 1 tokens are taken from the start of
    the split, so at least `num_tokens` next-token predictions are scored; every
    evaluation of every run with these settings scores exactly the same tokens.
    """
    if seq_len < 1 or num_tokens < 1 or batch_size < 1:
        raise ConfigError(f"seq_len={seq_len}, val_tokens={num_tokens} and batch size={batch_size} must be >= 1")
    shortfall = _validation_shortfall(len(val_tokens), seq_len, num_tokens)
    if shortfall:
        raise DataError(shortfall)
    window = seq_len + 1
    count = -(-num_tokens // seq_len)
    windows = np.asarray(val_tokens[:count * window], dtype=np.int64).reshape(count, window)
    return [torch.from_numpy(windows[start:start + batch_size].copy()) for start in range(0, count, batch_size)]


def unigram_entropy(tokens: np.ndarray, evaluate_on: np.ndarray | None = None, vocab_size: int | None = None,
                    chunk: int = 1 << 24) -> float:
    """The loss, in nats per token, of a model that ignores context: the unigram baseline.

    Without `evaluate_on` this is the entropy of the empirical unigram distribution of
    `tokens` (the train split), i.e. the unigram model's cross-entropy on the very tokens it
    was fit to - the number to beat. With `evaluate_on` (the validation split) it is that
    model's cross-entropy on held-out tokens, add-one smoothed over `vocab_size` so tokens
    unseen in training cost a finite amount.
    """
    size = vocab_size if vocab_size is not None else _max_plus_one(tokens, evaluate_on, chunk)
    counts = _bincount(tokens, size, chunk)
    total = counts.sum()
    if total == 0:
        raise DataError("cannot compute a unigram baseline of an empty split")
    if evaluate_on is None:
        p = counts[counts > 0] / total
        return float(-(p * np.log(p)).sum())
    log_q = np.log((counts + 1.0) / (total + size))
    held_out = _bincount(evaluate_on, size, chunk)
    if held_out.sum() == 0:
        raise DataError("cannot evaluate a unigram baseline on an empty split")
    return float(-(held_out * log_q).sum() / held_out.sum())


def _bincount(tokens: np.ndarray, size: int, chunk: int) -> np.ndarray:
    counts = np.zeros(size, dtype=np.float64)
    for start in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[start:start + chunk]), minlength=size)[:size]
    return counts


def _max_plus_one(tokens: np.ndarray, other: np.ndarray | None, chunk: int) -> int:
    largest = 0
    for array in (tokens, other):
        if array is not None:
            for start in range(0, len(array), chunk):
                largest = max(largest, int(array[start:start + chunk].max()))
    return largest + 1
