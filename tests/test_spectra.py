"""`log.spectra`: the measurements, their logging by the trainer, and their report figures."""

import itertools
import json
import statistics
from pathlib import Path

import pytest
import torch

from isoloco import merge_config
from isoloco.cli import main
from isoloco.comm import LocalCommunicator
from isoloco.config import resolve
from isoloco.errors import ConfigError
from isoloco.outer import OuterConfig, OuterStep
from isoloco.model import build_model
from isoloco.report import load_runs, write_report
from isoloco.report.spectra import read_spectra, write_spectra_plots
from isoloco.spectra import (QUANTITIES, disagreements, mean_pairwise_cosine, nonzero_singular_values, sigma_ratio,
                             stable_rank, unit_sum)
from isoloco.trainer import Trainer
import helpers
from helpers import SMALL_ARGS, final_params


def spectrum(matrix: torch.Tensor) -> tuple[float | None, float | None]:
    sigma = nonzero_singular_values(matrix)
    return stable_rank(sigma), sigma_ratio(sigma)


# ------------------------------------------------------------------------ the measurements


def test_a_flat_spectrum_has_its_rank_as_stable_rank_and_ratio_one():
    partial_identity = torch.zeros(6, 5)
    partial_identity[:3, :3] = 2 * torch.eye(3)
    assert spectrum(partial_identity) == pytest.approx((3.0, 1.0))
    orthogonal, _ = torch.linalg.qr(torch.randn(5, 5, generator=torch.Generator().manual_seed(0)))
    assert spectrum(orthogonal) == pytest.approx((5.0, 1.0), rel=1e-5)


def test_a_rank_one_matrix_has_stable_rank_one_despite_round_off():
    g = torch.Generator().manual_seed(1)
    rank_one = torch.outer(torch.randn(40, generator=g), torch.randn(30, generator=g))
    assert nonzero_singular_values(rank_one).numel() == 1
    assert spectrum(rank_one) == pytest.approx((1.0, 1.0), rel=1e-5)


