"""What a run says about its synchronisation: the slow link's totals in summary.json and on the
final line (over processes and resumes), its bytes per round beside float32's (measured across
processes, modelled in one), the start-up line's settings of the synchronisation and the workers,
a warning before training for a setting that wastes the run or does nothing, and one when a
validation loss rises above the unigram baseline."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from isoloco import checkpoint as ckpt
from isoloco.cli import _recipe, main
from isoloco.config import resolve
from isoloco.config_checks import run_warnings
from isoloco.data.shards import TokenData
from helpers import ONE_THREAD_ENV, SMALL_ARGS

TINY_RUN = [*SMALL_ARGS, "steps=4", "inner_steps=2", "workers=2", "eval_every=4", "data.val_tokens=256"]


def metrics_total(run: Path, key: str) -> float:
    """The sum of `key` over a run's metrics lines (the last line of each round holds it)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sum(line.get(key, 0.0) for line in lines)


def final_line(summary: dict, where: str) -> str:
    across = f"{summary['cross_island_wire_bytes']:,} bytes across islands; " if summary["processes"] > 1 else ""
    return (f"final validation loss {summary['final_val_loss']:.4f} (unigram baseline "
            f"{summary['unigram_baseline']:.4f}); slow link {summary['slow_link_bytes_per_round']:,.0f} bytes per "
            f"process per round ({where}; float32 {summary['slow_link_float32_bytes_per_round']:,.0f}), "
            + ("no fewer than float32 (uncompressed)"
               if summary["slow_link_bytes_per_round"] == summary["slow_link_float32_bytes_per_round"]
               else f"{summary['slow_link_fewer_than_float32']:.1f}× fewer than float32") + f"; {across}"
            f"{summary['exposed_sync_seconds']:.2f} s of synchronisation exposed"
            + (f"; WARNING: above the unigram baseline from step {summary['above_unigram_baseline_at_step']} "
               f"(validation loss {summary['above_unigram_baseline_val_loss']:.4f} there)"
               if "above_unigram_baseline_at_step" in summary else ""))


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
    # Measured per process per round; float32's is the run's own.
    assert summary["slow_link_bytes_per_round"] == summary["slow_link_float32_bytes_per_round"] == 4 * summary["params"]
    assert summary["slow_link_bytes_source"] == "measured"
    assert done.stdout.splitlines()[-1] == final_line(summary, "measured for this layout")
    assert "no fewer than float32 (uncompressed)" in done.stdout.splitlines()[-1]


def test_the_totals_survive_a_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "checkpoint_every=2", "--out", str(run), "--quiet"]) == 0
    whole = json.loads((run / "summary.json").read_text())
    assert whole["cross_island_wire_bytes"] == 0  # one process: no island to cross to
    # Modelled for 2 islands of one worker: a float32 ring all-reduce of the model, 2·(2 − 1)/2 of it.
    assert whole["slow_link_bytes_per_round"] == whole["slow_link_float32_bytes_per_round"] == 4 * whole["params"]
    assert whole["slow_link_fewer_than_float32"] == 1 and whole["slow_link_bytes_source"] == "modelled"
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
    assert capsys.readouterr().out.splitlines()[-1] == final_line(resumed, "modelled for 2 islands of one worker each")
    assert {key: resumed[key] for key in whole if key.startswith("slow_link")} == {
        key: whole[key] for key in whole if key.startswith("slow_link")}


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
    assert err[2].startswith("diloco (merge mean, outer nesterov lr 0.7, inner adamw lr 0.016, merge.quantize=int8, "
                             "merge.error_feedback=true, outer.overlap_steps=1 (α 0.5)): model tiny")


@pytest.mark.parametrize("keys, said", [
    ({"merge.compress": "lowrank", "merge.compress_rank": 2}, "merge.compress=lowrank (low rank 2)"),
    ({"merge.compress": "topk", "merge.compress_density": 0.01, "merge.quantize": "int4"},
     "merge.compress=topk (top-k: density 0.01 of every 4096 entries), merge.quantize=int4"),
    ({"worker_speeds": "1,0.5", "merge.weighting": "tokens"}, "worker_speeds=1,0.5, merge.weighting=tokens"),
    ({"faults.late_rate": 0.3, "faults.late": "carry"}, "faults.late_rate=0.3 (late deltas carried, ×0.5 per round "
                                                         "waited)"),
    ({"faults.late_rate": 0.1}, "faults.late_rate=0.1 (late deltas dropped)")])
