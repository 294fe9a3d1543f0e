"""The codecs: what a phase's contributions look like while they cross the slow link.

A tensor is sent as a `Wire`: one contiguous payload plus, for the integer formats, one
float32 absmax scale per *group* of consecutive entries of the flattened tensor:

* ``none``: the float32 entries as they are (4 bytes each);
* ``bf16``: the entries rounded to bfloat16 (2 bytes each);
* ``int8``: codes in [-127, 127], entry ≈ code · scale, scale = absmax(group) / 127
  (1 byte each);
* ``int4``: codes in [-7, 7], scale = absmax(group) / 7, packed two per byte (½ byte each).

A group is ``block_size`` entries of the flattened tensor (``scales=block``; the last block
may be shorter) or one row of a matrix (``scales=row``; a vector or scalar is one row, and a
tensor of more dimensions is seen as shape[0] rows). The grid is symmetric, so a code and its
negation decode to opposite values and the largest entry of a group is sent exactly up to one
rounding. Codes are rounded to nearest (ties to even) after a true division, and decoded by one
multiplication: every step is exactly rounded IEEE arithmetic, so every device gives the same
bits. The error of each entry is at most half its group's scale (``int8``, ``int4``) or 2⁻⁸ of
its magnitude (``bf16``); see `error_bound`.

Error feedback (`compress_with_feedback`) keeps what a worker's compression lost and adds it to
its next pseudo-gradient, so nothing is lost for good: over T rounds the values sent add up to
the values meant minus the last residual. The compressed sum across islands keeps the same
promise for every rounding on its way (`isoloco.sync.phase`).

`carry_refusal` is the codec's say on a rule: it carries a rule whose every collective is a
sum that tolerates rounding, and says in one line why not otherwise.

Scales are float32 on every device. A scale below float32's normal range (a group whose
absmax is under qmax · 2⁻¹²⁶, about 10⁻³⁶) loses precision, and the half-scale bound can then
be exceeded by that tiny scale's rounding; pseudo-gradients never come near it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from isoloco.configbase import check_at_least, check_choices, option

if TYPE_CHECKING:
    from isoloco.rules import Phase

#: What crosses the link, from exact to smallest.
FORMATS = ("none", "bf16", "int8", "int4")
#: How entries are grouped under one absmax scale (``int8`` and ``int4`` only).
SCALE_GROUPS = ("block", "row")
#: The largest code of each integer format; codes lie in [-qmax, qmax].
QMAX = {"int8": 127, "int4": 7}
#: Bytes of one float32 scale.
SCALE_BYTES = 4
#: The int4 nibble that decodes to 0; it pads a shard of odd length to a whole byte.
_INT4_OFFSET = 8


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How tensors are compressed on the slow link."""

    quantize: str = option("none", "what crosses the slow link: float32 as it is, bfloat16, or int8 / int4 codes "
                                   "with one float32 absmax scale per group", choices=FORMATS)
    scales: str = option("block", "int8/int4 scale groups: `block` (block_size consecutive entries of the "
                                  "flattened tensor) or `row` (one matrix row; a vector is one row)",
                         choices=SCALE_GROUPS)
    block_size: int = option(256, "entries per scale with scales=block; each scale adds 4 bytes to the wire")

    def check(self, section: str = "") -> None:
        """Raise `ConfigError` (keys named ``section.field``) for a value that is not allowed."""
        check_choices(section, self)
        check_at_least(f"{section}.block_size" if section else "block_size", self.block_size, 1)

    @property
    def scaled(self) -> bool:
        """Whether the format sends integer codes with scales (``int8``, ``int4``)."""
        return self.quantize in QMAX

    def group_size(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Entries per scale for a tensor of `shape`: the block size, the row length, or 1 where
        the format has no scales (every entry is its own group when a tensor is split in shards)."""
        if not self.scaled:
            return 1
        if self.scales == "block":
            return self.block_size
        numel = math.prod(shape)
        # A vector (or scalar) is one row; an empty tensor gets a group of 1 so that counts stay defined.
        rows = shape[0] if len(shape) >= 2 and shape[0] > 0 else 1
        return max(1, numel // rows)


def wire_nbytes(numel: int, quantization: Quantization, group_size: int) -> int:
    """Bytes of the `Wire` of `numel` entries in groups of `group_size`:

    * ``none``: 4·n; ``bf16``: 2·n;
    * ``int8``: n + 4·⌈n / g⌉; ``int4``: ⌈n / 2⌉ + 4·⌈n / g⌉ (g the group size).
    """
    if quantization.quantize == "none":
        return 4 * numel
    if quantization.quantize == "bf16":
        return 2 * numel
    scale_bytes = SCALE_BYTES * math.ceil(numel / group_size)
    code_bytes = numel if quantization.quantize == "int8" else (numel + 1) // 2
    return code_bytes + scale_bytes


@dataclasses.dataclass(frozen=True)
class Wire:
    """One tensor as it crosses the link; `dequantize` turns it back into float32."""

    #: The format, one of `FORMATS`.
    quantize: str
    #: 1-D: float32 (``none``), bfloat16 (``bf16``) or uint8: ``int8`` codes as two's-complement
    #: bytes, ``int4`` codes + 8 as nibbles, entry 2i in the low nibble of byte i and 2i+1 in the high.
    payload: torch.Tensor
    #: 1-D float32, one absmax scale per group (``int8``, ``int4``); empty for the other formats.
    scales: torch.Tensor
    #: Shape of the tensor sent.
    shape: torch.Size
    #: Entries per scale (1 for the formats without scales).
    group_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: payload plus scales (`wire_nbytes`)."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * SCALE_BYTES

    def as_bytes(self) -> torch.Tensor:
        """Scales then payload as one contiguous uint8 tensor of `nbytes` bytes, for a single
        collective. Scales come first so both parts start at an offset their dtype can be viewed at."""
        return torch.cat([self.scales.view(torch.uint8), self.payload.view(torch.uint8)])

    def slice(self, start: int, stop: int) -> Wire:
        """Entries [start, stop) of the flattened tensor as a wire of their own, without
        quantising again: `start` must begin a scale group (a shard of whole groups), so the
        slice decodes to exactly those entries of the whole. Views where the bytes line up."""
        if (start % self.group_size and start != self.numel) or not 0 <= start <= stop <= self.numel:
            raise ValueError(f"a slice [{start}, {stop}) of a wire of {self.numel} entries must start a group of "
                             f"{self.group_size}")
        shape = torch.Size((stop - start,))
        scales = self.scales[-(-start // self.group_size):-(-stop // self.group_size)] if self.scales.numel() else \
            self.scales
        if self.quantize != "int4":
            return Wire(self.quantize, self.payload[start:stop], scales, shape, self.group_size)
        if start % 2:  # the slice starts mid-byte: its nibbles are packed again
            return Wire("int4", _pack_int4(_unpack_int4(self.payload, stop)[start:]), scales, shape, self.group_size)
        payload = self.payload[start // 2:-(-stop // 2)]
        if stop % 2 and stop < self.numel:  # its last byte's high nibble is the next entry's: pad it as an odd end
            payload = torch.cat([payload[:-1], (payload[-1:] & 0x0F) | (_INT4_OFFSET << 4)])
        return Wire("int4", payload, scales, shape, self.group_size)

    @classmethod
    def from_bytes(cls, buffer: torch.Tensor, quantization: Quantization, shape: torch.Size | tuple[int, ...],
                   group_size: int | None = None) -> Wire:
        """The `Wire` whose `as_bytes` is `buffer` (views, no copy), for a tensor of `shape` sent
        under `quantization` with `group_size` entries per scale (by default the one for `shape`).
        `buffer` must start 4-byte aligned in its storage, as a received buffer does, for the
        scales to be viewed as float32."""
        shape = torch.Size(shape)
        group = quantization.group_size(shape) if group_size is None else group_size
        numel = math.prod(shape)
        expected = wire_nbytes(numel, quantization, group)
        if buffer.dtype != torch.uint8 or buffer.numel() != expected:
            raise ValueError(f"a {quantization.quantize} wire of {numel} entries in groups of {group} is {expected} "
                             f"uint8 bytes, got {buffer.numel()} of {buffer.dtype}")
        groups = math.ceil(numel / group) if quantization.scaled else 0
        split = SCALE_BYTES * groups
        payload_dtype = {"none": torch.float32, "bf16": torch.bfloat16}.get(quantization.quantize, torch.uint8)
        return cls(quantization.quantize, buffer[split:].view(payload_dtype),
                   buffer[:split].view(torch.float32), shape, group)


def _grouped(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """`flat` as rows of `group_size` entries, the last row zero-padded (a copy only then)."""
    groups = math.ceil(flat.numel() / group_size)
    pad = groups * group_size - flat.numel()
    return (F.pad(flat, (0, pad)) if pad else flat).view(groups, group_size)


def _refuse_non_finite(found: torch.Tensor, shape: torch.Size, group_size: int = 1) -> None:
    """Raise `FloatingPointError` naming where `found` (entries, or one value per group of
    `group_size` entries) is first not finite; one device sync."""
    bad = ~torch.isfinite(found)
    if bad.any():
        first = int(bad.nonzero()[0, 0]) * group_size
        last = min(first + group_size, math.prod(shape)) - 1
        where = f"entry {first}" if first == last else f"entries {first} to {last}"
        raise FloatingPointError(f"cannot quantise a tensor of shape {tuple(shape)}: {where} of its flattened "
                                 f"values hold NaN or inf; a non-finite pseudo-gradient must be refused before "
                                 f"it is sent")


def quantize(tensor: torch.Tensor, quantization: Quantization, group_size: int | None = None,
             check: bool = True) -> Wire:
    """`tensor` (float32, any shape, on any device) as it is sent under `quantization`.

    `group_size` (entries per scale) defaults to `quantization.group_size(tensor.shape)`; pass
    it for a flat slice of a larger tensor, such as a shard, so its groups stay those of the
    whole. With `check`, raises `FloatingPointError` when the tensor holds NaN or inf (or, for
    ``bf16``, an entry beyond bfloat16's range), so nothing non-finite is sent; that costs a
    device sync, so the sync layer checks a bucket's deltas once instead and passes False.
    """
    if tensor.dtype != torch.float32:
        raise TypeError(f"quantize takes float32 tensors, got {tensor.dtype}")
    group = quantization.group_size(tensor.shape) if group_size is None else group_size
    flat = tensor.reshape(-1)
    empty = torch.empty(0, dtype=torch.float32, device=tensor.device)
    if quantization.quantize == "none":
        if check:
            _refuse_non_finite(flat, tensor.shape)
        # A copy: a wire owns its bytes, so changing the tensor later (a residual) leaves it alone.
        return Wire("none", flat.clone(), empty, tensor.shape, group)
    if quantization.quantize == "bf16":
        payload = flat.to(torch.bfloat16)
        if check:  # checking the rounded values also catches float32 entries that overflow bfloat16
            _refuse_non_finite(payload, tensor.shape)
        return Wire("bf16", payload, empty, tensor.shape, group)

    qmax = QMAX[quantization.quantize]
    grouped = _grouped(flat, group)
    # amin and amax propagate NaN, so a non-finite entry shows in its group's scale: one small
    # check. Both extremes instead of abs().amax(): no temporary the size of the tensor.
    low, high = grouped.aminmax(dim=1)
    scales = torch.maximum(high, low.neg_()) / qmax
    if check:
        _refuse_non_finite(scales, tensor.shape, group)
    # An all-zero group has scale 0: divide it by 1 instead, so its codes are 0 and decode to 0.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    # The clamp only matters for a subnormal scale, whose rounding can push |x / scale| past qmax.
    codes = (grouped / divisor[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8).reshape(-1)[:flat.numel()]
    if quantization.quantize == "int8":
        return Wire("int8", codes.view(torch.uint8), scales, tensor.shape, group)
    return Wire("int4", _pack_int4(codes), scales, tensor.shape, group)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] as nibbles, two per byte (an odd count padded with the zero nibble)."""
    nibbles = (codes + _INT4_OFFSET).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = F.pad(nibbles, (0, 1), value=_INT4_OFFSET)
    return nibbles[0::2] | (nibbles[1::2] << 4)


def _unpack_int4(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 codes of `numel` entries packed by `_pack_int4`."""
    nibbles = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)[:numel]
    return nibbles.to(torch.int8) - _INT4_OFFSET


def dequantize(wire: Wire) -> torch.Tensor:
    """The float32 tensor a receiver decodes from `wire`, of the shape sent."""
    if wire.quantize in ("none", "bf16"):
        return wire.payload.to(torch.float32).reshape(wire.shape)
    codes = wire.payload.view(torch.int8) if wire.quantize == "int8" else _unpack_int4(wire.payload, wire.numel)
    # In place on the fresh float32 codes: one tensor of the wire's size, not two.
    grouped = _grouped(codes.to(torch.float32), wire.group_size).mul_(wire.scales[:, None])
    return grouped.reshape(-1)[:wire.numel].reshape(wire.shape)


def error_bound(wire: Wire, sent: torch.Tensor) -> torch.Tensor:
    """Per entry, the most `dequantize(wire)` can differ from `sent` (the tensor quantised):
    half the entry's group scale (``int8``, ``int4``), 2⁻⁸·|x| (``bf16``: 8 significant bits,
    rounded to nearest), 0 (``none``)."""
    if wire.quantize == "none":
        return torch.zeros_like(sent)
    if wire.quantize == "bf16":
        return sent.abs() * 2.0 ** -8
    per_entry = wire.scales.repeat_interleave(wire.group_size)[:wire.numel]
    return (per_entry / 2).reshape(wire.shape)


def compress_with_feedback(delta: torch.Tensor, residual: torch.Tensor | None,
                           quantization: Quantization) -> tuple[Wire, torch.Tensor]:
    """Error feedback: send `delta + residual` and keep what the compression lost.

    Returns the wire and the new residual (δ + e) − dequantize(wire), a plain float32 tensor of
    `delta`'s shape to keep in the worker's state and checkpoint. `residual` (None: zero) is
    updated in place and returned, so a worker holds one residual buffer, not two.
    """
    if residual is None:
        residual = torch.zeros_like(delta)
    residual.add_(delta)
    wire = quantize(residual, quantization)
    residual.sub_(dequantize(wire))
    return wire, residual


def aligned(size: int) -> int:
    """`size` bytes rounded up to a multiple of 4: blobs laid end to end keep their float32 scales aligned."""
    return -(-size // 4) * 4


def pad_aligned(raw: torch.Tensor) -> torch.Tensor:
    """uint8 `raw` zero-padded to `aligned` length."""
    return F.pad(raw, (0, aligned(raw.numel()) - raw.numel()))


def shard_ranges(numel: int, group_size: int, processes: int) -> list[tuple[int, int]]:
    """Entry ranges [start, stop) of the P shards of a flattened tensor: consecutive runs of
    ⌈G / P⌉ whole groups (G = ⌈n / g⌉), so no group is split between processes; the last shards
    may be shorter or empty."""
    groups = math.ceil(numel / group_size)
    per_shard = math.ceil(groups / processes) if groups else 0
    return [(min(numel, j * per_shard * group_size), min(numel, (j + 1) * per_shard * group_size))
            for j in range(processes)]


def carry_refusal(setting: str, phases: Sequence[Phase], rule: str) -> str | None:
    """Why `rule` (whose phases for a matrix are `phases`) cannot travel under the lossy
    `setting` (``key=value``, e.g. ``merge.quantize=int8``), or None when it can: every phase
    must be a sum whose terms tolerate rounding (not a gather of factors, not a sum of counts)."""
    for phase in phases:
        if phase.collective != "sum":
            return (f"{setting} is not allowed with merge.rule={rule}: {rule} gathers each worker's factors, and "
                    f"the codecs carry sums only; use {setting.split('=')[0]}=none")
        if phase.exact:
            return (f"{setting} is not allowed with merge.rule={rule}: one of its sums counts agreeing workers, "
                    f"which rounding would corrupt; use {setting.split('=')[0]}=none")
    return None
