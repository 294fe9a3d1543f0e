"""What the torchft test modules share: their tiny run, the rules merged in the quorum, and
replica-group processes started and joined with a deadline."""

from __future__ import annotations

import multiprocessing
import time

from isoloco.config import TrainConfig, resolve

import helpers

# The simulator tests' tiny setting (tests/test_trainer.py): 2 workers, 3 outer steps.
TINY = {**helpers.SMALL, "steps": 6, "inner_steps": 2, "workers": 2, "eval_every": 6, "device": "cpu"}

#: The methods whose rule torchft's all-reduce of the mean does not carry.
QUORUM_METHODS = ["dare", "ties", "tsv", "isocts"]

SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 300  # every process here finishes in well under a minute; this only bounds a hang


def config(**overrides) -> TrainConfig:
    return resolve(None, {**TINY, **overrides})


def join_groups(processes: list, deadline_s: float = JOIN_S) -> None:
    """Wait for every process; kill any still running at the deadline and fail."""
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
    assert not hung, f"replica group process(es) {hung} did not finish within {deadline_s} s"
