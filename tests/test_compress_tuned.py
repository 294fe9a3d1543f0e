"""scripts/compress_tuned.py: the seed-0 search picks the lowest loss, tries beyond an edge, and the
evaluation runs at the search's choice only once the search is complete."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def tuned(monkeypatch):
    spec = importlib.util.spec_from_file_location("compress_tuned", SCRIPTS / "compress_tuned.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while built
    spec.loader.exec_module(module)
    return module


def _finish(task, loss):
    run = task.runs()[0]
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"final_val_loss": loss}))


def test_a_best_at_the_grids_edge_is_searched_beyond_and_the_evaluation_waits(tuned, tmp_path):
    tasks, searches = tuned.plan(tmp_path, {"lowrank4"})
    search = next(s for s in searches if s.name == "diloco-lowrank4-R8")
    evaluation = next(t for t in tasks if t.search is search and t.seeds == "1,2,3")
    losses = {(0.7, 0.3): 4.87, (1.0, 0.3): 4.89, (1.5, 0.3): 4.92, (0.7, 0.6): 4.93, (1.0, 0.6): 5.12,
              (1.5, 0.6): float("nan")}  # a diverged point counts as the worst
    for task in search.grid:
        assert not evaluation.ready()
        _finish(task, losses[task.step])
    assert search.beyond() == (0.5, 0.3) and not evaluation.ready()

    tuned.extend(tasks, searches)
    added = search.grid[-1]
    assert added.step == (0.5, 0.3) and tasks[tasks.index(search.grid[-2]) + 1] is added
    assert "outer.lr=0.5" in added.overrides and "outer.momentum=0.3" in added.overrides
    _finish(added, 4.90)  # worse than lr 0.7: the best is inside the range now
    tuned.extend(tasks, searches)
    assert search.grid[-1] is added and search.complete() and evaluation.ready()
    command = evaluation.command(["isoloco"])
    assert command[command.index("outer.lr=0.7") - 1] == "outer.momentum=0.3"
    assert command[command.index("--seeds") + 1] == "1,2,3"
