"""The codecs: round-trip error bounds, exact wire bytes, int4 packing, refusal of non-finite
values, determinism and error feedback (the compressed sum is tests/test_compressed.py)."""

import io

import pytest
import torch

from isoloco.errors import ConfigError
from isoloco.sync.codec import (QMAX, SCALE_GROUPS, Quantization, Wire, compress_with_feedback, dequantize,
                                error_bound, quantize, shard_ranges, wire_nbytes)

SCALED = [Quantization(fmt, scales, block) for fmt in ("int8", "int4") for scales in SCALE_GROUPS
          for block in (128, 256)]
EVERY = [Quantization("none"), Quantization("bf16")] + SCALED
#: Shapes with a block length that does not divide the size, a vector, a 3-D tensor and a scalar.
SHAPES = [(64, 300), (1000,), (4, 3, 50), ()]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian entries, rows scaled from 1e-3 to 1 as the rows of a pseudo-gradient differ."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if len(shape) < 2:
        return x
    return x * torch.logspace(-3, 0, shape[0]).reshape(-1, *[1] * (len(shape) - 1))


@pytest.mark.parametrize("quantization", EVERY, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_stays_within_the_stated_bound(quantization, shape):
    x = _randn(*shape)
    wire = quantize(x, quantization)
    decoded = dequantize(wire)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    assert ((decoded - x).abs() <= error_bound(wire, x)).all()
    if quantization.scaled:
        # The scale is the group's absmax over qmax: the bound is half of it, per group.
        group = quantization.group_size(x.shape)
        padded = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % group)).view(-1, group)
        torch.testing.assert_close(wire.scales, padded.abs().amax(dim=1) / QMAX[quantization.quantize],
                                   rtol=0, atol=0)


def test_measured_round_trip_errors_relative_to_the_largest_entry():
    """The numbers the transport's users plan with: worst error over the largest entry, for a
    Gaussian 1024 x 1024 matrix."""
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    worst = {}
    for quantization in EVERY:
        decoded = dequantize(quantize(x, quantization))
        worst[(quantization.quantize, quantization.scales, quantization.block_size)] = \
            float((decoded - x).abs().max() / x.abs().max())
    assert worst[("none", "block", 256)] == 0
    assert worst[("bf16", "block", 256)] <= 2 ** -8
    # Half a code step of a group's absmax: 1/254 (int8), 1/14 (int4), and less where a group's
    # absmax is below the whole tensor's.
    for (fmt, _, _), error in worst.items():
        if fmt in QMAX:
            assert error <= 1 / (2 * QMAX[fmt])


def test_wire_bytes_are_exact():
    x = torch.randn(1000)
    expected = {"none": 4000, "bf16": 2000, "int8": 1000 + 4 * 4, "int4": 500 + 4 * 4}
    for fmt, nbytes in expected.items():
        wire = quantize(x, Quantization(fmt, "block", 256))
        assert wire.nbytes == nbytes == wire_nbytes(1000, Quantization(fmt, "block", 256), 256)
        assert wire.as_bytes().dtype == torch.uint8 and wire.as_bytes().numel() == nbytes
    # Row scales: one per row; an odd count of int4 codes takes a whole last byte.
    assert quantize(torch.randn(3, 300), Quantization("int8", "row")).nbytes == 900 + 3 * 4
    assert quantize(torch.randn(7), Quantization("int4", "block", 4)).nbytes == 4 + 2 * 4


@pytest.mark.parametrize("quantization", EVERY, ids=str)
def test_a_wire_survives_its_bytes(quantization):
    x = _randn(5, 77, seed=3)
    wire = quantize(x, quantization)
    received = Wire.from_bytes(wire.as_bytes().clone(), quantization, x.shape)
    assert torch.equal(dequantize(received), dequantize(wire))
    with pytest.raises(ValueError, match="uint8 bytes"):
        Wire.from_bytes(wire.as_bytes()[1:], quantization, x.shape)


def test_int8_codes_are_twos_complement_bytes_rounded_to_nearest_even():
    # absmax 127 gives scale 1, so the codes are the entries rounded, ties to even.
    x = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -2.5, -1.0])
    wire = quantize(x, Quantization("int8", "block", 7))
    assert wire.scales.tolist() == [1.0]
    assert wire.payload.view(torch.int8).tolist() == [127, -127, 0, 2, 2, -2, -1]
    assert wire.payload.tolist() == [127, 129, 0, 2, 2, 254, 255]


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -3.0])
    wire = quantize(x, Quantization("int4", "block", 5))
    # Codes + 8 = [15, 1, 9, 8, 5], padded with 8 (code 0) to an even count.
    assert wire.payload.dtype == torch.uint8
    assert wire.payload.tolist() == [15 | 1 << 4, 9 | 8 << 4, 5 | 8 << 4]
    assert torch.equal(dequantize(wire), x)


