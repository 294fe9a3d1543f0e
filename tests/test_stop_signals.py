"""Stop signals in `isoloco train` (issue 58): the first is acknowledged at once and the run stops
after the round's checkpoint, a second stops at once and says how to resume, Ctrl-C while the
command is still importing ends in one line, and a signal at any point after training began is
never taken for a start-up stop: during the final evaluation, the final save or after the loop,
the run completes, writes summary.json and says so."""

from __future__ import annotations

import builtins
import json
import os
import signal
import tomllib
from pathlib import Path

import pytest

from isoloco import checkpoint as ckpt
from isoloco.cli import main
from isoloco.trainer import Trainer

from test_new_user import TINY_RUN, Unhandled, sigterm_to_this_test  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]

ACKNOWLEDGED = ("{}: finishing the round, then writing a checkpoint and stopping; a second signal (Ctrl-C again) "
                "stops at once, losing the work since the last checkpoint")


def _signalled(monkeypatch, method: str, signum: int, when) -> None:
    """Make `Trainer.<method>` send `signum` to this process first when `when(trainer)` holds."""
    original = getattr(Trainer, method)

    def signalled(trainer, *args, **kwargs):
        if when(trainer):
            os.kill(os.getpid(), signum)
        return original(trainer, *args, **kwargs)

    monkeypatch.setattr(Trainer, method, signalled)


def _train(out: Path) -> int:
    return main(["train", *TINY_RUN, "--out", str(out), "--quiet"])


def _last_step(trainer: Trainer) -> bool:
    return trainer.step == trainer.cfg.train_steps


@pytest.mark.parametrize("method, signum", [
    ("evaluate", signal.SIGTERM), ("save", signal.SIGINT),
    # After the loop gave its handlers back (`summary` ends `Trainer.run`): once taken for a start-up
    # stop (SIGTERM: exit 143, no summary.json) or an interrupt (SIGINT: exit 130, no summary.json).
    ("summary", signal.SIGTERM), ("summary", signal.SIGINT),
])
def test_a_signal_at_the_end_of_a_run_lets_it_complete_and_says_so(tmp_path, capsys, monkeypatch,
                                                                    sigterm_to_this_test, method, signum):
    _signalled(monkeypatch, method, signum, _last_step)
    out = tmp_path / "run"
    assert _train(out) == 0
    captured = capsys.readouterr()
    name = signal.Signals(signum).name
    lines = [line for line in captured.err.splitlines() if not line.startswith("warning: ")]
    if method == "summary":
        assert lines == [f"{name} arrived as the run ended, after its final checkpoint: it is complete (nothing to "
                         "resume)"]
    else:
        assert lines == [ACKNOWLEDGED.format(name), f"{name} arrived during the last round: the run finished it and "
                                                    "wrote its final checkpoint, so it is complete (nothing to resume)"]
    assert f"results in {out}" in captured.out
    assert json.loads((out / "summary.json").read_text())["final_val_loss"] > 0
    assert ckpt.verify(ckpt.latest_checkpoint(out / "checkpoints"))["step"] == 4


def test_the_first_signal_is_acknowledged_at_once_and_the_run_stops_after_the_rounds_checkpoint(
        tmp_path, capsys, monkeypatch):
    _signalled(monkeypatch, "train_round", signal.SIGINT, lambda trainer: trainer.step == 0)
    out = tmp_path / "run"
    assert _train(out) == 128 + signal.SIGINT
    assert capsys.readouterr().err.splitlines() == [
        ACKNOWLEDGED.format("SIGINT"),
        f"stopped by SIGINT at step 2 after writing a checkpoint; continue with: isoloco train --resume {out}"]
    assert ckpt.verify(ckpt.latest_checkpoint(out / "checkpoints"))["step"] == 2
    assert not (out / "summary.json").exists()


def test_a_second_signal_stops_at_once_and_says_how_to_resume(tmp_path, capsys, monkeypatch):
    """Ctrl-C twice in the first round: no checkpoint yet, so a resume starts from the start."""
    train_round = Trainer.train_round

    def interrupted_twice(trainer, start, end):
        if start == 0:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return train_round(trainer, start, end)

    monkeypatch.setattr(Trainer, "train_round", interrupted_twice)
    out = tmp_path / "run"
    assert _train(out) == 130
    assert capsys.readouterr().err.splitlines() == [
        ACKNOWLEDGED.format("SIGINT"),
        "stopped at once by a second SIGINT, losing the work since the last checkpoint (or the start, before the "
        f"first); continue with: isoloco train --resume {out}"]
    assert not (out / "checkpoints").exists() and not (out / "summary.json").exists()


def test_ctrl_c_during_start_up_stops_at_once_saying_so(tmp_path, capsys, monkeypatch):
    building = Trainer.__init__

    def build_then_interrupted(trainer, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        building(trainer, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", build_then_interrupted)
    out = tmp_path / "run"
    assert _train(out) == 130
    assert capsys.readouterr().err.splitlines() == [
        "stopped by SIGINT during start-up, before training began: nothing was trained or written; run the same "
        "command to start it"]
    assert not out.exists()


def test_ctrl_c_while_the_command_imports_ends_in_one_line(capsys, monkeypatch):
    """The `isoloco` command goes through `isoloco.__main__.run`, which imports the commands (torch
    takes seconds): Ctrl-C there ends with status 130 and one line, not a traceback."""
    from isoloco.__main__ import run

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["isoloco"] == "isoloco.__main__:run"
    importing = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "isoloco.cli":
            raise KeyboardInterrupt
        return importing(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert run() == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]
