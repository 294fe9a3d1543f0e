"""SparseLoCo (`outer.transport=sparseloco`, `method=sparseloco`) against the released code,
re-implemented in float64 (`sparseloco_reference`)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from isoloco.comm import LocalCommunicator
from isoloco.config import resolve
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.merge_config import MergeConfig, Participation
from isoloco.metrics import read_metrics
from isoloco.outer import OuterConfig, OuterStep
from isoloco.sync import sparseloco
from isoloco.sync.cost import wire_bytes
from isoloco.trainer import Trainer

from helpers import ONE_THREAD_ENV, SMALL, SMALL_ARGS, final_params
from sparseloco_reference import ref_quantize, ref_round, ref_split

SHAPES = {"attn.weight": (128, 192), "ffn.weight": (10, 7), "norm.weight": (96,), "head.weight": (64, 64)}


def sparse_outer(topk: int, workers: int, rule: str = "mean", lr: float = 1.0) -> tuple[OuterStep, dict]:
    params = {name: torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
              for i, (name, shape) in enumerate(SHAPES.items())}
    outer = OuterConfig(optimizer="sgd", lr=lr, momentum=0.0, transport="sparseloco", sparse_topk=topk)
    step = OuterStep(list(params.items()), MergeConfig(rule=rule), outer, LocalCommunicator(workers), seed=0)
    return step, params


def round_deltas(workers: int, round: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + round)
    return {name: [torch.randn(shape, generator=g) * (1 + w) for w in range(workers)] for name, shape in SHAPES.items()}


@pytest.mark.parametrize("topk, workers", [(8, 3), (64, 4), (2, 2)])
def test_rounds_match_the_released_functions_in_float64(topk, workers):
    step, params = sparse_outer(topk, workers)
    accumulators = {name: [torch.zeros(shape) for _ in range(workers)] for name, shape in SHAPES.items()}
    theta = {name: p.detach().double().numpy().copy() for name, p in params.items()}
    errors = [{name: np.zeros(shape) for name, shape in SHAPES.items()} for _ in range(workers)]
    for round in range(3):
        deltas = round_deltas(workers, round)
        step.step(deltas, round, residuals=accumulators)
        ref_deltas = [{name: deltas[name][w].double().numpy() for name in SHAPES} for w in range(workers)]
        theta = ref_round(theta, errors, ref_deltas, 64, topk, 0.95, 1.0, range(workers))
        for name in SHAPES:
            np.testing.assert_allclose(params[name].detach().double().numpy(), theta[name], rtol=2e-5, atol=2e-6,
                                       err_msg=f"{name}, round {round}")
            for w in range(workers):
                np.testing.assert_allclose(accumulators[name][w].double().numpy(), errors[w][name], rtol=2e-5,
                                           atol=2e-6, err_msg=f"{name}, worker {w}, round {round}")


def test_a_late_worker_neither_sends_nor_touches_its_accumulator():
    workers = 3
    step, params = sparse_outer(8, workers)
    accumulators = {name: [torch.full(shape, 0.5) for _ in range(workers)] for name, shape in SHAPES.items()}
    theta = {name: p.detach().double().numpy().copy() for name, p in params.items()}
    errors = [{name: np.full(shape, 0.5) for name, shape in SHAPES.items()} for _ in range(workers)]
    deltas = round_deltas(workers, 0)
    step.step(deltas, 0, participation=Participation((0, 2)), residuals=accumulators)
    ref_deltas = [{name: deltas[name][w].double().numpy() for name in SHAPES} for w in range(workers)]
    theta = ref_round(theta, errors, ref_deltas, 64, 8, 0.95, 1.0, (0, 2))
    for name in SHAPES:
        np.testing.assert_allclose(params[name].detach().double().numpy(), theta[name], rtol=2e-5, atol=2e-6)
        assert torch.equal(accumulators[name][1], torch.full(SHAPES[name], 0.5))


def test_iso_c_applies_to_the_decoded_mean():
    """merge.rule=iso_c: the mean SparseLoCo sends, orthogonalised (every singular value their mean;
    in float64 from the plain run's mean)."""
    workers = 2
    plain, plain_params = sparse_outer(8, workers)
    iso, iso_params = sparse_outer(8, workers, rule="iso_c")
    start = {name: p.detach().clone() for name, p in plain_params.items()}
    for step in (plain, iso):
        step.step(round_deltas(workers, 0), 0,
                  residuals={name: [torch.zeros(shape) for _ in range(workers)] for name, shape in SHAPES.items()})
    for name, shape in SHAPES.items():
        mean = (start[name] - plain_params[name].detach()).double()
        if len(shape) == 2:
            # A sparse mean may be rank-deficient: Iso-C drops its null directions (docs/fidelity.md).
            u, s, vh = torch.linalg.svd(mean, full_matrices=False)
            kept = s > 1e-5 * s[0]
            mean = s.mean() * u[:, kept] @ vh[kept]
        torch.testing.assert_close((start[name] - iso_params[name].detach()).double(), mean, rtol=1e-4, atol=1e-5)


def test_the_wire_round_trips_and_is_as_long_as_its_count():
    layout = sparseloco.Tiling(64, 64).layout((128, 192))
    x = torch.randn(128, 192, generator=torch.Generator().manual_seed(3))
    blob = sparseloco.encode(x, layout)
    # 6 tiles of 64 entries: 20 bytes of header, 576 in 12 bits, 384 codes of 2 bits.
    assert blob.dtype == torch.uint8 and blob.numel() == layout.nbytes == 20 + 576 + 96
    index, values = sparseloco.decode(blob, layout)
    tiles = layout.to_tiles(x)
    expected = tiles.abs().topk(64, dim=1).indices.sort(dim=1).values
    assert torch.equal(index, expected)
    torch.testing.assert_close(values, torch.from_numpy(ref_quantize(tiles.gather(1, expected).double().numpy()))
                               .float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("count", [1, 2, 7, 64])
def test_indices_pack_as_the_reference_packs_them(count):
    indices = torch.randint(0, 4096, (count,), generator=torch.Generator().manual_seed(count))
    packed = sparseloco.pack_indices(indices)
    assert torch.equal(sparseloco.unpack_indices(packed, count), indices)
    pairs = np.pad(indices.numpy(), (0, count % 2)).reshape(-1, 2)  # the reference's byte layout
    expected = np.stack([pairs[:, 0] & 0xFF, ((pairs[:, 0] >> 8) & 0x0F) | ((pairs[:, 1] & 0x0F) << 4),
                         (pairs[:, 1] >> 4) & 0xFF], axis=1).reshape(-1)
    assert packed.tolist() == expected.tolist()
    codes = torch.randint(0, 4, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))
    assert torch.equal(sparseloco.unpack_codes(sparseloco.pack_codes(codes), count), codes)


def test_tiles_follow_the_reference_split_and_a_prime_side_still_travels():
    """Where the reference would ask for 2 entries of a 1-entry chunk (a prime side above the
    tile), each entry is its own tile and travels whole."""
    for n in (1, 7, 64, 96, 130, 192, 4096, 67):
        assert sparseloco.tile_side(n, 64) == ref_split(n, 64), n
    layout = sparseloco.Tiling(64, 64).layout((67,))
    assert (layout.entries, layout.kept) == (1, 1)
    x = torch.randn(67, generator=torch.Generator().manual_seed(0))
    index, values = sparseloco.decode(sparseloco.encode(x, layout), layout)
    assert torch.equal(index, torch.zeros(67, 1, dtype=torch.int64))
    torch.testing.assert_close(values.reshape(-1), torch.from_numpy(ref_quantize(x.double().numpy())).float())


def test_the_bytes_are_the_cost_models_all_gather_of_the_blobs():
    shapes = list(SHAPES.values())
    tiling = sparseloco.Tiling(64, 64)
    blob = sum(tiling.layout(shape).nbytes for shape in shapes)
    assert sparseloco.sparseloco_wire_bytes(shapes, tiling, 4) == wire_bytes("all_gather", blob, 4) == 3 * blob
    comm = LocalCommunicator(2)
    step = OuterStep([(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()],
                     MergeConfig(), OuterConfig(optimizer="sgd", lr=1.0, transport="sparseloco"), comm, seed=0)
    step.step(round_deltas(2, 0), 0, residuals={n: [torch.zeros(s), torch.zeros(s)] for n, s in SHAPES.items()})
    assert comm.reset_bytes() == blob


def test_a_non_finite_delta_is_refused_before_it_is_sent():
    step, _ = sparse_outer(8, 2)
    deltas = round_deltas(2, 0)
    deltas["norm.weight"][1][3] = float("nan")
    accumulators = {name: [torch.zeros(shape) for _ in range(2)] for name, shape in SHAPES.items()}
    with pytest.raises(NonFiniteDeltaError, match="'norm.weight' from worker 1 in round 0"):
        step.step(deltas, 0, residuals=accumulators)
    assert all(not a.any() for kept in accumulators.values() for a in kept)


@pytest.mark.parametrize("overrides, words", [
    ({"merge.quantize": "int8"}, "merge.quantize=int8 is not allowed with outer.transport=sparseloco: SparseLoCo "
                                 "sends its own 2-bit top-k entries; set merge.quantize=none"),
    ({"merge.compress": "topk"}, "set merge.compress=none"),
    ({"merge.rule": "ties"}, "merge.rule=ties is not allowed with outer.transport=sparseloco"),
    ({"merge.weighting": "tokens"}, "set merge.weighting=equal"),
    ({"outer.sparse_tile": 128}, "outer.sparse_tile=128 is not allowed: it must be in [1, 64]"),
    ({"outer.sparse_decay": 1.5}, "outer.sparse_decay=1.5 is not allowed: it must be in [0, 1]"),
    ({"outer.sparse_topk": 0}, "outer.sparse_topk=0 is not allowed: it must be > 0"),
])
def test_refusals_name_the_value_and_the_fix(overrides, words):
    with pytest.raises(ConfigError) as error:
        resolve(None, {"method": "sparseloco", **overrides})
    assert words in str(error.value)


class Stop(Exception):
    pass


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    """The accumulators are checkpointed with their workers (`w<id>.residual.<param>`)."""
    overrides = {**SMALL, "method": "sparseloco", "workers": 2, "inner_steps": 3, "steps": 12, "eval_every": 6,
                 "checkpoint_every": 6, "outer.sparse_topk": 8}

    def run(name, hooks=(), resume=False):
        (tmp_path / name).mkdir(exist_ok=True)
        trainer = Trainer(resolve(None, overrides), tmp_path / name, progress=False)
        trainer.after_turn.extend(hooks)
        trainer.run(resume=resume)
        return trainer

    reference = run("reference")

    def stop(worker, start, end):
        if start == 6:
            raise Stop

    with pytest.raises(Stop):
        run("killed", [stop])
    resumed = run("killed", resume=True)
    for ours, theirs in zip(resumed.global_params, reference.global_params, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(resumed.workers, reference.workers, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours.residual, theirs.residual, strict=True))
    ours, theirs = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("killed", "reference"))
    assert [m["train_loss"] for m in ours] == [m["train_loss"] for m in theirs]
    assert ours[-1]["bytes_per_worker"] > 0


@pytest.mark.multiprocess
def test_two_processes_give_the_simulators_numbers_and_the_cost_models_bytes(tmp_path):
    """4 workers on 2 gloo processes (2 islands of 2 workers) against the one-process simulator:
    the same bits, and the cross-island bytes of the cost model's all-gather of the blobs."""
    run = [*SMALL_ARGS, "method=sparseloco", "workers=4", "inner_steps=2", "steps=6", "eval_every=6",
           "checkpoint_every=0", "outer.sparse_topk=8"]

    def isoloco(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "isoloco", *args, "--quiet"], capture_output=True, text=True,
                              env=ONE_THREAD_ENV)
        assert done.returncode == 0, done.stderr

    isoloco("train", *run, "--out", str(tmp_path / "simulated"))
    isoloco("launch", "--nproc", "2", "--", "train", *run, "--out", str(tmp_path / "spread"))
    simulated, spread = final_params(tmp_path / "simulated"), final_params(tmp_path / "spread")
    for name, tensor in simulated.items():
        assert torch.equal(tensor, spread[name]), name
    shapes = [tensor.shape for tensor in simulated.values()]
    summary = json.loads((tmp_path / "spread" / "summary.json").read_text())
    rounds, processes = 3, 2
    per_merge = sparseloco.sparseloco_wire_bytes(shapes, sparseloco.Tiling(64, 8), islands=2, workers_per_island=2)
    assert summary["cross_island_wire_bytes"] == rounds * processes * per_merge


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"outer.overlap_steps": 1}, {"faults.late_rate": 0.4, "faults.late": "carry"},
                                   {"method": "sparseloco_isoc", "merge.exclude": "*embed_tokens*"}],
                         ids=["overlap", "late-carry", "isoc"])
