"""Merge rules: definitions, oracles (peft, numpy), edge cases, layout independence, config."""

import math
import threading
import warnings

import numpy as np
import pytest
import torch
from peft.utils import merge_utils

from isoloco import merge, merge_config, merge_functions, rules
from isoloco.comm import Communicator, LocalCommunicator
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.ortho import IsoSettings
from helpers import ProcessGroup, ThreadCommunicator

RULE_NAMES = ["mean", "ties", "dare", "tsv", "iso_c", "iso_cts"]
ORTHOS = ["svd", "gram", "newton_schulz", "polar_express"]


def make_deltas(count: int, shape: tuple, seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    """Pseudo-gradient-like deltas: a shared low-rank direction plus each worker's own noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(shape, generator=g, dtype=torch.float64)
    if len(shape) == 2:
        rank = min(3, *shape)
        common = torch.randn(shape[0], rank, generator=g, dtype=torch.float64) @ torch.randn(
            rank, shape[1], generator=g, dtype=torch.float64
        )
    return [(common + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype) for _ in range(count)]


def projector(vectors: torch.Tensor) -> torch.Tensor:
    return vectors @ vectors.mT


def merger(rule: str, workers: int, seed: int = 0, **knobs) -> merge.Merger:
    return merge.Merger(merge_config.MergeConfig(rule=rule, **knobs), LocalCommunicator(workers), seed)


# ----------------------------------------------------------------- definitions of the rules


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_iso_c_flattens_the_spectrum_of_the_mean(shape):
    deltas = make_deltas(4, shape, dtype=torch.float64)
    mean = torch.stack(deltas).mean(0)
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    result = merge_functions.iso_c(deltas)
    u_out, s_out, vh_out = torch.linalg.svd(result, full_matrices=False)
    torch.testing.assert_close(s_out, s.mean().expand_as(s), rtol=1e-10, atol=0)
    # Same singular subspaces (compared as projectors, which ignore sign and order).
    torch.testing.assert_close(projector(u_out), projector(u), atol=1e-10, rtol=0)
    torch.testing.assert_close(projector(vh_out.mT), projector(vh.mT), atol=1e-10, rtol=0)
    torch.testing.assert_close(result, s.mean() * u @ vh, atol=1e-12, rtol=0)


@pytest.mark.parametrize("ortho", ORTHOS)
@pytest.mark.parametrize("scale", ["exact", "rms", "inner"])
def test_iso_c_fast_paths_are_iso_correct_of_the_mean(ortho, scale):
    from isoloco.ortho import IsoSettings, iso_correct

    deltas = make_deltas(3, (10, 14))
    settings = IsoSettings(ortho, scale, 5, "bfloat16")
    expected = iso_correct(torch.stack(deltas).sum(0) / 3, settings)
    torch.testing.assert_close(merge_functions.iso_c(deltas, settings), expected, atol=1e-6, rtol=1e-5)


def test_merger_iso_c_is_aggregate_then_pure_finalize():
    deltas = make_deltas(3, (9, 6))
    m = merger("iso_c", 3, ortho="gram")
    aggregate = m.aggregate("w", deltas)
    assert torch.equal(aggregate, merge_functions.mean(deltas))
    assert torch.equal(m.finalize("w", aggregate), merge_functions.iso_c(deltas, IsoSettings(ortho="gram")))
    assert torch.equal(m.merge("w", deltas), merge_functions.iso_c(deltas, IsoSettings(ortho="gram")))
    vector = make_deltas(3, (6,))
    assert torch.equal(m.merge("b", vector), merge_functions.mean(vector))


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_iso_cts_with_full_common_fraction_is_iso_c(shape):
    deltas = make_deltas(4, shape)
    torch.testing.assert_close(merge_functions.iso_cts(deltas, common_fraction=1.0), merge_functions.iso_c(deltas), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("common_fraction", [0.5, 0.8])
def test_iso_cts_is_isotropic_and_spans_common_plus_worker_directions(common_fraction):
    deltas = make_deltas(3, (16, 12), dtype=torch.float64)
    result = merge_functions.iso_cts(deltas, common_fraction=common_fraction)
    sigma = torch.linalg.svdvals(result)
    torch.testing.assert_close(sigma, sigma.mean().expand_as(sigma), rtol=1e-8, atol=0)
    # The common block: the top r − R·s left singular vectors of the mean lie in the result's range.
    rank = 12
    _, per_worker = rules.iso_cts_split(rank, 3, common_fraction)
    u_mean = torch.linalg.svd(torch.stack(deltas).mean(0))[0][:, : rank - 3 * per_worker]
    u_out = torch.linalg.svd(result, full_matrices=False)[0]
    torch.testing.assert_close(projector(u_out) @ u_mean, u_mean, atol=1e-8, rtol=0)


@pytest.mark.parametrize(
    "rank, workers, fraction, split",
    [
        (24, 8, 0.8, (16, 1)),  # k = 19; round(5/8) = 1 direction per worker
        (64, 16, 0.8, (48, 1)),  # the tiny model's matrices at R = 16
        (20, 8, 0.8, (20, 0)),  # round(4/8) = round(0.5) = 0: half to even
        (100, 8, 0.8, (84, 2)),  # round(20/8) = round(2.5) = 2: half to even
        (40, 8, 0.8, (32, 1)),
        (12, 1, 0.8, (9, 3)),  # one worker completes the spectrum of its own delta
        (3, 2, 0.1, (1, 1)),  # round(3/2) = 2 would need 4 > 3 directions: s = ⌊3/2⌋
        (2, 3, 0.3, (2, 0)),  # round(2/3) = 1 would need 3 > 2: s = ⌊2/3⌋ = 0
    ],
)
def test_iso_cts_split_follows_the_papers_code(rank, workers, fraction, split):
    assert rules.iso_cts_split(rank, workers, fraction) == split


def polar_np(x: np.ndarray) -> np.ndarray:
    p, _, qt = np.linalg.svd(x, full_matrices=False)
    return p @ qt


def reference_iso_cts(deltas: list[torch.Tensor], common: int, per_worker: int) -> np.ndarray:
    """Iso-CTS straight from its written definition, in numpy float64, with the blocks in the
    other order (workers first, then the common one) to show the order does not matter."""
    scaled = [d.double().numpy() / len(deltas) for d in deltas]
    u, s, vt = np.linalg.svd(sum(scaled), full_matrices=False)
    u_c = u[:, :common]
    blocks = [np.linalg.svd(x - u_c @ u_c.T @ x, full_matrices=False) for x in scaled]
    big_u = np.concatenate([b[0][:, :per_worker] for b in blocks] + [u_c], axis=1)
    big_s = np.concatenate([b[1][:per_worker] for b in blocks] + [s[:common]])
    big_v = np.concatenate([b[2][:per_worker].T for b in blocks] + [vt[:common].T], axis=1)
    return polar_np(big_u) @ np.diag(np.full(len(big_s), big_s.mean())) @ polar_np(big_v).T


def test_iso_cts_hand_checked_case():
    """r = 24, f = 0.8, R = 8: a common block of 16 and one direction per worker; the isotropic
    value is the mean of σ(mean)[:16] and each worker's top σ of residual_r / R."""
    workers = 8
    deltas = make_deltas(workers, (24, 30), dtype=torch.float64)
    result = merge_functions.iso_cts(deltas, common_fraction=0.8, factors="exact")
    mean = torch.stack(deltas).mean(0)
    u, s, _ = torch.linalg.svd(mean, full_matrices=False)
    u_c = u[:, :16]
    tops = [torch.linalg.svdvals((d - u_c @ u_c.T @ d) / workers)[0] for d in deltas]
    scale = (s[:16].sum() + sum(tops)) / 24
    torch.testing.assert_close(torch.linalg.svdvals(result), scale.expand(24), rtol=1e-10, atol=0)
    np.testing.assert_allclose(result.numpy(), reference_iso_cts(deltas, 16, 1), atol=1e-12)


@pytest.mark.parametrize("workers, shape", [(2, (12, 8)), (3, (9, 14)), (4, (10, 10)), (8, (24, 30))])
def test_iso_cts_matches_its_definition(workers, shape):
    deltas = make_deltas(workers, shape, dtype=torch.float64)
    common, per_worker = rules.iso_cts_split(min(shape), workers, 0.8)
    np.testing.assert_allclose(merge_functions.iso_cts(deltas, factors="exact").numpy(),
                               reference_iso_cts(deltas, common, per_worker), atol=1e-12)


def reference_tsv(deltas: list[torch.Tensor]) -> np.ndarray:
    """TSV straight from its definition, in numpy float64: k = max(1, ⌊r/R⌋) per worker."""
    arrays = [d.double().numpy() for d in deltas]
    k = max(1, min(arrays[0].shape) // len(arrays))
    factors = [np.linalg.svd(a, full_matrices=False) for a in arrays]
    u = np.concatenate([f[0][:, :k] for f in factors], axis=1)
    s = np.concatenate([f[1][:k] for f in factors])
    v = np.concatenate([f[2][:k].T for f in factors], axis=1)
    return polar_np(u) @ np.diag(s) @ polar_np(v).T


@pytest.mark.parametrize("workers, shape", [(2, (12, 8)), (3, (9, 14)), (4, (8, 8)), (5, (4, 3)), (8, (6, 9))])
def test_tsv_matches_its_definition(workers, shape):
    """Including R > r, where every worker still keeps its top direction."""
    deltas = make_deltas(workers, shape, dtype=torch.float64)
    np.testing.assert_allclose(merge_functions.tsv(deltas, factors="exact").numpy(), reference_tsv(deltas), atol=1e-10)


def test_tsv_of_one_worker_is_its_delta():
    (delta,) = make_deltas(1, (9, 6))
    torch.testing.assert_close(merge_functions.tsv([delta]), delta, atol=1e-5, rtol=1e-5)


def test_ties_with_full_density_and_agreeing_signs_is_the_mean():
    deltas = [d.abs() + 0.1 for d in make_deltas(3, (6, 5))]  # all positive: every sign agrees
    torch.testing.assert_close(merge_functions.ties(deltas, density=1.0), merge_functions.mean(deltas))
    negative = [-d for d in deltas]
    torch.testing.assert_close(merge_functions.ties(negative, density=1.0), merge_functions.mean(negative))


@pytest.mark.parametrize("density", [0.3, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("workers", [2, 3, 5])
def test_ties_matches_peft(density, workers):
    """peft's ties with unit weights is the same rule: magnitude trim, "total" sign election,
    disjoint mean. Magnitudes are distinct, so the trims keep the same entries."""
    deltas = make_deltas(workers, (7, 9), seed=workers, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns that density 1 prunes nothing
        expected = merge_utils.ties(deltas, torch.ones(workers, dtype=torch.float64), density, "total")
    torch.testing.assert_close(merge_functions.ties(deltas, density=density), expected, rtol=1e-12, atol=1e-12)


def test_ties_zero_entries_neither_agree_nor_count():
    """Density 1 keeps every entry (threshold 0): a zero has no sign, so it is not among the
    agreeing entries of either elected sign, by hand."""
    deltas = [torch.tensor([1.0, 0.0, -2.0, 0.0]), torch.tensor([3.0, 0.0, 0.0, -1.0])]
    assert torch.equal(merge_functions.ties(deltas, density=1.0), torch.tensor([2.0, 0.0, -2.0, -1.0]))


def test_ties_elects_plus_where_nonzero_entries_sum_to_zero():
    """Where the kept entries cancel exactly (Σ = 0 of nonzero entries), the elected sign is +
    (peft's "total" method), so the positive entries are averaged; against a plain loop over
    entries, with integer values so that every sum is exact."""
    deltas = [torch.tensor([2.0, -1.0, 3.0, 1.0, -4.0, 0.0]),
              torch.tensor([-2.0, 1.0, -1.0, -1.0, 2.0, 5.0]),
              torch.tensor([0.0, 0.0, -2.0, 0.0, 2.0, -4.0])]
    expected = []
    for entries in zip(*(d.tolist() for d in deltas)):
        positive = sum(entries) >= 0
        agreeing = [e for e in entries if (e > 0 if positive else e < 0)]
        expected.append(sum(agreeing) / len(agreeing) if agreeing else 0.0)
    assert [sum(entries) for entries in zip(*(d.tolist() for d in deltas))].count(0) == 5  # the case under test
    assert merge_functions.ties(deltas, density=1.0).tolist() == expected


def test_ties_keeps_ties_at_the_threshold():
    delta = torch.tensor([3.0, -1.0, 1.0, 0.5])
    # density 0.5 keeps 2 entries; |-1| and |1| tie for second place, so both stay.
    assert torch.equal(rules.trim(delta, 0.5), torch.tensor([3.0, -1.0, 1.0, 0.0]))


def test_ties_keeps_at_least_one_entry_per_tensor():
    # density 0.2 of 4 entries is 0.8: the paper's code still keeps the largest one.
    delta = torch.tensor([0.5, -3.0, 1.0, 2.0])
    assert torch.equal(rules.trim(delta, 0.2), torch.tensor([0.0, -3.0, 0.0, 0.0]))


def test_dare_without_dropping_is_the_mean():
    deltas = make_deltas(4, (6, 5))
    assert torch.equal(merge_functions.dare(deltas, drop_rate=0.0), merge_functions.mean(deltas))


def test_dare_is_unbiased():
    deltas = make_deltas(3, (4, 5), dtype=torch.float64)
    draws = 2000
    total = sum(merge_functions.dare(deltas, drop_rate=0.3, seed=seed) for seed in range(draws))
    # Each entry's estimator has variance Σ_r Δ_r² · p/(1−p) / R²; allow 5 standard errors.
    stderr = (torch.stack(deltas).pow(2).sum(0) * (0.3 / 0.7) / 9 / draws).sqrt()
    assert ((total / draws - merge_functions.mean(deltas)).abs() < 5 * stderr).all()


def dare_mask(seed: int, worker: int, round: int, name: str, shape: tuple, drop_rate: float) -> torch.Tensor:
    numel = math.prod(shape)
    return rules.keep_mask(rules.mask_key(seed, worker, round, name), 0, numel, 1 - drop_rate,
                           torch.device("cpu")).view(shape)


@pytest.mark.parametrize("drop_rate", [0.1, 0.5])
def test_dare_is_its_definition_with_the_counter_based_masks(drop_rate):
    """Mask, rescale by 1/(1 − p), mean: what peft's dare_linear computes for given masks."""
    deltas = make_deltas(3, (8, 6), dtype=torch.float64)
    masks = [dare_mask(7, r, 0, "tensor", (8, 6), drop_rate) for r in range(3)]
    expected = sum(d * m / (1 - drop_rate) for d, m in zip(deltas, masks)) / 3
    torch.testing.assert_close(merge_functions.dare(deltas, drop_rate=drop_rate, seed=7), expected, rtol=1e-12, atol=0)


def test_dare_keep_rate_and_chunks():
    """The keep rate is 1 − p within 5 standard errors over a million entries, and a mask is a
    function of (key, index): drawn in pieces it is the same as drawn whole."""
    key, keep, count = rules.mask_key(0, 1, 2, "w"), 0.7, 1 << 20
    whole = rules.keep_mask(key, 0, count, keep, torch.device("cpu"))
    assert abs(whole.double().mean().item() - keep) < 5 * math.sqrt(keep * (1 - keep) / count)
    pieces = torch.cat([rules.keep_mask(key, start, min(start + 300_007, count), keep, torch.device("cpu"))
                        for start in range(0, count, 300_007)])
    assert torch.equal(pieces, whole)
    # Neighbouring entries and neighbouring keys are not correlated.
    assert abs(torch.corrcoef(torch.stack([whole[:-1].double(), whole[1:].double()]))[0, 1]) < 0.01
    other = rules.keep_mask(rules.mask_key(0, 2, 2, "w"), 0, count, keep, torch.device("cpu"))
    assert abs(torch.corrcoef(torch.stack([whole.double(), other.double()]))[0, 1]) < 0.01


@pytest.mark.cuda
def test_dare_masks_are_the_same_bits_on_cpu_and_gpu():
    key = rules.mask_key(3, 5, 7, "model.embed_tokens.weight")
    cpu = rules.keep_mask(key, 0, 3 << 20, 0.9, torch.device("cpu"))
    gpu = rules.keep_mask(key, 0, 3 << 20, 0.9, torch.device("cuda"))
    assert torch.equal(cpu, gpu.cpu())


# ------------------------------------------------------------------------------ edge cases


def run_rule(rule: str, deltas: list[torch.Tensor], **knobs) -> torch.Tensor:
    return merger(rule, len(deltas), **knobs).merge("weight", deltas)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (1, 5), (5, 1), (5,)])
def test_all_zero_deltas_give_zeros(rule, shape):
    deltas = [torch.zeros(shape) for _ in range(3)]
    assert torch.equal(run_rule(rule, deltas), torch.zeros(shape))


@pytest.mark.parametrize("ortho", ORTHOS)
@pytest.mark.parametrize("scale", ["exact", "rms", "inner"])
def test_all_zero_deltas_give_zeros_for_every_iso_c_path(ortho, scale):
    deltas = [torch.zeros(6, 4) for _ in range(2)]
    assert torch.equal(run_rule("iso_c", deltas, ortho=ortho, scale=scale), torch.zeros(6, 4))


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("shape", [(1, 6), (6, 1)])
@pytest.mark.parametrize("workers", [1, 3])
def test_vector_shaped_matrices(rule, shape, workers):
    """r = 1: Iso-C and Iso-CTS reduce to the mean; TSV keeps each worker's one direction."""
    deltas = make_deltas(workers, shape)
    result = run_rule(rule, deltas)
    assert result.shape == shape and torch.isfinite(result).all()
    if rule in ("mean", "iso_c", "iso_cts"):
        torch.testing.assert_close(result, merge_functions.mean(deltas), atol=1e-6, rtol=1e-5)
    if rule == "tsv":
        np.testing.assert_allclose(result.numpy(), reference_tsv(deltas), atol=1e-5)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_rank_deficient_deltas(rule):
    """All deltas share one rank-2 column space: every rule stays finite, and the spectral
    rules stay inside that space (null directions are never completed with noise)."""
    g = torch.Generator().manual_seed(5)
    basis = torch.linalg.qr(torch.randn(10, 2, generator=g))[0]
    deltas = [basis @ torch.randn(2, 7, generator=g) for _ in range(3)]
    result = run_rule(rule, deltas)
    assert torch.isfinite(result).all()
    if rule not in ("ties", "dare"):  # entrywise rules do not preserve a column space
        torch.testing.assert_close(basis @ (basis.T @ result), result, atol=1e-5, rtol=1e-5)
    if rule == "iso_c":
        sigma = torch.linalg.svdvals(result)
        mean_sigma = torch.linalg.svdvals(merge_functions.mean(deltas)).sum() / 7
        torch.testing.assert_close(sigma[:2], mean_sigma.expand(2), rtol=1e-5, atol=0)
        assert sigma[2:].max() < 1e-5 * sigma[0]


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_one_worker(rule):
    (delta,) = make_deltas(1, (9, 7))
    from isoloco.ortho import iso_correct

    expected = {
        "mean": delta,
        "ties": rules.trim(delta, 0.9),
        "tsv": delta,
        "iso_c": iso_correct(delta),
        "iso_cts": iso_correct(delta),  # the residual's top directions complete the common ones
    }
    result = run_rule(rule, [delta])
    if rule == "dare":
        kept = result != 0
        torch.testing.assert_close(result[kept], delta[kept] / 0.9)
        assert 0 < kept.sum() < delta.numel()
    else:
        torch.testing.assert_close(result, expected[rule], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rule", ["tsv", "iso_c", "iso_cts"])
def test_spectral_rules_take_the_mean_of_non_matrices(rule):
    deltas = make_deltas(3, (4, 3, 2))
    assert torch.equal(run_rule(rule, deltas), merge_functions.mean(deltas))
    vectors = make_deltas(3, (7,))
    assert torch.equal(run_rule(rule, vectors), merge_functions.mean(vectors))


@pytest.mark.parametrize("rule", ["tsv", "iso_c", "iso_cts"])
def test_excluded_matrices_take_the_mean(rule):
    m = merger(rule, 2, exclude=["*embed*", "lm_head.weight"])
    deltas = make_deltas(2, (8, 6))
    assert torch.equal(m.merge("model.embed_tokens.weight", deltas), merge_functions.mean(deltas))
    assert torch.equal(m.merge("lm_head.weight", deltas), merge_functions.mean(deltas))
    assert not torch.allclose(m.merge("model.layers.0.mlp.weight", deltas), merge_functions.mean(deltas))


def test_non_finite_delta_names_parameter_worker_and_round():
    comm = ProcessGroup(2).communicators(workers_per_process=2)[1]  # holds workers 2 and 3
    m = merge.Merger(merge_config.MergeConfig(rule="mean"), comm, seed=0)
    deltas = make_deltas(2, (3, 3))
    deltas[1][0, 0] = float("nan")
    with pytest.raises(NonFiniteDeltaError, match=r"'blocks.3.attn.weight' from worker 3 in round 7"):
        m.merge("blocks.3.attn.weight", deltas, round=7)
    deltas[1][0, 0] = float("inf")
    with pytest.raises(ValueError, match="worker 1"):
        merge_functions.iso_c([torch.ones(2, 2), deltas[1]])


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_deltas_are_not_modified(rule):
    deltas = make_deltas(3, (6, 5))
    copies = [d.clone() for d in deltas]
    run_rule(rule, deltas)
    assert all(torch.equal(d, c) for d, c in zip(deltas, copies))


def test_wrong_number_of_deltas():
    with pytest.raises(ValueError, match="one delta per local worker"):
        merger("mean", 3).merge("w", make_deltas(2, (2, 2)))


# -------------------------------------------------------------------- communication cost


@pytest.mark.parametrize(
    "rule, floats",
    [
        ("mean", lambda m, n, R: m * n),
        ("dare", lambda m, n, R: m * n),
        ("iso_c", lambda m, n, R: m * n),
        ("ties", lambda m, n, R: 3 * m * n),
        ("tsv", lambda m, n, R: rules.tsv_components(min(m, n), R) * (m + n + 1)),
        ("iso_cts", lambda m, n, R: m * n + rules.iso_cts_split(min(m, n), R, 0.8)[1] * (m + n + 1)),
    ],
)
@pytest.mark.parametrize("m, n, workers", [(24, 20, 2), (24, 30, 8), (4, 3, 5)])
def test_bytes_sent_per_worker(rule, floats, m, n, workers):
    comm = LocalCommunicator(workers)
    merge.Merger(merge_config.MergeConfig(rule=rule), comm, seed=0).merge("w", make_deltas(workers, (m, n)))
    assert comm.reset_bytes() == 4 * floats(m, n, workers)


# ------------------------------------------------------------------ layout independence


PARAMETERS = {"wide.weight": (10, 16), "tall.weight": (18, 8), "norm.weight": (8,)}


def merge_all(m: merge.Merger, deltas: dict[str, list[torch.Tensor]], rounds: int) -> list[dict[str, torch.Tensor]]:
    return [{name: m.merge(name, ds, round=t) for name, ds in deltas.items()} for t in range(rounds)]


def merge_in_processes(cfg: merge_config.MergeConfig, deltas, world_size: int, rounds: int):
    workers_per_process = len(next(iter(deltas.values()))) // world_size
    comms = ProcessGroup(world_size).communicators(workers_per_process)
    results: list = [None] * world_size

    def run(rank: int) -> None:
        ids = comms[rank].local_worker_ids
        local = {name: [ds[i] for i in ids] for name, ds in deltas.items()}
        results[rank] = merge_all(merge.Merger(cfg, comms[rank], seed=11), local, rounds)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None for r in results), "a simulated process failed"
    return results


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_rules_do_not_depend_on_the_process_layout(rule, world_size):
    """4 workers in one process == 4 workers spread over processes, for every rule (DARE's
    masks included: each worker's stream is seeded by its global id)."""
    cfg = merge_config.MergeConfig(rule=rule, drop_rate=0.3)
    deltas = {name: make_deltas(4, shape, seed=i) for i, (name, shape) in enumerate(PARAMETERS.items())}
    expected = merge_all(merge.Merger(cfg, LocalCommunicator(4), seed=11), deltas, rounds=2)
    for per_process in merge_in_processes(cfg, deltas, world_size, rounds=2):
        for got_round, want_round in zip(per_process, expected):
            for name in PARAMETERS:
                torch.testing.assert_close(got_round[name], want_round[name], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- DARE's masks


def test_dare_masks_depend_only_on_seed_worker_round_and_parameter():
    """No state: a merger made afresh (a resumed run, another device or layout) draws the
    masks of round 3 that a merger which drew rounds 0-2 first draws."""
    deltas = make_deltas(3, (5, 4))
    used = merger("dare", 3, seed=4)
    for round in range(3):
        used.merge("w", deltas, round)
    fresh = merger("dare", 3, seed=4)
    assert torch.equal(fresh.merge("w", deltas, 3), used.merge("w", deltas, 3))
    # Each of the four changes the masks.
    for other in (merger("dare", 3, seed=5).merge("w", deltas, 3), fresh.merge("v", deltas, 3),
                  fresh.merge("w", deltas, 2)):
        assert not torch.equal(other, used.merge("w", deltas, 3))


def test_dare_masks_differ_between_workers():
    (delta,) = make_deltas(1, (6, 6))
    dropped = merger("dare", 2, seed=1, drop_rate=0.5).merge("w", [delta, delta])
    # An entry equals Δ only if exactly one worker kept it ((2Δ + 0)/2): the masks differ.
    assert (dropped == delta).any()


def test_dare_masks_do_not_depend_on_the_delta_dtype():
    deltas = make_deltas(2, (8, 4), dtype=torch.float64)
    m = merger("dare", 2, seed=3, drop_rate=0.3)
    masks = [dare_mask(3, w, 1, "w", (8, 4), 0.3) for w in range(2)]
    expected = sum(d * k / 0.7 for d, k in zip(deltas, masks)) / 2
    torch.testing.assert_close(m.merge("w", deltas, 1), expected, rtol=1e-12, atol=0)
    single = m.merge("w", [d.float() for d in deltas], 1)
    torch.testing.assert_close(single, expected.float(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- config


def test_registry_matches_config_choices():
    import dataclasses

    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(merge_config.MergeConfig)}
    assert set(rules.RULES) == set(choices["rule"]) == set(RULE_NAMES)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rule="median"), "merge.rule"),
        (dict(density=0.0), "merge.density"),
        (dict(density=1.5), "merge.density"),
        (dict(drop_rate=1.0), "merge.drop_rate"),
        (dict(drop_rate=-0.1), "merge.drop_rate"),
        (dict(common_fraction=0.0), "merge.common_fraction"),
        (dict(ortho="qr"), "merge.ortho"),
        (dict(scale="median"), "merge.scale"),
        (dict(ns_steps=0), "merge.ns_steps"),
        (dict(ns_dtype="float16"), "merge.ns_dtype"),
        (dict(exclude="lm_head.weight"), "merge.exclude"),
        (dict(factors="svd"), "merge.factors"),
        (dict(oversample=-1), "merge.oversample"),
        (dict(power_iters=-2), "merge.power_iters"),
        (dict(finder_dtype="float16"), "merge.finder_dtype"),
        (dict(bucket_mb=0), "merge.bucket_mb"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        merge_config.MergeConfig(**overrides).validate()


def test_default_config_is_valid_and_corrects_every_matrix():
    cfg = merge_config.MergeConfig()
    cfg.validate()
    assert cfg.exclude == [] and not cfg.excludes("model.embed_tokens.weight")
    assert math.isclose(cfg.density, 0.9) and cfg.rule == "mean" and cfg.ortho == "auto"


@pytest.mark.parametrize("arg, needle", [
    ("merge.bucket_mb=0", "merge.bucket_mb=0.0"),
    ("merge.factors=lanczos", "merge.factors='lanczos'"),
    ("merge.oversample=-4", "merge.oversample=-4"),
    ("merge.power_iters=-1", "merge.power_iters=-1"),
    ("merge.finder_dtype=half", "merge.finder_dtype='half'"),
])
def test_bad_engine_settings_exit_2_with_one_line_before_any_work(tmp_path, capsys, arg, needle):
    from isoloco.cli import main

    out = tmp_path / "run"
    assert main(["train", "method=tsv", arg, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1
    assert not out.exists()


# ------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_buckets_and_fetching_do_not_change_the_merge(rule):
    """Every parameter in a bucket of its own, or all in one; deltas given or fetched: the
    same merged tensors (within rounding: one bucket batches Iso-C's same-shape matrices)."""
    shapes = {"a.weight": (12, 8), "b.weight": (12, 8), "c.weight": (8, 20), "norm": (8,)}
    deltas = {name: make_deltas(4, shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    one_each = merge.Merger(merge_config.MergeConfig(rule=rule, bucket_mb=1e-9), LocalCommunicator(4), seed=2)
    together = merge.Merger(merge_config.MergeConfig(rule=rule), LocalCommunicator(4), seed=2)
    expected = one_each.merge_all(deltas, round=1)
    fetched = together.merge_all(deltas, round=1, fetch=lambda d: d.clone())
    for name in shapes:
        torch.testing.assert_close(fetched[name], expected[name], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(together.merge(name, deltas[name], round=1), expected[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_the_merge_holds_one_fetched_delta_at_a_time(rule):
    """Whatever the number of workers, a fetched delta is dropped before the next is fetched,
    so the merge's memory does not grow with R (the scale benchmark measures the bytes)."""
    import weakref

    alive: list[weakref.ref] = []

    def fetch(stored: torch.Tensor) -> torch.Tensor:
        assert sum(ref() is not None for ref in alive) == 0, "an earlier fetched delta is still held"
        copy = stored.clone()
        alive.append(weakref.ref(copy))
        return copy

    deltas = {"w": make_deltas(8, (48, 40)), "v": make_deltas(8, (16,))}  # Iso-CTS: s = 1 direction each
    merge.Merger(merge_config.MergeConfig(rule=rule), LocalCommunicator(8), seed=0).merge_all(deltas, 0, fetch)
    # Each phase fetches every delta once: TIES has two for both tensors, Iso-CTS two for "w".
    assert len(alive) == 8 * {"ties": 4, "iso_cts": 3}.get(rule, 2)


def test_one_collective_per_bucket_and_phase():
    calls = []

    class Counting(LocalCommunicator):
        def _sum_across_processes(self, tensor):
            calls.append("sum")
            return tensor

        def _gather_across_processes(self, tensors):
            calls.append("gather")
            return list(tensors)

    shapes = {f"layer{i}.weight": (16, 12) for i in range(5)} | {"norm": (12,)}
    deltas = {name: make_deltas(2, shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    for rule, expected in {"mean": ["sum"], "ties": ["sum", "sum"], "iso_cts": ["sum", "gather"],
                           "tsv": ["sum", "gather"]}.items():
        calls.clear()
        merge.Merger(merge_config.MergeConfig(rule=rule), Counting(2), seed=0).merge_all(deltas)
        assert calls == expected, rule


@pytest.mark.parametrize("finder_dtype", ["bfloat16", "float32"])
def test_randomized_factors_match_the_exact_ones_where_auto_takes_them(finder_dtype):
    """A worker keeping at most 1/16 of the rank: the range finder's merge is the exact one
    to within half the 1e-3 bar on deltas with decaying spectra (a shared part plus each worker's
    own directions), whether its early iterations run in bfloat16 or not; where a worker
    keeps more, auto is the exact path itself."""
    g = torch.Generator().manual_seed(0)

    def decaying(rows: int, cols: int, rate: float) -> torch.Tensor:
        u = torch.linalg.qr(torch.randn(rows, 64, generator=g))[0]
        v = torch.linalg.qr(torch.randn(cols, 64, generator=g))[0]
        return (u * rate ** torch.arange(64.0)) @ v.T

    shared = decaying(192, 160, 0.8)  # a rank of at least RANDOMIZED_MIN_RANK: auto considers the finder
    deltas = [shared + 0.5 * decaying(192, 160, 0.7) for _ in range(16)]
    for rule in (merge_functions.tsv, merge_functions.iso_cts):
        exact = rule(deltas, factors="exact")
        relative = (rule(deltas, factors="auto", finder_dtype=finder_dtype) - exact).norm() / exact.norm()
        assert 0 < relative < 5e-4, (rule.__name__, relative)
    two = deltas[:2]  # k = 80 of 160: auto takes the full SVD
    assert torch.equal(merge_functions.tsv(two, factors="auto"), merge_functions.tsv(two, factors="exact"))


def test_the_finder_dtype_names_map_to_dtypes():
    from isoloco.factors import FactorSettings, fast_bfloat16

    cpu = torch.device("cpu")
    assert FactorSettings(finder_dtype="float32").early_dtype(cpu) == torch.float32
    assert FactorSettings(finder_dtype="bfloat16").early_dtype(cpu) == torch.bfloat16
    assert FactorSettings().early_dtype(cpu) == (torch.bfloat16 if fast_bfloat16(cpu) else torch.float32)
    with pytest.raises(ValueError, match="finder_dtype='half'"):
        FactorSettings(finder_dtype="half")


@pytest.mark.parametrize("shape", [(200, 120), (120, 200)])
def test_early_iterations_in_bfloat16_differ_from_float32_ones_only_by_rounding(shape):
    """The range finder's bfloat16 iterations (which re-orthonormalise only the short side)
    change which basis the last, float32 one starts from, not what it converges to: the
    factors agree far below the 1e-3 bar, on tall and wide matrices."""
    from isoloco.factors import FactorSettings, top_factors

    g = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(shape[0], 48, generator=g))[0]
    v = torch.linalg.qr(torch.randn(shape[1], 48, generator=g))[0]
    matrix = (u * 0.85 ** torch.arange(48.0)) @ v.T + 1e-3 * torch.randn(shape, generator=g)
    low, full = (top_factors(matrix, 6, FactorSettings("randomized", finder_dtype=d)) for d in ("bfloat16", "float32"))
    product = [(f[0] * f[1]) @ f[2].T for f in (low, full)]
    assert 0 < (product[0] - product[1]).norm() / product[1].norm() < 1e-5
    torch.testing.assert_close(low[1], full[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(48, 40), (48, 48), (200, 120)])
@pytest.mark.parametrize("outside", [True, False])
def test_the_polar_factor_beside_an_orthonormal_block_is_the_whole_one(shape, outside):
    """Iso-CTS's stacked singular vectors: an orthonormal common block L (here with one zero
    column, a null direction of the mean) beside the workers' X. X outside L's span (the U
    side: each residual was projected off U_c) or not (the V side), with a null column and a
    column inside L's span: the small problem every method but exact solves gives the whole
    [L, X]'s polar factor; exact orthogonalises the whole and agrees to float32 rounding."""
    from isoloco.factors import FactorSettings
    from isoloco.svd import polar_svd

    g = torch.Generator().manual_seed(0)
    rows, cols = shape
    common = torch.linalg.qr(torch.randn(rows, cols * 3 // 5, generator=g, dtype=torch.float64))[0]
    common[:, 3] = 0
    extra = torch.randn(rows, cols - common.shape[1], generator=g, dtype=torch.float64)
    if outside:
        extra = extra - common @ (common.T @ extra)
    else:
        extra[:, 0] = 2 * common[:, 0] - common[:, 1]
    extra[:, -1] = 0
    whole = polar_svd(torch.cat([common, extra], 1)).factor
    for method in ("auto", "randomized", "exact"):
        beside = FactorSettings(method=method).polar_beside(common.float(), extra.float())
        torch.testing.assert_close(beside.double(), whole, atol=1e-5, rtol=0)
    exact64 = FactorSettings().polar_beside(common, extra)
    torch.testing.assert_close(exact64, whole, atol=1e-12, rtol=0)
    assert exact64[:, 3].abs().max() < 1e-14 and exact64[:, -1].abs().max() < 1e-14  # null stays null
    if outside:
        assert torch.equal(exact64[:, :common.shape[1]], common)


# ---------------------------------------------------------------------- compressed sums


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("rule", ["mean", "iso_c", "dare"])
def test_a_compressed_merge_is_the_rule_on_the_compressed_sum(fmt, rule):
    """The simulator's R workers are R islands: each worker's contribution is encoded, the
    decoded ones are added in worker order, and the owners re-encode the total (R > 2)."""
    from isoloco.sync.codec import Quantization, dequantize, quantize

    q = Quantization(fmt)
    deltas = {"w": make_deltas(4, (12, 10)), "b": make_deltas(4, (10,), seed=1)}
    comm = LocalCommunicator(4)
    merged = merge.Merger(merge_config.MergeConfig(rule=rule, quantize=fmt), comm, seed=0).merge_all(deltas)
    exact = merge.Merger(merge_config.MergeConfig(rule=rule), LocalCommunicator(4), seed=0)
    for name, ds in deltas.items():
        if rule == "dare":  # its contributions are the masked, rescaled deltas
            ds = [d * rules.keep_mask(rules.mask_key(0, r, 0, name), 0, d.numel(), 0.9, d.device).view_as(d) / 0.9
                  for r, d in enumerate(ds)]
        total = sum(dequantize(quantize(d, q)) for d in ds)
        mean = dequantize(quantize(total, q)) / 4
        expected = exact.finalize(name, mean) if rule == "iso_c" else mean
        torch.testing.assert_close(merged[name], expected, rtol=1e-6, atol=1e-7, msg=name)
    # Per worker, the compressed bytes of each tensor, not float32's.
    assert comm.reset_bytes() < {"bf16": 0.55, "int8": 0.3, "int4": 0.17}[fmt] * 4 * (120 + 10)


def test_error_feedback_sends_what_compression_lost_later():
    """Over rounds, what the merge received adds up to what the workers meant minus their last
    residuals (exactly, up to float rounding), and the residuals live on between rounds."""
    m = merge.Merger(merge_config.MergeConfig(rule="mean", quantize="int4", error_feedback=True), LocalCommunicator(2), 0)
    residuals = {"w": [torch.zeros(6, 5) for _ in range(2)]}
    meant = received = 0
    for t in range(5):
        deltas = {"w": make_deltas(2, (6, 5), seed=t)}
        received = received + m.merge_all(deltas, t, residuals=residuals)["w"]
        meant = meant + sum(deltas["w"]) / 2
    torch.testing.assert_close(received, meant - sum(residuals["w"]) / 2, atol=1e-5, rtol=1e-5)
    assert all(r.abs().sum() > 0 for r in residuals["w"])
    with pytest.raises(ValueError, match="residuals"):
        m.merge_all({"w": make_deltas(2, (6, 5))}, 0)


@pytest.mark.parametrize("overrides, message", [
    (dict(rule="ties", quantize="int8"), "merge.quantize=int8 is not allowed with merge.rule=ties: one of its sums "
                                         "counts agreeing workers"),
    (dict(rule="tsv", quantize="int4"), "merge.quantize=int4 is not allowed with merge.rule=tsv: tsv gathers"),
    (dict(rule="iso_cts", quantize="bf16"), "merge.quantize=bf16 is not allowed with merge.rule=iso_cts"),
    (dict(rule="mean", error_feedback=True), "merge.error_feedback=true is not allowed with merge.quantize=none"),
    (dict(rule="mean", quantize="int2"), "merge.quantize"),
    (dict(rule="mean", quantize="int8", quantize_block=0), "merge.quantize_block"),
])
def test_compression_settings_a_rule_cannot_take_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        merge_config.MergeConfig(**overrides).validate()
