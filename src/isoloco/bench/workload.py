"""What the merge benchmarks run on: the presets' parameter shapes, pseudo-gradients that
look like real ones, and the methods whose merge rules are compared."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from isoloco.config import resolve
from isoloco.data import DataConfig
from isoloco.merge_config import MergeConfig
from isoloco.model import llama_config
from isoloco.outer import OuterConfig
from isoloco.trainer import Trainer

#: One named method per merge rule, with the paper's knobs, plus IsoLoCo's fast variant
#: (Newton–Schulz in bf16 and the RMS scale) beside its exact one.
RULE_METHODS = ("diloco", "ties", "dare", "tsv", "isoloco", "isoloco_fast", "isocts")

#: The paper's presets use its 32k vocabulary; the CPU presets the default BPE vocabulary.
PAPER_PRESETS = ("178m", "512m", "1b")
CPU_PRESETS = ("tiny", "small")


def vocab_size(preset: str) -> int:
    return 32000 if preset in PAPER_PRESETS else DataConfig().vocab_size


def parameter_shapes(preset: str) -> list[tuple[str, torch.Size]]:
    """Every parameter's name and shape, from the model built on the meta device (no memory,
    so the 1B preset costs nothing)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(preset, vocab_size(preset), max_positions=2048))
    return [(name, param.shape) for name, param in model.named_parameters()]


def matrix_shapes(preset: str) -> list[tuple[int, int]]:
    """The distinct 2-D parameter shapes of a preset, in model order."""
    shapes = [tuple(shape) for _, shape in parameter_shapes(preset) if len(shape) == 2]
    return list(dict.fromkeys(shapes))


def pseudo_gradient(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A matrix shaped like a pseudo-gradient: a rank-16 signal with singular values from 50
    down to 5 plus dense noise whose singular values lie in about [0, 2]."""
    g = torch.Generator().manual_seed(seed)
    rank = min(16, rows, cols)
    u = torch.linalg.qr(torch.randn(rows, rank, generator=g))[0]
    v = torch.linalg.qr(torch.randn(cols, rank, generator=g))[0]
    strengths = torch.logspace(math.log10(50), math.log10(5), rank)
    noise = torch.randn(rows, cols, generator=g) / math.sqrt(max(rows, cols))
    return (u * strengths) @ v.T + noise


def worker_deltas(shapes: list[tuple[str, torch.Size]], workers: int, distinct: int = 16) -> dict[str, list[torch.Tensor]]:
    """One pseudo-gradient per parameter and worker, as an outer step receives them.

    Only `distinct` different deltas are drawn; worker r gets number r mod `distinct`, so
    R = 128 workers of the `small` preset take 0.6 GB instead of 4.6 GB. The rules do the
    same work per worker whatever the values, and 16 deltas of either CPU preset already
    exceed this machine's 32 MiB L3 cache, so the sums stream from memory as they would
    with R distinct deltas.
    """
    pool = []
    for k in range(min(workers, distinct)):
        pool.append({
            name: pseudo_gradient(*shape, seed=k) if len(shape) == 2
            else torch.randn(shape, generator=torch.Generator().manual_seed(k))
            for name, shape in shapes
        })
    return {name: [pool[r % len(pool)][name] for r in range(workers)] for name, _ in shapes}


def method_sections(method: str) -> tuple[MergeConfig, OuterConfig]:
    """The merge and outer sections a named method resolves to."""
    cfg = resolve(None, {"method": method})
    return cfg.merge, cfg.outer


def simulator(preset: str, method: str, workers: int, global_batch: int, seq_len: int, inner_steps: int,
              steps: int, **overrides) -> Trainer:
    """A one-process Trainer whose rounds the benchmarks time piece by piece.

    The benchmarks never call `run()`, so nothing is written to the output directory.
    """
    cfg = resolve(None, {"method": method, "model": preset, "workers": workers, "global_batch": global_batch,
                         "seq_len": seq_len, "inner_steps": inner_steps, "steps": steps, **overrides})
    return Trainer(cfg, Path(tempfile.gettempdir()) / "isoloco-bench", progress=False)


def trained_deltas(rounds: int, preset: str | None = None, **overrides) -> dict[str, list[torch.Tensor]]:
    """Real pseudo-gradients: every parameter's per-worker deltas (float64) of round `rounds`
    of a run (`preset` plus `overrides`, on the CPU), as its outer step would receive them; the
    rounds before it merge as the run says."""
    cfg = resolve(preset, {"device": "cpu", **overrides})
    trainer = Trainer(cfg, Path(tempfile.gettempdir()) / "isoloco-bench", progress=False)
    h = cfg.inner_steps
    for start in range(0, h * (rounds - 1), h):
        trainer.train_round(start, start + h)
    for worker in trainer.workers:
        trainer.take_turn(worker, h * (rounds - 1), h * rounds)
    names = [name for name, _ in trainer.named_params]
    return {name: [worker.delta[i].double() for worker in trainer.workers] for i, name in enumerate(names)}
