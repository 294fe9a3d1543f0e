"""Helpers shared by test modules: the tiny run most tests train, and comparisons of results."""

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from isoloco import checkpoint as ckpt

#: Where device-agnostic training tests run (see conftest.py).
TEST_DEVICE = os.environ.get("ISOLOCO_TEST_DEVICE", "cpu")

#: The smallest run worth training: the tiny model, 32-token sequences, a 512-token vocabulary.
#: Tests add steps, workers, H and the method.
SMALL = {"model": "tiny", "seq_len": 32, "global_batch": 8, "eval_batch": 8, "data.vocab_size": 512,
         "data.val_tokens": 1024, "checkpoint_every": 0, "device": TEST_DEVICE}

#: The same as `isoloco train` arguments, on the CPU (tests that start processes).
SMALL_ARGS = ["model=tiny", "seq_len=32", "global_batch=8", "data.vocab_size=512", "data.val_tokens=1024",
              "device=cpu"]

#: The environment of a training process started by a test: one thread, as `make test` runs.
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def final_params(run: Path) -> dict[str, torch.Tensor]:
    """θ of a run directory's newest checkpoint."""
    return load_file(str(ckpt.latest_checkpoint(run / "checkpoints") / "global.safetensors"))


def assert_close_relative(ours: list[torch.Tensor], reference: list[torch.Tensor], rtol: float,
                          names: list[str] | None = None) -> None:
    """Relative error per tensor, ||x - y|| / ||y|| (Frobenius), at most `rtol`."""
    names = names or [str(i) for i in range(len(reference))]
    for name, x, y in zip(names, ours, reference, strict=True):
        error = (torch.linalg.norm(x - y) / torch.linalg.norm(y)).item()
        assert error <= rtol, f"{name}: relative error {error:.2e}"
