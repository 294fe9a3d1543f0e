"""How a merge is configured: `MergeConfig` (the `merge.*` keys) and `Participation` (which
workers one merge counts, and their weights).

The merge engine (`isoloco.merge`) runs what these describe; the rules themselves are
`isoloco.rules`, and how sums cross the slow link is `isoloco.sync`.
"""

from __future__ import annotations

import dataclasses

import torch

from isoloco.configbase import check_at_least, check_choices, check_positive, check_range, name_matches, option
from isoloco.errors import ConfigError
from isoloco.factors import FACTOR_METHODS, FINDER_DTYPES, FactorSettings
from isoloco.newton_schulz import NS_DTYPES
from isoloco.ortho import POLAR_METHODS, SCALE_METHODS, IsoSettings, spectrum_knob_problem
from isoloco.rules import RULES, Knobs
from isoloco.sync.codec import FORMATS, SCALE_GROUPS, Quantization, carry_refusal
from isoloco.sync.phase import Compression
from isoloco.sync.topk import MAX_CHUNK, TopK

#: `merge.weighting`: how much each merged worker's pseudo-gradient counts.
WEIGHTINGS = ("equal", "tokens")
#: `merge.compress`: how a matrix's sum is cut down before it crosses the slow link.
COMPRESSORS = ("none", "lowrank", "topk")


