"""What a run says about its synchronisation: the slow link's totals in summary.json and on the
final line (over processes and resumes), the start-up line's compression and overlap, and a
warning before training for a setting that wastes the run or does nothing."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from isoloco import checkpoint as ckpt
from isoloco.cli import main
from isoloco.config import resolve, run_warnings
from helpers import ONE_THREAD_ENV, SMALL_ARGS

TINY_RUN = [*SMALL_ARGS, "steps=4", "inner_steps=2", "workers=2", "eval_every=4", "data.val_tokens=256"]


def metrics_total(run: Path, key: str) -> float:
    """The sum of `key` over a run's metrics lines (the last line of each round holds it)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sum(line.get(key, 0.0) for line in lines)


def final_line(summary: dict) -> str:
    return (f"final validation loss {summary['final_val_loss']:.4f} (unigram baseline "
            f"{summary['unigram_baseline']:.4f}); {summary['cross_island_wire_bytes']:,} bytes across islands, "
            f"{summary['exposed_sync_seconds']:.2f} s of synchronisation exposed")


@pytest.mark.multiprocess
def test_a_two_process_run_sums_its_cross_island_bytes_and_exposed_seconds(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "isoloco", "launch", "--nproc", "2", "--", "train", *SMALL_ARGS,
                           "steps=6", "inner_steps=3", "workers=2", "eval_every=6", "method=isoloco", "--out",
                           str(run), "--quiet"], capture_output=True, text=True, env=ONE_THREAD_ENV, timeout=600)
    assert done.returncode == 0, done.stderr
    summary = json.loads((run / "summary.json").read_text())
    # Each process is an island and all-reduces its float32 sum of the model with the other's
    # once a round: a ring over 2 puts 2·(2 − 1)/2 of it on the wire, per process and round.
    rounds, processes = 2, 2
    assert summary["cross_island_wire_bytes"] == rounds * processes * 4 * summary["params"]
    # metrics.jsonl holds rank 0's exposed seconds of each round.
    assert summary["exposed_sync_seconds"] == pytest.approx(metrics_total(run, "sync_exposed_s"), rel=1e-9)
    assert summary["exposed_sync_seconds"] > 0
    assert done.stdout.splitlines()[-1] == final_line(summary)


def test_the_totals_survive_a_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "checkpoint_every=2", "--out", str(run), "--quiet"]) == 0
    whole = json.loads((run / "summary.json").read_text())
    assert whole["cross_island_wire_bytes"] == 0  # one process: no island to cross to
    assert whole["exposed_sync_seconds"] == pytest.approx(metrics_total(run, "sync_exposed_s"), rel=1e-9)
    # Resume from step 2: the total is the checkpoint's first round plus the retrained second.
    first, last = ckpt.list_checkpoints(run / "checkpoints")
    (run / "summary.json").unlink()
    shutil.rmtree(last)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["exposed_sync_seconds"] == pytest.approx(metrics_total(run, "sync_exposed_s"), rel=1e-9)
    assert resumed["exposed_sync_seconds"] > json.loads((first / "state.json").read_text())["exposed_sync_s"] > 0
    assert capsys.readouterr().out.splitlines()[-1] == final_line(resumed)


def test_the_start_up_line_names_compression_and_overlap_after_the_warnings(tmp_path, capsys):
    assert main(["train", *TINY_RUN, "method=diloco", "merge.quantize=int8", "merge.error_feedback=true",
                 "outer.overlap_steps=1", "outer.overlap_alpha=0.5", "dist.emulate_link=1,10", "--out",
                 str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("warning: outer.overlap_steps=1 with inner_steps=2 overlaps 0.50 of each round, more than the "
                      "1/6 measured as harmless (τ = 5 of H = 30); the loss worsens with τ/H and τ = 5 of H = 10 "
                      "ended above the unigram baseline: use outer.overlap_steps <= 0")
    assert err[1] == ("warning: dist.emulate_link=1,10 does nothing in this run: it delays the collectives between "
                      "islands, and this run is one island; launch several (e.g. isoloco launch --nproc 2 -- train "
                      "...) or drop it")
    assert err[2].startswith("diloco (merge mean, outer nesterov lr 0.7, inner adamw lr 0.016, merge.quantize=int8 "
                             "with error feedback, outer.overlap_steps=1 (α 0.5)): model tiny")


@pytest.mark.parametrize("overlap, inner_steps, warned", [(5, 30, False), (6, 30, True), (2, 12, False),
                                                         (3, 12, True), (5, 10, True), (0, 2, False)])
def test_overlap_beyond_a_sixth_of_the_round_is_warned_about(overlap, inner_steps, warned):
    cfg = resolve(None, {"outer.overlap_steps": overlap, "inner_steps": inner_steps})
    lines = run_warnings(cfg, islands=1)
    assert len(lines) == warned
    if warned:
        assert lines[0].startswith(f"outer.overlap_steps={overlap} with inner_steps={inner_steps} overlaps ")
        assert lines[0].endswith(f"use outer.overlap_steps <= {inner_steps // 6}")


def test_an_emulated_link_is_warned_about_only_without_a_second_island():
    cfg = resolve(None, {"dist.emulate_link": "0.1,20"})
    assert [line.split(" does nothing")[0] for line in run_warnings(cfg, islands=1)] == ["dist.emulate_link=0.1,20"]
    assert run_warnings(cfg, islands=2) == []
    assert run_warnings(resolve(None, {}), islands=1) == []
