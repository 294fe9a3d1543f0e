"""scripts/claim2_settle.py: the pre-registration's step swap gains a method's grid cells at R = 32
and 64, at its inner lr, once that method's search chooses an inner lr other than the grid's."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from isoloco.config import resolve, to_dict

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


#: The unigram baseline of the made-up runs' corpus.
UNIGRAM = 5.96


def write_long_run(settle, out: Path, method: str, workers: int, seed: int, losses: dict[int, float]) -> None:
    """A 960-step run as `isoloco train` leaves it, evaluated at the steps of `losses`; finished
    (summary.json) once it has reached step 960."""
    run = out / "long" / f"{method}-R{workers}" / f"{method}-R{workers}-H30-s{seed}"
    run.mkdir(parents=True)
    cfg = resolve("repro-cpu-r128", {"steps": 960, "method": method, "workers": workers, "inner_steps": 30,
                         "seed": seed})
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    records = [{"step": step, "tokens": step * 4096, "train_loss": 9.0, "val_loss": loss} for step, loss in losses.items()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    if 960 in losses:
        (run / "summary.json").write_text(json.dumps({"final_val_loss": losses[960], "unigram_baseline": UNIGRAM}))


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
    # Drawn at step 60, the one evaluation two seeds reached; the same runs draw the same bytes.
    png = (out / "long" / "contrast.png").read_bytes()
    assert png.startswith(b"\x89PNG") and "](contrast.png)" in table
    settle.write_contrast(out)
    assert (out / "long" / "contrast.png").read_bytes() == png


def test_no_contrast_is_drawn_before_two_seeds_reach_an_evaluation(settle, tmp_path):
    out = tmp_path / "out"
    for method, workers in (("isoloco", 128), ("diloco", 128), ("isoloco", 16), ("diloco", 16)):
        write_long_run(settle, out, method, workers, 1, {60: 4.5})
    settle.write_contrast(out)
    assert "| 60 | 1 | +0.0000 | — | — |" in (out / "long" / "contrast.md").read_text()
    assert not (out / "long" / "contrast.png").exists()


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


#: each swap cell's final loss before a test's per-seed offsets
SWAP_LOSSES = {"isoloco-R32-mu0.6-lr1.5": 4.50, "isoloco-R64-mu0.6-lr1.5": 4.60, "diloco-R32-mu0.6-lr1.0": 4.80,
               "diloco-R64-mu0.6-lr1.0": 4.85, "diloco-R32-mu0.6-lr0.7": 4.82, "diloco-R64-mu0.6-lr0.7": 4.95}


def write_swap_run(out: Path, cell: str, seed: int, loss: float) -> None:
    method, workers = cell.split("-")[:2]
    run = out / "swap" / cell / f"{method}-{workers}-H30-s{seed}"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"final_val_loss": loss}))


def test_the_swap_holds_dilocos_step_and_reads_the_change_as_preregistered(settle, tmp_path):
    """IsoLoCo 4.50 at R = 32 and 4.60 at 64; DiLoCo at lr 1.0 4.80 and 4.85, at lr 0.7 4.82 and 4.95,
    seed s adding 0.01 * s to DiLoCo at R = 64 only. Held at lr 1.0 the change is
    (4.60 - 4.85 - 0.01s) - (4.50 - 4.80) = 0.05 - 0.01s: 0.04, 0.03, 0.02 (mean 0.03, sd 0.01,
    t(0.975, 2) = 4.3027: half-width 0.024842; t = 5.196, p 0.0351); held at lr 0.7: (4.60 - 4.95 - 0.01s) -
    (4.50 - 4.82) = -0.03 - 0.01s: -0.04, -0.05, -0.06 (t = -8.660, p 0.0131). Both called: the switch is not the cause."""
    out = tmp_path / "out"
    for cell, loss in SWAP_LOSSES.items():
        for seed in (1, 2, 3):
            write_swap_run(out, cell, seed, loss + (0.01 * seed if cell.startswith("diloco-R64") else 0.0))
    held = {32: (1.0, 0.6), 64: (1.0, 0.6)}
    assert settle.swap_change(out / "swap", held) == pytest.approx({1: 0.04, 2: 0.03, 3: 0.02})
    settle.write_swap(out)
    table = (out / "swap" / "swap.md").read_text()
    assert "| lr 1.0 at both R | 3 (+0.0400, +0.0300, +0.0200) | +0.0300 | [+0.0052, +0.0548] | 0.0351 | called |" in table
    assert "| lr 0.7 at both R | 3 (-0.0400, -0.0500, -0.0600) | -0.0500 |" in table
    # the grid's pairing: (4.60 - 4.95 - 0.01s) - (4.50 - 4.80) = -0.05 - 0.01s
    assert "| the grid's: lr 1.0 at R = 32, 0.7 at R = 64 | 3 (-0.0600, -0.0700, -0.0800) | -0.0700 |" in table
    assert "the step switch is not its cause" in table


@pytest.mark.parametrize("called, reading", [
    ({"lr 1.0": True, "lr 0.7": True}, "the step switch is not its cause"),
    ({"lr 1.0": False, "lr 0.7": False}, "not shown apart from the step switch"),
    ({"lr 1.0": False, "lr 0.7": True}, "called only with DiLoCo's step held at lr 0.7"),
])
def test_the_swap_reading_is_the_preregistered_one(settle, called, reading):
    assert reading in settle.swap_reading(called)


def test_a_swap_seed_still_running_leaves_the_reading_to_come(settle, tmp_path):
    out = tmp_path / "out"
    for cell in SWAP_LOSSES:
        for seed in (1, 2) if cell == "isoloco-R64-mu0.6-lr1.5" else (1, 2, 3):
            write_swap_run(out, cell, seed, 4.5 + 0.01 * seed * (cell == "diloco-R64-mu0.6-lr0.7"))
    settle.write_swap(out)
    table = (out / "swap" / "swap.md").read_text()
    assert "| to come |" in table and "Reading: to come" in table and "called |" not in table


def test_a_swap_change_within_its_seeds_noise_is_not_called(settle, tmp_path):
    """As above, but DiLoCo at R = 64 with lr 0.7 off by +0.09, -0.05, +0.02 on seeds 1-3: held at
    lr 0.7 the change is -0.03 minus those, -0.12, +0.02, -0.05 (mean -0.05, sd 0.07, t = -1.237,
    p 0.342): not called, so the change is called with the step held at lr 1.0 only."""
    out = tmp_path / "out"
    offsets = {"diloco-R64-mu0.6-lr1.0": {1: 0.01, 2: 0.02, 3: 0.03}, "diloco-R64-mu0.6-lr0.7": {1: 0.09, 2: -0.05, 3: 0.02}}
    for cell, loss in SWAP_LOSSES.items():
        for seed in (1, 2, 3):
            write_swap_run(out, cell, seed, loss + offsets.get(cell, {}).get(seed, 0.0))
    settle.write_swap(out)
    table = (out / "swap" / "swap.md").read_text()
    assert "| lr 0.7 at both R | 3 (-0.1200, +0.0200, -0.0500) | -0.0500 |" in table
    assert "| 0.342 | not called |" in table and "| 0.0351 | called |" in table
    assert "called only with DiLoCo's step held at lr 1.0" in table


def test_the_long_runs_go_seed_by_seed_each_seeds_four_cells_first(settle, tmp_path):
    out = tmp_path / "out"
    finish_search(settle, out, "diloco", 0.004)
    finish_search(settle, out, "isoloco", 0.004)
    tasks, _ = settle.plan(out)
    long = [(task.out.name, task.seeds) for task in tasks if task.out.parent.name == "long"]
    cells = ["diloco-R16", "isoloco-R16", "diloco-R128", "isoloco-R128"]
    assert long == [(cell, str(seed)) for seed in range(1, 6) for cell in cells]
    assert all(task.ready() and "inner.lr=0.004" in " ".join(task.command(["isoloco"])) and "steps=960" in task.overrides
               for task in tasks if task.out.parent.name == "long")


def test_the_preregistered_test_joins_the_page_wide_adjustment_with_its_unrounded_p(settle, tmp_path, monkeypatch):
    """Five seeds at step 960 with d = -0.10, -0.12, -0.11, -0.09, -0.10 (IsoLoCo at R = 128 4.5 + d,
    the other three runs 4.5): mean -0.104, sd 0.0114018, t = -20.396 over 4 degrees of freedom, whose
    two-sided p is 1 - 1.5x + 0.5x^3 with x = |t| / sqrt(4 + t^2). The page quoting both of contrast.md's
    tables gains one paired test (its p unrounded, as the script computed it) and no contrast."""
    monkeypatch.chdir(tmp_path)
    out = Path("out")
    contrasts = (-0.10, -0.12, -0.11, -0.09, -0.10)
    for seed, d in enumerate(contrasts, start=1):
        for method, workers in (("isoloco", 128), ("diloco", 128), ("isoloco", 16), ("diloco", 16)):
            # every run above the unigram baseline (5.96) at step 60; one of them again at step 480
            diverged = {480: 6.2} if (method, workers, seed) == ("diloco", 16, 1) else {}
            write_long_run(settle, out, method, workers, seed,
                           {60: 6.5, **diverged, 960: 4.5 + (d if (method, workers) == ("isoloco", 128) else 0.0)})
    settle.write_contrast(out)
    table = (out / "long" / "contrast.md").read_text()
    assert ("Of the 20 finished runs, 20 were above their unigram baseline at an evaluation, 1 of them after their "
            "first evaluation: diloco-R16-H30-s1.") in table
    assert "**Outcome at step 960** (the pre-registered test, margin ±0.05): grows." in table
    assert "| 16, 128 | 30 | 5 | -0.1040 ± 0.0142 | [-0.1149, -0.0931] |" in table  # t(0.95, 4) = 2.1318
    spec = importlib.util.spec_from_file_location("claim_reports", SCRIPTS / "claim_reports.py")
    reports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reports)
    doc = Path("page.md")
    doc.write_text('<!-- table: out/long/contrast.md "The contrast at every evaluation" -->\n\n| x |\n\n'
                   '<!-- table: out/long/contrast.md "The pre-registered test at step 960" -->\n\n| x |\n')
    mean = sum(contrasts) / 5
    t = mean / math.sqrt(sum((d - mean) ** 2 for d in contrasts) / 4 / 5)
    x = abs(t) / math.sqrt(4 + t * t)
    [test] = reports.quoted_tests(doc)
    assert test["exact"] == pytest.approx(1 - 1.5 * x + 0.5 * x ** 3, rel=1e-9)
    assert (test["R"], test["seeds"], test["call"]) == ("16, 128", "5", "IsoLoCo's lead grows as R grows")
    assert reports.quoted_contrasts(doc) == []
    assert "1 paired tests in the compare tables the page quotes and its pre-registered tests" in (
        reports.page_tests_markdown(doc))
    assert "1 of them called" in reports.page_tests_markdown(doc)