@dataclasses.dataclass
class MergeConfig:
    """How worker pseudo-gradients are merged (docs/fidelity.md has each rule's definition)."""

    rule: str = option("mean", "aggregation rule for the workers' pseudo-gradients", choices=RULES)
    density: float = option(0.9, "TIES: fraction of each delta's entries kept, by magnitude")
    drop_rate: float = option(0.1, "DARE: probability of dropping each entry")
    common_fraction: float = option(0.8, "Iso-CTS: fraction of the rank given to the common subspace")
    ortho: str = option(
        IsoSettings.ortho,
        "Iso-C orthogonalisation: exact auto (gram for non-square, svd for square matrices), svd or gram; "
        "or approximate newton_schulz / polar_express",
        choices=POLAR_METHODS,
    )
    scale: str = option(
        IsoSettings.scale, "Iso-C singular value: exact mean, rms (‖M‖_F/√r) or inner (⟨M, polar(M)⟩/r)",
        choices=SCALE_METHODS,
    )
    ns_steps: int = option(IsoSettings.ns_steps, "iterations of newton_schulz / polar_express")
    ns_dtype: str = option(IsoSettings.ns_dtype, "dtype of the newton_schulz / polar_express iterations",
                           choices=NS_DTYPES)
    iso_power: float = option(
        IsoSettings.iso_power,
        "Iso-C partial flattening in [0, 1]: each singular value σ becomes c·σ^p, c keeping their mean "
        "(0: Iso-C, 1: the update unchanged); needs merge.ortho=auto, svd or gram and merge.scale=exact")
    iso_floor: float = option(
        IsoSettings.iso_floor,
        "Iso-C floor in [0, 1): singular values below this fraction of the largest keep their own value, the "
        "others get their mean (0: Iso-C); needs merge.ortho=auto, svd or gram and merge.scale=exact")
    factors: str = option(
        FactorSettings.method,
        "TSV / Iso-CTS: how each worker's top singular directions are found: randomized (a range finder, "
        "matmuls only), exact (a full SVD per worker), or auto (randomized where a worker keeps at most 1/16 of "
        "a rank of at least 128 and its factors pass a certificate, exact top-k elsewhere)", choices=FACTOR_METHODS)
    oversample: int = option(FactorSettings.oversample, "factors=randomized: extra columns beyond the k wanted")
    power_iters: int = option(FactorSettings.power_iters, "factors=randomized: subspace iterations")
    finder_dtype: str = option(
        FactorSettings.finder_dtype,
        "factors=randomized: precision of every subspace iteration but the last (the last and the final product "
        "run in float32): auto (bfloat16 on CUDA GPUs of compute capability 8.0 or later, else float32; recorded "
        "as merge_finder_dtype in summary.json and metrics.jsonl), bfloat16 or float32", choices=FINDER_DTYPES)
    quantize: str = option(
        "none", "what crosses the slow link: each island's sum of its workers' contributions as float32 (none), or "
                "compressed to bfloat16, int8 or int4 codes with absmax scales (rules whose collectives are sums: "
                "mean, Iso-C, DARE)", choices=FORMATS)
    quantize_scales: str = option("block", "merge.quantize=int8/int4: one scale per block of entries or per "
                                           "matrix row", choices=SCALE_GROUPS)
    quantize_block: int = option(256, "merge.quantize_scales=block: entries per scale (4 bytes each)")
    compress: str = option(
        "none", "what a matrix's sum crosses the slow link as: whole (none), rank-k factors in PowerSGD's form "
                "(lowrank: two sums, of m×k and n×k factors), or each chunk's largest entries (topk: indices and "
                "values, all-gathered); vectors stay whole; the factors and values travel under merge.quantize "
                "(rules whose collectives are sums: mean, Iso-C, DARE)", choices=COMPRESSORS)
    compress_rank: int = option(4, "merge.compress=lowrank: rank k of the factors, clamped to each matrix's "
                                   "smaller side (the clamp is recorded as compress_rank_clamped in metrics.jsonl)")
    compress_density: float = option(0.03, "merge.compress=topk: fraction of each chunk's entries sent, in (0, 1]")
    compress_chunk: int = option(4096, f"merge.compress=topk: entries per chunk (at most {MAX_CHUNK}; indices "
                                       f"travel as 2 bytes)")
    compress_exclude: list[str] = option(
        [], "with merge.compress: fnmatch patterns of parameter names whose matrices skip it and cross the slow "
            "link whole under merge.quantize (e.g. ['*embed_tokens*', 'lm_head.weight'], so that the embeddings and "
            "the head travel dense while the blocks' matrices go low-rank or top-k); empty = compress every matrix")
    error_feedback: bool = option(
        False, "with merge.quantize or merge.compress: each island keeps what its sum lost on the way (its own "
               "encode, what low rank's projection or top-k left out, and the re-encode of the chunks of the total "
               "it owns) and adds it to its next sum; the islands are a job's processes, or the dist.islands the "
               "simulator plays (0: every worker an island); kept and checkpointed with each island's first worker")
    bucket_mb: float = option(
        64.0, "parameters are merged in buckets of about this many MiB: one collective per bucket and phase, "
              "one finiteness check per bucket")
    exclude: list[str] = option(
        [],
        "fnmatch patterns of parameter names whose 2-D tensors skip the spectral rules "
        "(tsv, iso_c, iso_cts) and take the mean; empty = correct every matrix",
    )
    weighting: str = option(
        "equal", "each worker's pseudo-gradient counts equally (equal), or in proportion to the tokens it trained "
                 "this round (tokens: differs from equal only with worker_speeds; docs/fidelity.md defines it per "
                 "rule)", choices=WEIGHTINGS)

    def validate(self) -> None:
        check_choices("merge", self)
        check_range("merge.density", self.density, 0, 1, low_open=True, high_open=False)
        check_range("merge.drop_rate", self.drop_rate, 0, 1, low_open=False, high_open=True)
        check_range("merge.common_fraction", self.common_fraction, 0, 1, low_open=True, high_open=False)
        check_at_least("merge.ns_steps", self.ns_steps, 1)
        spectrum_problem = spectrum_knob_problem(self, prefix="merge.")
        if spectrum_problem:
            raise ConfigError(spectrum_problem)
        check_at_least("merge.oversample", self.oversample, 0)
        check_at_least("merge.power_iters", self.power_iters, 0)
        check_positive("merge.bucket_mb", self.bucket_mb)
        check_at_least("merge.quantize_block", self.quantize_block, 1)
        check_at_least("merge.compress_rank", self.compress_rank, 1)
        check_range("merge.compress_density", self.compress_density, 0, 1, low_open=True, high_open=False)
        check_range("merge.compress_chunk", self.compress_chunk, 1, MAX_CHUNK, low_open=False, high_open=False)
        lossy = self.lossy_setting
        if self.error_feedback and lossy is None:
            raise ConfigError("merge.error_feedback=true is not allowed with merge.quantize=none and "
                              "merge.compress=none: there is no compression error to feed back; set "
                              "merge.quantize=bf16, int8 or int4, or merge.compress=lowrank or topk")
        # The phases of a typical matrix: a small one may skip a rule's gather (Iso-CTS's residuals).
        refusal = lossy and carry_refusal(lossy, RULES[self.rule].phases((256, 256), 2, self.knobs), self.rule)
        if refusal:
            raise ConfigError(refusal)
        for key in ("exclude", "compress_exclude"):
            patterns = getattr(self, key)
            if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
                raise ConfigError(f"merge.{key}={patterns!r} is not allowed: it must be a list of name patterns, "
                                  f"e.g. ['*embed_tokens*', 'lm_head.weight']")
        if self.compress_exclude and self.compress == "none":
            raise ConfigError(f"merge.compress_exclude={list(self.compress_exclude)} is ignored with merge.compress=none: "
                              f"it names matrices that skip merge.compress; set merge.compress=lowrank or topk, or "
                              f"drop merge.compress_exclude")

    @property
    def iso(self) -> IsoSettings:
        """The Iso-C settings these keys describe."""
        return IsoSettings(self.ortho, self.scale, self.ns_steps, self.ns_dtype, self.iso_power, self.iso_floor)

    @property
    def lossy_setting(self) -> str | None:
        """The setting that makes the slow link lossy, as `key=value` (the compressor first), or None."""
        if self.compress != "none":
            return f"merge.compress={self.compress}"
        return f"merge.quantize={self.quantize}" if self.quantize != "none" else None

    @property
    def topk(self) -> TopK:
        """Which entries merge.compress=topk sends."""
        return TopK(self.compress_density, self.compress_chunk)

    @property
    def quantization(self) -> Quantization:
        """How the workers' pseudo-gradients cross the slow link."""
        return Quantization(self.quantize, self.quantize_scales, self.quantize_block)

    @property
    def compression(self) -> Compression:
        """How a sum phase crosses the slow link."""
        return Compression(self.quantization, self.compress, self.topk, self.error_feedback,
                           tuple(self.compress_exclude), self.compress_rank)

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes: about what one bucket of parameters holds."""
        return int(self.bucket_mb * 2**20)

    @property
    def lossy_compression(self) -> Compression | None:
        """`compression` where the slow link is lossy (`lossy_setting`); None: float32 sums."""
        return self.compression if self.lossy_setting is not None else None

    @property
    def knobs(self) -> Knobs:
        """The settings the rules read."""
        return Knobs(self.density, self.drop_rate, self.common_fraction, self.iso,
                     FactorSettings(self.factors, self.oversample, self.power_iters, self.finder_dtype))

    def finder_precision(self, device: torch.device) -> str | None:
        """The precision TSV's and Iso-CTS's range finder runs its early iterations in on `device`
        (`merge.finder_dtype` resolved: float32 or bfloat16), or None where no finder runs."""
        if self.rule not in ("tsv", "iso_cts") or self.factors == "exact":
            return None
        return self.knobs.factors.finder_precision(device)

    def excludes(self, name: str) -> bool:
        """Whether parameter `name` matches one of the `exclude` patterns."""
        return name_matches(name, self.exclude)

    def applies(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether the rule itself merges parameter `name` (else the mean does): a spectral
        rule takes only the matrices it is not told to exclude."""
        return not RULES[self.rule].spectral or (tensor.ndim == 2 and not self.excludes(name))