def test_the_start_up_line_names_every_setting_of_the_synchronisation_and_the_workers(keys, said):
    recipe = _recipe(resolve("quick", {"method": "diloco", **keys}))
    assert recipe == f"merge mean, outer nesterov lr 0.7, inner adamw lr 0.016, {said}"


def test_a_compressed_one_process_run_gives_its_modelled_bytes_beside_float32s(tmp_path, capsys):
    """int8 with three islands (R = 3): each island sends a third of its codes to each other one
    and gets the re-encoded total back, about a quarter of float32's ring."""
    assert main(["train", *TINY_RUN, "workers=4", "method=diloco", "merge.quantize=int8", "merge.error_feedback=true",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    float32 = 2 * (4 - 1) / 4 * 4 * summary["params"]
    assert summary["slow_link_float32_bytes_per_round"] == float32
    assert 3.5 < summary["slow_link_fewer_than_float32"] < 4 and summary["slow_link_bytes_source"] == "modelled"
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == final_line(summary, "modelled for 4 islands of one worker each") and "× fewer than float32" in line


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", [["method=isoloco", "merge.compress=lowrank", "merge.compress_rank=2",
                                      "merge.quantize=int8"], ["method=sparseloco"]])
def test_the_modelled_bytes_are_those_two_processes_measure(tmp_path, setting):
    """The simulator's figure for the 2 islands of 2 workers it plays (`islands=2`) is what 2
    processes of 2 workers, one island each, put on the wire (SparseLoCo: every worker's blob)."""
    run = [*SMALL_ARGS, "steps=4", "inner_steps=2", "workers=4", "islands=2", "eval_every=0", *setting, "--quiet",
           "--out"]
    done = subprocess.run([sys.executable, "-m", "isoloco", "launch", "--nproc", "2", "--", "train", *run,
                           str(tmp_path / "two")], capture_output=True, text=True, env=ONE_THREAD_ENV, timeout=600)
    assert done.returncode == 0, done.stderr
    assert main(["train", *run, str(tmp_path / "one")]) == 0
    measured, modelled = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("two", "one"))
    assert measured["slow_link_bytes_source"] == "measured" and modelled["slow_link_bytes_source"] == "modelled"
    for key in ("slow_link_bytes_per_round", "slow_link_float32_bytes_per_round"):
        assert measured[key] == modelled[key] > 0
    assert measured["slow_link_fewer_than_float32"] > 10


def test_a_validation_loss_above_the_unigram_baseline_is_warned_about_then_and_at_the_end(tmp_path, capsys,
                                                                                          monkeypatch):
    """With a baseline below any loss the model reaches: the first evaluation mid-run (step 2) may
    be above it while the model learns the token frequencies; the next (step 4) says so once."""
    monkeypatch.setattr(TokenData, "unigram_loss", property(lambda data: 0.5))
    assert main(["train", *TINY_RUN, "steps=6", "eval_every=2", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: step 4: validation loss ")
    assert "is above the unigram baseline 0.5000" in warned[0] and "known causes: learning rates" in warned[0]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    at_4 = next(line["val_loss"] for line in lines if line["step"] == 4)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["above_unigram_baseline_at_step"], summary["above_unigram_baseline_val_loss"]) == (4, at_4)
    assert captured.out.splitlines()[-1].endswith(
        f"; WARNING: above the unigram baseline from step 4 (validation loss {at_4:.4f} there)")


def test_a_first_evaluation_above_a_uniform_guess_is_warned_about_at_once(tmp_path, capsys, monkeypatch):
    """No model starts above ln V (here ln 512 = 6.2383): a first evaluation there has diverged."""
    from isoloco.trainer import Trainer

    losses = iter([6.3, 5.0, 5.0])
    monkeypatch.setattr(Trainer, "evaluate", lambda trainer: next(losses))
    monkeypatch.setattr(TokenData, "unigram_loss", property(lambda data: 5.5))
    assert main(["train", *TINY_RUN, "steps=6", "eval_every=2", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    (warned,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warned.startswith("warning: step 2: validation loss 6.3000 is above the unigram baseline 5.5000 (")
    assert "above even a uniform guess (ln 512 = 6.2383): the run diverged;" in warned
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["above_unigram_baseline_at_step"] == 2


def test_evaluating_only_at_the_end_warns_at_the_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(TokenData, "unigram_loss", property(lambda data: 0.5))
    assert main(["train", *TINY_RUN, "eval_every=0", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "val_loss" in line] == [4]
    assert "warning: step 4: validation loss" in capsys.readouterr().err


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
