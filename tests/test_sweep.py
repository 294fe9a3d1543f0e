"""`isoloco sweep`: the grid, input errors before any run, kill-and-rerun, finished runs skipped."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from isoloco.cli import main
from isoloco.config import parse_overrides, resolve
from isoloco.sweep import Grid, build_grid, job_environments, plan_runs, sweep_manifest

TINY = ["model=tiny", "seq_len=32", "global_batch=8", "steps=6", "data.vocab_size=512", "data.val_tokens=1024",
        "eval_every=3", "checkpoint_every=3"]


def _sweep_args(out: Path, *extra: str) -> list[str]:
    return ["sweep", *TINY, "--methods", "dp,diloco", "--workers", "2", "--inner-steps", "3", "--out", str(out),
            *extra]


def _write_preset(path: Path, sweep: dict) -> Path:
    path.write_text(yaml.safe_dump({"model": "tiny", "global_batch": 16, "steps": 60, "sweep": sweep}))
    return path


def test_grid_from_the_preset_section_with_flags_replacing_an_axis(tmp_path):
    preset = str(_write_preset(tmp_path / "grid.yaml", {"methods": ["dp", "isoloco"], "workers": [1, 2, 4],
                                                        "inner_steps": [60, 30], "seeds": "0,1"}))
    grid = build_grid(preset, {}, {"methods": None, "workers": "4,2,4", "inner_steps": None, "seeds": None})
    assert grid.workers == [4, 2] and grid.inner_steps == [60, 30] and grid.seeds == [0, 1]
    runs = plan_runs(preset, [], grid)
    names = [r.name for r in runs]
    # dp once per seed, with the smallest H; seeds outermost so a partial sweep has whole seeds.
    assert names[:5] == ["dp-s0", "isoloco-R4-H60-s0", "isoloco-R4-H30-s0", "isoloco-R2-H60-s0", "isoloco-R2-H30-s0"]
    assert len(names) == 10 and names[5] == "dp-s1"
    dp = runs[0]
    assert dp.config["algorithm"] == "dp" and dp.config["inner_steps"] == 30 and dp.config["workers"] == 1
    assert runs[1].items[0] == preset and "workers=4" in runs[1].items and runs[1].config["steps"] == 60


@pytest.mark.parametrize("preset, count", [("repro-cpu", 26), ("repro-cpu-h", 9), ("paper-178m", 89),
                                           ("paper-512m", 25), ("paper-1b", 7)])
def test_shipped_sweep_presets_validate_every_run(preset, count):
    runs = plan_runs(preset, [], build_grid(preset, {}, dict.fromkeys(["methods", "workers", "inner_steps", "seeds"])))
    assert len(runs) == count and runs[0].name == "dp-s0"
    assert resolve(preset, {}).method == "isoloco"  # `isoloco train PRESET` ignores the sweep section


def test_axes_default_to_the_resolved_config(tmp_path):
    grid = build_grid(None, parse_overrides(["steps=6"]), dict.fromkeys(["methods", "workers", "inner_steps", "seeds"]))
    assert (grid.methods, grid.workers, grid.inner_steps, grid.seeds) == (["isoloco"], [4], [30], [0])


def test_jobs_split_the_cores_or_take_one_gpu_each():
    cpu = job_environments(2, [], cores=8, environ={"PATH": "/bin"})
    assert [e["OMP_NUM_THREADS"] for e in cpu] == ["4", "4"] and "CUDA_VISIBLE_DEVICES" not in cpu[0]
    assert job_environments(3, [], cores=2, environ={})[0]["OMP_NUM_THREADS"] == "1"
    assert job_environments(2, [], cores=8, environ={"OMP_NUM_THREADS": "3"})[1]["OMP_NUM_THREADS"] == "3"
    gpu = job_environments(3, ["4", "6"], cores=16, environ={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["4", "6", "4"]


@pytest.mark.parametrize("extra, needle", [
    (["--methods", "dp,nope"], "unknown method 'nope'"),
    (["--workers", "0"], "--workers: 0 is not allowed"),
    (["--workers", "2,x"], "--workers: 'x' is not an integer"),
    (["--workers", "3"], "run diloco-R3-H3-s0: global_batch=8 is not divisible by workers=3"),
    (["workers=4"], "workers=4 is a sweep axis: use --workers 4"),
    (["--jobs", "0"], "--jobs 0 is not allowed"),
    (["wrkers=4"], "unknown key 'wrkers'"),
    (["steps=100000"], "run dp-s0: 100000 steps x global_batch 8"),
])
def test_bad_input_exits_2_with_one_line_before_any_run(tmp_path, capsys, extra, needle):
    out = tmp_path / "sweep"
    assert main(_sweep_args(out, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err, err
    assert len(err.splitlines()) == 1
    assert not out.exists()


def test_bad_preset_section_exits_2(tmp_path, capsys):
    preset = _write_preset(tmp_path / "bad.yaml", {"methods": ["dp"], "worker": [2]})
    assert main(["sweep", str(preset), "--out", str(tmp_path / "s")]) == 2
    assert "unknown key sweep.worker" in capsys.readouterr().err


def test_a_directory_trained_with_another_config_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    (out / "dp-s0").mkdir(parents=True)
    (out / "dp-s0" / "config.yaml").write_text("method: dp\nalgorithm: dp\nsteps: 999\n")
    assert main(_sweep_args(out)) == 2
    assert "dp-s0 was trained with another config" in capsys.readouterr().err


def _mtimes(out: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in sorted(out.glob("*/summary.json"))}


@pytest.mark.multiprocess
def test_killed_sweep_finishes_on_rerun_without_redoing_finished_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sweep = subprocess.Popen([sys.executable, "-m", "isoloco", *_sweep_args(out, "--jobs", "1", "--no-report")],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "dp-s0" / "summary.json"
    deadline = time.monotonic() + 120
    while not first.exists() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.exists(), "the first run did not finish"
    sweep.send_signal(signal.SIGKILL)  # no chance to clean up; its running child is orphaned
    sweep.wait()
    before = _mtimes(out)
    first_bytes = first.read_bytes()

    # The same command again: it waits for an orphan still holding a run, trains what is left,
    # and leaves the finished run alone.
    assert main(_sweep_args(out, "--jobs", "1")) == 0
    after = _mtimes(out)
    assert set(after) == {"dp-s0", "diloco-R2-H3-s0"}
    assert {k: after[k] for k in before} == before and first.read_bytes() == first_bytes
    steps = [int(line.split('"step": ')[1].split(",")[0])
             for line in (out / "diloco-R2-H3-s0" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], "a run must not be trained twice into one directory"
    assert not (out / "logs" / "diloco-R2-H3-s0.lock").exists(), "a finished run keeps no lock file"
    assert (out / "results.csv").read_text().count("\n") == 3

    # A run killed after its last checkpoint but before summary.json is resumed, not redone.
    (out / "diloco-R2-H3-s0" / "summary.json").unlink()
    capsys.readouterr()
    assert main(_sweep_args(out, "--dry-run")) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split()[:2] == ["dp-s0", "finished"]
    assert listing[1].split()[:2] == ["diloco-R2-H3-s0", "resume"] and "--resume" in listing[1]
    assert main(_sweep_args(out, "--jobs", "1", "--no-report")) == 0
    assert (out / "diloco-R2-H3-s0" / "summary.json").exists()
    assert _mtimes(out)["dp-s0"] == before["dp-s0"]
    assert len((out / "diloco-R2-H3-s0" / "metrics.jsonl").read_text().splitlines()) == 6


def test_the_manifest_keeps_the_seeds_of_earlier_sweeps_of_the_same_grid(tmp_path):
    """Seeds swept a few at a time into one directory all stay listed; another grid replaces the record."""
    path = tmp_path / "sweep.yaml"
    grid = lambda seeds: Grid(methods=["diloco"], workers=[16], inner_steps=[30], seeds=seeds)
    first = sweep_manifest(path, "repro-cpu-r128", ["steps=960"], grid([1]))
    assert first == {"preset": "repro-cpu-r128", "overrides": ["steps=960"], "methods": ["diloco"], "workers": [16],
                     "inner_steps": [30], "seeds": [1]}
    path.write_text(yaml.safe_dump(first, sort_keys=False))
    assert sweep_manifest(path, "repro-cpu-r128", ["steps=960"], grid([3, 1, 2]))["seeds"] == [1, 3, 2]
    for other in (sweep_manifest(path, "repro-cpu-r128", ["steps=480"], grid([2])),
                  sweep_manifest(path, "repro-cpu-r128", ["steps=960"],
                                 Grid(methods=["isoloco"], workers=[16], inner_steps=[30], seeds=[2]))):
        assert other["seeds"] == [2]