@dataclasses.dataclass(frozen=True)
class Participation:
    """The workers one merge counts, by global id, and how much each weighs; every process
    passes the same (each knows it without communication, e.g. from the seed).

    A worker left out contributes nothing: a sum phase skips it, a gather phase drops its
    block, and the rule is built for the n workers that arrived (the mean divides by n, TSV
    keeps ⌊r/n⌋ directions per worker)."""

    arrived: tuple[int, ...]  # global worker ids, ascending
    weights: tuple[float, ...] | None = None  # one per arrived worker (e.g. tokens trained); None: equal

    def scales(self, workers: int) -> dict[int, float]:
        """c_r = n·w_r / Σ w, by global id, of a run of `workers` workers. Every rule merges
        c_r·Δ_r: since Σ c_r = n, the mean's divisor n gives Σ w_r Δ_r / Σ w_r, and equal
        weights give c_r = 1 exactly (the unweighted merge, bit for bit)."""
        if not self.arrived or list(self.arrived) != sorted(set(self.arrived)) or not (
                0 <= self.arrived[0] and self.arrived[-1] < workers):
            raise ValueError(f"arrived={self.arrived} must be distinct worker ids in 0..{workers - 1}, ascending")
        weights = self.weights or (1.0,) * len(self.arrived)
        if len(weights) != len(self.arrived) or not all(w > 0 for w in weights):
            raise ValueError(f"weights={self.weights} must be one positive weight per arrived worker")
        if len(set(weights)) == 1:
            return dict.fromkeys(self.arrived, 1.0)
        total = sum(weights)
        return {worker: len(weights) * weight / total for worker, weight in zip(self.arrived, weights)}

