"""isoloco.tuned: a search's ladder beyond an edge, a run held elsewhere, a search whose choice a
later search and the evaluation take (dp's inner lr before the outer step), and a driver that lays
its tasks out afresh as runs finish."""

import json

from isoloco import tuned
from isoloco.sweep import claim, release


def _finish(task, loss):
    run = task.runs()[0]
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"final_val_loss": loss}))


def test_the_ladder_goes_on_while_the_edge_keeps_winning_and_stops_at_its_end(tmp_path):
    search = tuned.Search(tmp_path, "sparseloco", "sparseloco", 8, "", "repro-cpu")
    for lr in (0.5, 1.0, 1.5, 2.0):
        _finish(search.add((lr, 0.0)), 5.0 - lr)  # the largest lr always wins
    seen = []
    while (step := search.beyond()) is not None:
        seen.append(step[0])
        _finish(search.add(step), 5.0 - step[0])
    assert seen == [v for v in tuned.LR_LADDER if v > 2.0] and search.chosen().step == (6.0, 0.0)
    assert search.complete()


def test_momentum_goes_past_its_edge_at_the_best_lr_only_when_asked(tmp_path):
    """A loss that falls with momentum up to 0.8 and is least at lr 1.0: the grid's best is
    (1.0, 0.6), at the momentum edge; with `momenta` the search tries 0.8 at lr 1.0, then the lrs
    beside 1.0 at 0.8 (its only lr there is an edge), then 0.9, and stops at (1.0, 0.8). Without,
    it stops at (1.0, 0.6)."""
    def loss(lr, mu):
        return 5.0 + abs(lr - 1.0) + abs(mu - 0.8)

    for momenta, expected in (((0.3, 0.6, 0.8, 0.9), [(1.0, 0.8), (0.7, 0.8), (1.5, 0.8), (1.0, 0.9)]), ((), [])):
        search = tuned.Search(tmp_path / str(len(momenta)), "", "isoloco", 16, "", "repro-cpu-r128",
                              momenta=momenta)
        for step in tuned.NESTEROV_STEPS:
            _finish(search.add(step), loss(*step))
        seen = []
        while (step := search.beyond()) is not None:
            seen.append(step)
            _finish(search.add(step), loss(*step))
        assert seen == expected and search.complete()
        assert search.chosen().step == ((1.0, 0.8) if momenta else (1.0, 0.6))


def test_a_run_another_process_holds_counts_as_running_elsewhere(tmp_path):
    task = tuned.Task(tmp_path / "isoloco-lowrank4-R8", "isoloco", 8, "1,2,3", "", "repro-cpu")
    assert not task.elsewhere()
    (task.out / "logs").mkdir(parents=True)
    lock = task.out / "logs" / "isoloco-R8-H30-s2.lock"
    held = claim(lock)  # as a sweep training seed 2 holds it
    assert task.elsewhere()
    release(lock, held, finished=False)
    assert not task.elsewhere() and lock.exists()  # free again, and a probe leaves the file


def test_a_search_that_needs_another_waits_for_it_and_takes_both_choices(tmp_path):
    inner = tuned.Search(tmp_path, "inner", "dp", 1, "", "wide", render=lambda lr, _: f"inner.lr={lr}",
                         label=lambda lr, _: f"lr{lr}", ladder=(0.004, 0.008, 0.016, 0.032, 0.064))
    for lr in (0.008, 0.016, 0.032):
        inner.add((lr, 0.0))
    assert [t.runs()[0].name for t in inner.grid] == ["dp-s0"] * 3  # dp's sweep names neither R nor H
    outer = tuned.Search(tmp_path, "", "isoloco", 128, "", "wide", needs=(inner,))
    for step in tuned.NESTEROV_STEPS:
        outer.add(step)
    evaluation = tuned.Task(tmp_path / "isoloco-R128", "isoloco", 128, "1,2,3", "", "wide", search=outer,
                            needs=(inner,))
    assert not any(t.ready() for t in outer.grid) and not evaluation.ready()
    for task, loss in zip(inner.grid, (5.1, 5.0, 5.2)):
        _finish(task, loss)
    assert inner.complete() and all(t.ready() for t in outer.grid) and not evaluation.ready()
    assert outer.grid[0].command(["isoloco"])[2:5] == ["wide", "inner.lr=0.016", "outer.optimizer=nesterov"]
    for task, loss in zip(outer.grid, (4.9, 4.8, 4.85, 5.0, 4.95, 5.3)):
        _finish(task, loss)
    assert outer.complete() and evaluation.ready()
    command = " ".join(evaluation.command(["isoloco"]))
    assert "inner.lr=0.016 outer.optimizer=nesterov outer.momentum=0.3 outer.lr=1.0" in command


def test_the_driver_lays_the_tasks_out_afresh_so_a_task_a_finished_run_calls_for_joins(tmp_path, monkeypatch):
    """With `replan`, a task the layout adds only once another task has finished is trained in the
    same drive, without a restart; without it, the first layout is all that runs."""
    first = tuned.Task(tmp_path / "first", "isoloco", 8, "0", "", "repro-cpu")
    follow = tuned.Task(tmp_path / "follow", "isoloco", 8, "1", "", "repro-cpu")

    def layout():
        return ([first, follow] if first.done() else [first]), []

    started = []

    class FinishedRun:
        """A stand-in for the sweep process: its runs are finished as it starts."""

        def __init__(self, command, **_):
            task = {str(t.out): t for t in (first, follow)}[command[command.index("--out") + 1]]
            started.append(task.out.name)
            for run in task.runs():
                run.mkdir(parents=True)
                (run / "summary.json").write_text(json.dumps({"final_val_loss": 5.0}))

        def poll(self):
            return 0

        returncode = 0

    monkeypatch.setattr(tuned.subprocess, "Popen", FinishedRun)
    monkeypatch.setattr(tuned.time, "sleep", lambda _: None)
    tasks, searches = layout()
    assert tuned.drive(tmp_path, tasks, searches, 1, lambda: None, replan=layout) == 0
    assert started == ["first", "follow"] and follow.done()
    # The same without replan stops after the first layout.
    other = tmp_path / "again"
    first.out, follow.out = other / "first", other / "follow"
    started.clear()
    tasks, searches = layout()
    assert tuned.drive(tmp_path, tasks, searches, 1, lambda: None) == 0
    assert started == ["first"] and not follow.done()


def test_the_driver_writes_its_selection_once_per_finished_run_not_every_poll(tmp_path, monkeypatch):
    """A sweep of two seeds polled many times while it trains: the selection is written at the
    start, after each of its runs finishes, and not in between."""
    task = tuned.Task(tmp_path / "cell", "isoloco", 8, "1,2", "", "repro-cpu")
    polls = []

    class TwoRuns:
        """A stand-in for the sweep: seed 1 finishes at its 3rd poll, seed 2 (and the sweep) at its 6th."""

        def __init__(self, command, **_):
            self.returncode = None

        def poll(self):
            polls.append(1)
            for run, at in zip(task.runs(), (3, 6)):
                if len(polls) == at:
                    run.mkdir(parents=True)
                    (run / "summary.json").write_text(json.dumps({"final_val_loss": 5.0}))
            self.returncode = 0 if len(polls) >= 6 else None
            return self.returncode

    monkeypatch.setattr(tuned.subprocess, "Popen", TwoRuns)
    monkeypatch.setattr(tuned.time, "sleep", lambda _: None)
    writes = []
    assert tuned.drive(tmp_path, [task], [], 1, lambda: writes.append(len(polls))) == 0
    assert len(polls) == 6 and writes == [0, 3, 6]
