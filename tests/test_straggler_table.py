"""scripts/straggler_table.py: participation counted from the runs' metrics, and each cell taken
from the right paired test of the report."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def table(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports claim_reports from beside itself
    spec = importlib.util.spec_from_file_location("straggler_table", SCRIPTS / "straggler_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics(run: Path, rounds: list[tuple[list[int], int]]) -> None:
    run.mkdir(parents=True)
    lines = [{"step": 1, "round": 0, "train_loss": 9.0}]  # a step record: no participation
    lines += [{"step": 30 * (i + 1), "worker_steps": steps, "workers_merged": merged}
              for i, (steps, merged) in enumerate(rounds)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_participation_counts_the_steps_taken_and_the_deltas_merged(table, tmp_path):
    slow = [30, 8] * 4  # half the workers take 8 of 30 steps
    _metrics(tmp_path / "run", [(slow, 8), ([30] * 8, 5)])
    share, merged = table.participation(tmp_path / "run")
    assert share == pytest.approx((4 * 38 + 240) / (2 * 8 * 30))  # 392 of the 480 steps two rounds hold
    assert merged == 6.5
    _metrics(tmp_path / "old", [])
    assert table.participation(tmp_path / "old") is None


def test_the_cells_come_from_their_own_pair(table, tmp_path):
    label = table.straggler_label
    late, free = label("isoloco", rate=0.3, late="carry"), label("isoloco")
    drop = label("isoloco", rate=0.3, late="drop")
    view = tmp_path / table.VIEW
    view.mkdir()
    rows = [(f"{late} − {free}", "+0.0100 ± 0.0200", f"{free} lower"),
            (f"{late} − {drop}", "-0.0300 ± 0.0100", f"{late} lower"),
            (f"{late} − {free}", "+9.0000 ± 0.0100", f"{free} lower")]  # at another R: not this view's
    header = "| A − B | R | A − B (final loss) | call after BH |\n|---|---|---|---|\n"
    (view / "compare.md").write_text("## Every pair\n\n" + header + "".join(
        f"| {pair} | {8 if i < 2 else 16} | {difference} | {call} |\n" for i, (pair, difference, call) in
        enumerate(rows)))
    pairs = table.compare_rows(view, 8)
    names = {late: "late 30%, carried", free: "fault-free", drop: "late 30%, dropped"}
    assert table.difference_cell(pairs, late, free, names) == "+0.0100 ± 0.0200, fault-free lower"
    assert table.difference_cell(pairs, late, drop, names) == "-0.0300 ± 0.0100, late 30%, carried lower"
    assert table.difference_cell(pairs, drop, free, names) == "—"


def test_the_contrast_cell_comes_from_its_own_contrast(table, tmp_path):
    label = table.straggler_label
    view = tmp_path / table.VIEW
    view.mkdir()
    sections = []
    for setting, contrast, call in (({"rate": 0.1}, "+0.2000 ± 0.0500", "diloco x lower"),
                                    ({"rate": 0.3}, "-0.0100 ± 0.0900", "not distinguishable with 3 seeds")):
        heading = " − ".join(f"({label(m, **setting)} − {label(m)})" for m in ("isoloco", "diloco"))
        sections.append(f"## {heading}\n\n| R | H | seeds | contrast (final loss) | call |\n|---|---|---|---|---|\n"
                        f"| 16 | 30 | 3 | +9.0000 ± 0.1000 | x lower |\n| 8 | 30 | 3 | {contrast} | {call} |\n")
    (view / "contrast.md").write_text("# Contrasts\n\n" + "\n".join(sections))
    assert table.contrast_cell(view, {"rate": 0.1}) == "+0.2000 ± 0.0500, called"
    assert table.contrast_cell(view, {"rate": 0.3}) == "-0.0100 ± 0.0900, not distinguishable with 3 seeds"
    assert table.contrast_cell(view, {"rate": 0.3, "late": "carry"}) == "—"
