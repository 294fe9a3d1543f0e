"""Inner optimizers (what each worker runs every step) and their learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from isoloco.configbase import check_choices, check_positive, check_range, option

INNER_OPTIMIZERS = ("adamw", "muon", "sgd")


@dataclass
class InnerConfig:
    optimizer: str = option("adamw", "inner optimizer of every worker (and of the dp baseline)", INNER_OPTIMIZERS)
    lr: float = option(0.00138, "peak inner learning rate")
    weight_decay: float = option(0.1, "decoupled weight decay of AdamW / Muon (sgd ignores it)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    muon_momentum: float = option(0.95, "Muon momentum (hidden 2-D weights only)")
    grad_clip: float = option(1.0, "clip the gradient norm of every inner step to this (0 disables)")
    warmup_fraction: float = option(0.1, "fraction of the steps spent warming up from min_lr_ratio to 1x peak")
    min_lr_ratio: float = option(0.1, "learning rate at the start of warm-up and end of cosine decay, as a fraction of peak")

    def validate(self) -> None:
        check_choices("inner", self)
        check_positive("inner.lr", self.lr)
        check_range("inner.weight_decay", self.weight_decay, 0.0, math.inf, low_open=False, high_open=True)
        check_range("inner.beta1", self.beta1, 0.0, 1.0, low_open=False, high_open=True)
        check_range("inner.beta2", self.beta2, 0.0, 1.0, low_open=False, high_open=True)
        check_range("inner.muon_momentum", self.muon_momentum, 0.0, 1.0, low_open=False, high_open=True)
        check_range("inner.grad_clip", self.grad_clip, 0.0, math.inf, low_open=False, high_open=True)
        check_range("inner.warmup_fraction", self.warmup_fraction, 0.0, 1.0, low_open=False, high_open=True)
        check_range("inner.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0, low_open=False, high_open=False)


def lr_factor(step: int, total_steps: int, warmup_fraction: float, min_ratio: float) -> float:
    """Multiplier of the peak LR at `step`: linear warm-up from min_ratio, cosine back to min_ratio."""
    # ⌊fraction·total⌋ warm-up steps, as the paper's code counts them.
    warmup = max(1, int(warmup_fraction * total_steps)) if warmup_fraction > 0 else 0
    if step < warmup:
        return min_ratio + (1.0 - min_ratio) * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Muon is for hidden matrices; embeddings, LM head and 1-D tensors go to AdamW."""
    return param.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name


class InnerOptimizer:
    """One worker's optimizer(s), a schedule, and gradient clipping, behind one `step`.

    Muon needs AdamW beside it for the tensors it is not meant for, so a worker may own two
    torch optimizers; this wrapper keeps that detail out of the training loop.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: InnerConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.params = [p for _, p in named_params]
        adamw_kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        if cfg.optimizer == "sgd":
            self.optimizers = [torch.optim.SGD(self.params, lr=cfg.lr)]
        elif cfg.optimizer == "adamw":
            self.optimizers = [torch.optim.AdamW(self.params, **adamw_kwargs, foreach=True)]
        else:
            hidden = [p for n, p in named_params if uses_muon(n, p)]
            other = [p for n, p in named_params if not uses_muon(n, p)]
            # match_rms_adamw scales Muon's update to AdamW's RMS so one peak LR serves both.
            self.optimizers = [
                torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(other, **adamw_kwargs, foreach=True),
            ]
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["peak_lr"] = cfg.lr
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # offloaded state, one buffer per tensor

    def lr_at(self, step: int) -> float:
        return self.cfg.lr * lr_factor(step, self.total_steps, self.cfg.warmup_fraction, self.cfg.min_lr_ratio)

    def step(self, step: int) -> None:
        """Clip, set the scheduled LR for global step `step`, update, clear gradients."""
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        factor = lr_factor(step, self.total_steps, self.cfg.warmup_fraction, self.cfg.min_lr_ratio)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * factor
            opt.step()
            opt.zero_grad(set_to_none=True)

    def state_dicts(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dicts(self, states: list[dict]) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(f"checkpoint holds {len(states)} inner optimizers, this run builds {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, states):
            opt.load_state_dict(state)

    def move_state(self, device: torch.device) -> None:
        """Move optimizer state tensors (moments, momentum) to `device` (idle-worker offload).

        To the CPU they go into buffers allocated once per tensor at its exact size and copied
        synchronously: a non-blocking copy would land in page-locked memory from torch's host
        cache (sizes rounded up to a power of two, never returned, not swappable) and could
        still be in flight when a checkpoint reads it. Back to the GPU the copy may overlap.
        """
        for opt in self.optimizers:
            for param, state in opt.state.items():
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor) or value.device == device or value.ndim == 0:
                        continue
                    if device.type == "cpu":
                        host = self._host.get((id(param), key))
                        if host is None or host.shape != value.shape or host.dtype != value.dtype:
                            host = self._host[id(param), key] = torch.empty_like(value, device="cpu")
                        state[key] = host.copy_(value)
                    else:
                        state[key] = value.to(device, non_blocking=True)