def test_int4_round_trip_of_every_code():
    codes = torch.arange(-7, 8, dtype=torch.float32).repeat(3)[:-1]  # 44 entries, odd and even positions
    quantization = Quantization("int4", "block", codes.numel())
    assert torch.equal(dequantize(quantize(codes * 0.25, quantization)), codes * 0.25)


def test_bf16_sends_bfloat16_rounded_to_nearest():
    x = _randn(8, 33, seed=4)
    wire = quantize(x, Quantization("bf16"))
    assert wire.payload.dtype == torch.bfloat16 and wire.scales.numel() == 0
    assert torch.equal(wire.payload, x.reshape(-1).to(torch.bfloat16))
    assert torch.equal(dequantize(wire), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("quantization", SCALED, ids=str)
def test_zero_and_constant_groups(quantization):
    zeros = torch.zeros(3, 256)
    wire = quantize(zeros, quantization)
    assert (wire.scales == 0).all() and torch.equal(dequantize(wire), zeros)
    for value in (0.37, -2.5e-3, 1e30):
        constant = torch.full((3, 256), value)
        wire = quantize(constant, quantization)
        decoded = dequantize(wire)
        # Every entry is the group's absmax: one code, ±qmax, throughout.
        assert wire.payload.unique().numel() == 1
        assert ((decoded - constant).abs() <= error_bound(wire, constant)).all()
        torch.testing.assert_close(decoded, constant, rtol=2e-7, atol=0)


def test_an_empty_tensor_sends_nothing():
    for quantization in EVERY:
        wire = quantize(torch.zeros(0, 5), quantization)
        assert wire.nbytes == 0 and dequantize(wire).shape == (0, 5)


@pytest.mark.parametrize("quantization", EVERY, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(quantization, bad):
    x = torch.randn(4, 300)
    x[2, 17] = bad
    where = "entry 617" if not quantization.scaled else {
        "block": f"entries {617 // quantization.block_size * quantization.block_size} to",
        "row": "entries 600 to 899"}[quantization.scales]
    with pytest.raises(FloatingPointError, match=rf"shape \(4, 300\): {where}.* hold NaN or inf"):
        quantize(x, quantization)


def test_an_entry_beyond_bfloat16_range_is_refused():
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        quantize(torch.tensor([1.0, 3.4e38]), Quantization("bf16"))


def test_only_float32_is_taken():
    with pytest.raises(TypeError, match="float32"):
        quantize(torch.zeros(4, dtype=torch.float64), Quantization("int8"))


@pytest.mark.parametrize("quantization", EVERY, ids=str)
def test_quantisation_is_deterministic_and_a_shard_quantises_as_part_of_the_whole(quantization):
    x = _randn(40, 64, seed=5)
    first, second = quantize(x, quantization), quantize(x.clone(), quantization)
    assert torch.equal(first.as_bytes(), second.as_bytes())
    # Group-aligned shards give the same codes and scales as the whole tensor.
    group = quantization.group_size(x.shape)
    whole = dequantize(first).reshape(-1)
    for start, stop in shard_ranges(x.numel(), group, 3):
        part = dequantize(quantize(x.reshape(-1)[start:stop], quantization, group))
        assert torch.equal(part, whole[start:stop])


def _codes_by_loop(payload: torch.Tensor, numel: int) -> list[int]:
    """The int4 codes of a packed payload, read nibble by nibble (entry 2i low, 2i+1 high)."""
    nibbles = [nibble for byte in payload.tolist() for nibble in (byte & 0x0F, byte >> 4)]
    return [nibble - 8 for nibble in nibbles[:numel]]


def _packed_by_loop(codes: list[int]) -> list[int]:
    """`codes` packed two per byte, low nibble first, an odd count padded with the zero code's nibble."""
    nibbles = [code + 8 for code in codes] + [8] * (len(codes) % 2)
    return [nibbles[i] | (nibbles[i + 1] << 4) for i in range(0, len(nibbles), 2)]


@pytest.mark.parametrize("scales", SCALE_GROUPS)
def test_an_int4_slice_is_the_wholes_codes_packed_again_at_any_offset(scales):
    """Groups of 5 entries (blocks of 5, or rows of 5) put group starts at odd and even offsets
    and slice ends mid-byte: every slice [start, stop) that starts a group carries exactly the
    whole's codes of those entries, repacked from its first one (the zero nibble after an odd
    end), with the whole's scales of its groups, and decodes to the whole's entries."""
    quantization = Quantization("int4", scales, block_size=5)
    x = _randn(7, 5, seed=11)
    whole = quantize(x, quantization)
    codes = _codes_by_loop(whole.payload, x.numel())
    decoded = dequantize(whole).reshape(-1)
    for start in range(0, x.numel() + 1, 5):
        for stop in range(start, x.numel() + 1):
            part = whole.slice(start, stop)
            assert part.payload.tolist() == _packed_by_loop(codes[start:stop]), (start, stop)
            assert part.scales.tolist() == whole.scales[start // 5:-(-stop // 5)].tolist(), (start, stop)
            assert torch.equal(dequantize(part), decoded[start:stop]), (start, stop)


def test_config_is_checked():
    Quantization("int4", "row", 128).check("merge")
    with pytest.raises(ConfigError, match="merge.quantize='int3'"):
        Quantization("int3").check("merge")
    with pytest.raises(ConfigError, match="merge.scales='column'"):
        Quantization("int8", "column").check("merge")
    with pytest.raises(ConfigError, match="merge.block_size=0"):
        Quantization("int8", "block", 0).check("merge")
    assert Quantization("int8", "row").group_size((12, 34)) == 34
    assert Quantization("int8", "row").group_size((2, 3, 4)) == 12
    assert Quantization("int8", "row").group_size((50,)) == 50
    assert Quantization("bf16", "block", 128).group_size((50,)) == 1


@pytest.mark.parametrize("quantization", SCALED, ids=str)
def test_error_feedback_loses_nothing_over_rounds(quantization):
    generator = torch.Generator().manual_seed(6)
    residual = None
    sent_total = torch.zeros(16, 300, dtype=torch.float64)
    true_total = torch.zeros(16, 300, dtype=torch.float64)
    rounds = 64
    for _ in range(rounds):
        # A persistent small component (the signal) under noise with a few large entries.
        delta = 0.01 + torch.randn(16, 300, generator=generator)
        wire, residual = compress_with_feedback(delta, residual, quantization)
        assert residual.dtype == torch.float32 and residual.shape == delta.shape
        sent_total += dequantize(wire).double()
        true_total += delta.double()
    # What was sent adds up to what was meant, less what the last residual still holds, and the
    # residual stays within half a step of its group: the time average of what was sent
    # approaches the true mean as 1/T.
    torch.testing.assert_close(sent_total, true_total - residual.double(), rtol=0, atol=1e-4)
    half_step = error_bound(wire, residual)
    assert (residual.abs() <= half_step).all()
    assert ((sent_total - true_total).abs() / rounds <= half_step.double() / rounds + 1e-6).all()


def test_error_feedback_sends_what_plain_quantisation_drops():
    quantization = Quantization("int4", "block", 4)
    # 0.01 is under half a step (1/14) of its block's absmax 1: plain quantisation never sends it.
    delta = torch.tensor([1.0, 0.01, -1.0, 0.0])
    rounds = 140
    plain = sum(dequantize(quantize(delta, quantization))[1].item() for _ in range(rounds))
    residual, fed = None, 0.0
    for _ in range(rounds):
        wire, residual = compress_with_feedback(delta, residual, quantization)
        fed += dequantize(wire)[1].item()
    assert plain == 0.0
    assert abs(fed - rounds * 0.01) <= 1 / 14 + 1e-5


def test_the_residual_is_a_plain_checkpointable_tensor():
    quantization = Quantization("int8", "block", 128)
    generator = torch.Generator().manual_seed(7)
    deltas = [torch.randn(10, 200, generator=generator) for _ in range(6)]
    residual = None
    for delta in deltas[:3]:
        _, residual = compress_with_feedback(delta, residual, quantization)
    buffer = io.BytesIO()
    torch.save({"residual": residual}, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=True)["residual"]
    for delta in deltas[3:]:
        wire, residual = compress_with_feedback(delta, residual, quantization)
        resumed, restored = compress_with_feedback(delta, restored, quantization)
        assert torch.equal(wire.as_bytes(), resumed.as_bytes()) and torch.equal(residual, restored)


def test_shards_are_whole_groups_covering_the_tensor():
    assert shard_ranges(1000, 256, 2) == [(0, 512), (512, 1000)]
    assert shard_ranges(1000, 256, 4) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert shard_ranges(300, 256, 4) == [(0, 256), (256, 300), (300, 300), (300, 300)]
    assert shard_ranges(10, 1, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