def test_it_trains_beside_the_other_round_keys(tmp_path, extra):
    cfg = resolve(None, {**SMALL, "method": "sparseloco", "workers": 4, "inner_steps": 3, "steps": 9,
                         "eval_every": 9, **extra})
    trainer = Trainer(cfg, tmp_path, progress=False)
    trainer.run()
    assert all(torch.isfinite(p).all() for p in trainer.global_params)
    assert any(m.get("bytes_per_worker", 0) > 0 for m in read_metrics(tmp_path / "metrics.jsonl"))


def test_torchft_refuses_it_in_one_line():
    pytest.importorskip("torchft")
    from isoloco.torchft.replica import check_group_config

    with pytest.raises(ConfigError, match="outer.transport=sparseloco is not supported under torchft: torchft's "
                                          "DiLoCo all-reduces whole pseudo-gradients"):
        check_group_config(resolve("quick", {"workers": 2, "method": "sparseloco"}), 0, 1)


def test_the_tuned_outer_lr_the_divergence_warning_names_is_the_committed_selection():
    """`config.SPARSELOCO_TUNED_LR` quotes seed 0's choices of results/claims/compress-tuned: the
    lr each SparseLoCo method chose at each R there (the row's `chosen` column, sgd-lr<x>)."""
    from pathlib import Path

    from isoloco.config_checks import SPARSELOCO_TUNED_LR

    selection = Path(__file__).resolve().parents[1] / "results/claims/compress-tuned/selection.md"
    chosen: dict[str, dict[int, float]] = {}
    for line in selection.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] == "sparseloco" and cells[4].startswith("sgd-lr"):
            chosen.setdefault(cells[1], {})[int(cells[2])] = float(cells[4].removeprefix("sgd-lr"))
    assert chosen == SPARSELOCO_TUNED_LR
