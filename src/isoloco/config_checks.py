"""What a resolved config is checked against beyond its own fields, and what is said about it:
the model's parameter names that `merge.exclude` and `merge.compress_exclude` match, the
warnings said before a run starts, and the known causes said when a run diverges.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from fractions import Fraction

from isoloco.configbase import name_matches
from isoloco.errors import ConfigError
from isoloco.model import llama_config
from isoloco.train_config import TrainConfig


# ---------------------------------------------------------------------------------------
# Parameter names


@functools.lru_cache(maxsize=None)
def parameter_names(model: str) -> tuple[tuple[str, int], ...]:
    """Every parameter of model preset `model` as (name, dimensions), in model order: the names
    `merge.compress_exclude` and `merge.exclude` match. From the model built on the meta device
    (no memory, no weights; the names do not depend on the vocabulary)."""
    import torch
    from transformers import LlamaForCausalLM  # seconds to import: only when patterns are given

    with torch.device("meta"):
        net = LlamaForCausalLM(llama_config(model, vocab_size=256, max_positions=128))
    return tuple((name, param.dim()) for name, param in net.named_parameters())


def matrix_names(model: str) -> list[str]:
    """The names of model preset `model`'s 2-D parameters, the only ones the patterns act on."""
    return [name for name, dims in parameter_names(model) if dims == 2]


def excluded_matrices(cfg: TrainConfig) -> list[str]:
    """The matrices `merge.compress_exclude` keeps whole (none without patterns)."""
    patterns = list(cfg.merge.compress_exclude)
    return [name for name in matrix_names(cfg.model) if name_matches(name, patterns)] if patterns else []


def check_exclude_patterns(cfg: TrainConfig) -> None:
    """Refuse a `merge.compress_exclude` or `merge.exclude` pattern that names no matrix of
    `cfg.model` (a typo would leave every matrix as it was, in silence), naming the matrices it
    could have meant; and a `merge.compress_exclude` that names every matrix, so that
    `merge.compress` compresses nothing."""
    for key in ("compress_exclude", "exclude"):
        patterns = list(getattr(cfg.merge, key))
        if not patterns:
            continue
        names, everything = matrix_names(cfg.model), parameter_names(cfg.model)
        for pattern in patterns:
            if any(name_matches(name, [pattern]) for name in names):
                continue
            vectors = [name for name, _ in everything if name_matches(name, [pattern])]
            what = (f"no matrix of model={cfg.model}, only vectors ({_listed(vectors)}), which merge.{key} never "
                    "touches" if vectors else f"no parameter of model={cfg.model}")
            raise ConfigError(f"merge.{key}={spelled(patterns)} is not allowed: the pattern {pattern!r} names {what}; "
                              f"{_meant(pattern, names)}")
    excluded = excluded_matrices(cfg)
    if excluded and len(excluded) == len(matrix_names(cfg.model)):
        raise ConfigError(f"merge.compress_exclude={spelled(cfg.merge.compress_exclude)} is not allowed: it keeps every "
                          f"matrix of model={cfg.model} whole, so merge.compress={cfg.merge.compress} would compress "
                          "nothing; name only the matrices to keep whole (e.g. model.embed_tokens.weight,"
                          "lm_head.weight), or drop both merge.compress and merge.compress_exclude")


def spelled(patterns: list[str]) -> str:
    """Patterns (a list value) as the command line spells them."""
    return ",".join(patterns)


