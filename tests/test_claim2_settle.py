"""scripts/claim2_settle.py: the pre-registration's step swap gains a method's grid cells at R = 32
and 64, at its inner lr, once that method's search chooses an inner lr other than the grid's."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def settle(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("claim2_settle", SCRIPTS / "claim2_settle.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while built
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "GRID", tmp_path / "grid")  # the grid's shared points, made here
    return module


def finish_search(settle, out: Path, method: str, best: float) -> None:
    """Train `method`'s inner-lr search to its end on a loss least at `best`, as the driver would:
    every point laid out, then the ladder's next past an edge."""
    while True:
        _, searches = settle.plan(out)
        search = next(s for s in searches if s.method == method)
        if search.complete():
            assert search.chosen().step[0] == best
            return
        for task in search.grid:
            if not task.done():
                run = task.runs()[0]
                run.mkdir(parents=True)
                loss = 4.0 + abs(math.log2(task.step[0] / best))
                (run / "summary.json").write_text(json.dumps({"final_val_loss": loss}))


def swap_cells(settle, out: Path) -> dict[str, str | None]:
    """The swap's cells laid out now, each with its command once the searches it needs are complete."""
    tasks, _ = settle.plan(out)
    return {task.out.name: " ".join(task.command(["isoloco"])) if task.ready() else None
            for task in tasks if task.out.parent.name == "swap"}


def test_a_method_choosing_another_inner_lr_runs_its_grid_cells_at_r32_and_64_at_that_lr(settle, tmp_path):
    out = tmp_path / "out"
    swapped = {"diloco-R32-mu0.6-lr0.7", "diloco-R64-mu0.6-lr1.0"}
    assert set(swap_cells(settle, out)) == swapped
    finish_search(settle, out, "diloco", 0.004)
    cells = swap_cells(settle, out)
    # DiLoCo's grid steps there: R = 16's choice (lr 1.0) up to R = 32, R = 128's (lr 0.7) from 64.
    assert set(cells) == swapped | {"diloco-R32-mu0.6-lr1.0", "diloco-R64-mu0.6-lr0.7"}
    for name, command in cells.items():
        workers = name.split("-")[1].removeprefix("R")
        assert "inner.lr=0.004" in command and f"--workers {workers}" in command and "--seeds 1,2,3" in command
    assert "outer.lr=1.0" in cells["diloco-R32-mu0.6-lr1.0"] and "outer.lr=0.7" in cells["diloco-R64-mu0.6-lr0.7"]
    # IsoLoCo keeping the grid's inner lr needs no cell of its own: the grid ran them.
    finish_search(settle, out, "isoloco", settle.GRID_INNER_LR)
    assert set(swap_cells(settle, out)) == swapped | {"diloco-R32-mu0.6-lr1.0", "diloco-R64-mu0.6-lr0.7"}


def test_isoloco_choosing_another_inner_lr_runs_its_own_cells_at_its_grid_step(settle, tmp_path):
    out = tmp_path / "out"
    finish_search(settle, out, "isoloco", 0.008)
    cells = {name: command for name, command in swap_cells(settle, out).items() if name.startswith("isoloco")}
    assert set(cells) == {"isoloco-R32-mu0.6-lr1.5", "isoloco-R64-mu0.6-lr1.5"}
    assert all("inner.lr=0.008" in command and "outer.lr=1.5" in command for command in cells.values())


def write_long_run(settle, out: Path, method: str, workers: int, seed: int, losses: dict[int, float]) -> None:
    run = out / "long" / f"{method}-R{workers}" / f"{method}-R{workers}-H30-s{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "train_loss": 9.0, "val_loss": loss}) + "\n"
                                               for step, loss in losses.items()))


def test_the_contrast_is_drawn_at_every_evaluation_its_seeds_reached(settle, tmp_path):
    """Seed 1's four runs reached step 120, seed 2's only 60 (its IsoLoCo R = 16 run lags): the
    table has step 60 over both seeds and step 120 over one, with figures worked by hand."""
    out = tmp_path / "out"
    cells = {("isoloco", 128): (4.60, 4.50), ("diloco", 128): (4.90, 4.85), ("isoloco", 16): (4.40, 4.30),
             ("diloco", 16): (4.60, 4.55)}
    for (method, workers), (at60, at120) in cells.items():
        write_long_run(settle, out, method, workers, 1, {60: at60, 120: at120})
        lag = method == "isoloco" and workers == 16
        write_long_run(settle, out, method, workers, 2, {60: at60 + (0.02 if lag else 0.0)} if lag
                       else {60: at60, 120: at120})
    by_step = settle.contrast_by_step(out / "long")
    # step 60, seed 1: (4.60 - 4.90) - (4.40 - 4.60) = -0.10; seed 2: IsoLoCo R = 16 0.02 higher: -0.12
    assert by_step[60] == pytest.approx({1: -0.10, 2: -0.12}) and by_step[120] == pytest.approx({1: -0.10})
    settle.write_contrast(out)
    table = (out / "long" / "contrast.md").read_text()
    # step 60: mean -0.11, sd 0.014142, t(0.975, 1) = 12.7062: half-width 0.127062
    assert "| 60 | 2 | -0.1100 | [-0.2371, +0.0171] |" in table
    assert "| 120 | 1 | -0.1000 | — | — |" in table
    assert "to come (0 of 5 seeds there)" in table


@pytest.mark.parametrize("values, expected", [
    ([-0.10, -0.12, -0.11, -0.09, -0.10], "grows"),  # 95% interval -0.104 ± 0.0142, all below 0
    ([-0.02, -0.025, -0.015, -0.02, -0.02], "grows, by less than the margin"),  # and 90% inside ±0.05
    ([0.08, 0.10, 0.09, 0.11, 0.12], "shrinks"),
    ([0.01, -0.01, 0.0, 0.005, -0.005], "level"),  # 90% interval 0 ± 0.0075, inside ±0.05, 95% holds 0
    ([0.10, -0.10, 0.05, -0.05, 0.0], "not shown"),  # 90% interval 0 ± 0.075 reaches past the margin
    ([-0.06, 0.0, -0.03, -0.05, -0.01], "not shown"),  # below 0 at 90% (-0.03 ± 0.0243), not at 95% (± 0.0317)
    ([-0.10, -0.12, float("nan"), -0.09, -0.10], "not shown"),  # a run ended non-finite
])
def test_the_outcome_is_the_one_the_preregistration_names(settle, values, expected):
    assert settle.outcome(values) == expected