def test_a_known_spectrum_and_the_zero_matrix():
    assert spectrum(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx((10 / 9, 1.5))
    assert spectrum(torch.zeros(4, 3)) == (None, None)
    with pytest.raises(ValueError, match="need a matrix"):
        nonzero_singular_values(torch.ones(4))


def brute_force_mean_cosine(deltas: list[torch.Tensor]) -> float:
    flat = [d.reshape(-1).double() for d in deltas]
    pairs = [torch.dot(a, b) / (a.norm() * b.norm()) for a, b in itertools.combinations(flat, 2)]
    return float(torch.stack(pairs).mean())


def cosine(deltas: list[torch.Tensor]) -> float | None:
    return mean_pairwise_cosine(*unit_sum(iter(deltas)))


def test_identical_directions_agree_orthogonal_ones_do_not_opposite_ones_disagree():
    delta = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    assert cosine([delta, 2 * delta, 0.5 * delta]) == pytest.approx(1.0, abs=1e-6)
    assert cosine(list(torch.eye(4).reshape(4, 2, 2))) == pytest.approx(0.0, abs=1e-7)
    assert cosine([delta, -3 * delta]) == pytest.approx(-1.0, abs=1e-6)


def test_the_streamed_mean_cosine_equals_the_pairwise_mean():
    g = torch.Generator().manual_seed(3)
    common = torch.randn(8, 6, generator=g)
    deltas = [common + torch.randn(8, 6, generator=g) for _ in range(5)]
    assert cosine(deltas) == pytest.approx(brute_force_mean_cosine(deltas), abs=1e-6)


def test_one_delta_has_no_pair_and_a_zero_delta_no_direction():
    delta = torch.randn(3, 3, generator=torch.Generator().manual_seed(4))
    assert cosine([delta]) is None
    assert cosine([delta, torch.zeros(3, 3)]) is None
    assert cosine([delta, torch.zeros(3, 3), delta]) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least one"):
        unit_sum(iter([]))


class Recording(LocalCommunicator):
    """One process of two: keeps what it hands to the all-reduce."""

    def _sum_across_processes(self, tensor):
        self.handed = tensor.clone()
        return tensor


class Adding(LocalCommunicator):
    """The other process of two: its all-reduce adds what the first handed."""

    def __init__(self, other: torch.Tensor, worker_ids: list[int]):
        super().__init__(worker_ids=worker_ids)
        self.other = other

    def _sum_across_processes(self, tensor):
        return tensor + self.other


def test_processes_holding_some_workers_each_get_the_disagreement_of_all():
    g = torch.Generator().manual_seed(5)
    deltas = [[torch.randn(5, 4, generator=g) for _ in range(4)], [torch.randn(3, 2, generator=g) for _ in range(4)]]
    whole = disagreements(deltas, LocalCommunicator(4), lambda d: d, torch.device("cpu"))
    first = Recording(worker_ids=[0, 1])
    disagreements([d[:2] for d in deltas], first, lambda d: d, torch.device("cpu"))
    second = disagreements([d[2:] for d in deltas], Adding(first.handed, [2, 3]), lambda d: d, torch.device("cpu"))
    assert second == pytest.approx(whole, abs=1e-6)
    assert whole == pytest.approx([brute_force_mean_cosine(d) for d in deltas], abs=1e-6)


def test_the_measurements_collective_is_not_counted_as_merge_traffic():
    def counted() -> LocalCommunicator:
        comm = LocalCommunicator(2)
        comm.sum(torch.ones(5))
        comm.record("cross_island", 100, 150.0, calls=2)
        comm.record("in_island", 10, 20.0, calls=1)
        return comm

    measured, reference = counted(), counted()
    with measured.uncounted():
        assert torch.equal(measured.sum(torch.ones(3)), torch.ones(3))
        measured.record("cross_island", 7, 7.0)
    assert measured.reset_bytes() == reference.reset_bytes() > 0
    assert torch.equal(measured.reset_link_bytes(), reference.reset_link_bytes())


# ------------------------------------------------------------------------ the outer step

SHAPES = {"attn.weight": (6, 4), "mlp.weight": (5, 7), "norm.weight": (4,)}
WORKERS = 3


def outer_rounds(measured: bool, rounds: int = 3, **outer) -> tuple[OuterStep, list[dict]]:
    g = torch.Generator().manual_seed(0)
    params = [(name, torch.nn.Parameter(torch.randn(shape, generator=g))) for name, shape in SHAPES.items()]
    step = OuterStep(params, merge_config.MergeConfig(rule="ties"), OuterConfig(**outer), LocalCommunicator(WORKERS), seed=0)
    probe = step.measure_spectra() if measured else None
    records = []
    for round in range(rounds):
        deltas = {name: [torch.randn(shape, generator=g) for _ in range(WORKERS)] for name, shape in SHAPES.items()}
        step.step(deltas, round=round)
        records.append(probe.take_records() if probe else {})
    return step, records


def test_measuring_changes_neither_the_step_nor_the_counted_bytes():
    plain, _ = outer_rounds(measured=False)
    measured, records = outer_rounds(measured=True)
    for (_, a), (_, b) in zip(plain.named_params, measured.named_params, strict=True):
        assert torch.equal(a, b)
    assert measured.comm.reset_bytes() == plain.comm.reset_bytes()
    assert measured.spectra.seconds > 0
    for record in records:
        assert set(record) == {"attn.weight", "mlp.weight"}  # matrices only
        for values in record.values():
            assert list(values) == list(QUANTITIES)
            assert values["stable_rank"] >= 1 and values["sigma_ratio"] >= 1
            assert -1 <= values["disagreement"] <= 1
    assert measured.spectra.take_records() == {}  # taken once


def test_the_norms_are_those_of_the_merged_update_and_of_the_step():
    g = torch.Generator().manual_seed(6)
    param = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    step = OuterStep([("w", param)], merge_config.MergeConfig(rule="mean"),
                     OuterConfig(optimizer="sgd", lr=0.5, momentum=0.0), LocalCommunicator(2), seed=0)
    probe = step.measure_spectra()
    deltas = [torch.randn(4, 3, generator=g) for _ in range(2)]
    before = param.detach().clone()
    step.step({"w": deltas}, round=0)
    record = probe.take_records()["w"]
    mean = (deltas[0] + deltas[1]) / 2
    assert record["update_norm"] == pytest.approx(float(mean.norm()), rel=1e-6)
    assert record["step_norm"] == pytest.approx(float((param.detach() - before).norm()), rel=1e-6)
    assert record["step_norm"] == pytest.approx(0.5 * record["update_norm"], rel=1e-5)
    assert record["disagreement"] == pytest.approx(brute_force_mean_cosine(deltas), abs=1e-6)


# ------------------------------------------------------------------------ training runs and the report

RUN = [*SMALL_ARGS, "steps=4", "eval_every=4", "seed=0"]


def train(out: Path, *keys: str) -> None:
    assert main(["train", *RUN, *keys, "--out", str(out), "--quiet"]) == 0


def lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A sweep folder of runs with spectra (R 2 and 4, H 2 and 3, and dp), and beside it the
    first run again without them."""
    root = tmp_path_factory.mktemp("spectra")
    for name, keys in (("diloco-R2-H2-s0", ["workers=2", "inner_steps=2"]),
                       ("diloco-R4-H2-s0", ["workers=4", "inner_steps=2"]),
                       ("diloco-R2-H3-s0", ["workers=2", "inner_steps=3"]),
                       ("dp-s0", ["method=dp"])):
        method = [] if name.startswith("dp") else ["method=diloco"]
        train(root / "sweep" / name, *method, *keys, "log.spectra=true")
    train(root / "off" / "diloco-R2-H2-s0", "method=diloco", "workers=2", "inner_steps=2")
    return root


def test_sync_lines_carry_the_spectra_and_the_summary_their_cost(runs):
    run = runs / "sweep" / "diloco-R2-H2-s0"
    matrices = [name for name, p in build_model("tiny", 512, 32, seed=0).named_parameters() if p.ndim == 2]
    for line in lines(run):
        assert ("spectra" in line) == (line["step"] % 2 == 0)  # H = 2: a sync every second step
        if "spectra" in line:
            assert list(line["spectra"]) == matrices
            for values in line["spectra"].values():
                assert list(values) == list(QUANTITIES)
                assert all(isinstance(v, float) for v in values.values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["spectra_s"] > 0
    dp = runs / "sweep" / "dp-s0"
    assert not any("spectra" in line for line in lines(dp))
    assert "spectra_s" not in json.loads((dp / "summary.json").read_text())


def test_without_spectra_nothing_is_logged_and_training_is_the_same_bits(runs):
    on, off = runs / "sweep" / "diloco-R2-H2-s0", runs / "off" / "diloco-R2-H2-s0"
    assert not any("spectra" in line for line in lines(off))
    summaries = [json.loads((run / "summary.json").read_text()) for run in (on, off)]
    assert "spectra_s" not in summaries[1]
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    assert [line["train_loss"] for line in lines(on)] == [line["train_loss"] for line in lines(off)]
    for name, tensor in final_params(off).items():
        assert torch.equal(tensor, final_params(on)[name]), name


def test_spectra_with_overlapped_synchronisation_is_refused():
    with pytest.raises(ConfigError, match="log.spectra=true is not allowed with outer.overlap_steps=1"):
        resolve(None, {**helpers.SMALL, "steps": 4, "method": "diloco", "workers": 2, "inner_steps": 2,
                       "outer.overlap_steps": 1, "log.spectra": True})


def test_the_report_draws_heatmaps_and_the_disagreement_against_r_and_h(runs):
    sweep = runs / "sweep"
    write_report(sweep)
    spectra_plots = {"spectra_diloco-R2-H2-s0.png", "spectra_diloco-R4-H2-s0.png", "spectra_diloco-R2-H3-s0.png",
                     "disagreement_vs_R.png", "disagreement_vs_H.png"}
    drawn = {p.name: p.read_bytes() for p in (sweep / "plots").glob("*.png") if p.name in spectra_plots}
    assert set(drawn) == spectra_plots
    assert all(png.startswith(b"\x89PNG") for png in drawn.values())
    markdown = (sweep / "results.md").read_text()
    assert all(f"(plots/{name})" in markdown for name in spectra_plots)
    write_report(sweep)  # the same bytes every time
    assert {name: (sweep / "plots" / name).read_bytes() for name in spectra_plots} == drawn
    # The table of every run's means: one row per run, from its own metrics lines.
    table = [line for line in (sweep / "spectra.md").read_text().splitlines() if line.startswith("| diloco-")]
    assert [row.split(" | ")[0] for row in table] == ["| diloco-R2-H2-s0", "| diloco-R2-H3-s0", "| diloco-R4-H2-s0"]
    rounds = read_spectra(sweep / "diloco-R4-H2-s0" / "metrics.jsonl")
    first = statistics.fmean(r["disagreement"] for r in rounds[0][1].values() if r["disagreement"] is not None)
    assert table[2].split(" | ")[5] == f"{first:.3f}"


def test_runs_without_spectra_leave_the_report_unchanged(runs, tmp_path):
    off = runs / "off"
    assert write_spectra_plots(off, load_runs(off), tmp_path / "plots") == []
    write_report(off)
    assert not any(p.name.startswith(("spectra_", "disagreement_")) for p in (off / "plots").iterdir())
    assert not (off / "spectra.md").exists()
    assert "spectra" not in (off / "results.md").read_text()