def _listed(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _meant(pattern: str, names: list[str]) -> str:
    """What a pattern that matched nothing could have meant: the matrices holding its longest
    literal part (`*embed_token` -> model.embed_tokens.weight), else the closest spellings of the
    whole name (a typo) or of a part of it, else a sample of what the names look like."""
    literal = max(re.split(r"[*?\[\]]", pattern), key=len).strip(".")
    close = [name for name in names if literal and literal in name][:3]
    close = close or difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
    if not close and literal:
        parts = {}
        for name in names:
            for part in name.split("."):
                parts.setdefault(part, name)
        close = [parts[part] for part in difflib.get_close_matches(literal, list(parts), n=3, cutoff=0.7)]
    if close:
        return f"did you mean {', '.join(close)}? (fnmatch patterns of parameter names, e.g. '*embed_tokens*')"
    layers = sorted({name for name in names if ".layers." not in name or ".layers.0." in name})
    return (f"the matrices are named like {_listed(layers, 4)} (fnmatch patterns, e.g. '*embed_tokens*' or "
            "'*.mlp.*')")


# ---------------------------------------------------------------------------------------
# Warnings


#: The largest share of a round τ/H (outer.overlap_steps/inner_steps) the docs measured as
#: harmless: τ = 5 of H = 30 left IsoLoCo's final loss equivalent within ±1% to τ = 0 at R = 8
#: and DiLoCo's not distinguishable from it (docs/claims/slow-link.md), while τ = 5 of
#: H = 10 ended above the unigram baseline and the loss worsened steadily with τ/H (a user's report).
SAFE_OVERLAP = Fraction(1, 6)


def run_warnings(cfg: TrainConfig, islands: int) -> list[str]:
    """One line for each setting a run on `islands` islands allows but that probably wastes it
    or does nothing, said before it starts."""
    lines = []
    if cfg.algorithm == "diloco" and cfg.inner_steps > cfg.steps:
        lines.append(f"inner_steps={cfg.inner_steps} is more than steps={cfg.steps}: the workers train every step "
                     "apart and synchronise once, at the end; set inner_steps <= steps for more than one round")
    overlap = Fraction(cfg.outer.overlap_steps, cfg.inner_steps)
    if overlap > SAFE_OVERLAP:
        lines.append(f"outer.overlap_steps={cfg.outer.overlap_steps} with inner_steps={cfg.inner_steps} overlaps "
                     f"{float(overlap):.2f} of each round, more than the {SAFE_OVERLAP} measured as harmless "
                     f"(τ = 5 of H = 30); the loss worsens with τ/H and τ = 5 of H = 10 ended above the unigram "
                     f"baseline: use outer.overlap_steps <= {math.floor(cfg.inner_steps * SAFE_OVERLAP)}")
    if cfg.dist.emulate_link and islands == 1:
        lines.append(f"dist.emulate_link={cfg.dist.emulate_link} does nothing in this run: it delays the collectives "
                     "between islands, and this run is one island; launch several (e.g. isoloco launch --nproc 2 "
                     "-- train ...) or drop it")
    return lines


#: The outer lr chosen on seed 0 for SparseLoCo's methods on the tiny model, by R (docs/slow-link.md's
#: compressor table; results/claims/compress-tuned/selection.md).
SPARSELOCO_TUNED_LR = {"sparseloco": {8: 0.5, 16: 0.3}, "sparseloco_isoc": {8: 2.0, 16: 1.5}}


def divergence_causes(cfg: TrainConfig) -> str:
    """What is known to drive a run of `cfg` above the unigram baseline, for the warning that
    says it went there: the run's settings measured to, then the learning rates."""
    causes = []
    if cfg.merge.compress != "none" and cfg.algorithm == "diloco":
        causes.append(f"merge.compress={cfg.merge.compress} (low rank and top-k each ended above it in runs on the "
                      "tiny model; docs/claims/compression.md)")
    if cfg.outer.transport == "sparseloco" and cfg.algorithm == "diloco":
        tuned = SPARSELOCO_TUNED_LR.get(cfg.method)
        if tuned:
            said = ", ".join(f"{lr:g} at R = {workers}" for workers, lr in tuned.items())
            step = (f"its step tuned on the tiny model is outer.lr={said} (docs/slow-link.md's compressor table; "
                    "results/claims/compress-tuned/selection.md)")
        else:
            step = "the tuned SparseLoCo rows of docs/slow-link.md's compressor table lower outer.lr"
        causes.append(f"SparseLoCo (outer.transport=sparseloco) at outer.lr={cfg.outer.lr:g}: {step}")
    if Fraction(cfg.outer.overlap_steps, cfg.inner_steps) > SAFE_OVERLAP:
        causes.append(f"outer.overlap_steps={cfg.outer.overlap_steps} with inner_steps={cfg.inner_steps} "
                      f"(τ/H above {SAFE_OVERLAP})")
    causes.append(f"learning rates too high for the model (inner.lr={cfg.inner.lr:g}"
                  + (f", outer.lr={cfg.outer.lr:g})" if cfg.algorithm == "diloco" else ")"))
    causes.append(f"too few steps (steps={cfg.steps})")
    return "known causes: " + "; ".join(causes)
