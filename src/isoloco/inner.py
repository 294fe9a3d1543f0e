"""Inner steps: the forward and backward every worker runs each step, the inner optimizers
and their learning-rate schedule."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from isoloco.checkpoint import saved_optimizer_state
from isoloco.configbase import check_choices, check_positive, check_range, option

INNER_OPTIMIZERS = ("adamw", "muon", "sgd")
#: AdamW's kernels: `fused` updates every tensor in one kernel per step (torch has it on CPU and
#: CUDA); `foreach` is the multi-tensor kernel runs used before `inner.kernel` existed. The two
#: agree to float32 round-off, not bit for bit.
ADAMW_KERNELS = ("fused", "foreach")


def mixed_precision(device: torch.device) -> AbstractContextManager:
    """Where a step's forward runs in bfloat16: autocast on CUDA (fp32 weights); the CPU
    computes in float32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def attention_kernels(deterministic: bool) -> AbstractContextManager:
    """The math attention kernel when deterministic: the fused ones' backward passes
    accumulate in a nondeterministic order on CUDA."""
    if not deterministic:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def next_token_loss(model: torch.nn.Module, rows: torch.Tensor, autocast: AbstractContextManager,
                    deterministic: bool) -> torch.Tensor:
    """Mean next-token cross-entropy of `rows` ([n, seq_len + 1]), the logits in float32."""
    with autocast, attention_kernels(deterministic):
        logits = model(input_ids=rows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))


def forward_backward(model: torch.nn.Module, rows: torch.Tensor, micro_batch: int, autocast: AbstractContextManager,
                     deterministic: bool) -> torch.Tensor:
    """One inner step's forward and backward: the mean next-token loss over `rows`, accumulated
    over micro-batches of `micro_batch` rows into ``.grad``. The loss stays a device tensor (no
    host sync per micro-batch); the trainer and torchft's replica groups both step with this."""
    chunks = rows.split(micro_batch)
    total = torch.zeros((), device=rows.device)
    for chunk in chunks:
        loss = next_token_loss(model, chunk, autocast, deterministic)
        (loss / len(chunks)).backward()
        total += loss.detach()
    return total / len(chunks)


@dataclass
class InnerConfig:
    optimizer: str = option("adamw", "inner optimizer of every worker (and of the dp baseline)", INNER_OPTIMIZERS)
    lr: float = option(0.00138, "peak inner learning rate")
    weight_decay: float = option(0.1, "decoupled weight decay of AdamW / Muon (sgd ignores it)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    kernel: str = option("fused", "AdamW's kernel (also Muon's AdamW side): fused, one kernel per step (CPU and "
                         "CUDA), or foreach, as runs made before this key (other last bits)", ADAMW_KERNELS)
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


def pinned_zeros_like(like: torch.Tensor, owner: object) -> torch.Tensor:
    """A zero CPU tensor shaped like `like`, page-locked while `owner` lives: host memory for
    state offloaded from a GPU, which copies to and from the GPU at full bus speed and, from
    the GPU's side, asynchronously.

    Pinned by registering ordinary memory (`cudaHostRegister`), as torch's own checkpoint
    stager does, rather than through `pin_memory=True`: torch's pinned allocator rounds every
    request up to a power of two and keeps it cached, up to twice the state in locked memory.
    The unregistering finalizer holds the buffer, so its memory is unpinned before it is freed.
    """
    buffer = torch.zeros(like.shape, dtype=like.dtype)
    if buffer.nbytes:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
        # Not at exit: the process's memory goes back whole, and CUDA may be torn down already.
        weakref.finalize(owner, _unpin, buffer).atexit = False
    return buffer


