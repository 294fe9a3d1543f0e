"""Simulator throughput: tokens/s of DiLoCo with R simulated workers / tokens/s of a plain loop.

The plain loop is the simplest PyTorch training loop on the same model, with the same
micro-batch one worker sees (global_batch / R sequences) and the same AdamW + clipping; a
sequential simulator can at best match it (ratio 1.0). Both are timed in the same process,
alternating, and the ratio of medians is printed: a ratio, never a bare time, because
these machines are noisy.

    python benchmarks/throughput.py [--workers 8] [--model small] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from isoloco.config import resolve
from isoloco.trainer import Trainer


def plain_loop_seconds(trainer: Trainer, steps: int, micro_batch: int) -> float:
    """Time `steps` of a textbook loop on the trainer's own model and data."""
    model = trainer.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    rows = [trainer.batches.rows(s, 0, micro_batch) for s in range(steps)]
    began = time.perf_counter()
    for batch in rows:
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--model", default="small")
    parser.add_argument("--method", default="diloco")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = resolve(None, {"method": args.method, "model": args.model, "workers": args.workers,
                         "global_batch": args.global_batch, "seq_len": args.seq_len,
                         "inner_steps": args.inner_steps, "steps": args.inner_steps * (args.repeats + 1)})
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, out, progress=False, say=lambda _m: None)
        micro = cfg.global_batch // cfg.workers
        round_tokens = cfg.inner_steps * cfg.global_batch * cfg.seq_len
        plain_steps = cfg.inner_steps * cfg.workers  # the same tokens as one round
        trainer._round(0, cfg.inner_steps)  # warm-up (allocations, first-call costs)
        plain_loop_seconds(trainer, cfg.workers, micro)
        diloco, plain = [], []
        for r in range(1, args.repeats + 1):
            began = time.perf_counter()
            trainer._round(r * cfg.inner_steps, (r + 1) * cfg.inner_steps)
            diloco.append(round_tokens / (time.perf_counter() - began))
            plain.append(round_tokens / plain_loop_seconds(trainer, plain_steps, micro))
    ratio = statistics.median(diloco) / statistics.median(plain)
    print(f"model {cfg.model} ({trainer.num_params:,} params), {cfg.method}, R={cfg.workers}, H={cfg.inner_steps}, "
          f"micro-batch {micro}x{cfg.seq_len}, threads {torch.get_num_threads()}, {args.repeats} repeats")
    print("| measure | median tokens/s |\n|---|---|")
    print(f"| DiLoCo simulator, R={cfg.workers} | {statistics.median(diloco):,.0f} |")
    print(f"| plain PyTorch loop | {statistics.median(plain):,.0f} |")
    print(f"throughput ratio (simulator / plain loop): {ratio:.3f}")


if __name__ == "__main__":
    main()