def _unpin(buffer: torch.Tensor) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that `InnerOptimizer.prefetch` copies on, one per GPU."""
    return torch.cuda.Stream(device)


def _movable(value: Any, device: torch.device) -> bool:
    """Whether `move_state` moves this state value: tensors with data (AdamW's 0-d `step` stays
    where torch keeps it: the CPU, or its parameter's device with a fused kernel) that are not on
    `device` already."""
    return isinstance(value, torch.Tensor) and value.ndim > 0 and value.device != device


class InnerOptimizer:
    """One worker's optimizer(s), a schedule, and gradient clipping, behind one `step`.

    Muon needs AdamW beside it for the tensors it is not meant for, so a worker may own two
    torch optimizers; this wrapper keeps that detail out of the training loop.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: InnerConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.params = [p for _, p in named_params]
        adamw_kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "weight_decay": cfg.weight_decay,
                        cfg.kernel: True}
        if cfg.optimizer == "sgd":
            self.optimizers = [torch.optim.SGD(self.params, lr=cfg.lr)]
        elif cfg.optimizer == "adamw":
            self.optimizers = [torch.optim.AdamW(self.params, **adamw_kwargs)]
        else:
            hidden = [p for n, p in named_params if uses_muon(n, p)]
            other = [p for n, p in named_params if not uses_muon(n, p)]
            # match_rms_adamw scales Muon's update to AdamW's RMS so one peak LR serves both.
            self.optimizers = [
                torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(other, **adamw_kwargs),
            ]
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["peak_lr"] = cfg.lr
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # offloaded state, one buffer per tensor
        self._prefetched: dict[tuple[int, str], torch.Tensor] = {}  # state copied ahead to the GPU
        self._prefetch_done: torch.cuda.Event | None = None

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

    def load_state(self, saved: Mapping[str, torch.Tensor], scalars: Mapping[str, Any], prefix: str,
                   device: torch.device) -> None:
        """Restore the state a checkpoint keeps under `prefix` (see `flatten_optimizer_state`),
        each tensor read from `saved` and put on `device`, this worker's storage (its pinned
        host buffer when offloaded from a GPU), before the next is read: a restore holds one
        tensor beyond the state.

        This is what torch's `load_state_dict` does for a fresh optimizer, except where the
        moments go: torch would put them on their parameters' device, a round trip through the
        GPU for an offloaded worker. `step` goes where torch puts it: a fused or capturable
        kernel keeps it on its parameter's device as float32 (and refuses it elsewhere), the
        others on the CPU.
        """
        for j, opt in enumerate(self.optimizers):
            opt.state.clear()
            step_with_param = {id(p) for group in opt.param_groups if group.get("fused") or group.get("capturable")
                               for p in group["params"]}
            for param, key, value in saved_optimizer_state(opt, saved, scalars, f"{prefix}.opt{j}"):
                if key == "step" and id(param) in step_with_param and isinstance(value, torch.Tensor):
                    value = value.to(device=param.device, dtype=torch.float32)
                elif isinstance(value, torch.Tensor) and value.ndim > 0:
                    if device.type == "cpu" and param.is_cuda:  # offloaded from a GPU: its pinned buffer
                        value = self._host_buffer(param, key, value).copy_(value)
                    else:
                        value = value.to(device=device, dtype=param.dtype)
                opt.state[param][key] = value

    def move_state(self, device: torch.device) -> None:
        """Move optimizer state tensors (moments, momentum) to `device` (idle-worker offload).

        To the CPU they go into buffers allocated once per tensor at its exact size, pinned
        when they come from a GPU (`pinned_zeros_like`), and copied synchronously: a
        checkpoint or the next worker's prefetch may read them next. Back to the GPU the copy
        may overlap, or was already made by `prefetch`; then the compute stream waits for it.
        """
        if self._prefetch_done is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._prefetch_done)
            self._prefetch_done = None
        for opt in self.optimizers:
            for param, state in opt.state.items():
                for key, value in state.items():
                    if not _movable(value, device):
                        continue
                    if device.type == "cpu":
                        state[key] = self._host_buffer(param, key, value).copy_(value)
                    elif (id(param), key) in self._prefetched:
                        state[key] = self._prefetched.pop((id(param), key))
                        # Allocated on the side stream: keep its memory until the compute stream is done.
                        state[key].record_stream(torch.cuda.current_stream(device))
                    else:
                        state[key] = value.to(device, non_blocking=True)

    def prefetch(self, device: torch.device) -> None:
        """Start copying the offloaded state to `device`, a GPU, on a side stream, so the copy
        runs while the compute stream trains another worker; the next `move_state(device)`
        uses the copies. This worker's state occupies device memory from now on."""
        stream = _copy_stream(device)
        with torch.cuda.stream(stream):
            for opt in self.optimizers:
                for param, state in opt.state.items():
                    for key, value in state.items():
                        if _movable(value, device):
                            self._prefetched[id(param), key] = value.to(device, non_blocking=True)
        self._prefetch_done = stream.record_event()

    def _host_buffer(self, param: torch.Tensor, key: str, like: torch.Tensor) -> torch.Tensor:
        """The host buffer of one state tensor of `param`, pinned when it trains on a GPU."""
        host = self._host.get((id(param), key))
        if host is None or host.shape != like.shape or host.dtype != like.dtype:
            host = pinned_zeros_like(like, self) if param.is_cuda else torch.empty_like(like, device="cpu")
            self._host[id(param), key] = host
        return host
