"""`isoloco launch` and what a run says: the job's own exit status and one line when a process
is lost, a dry run answered without processes, layouts in words, plain progress lines where no
terminal draws a bar, a finished run that is resumed."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from isoloco import launch
from isoloco.cli import _resume_command, main
from isoloco.config import resolve
from isoloco.errors import ConfigError
from helpers import ONE_THREAD_ENV, SMALL_ARGS

TINY_RUN = [*SMALL_ARGS, "steps=4", "inner_steps=2", "workers=2", "eval_every=4", "data.val_tokens=256"]


def test_a_dry_run_under_launch_prints_the_config_once_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda argv: pytest.fail("torchrun was started"))
    out = tmp_path / "run"
    assert main(["launch", "--nproc", "2", "--", "train", *TINY_RUN, "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\nmethod: isoloco\n") == 1
    assert f"# isoloco train would write {out}\n# layout: 2 workers on 2 processes, 1 worker per process\n" in printed
    assert not out.exists()


def test_help_under_launch_is_printed_once_without_processes(capsys, monkeypatch):
    monkeypatch.setattr(launch, "run_torchrun", lambda argv: pytest.fail("torchrun was started"))
    assert main(["launch", "--nproc", "2", "--", "train", "--help"]) == 0
    assert capsys.readouterr().out.count("usage: isoloco train") == 1


def test_a_layout_that_does_not_fit_is_refused_by_launch_in_one_line(tmp_path, capsys):
    assert main(["launch", "--nproc", "3", "--", "train", *TINY_RUN, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: workers=2 cannot be spread") and len(err.splitlines()) == 1


def failure(rank: int, exitcode: int, pid: int) -> tuple[int, ProcessFailure]:
    return rank, ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file="<N/A>")


def test_the_job_status_is_that_of_the_process_that_ended_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="isoloco")
    log = tmp_path / "launch.log"
    # In the same second (torchrun's resolution): rank 1 was killed, rank 0 stopped because of it
    # or was stopped by torchrun.
    for survivor in (3, -signal.SIGTERM):
        killed = ChildFailedError("isoloco", dict([failure(0, survivor, 40), failure(1, -signal.SIGKILL, 41)]))
        killed.failures[0].timestamp = killed.failures[1].timestamp
        assert launch._job_status(killed, log) == 3
        assert "rank 1 (pid 41) was killed by SIGKILL" in caplog.text and str(log) in caplog.text
        caplog.clear()
    hung = ChildFailedError("isoloco", dict([failure(0, 3, 40), failure(1, -signal.SIGKILL, 41)]))
    hung.failures[1].timestamp = hung.failures[0].timestamp + 30  # torchrun's SIGKILL, 30 s after
    assert launch._job_status(hung, log) == 3
    assert "rank 0 exited with status 3" in caplog.text
    caplog.clear()
    refused = ChildFailedError("isoloco", dict([failure(0, 2, 40), failure(1, 2, 41)]))
    assert launch._job_status(refused, log) == 2
    assert "rank 0 exited with status 2" in caplog.text


def test_peer_silence_is_an_option_of_its_own():
    cfg = resolve(None, {})
    assert (cfg.dist.peer_silence_s, cfg.dist.timeout_s) == (45.0, 600.0)
    with pytest.raises(ConfigError, match=r"dist.peer_silence_s=0.0 is not allowed: it must be > 0"):
        resolve(None, {"dist.peer_silence_s": 0.0})


def children_of(pid: int) -> dict[int, dict[str, str]]:
    """The processes whose parent is `pid`, with their environments."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                variables = (entry / "environ").read_bytes().decode().split("\0")
                found[int(entry.name)] = dict(item.split("=", 1) for item in variables if "=" in item)
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
    return found


@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_launched_job_with_status_3_and_a_few_lines(tmp_path):
    """Default dist settings: the job ends within 120 s, exit status 3, no torchrun traceback."""
    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "isoloco", "launch", "--nproc", "2", "--", "train", *SMALL_ARGS,
                            "steps=400", "inner_steps=5", "workers=2", "checkpoint_every=10", "--out", str(run),
                            "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ONE_THREAD_ENV)
    try:
        deadline = time.monotonic() + 180
        while not (run / "checkpoints" / "step_00000010").exists():
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.1)
        rank1 = next(pid for pid, env in children_of(job.pid).items() if env.get("RANK") == "1")
        killed = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        out, err = job.communicate(timeout=120)
        seconds = time.monotonic() - killed
    finally:
        job.kill()
    assert job.returncode == 3, err
    assert seconds < 120
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in err and "ChildFailedError" not in err, err
    assert f"rank 1 (pid {rank1}) was killed by SIGKILL" in lines[-1], err
    log = Path(lines[-1].rsplit("torchrun's output: ", 1)[1].rstrip(")"))
    assert "exitcode  : -9" in log.read_text()
    log.unlink()
    assert out == ""


@pytest.mark.multiprocess
def test_progress_is_plain_lines_when_the_output_is_not_a_terminal(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "isoloco", "train", *SMALL_ARGS, "steps=60", "inner_steps=5",
                           "workers=2", "eval_every=20", "--out", str(run)], capture_output=True, env=ONE_THREAD_ENV)
    assert done.returncode == 0, done.stderr
    written = done.stdout + done.stderr
    assert len(written) < 20_000 and b"\r" not in written
    progress = [line for line in done.stderr.decode().splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in progress] == [f"step {end}/60" for end in range(5, 61, 5)]
    assert progress[-1].startswith("step 60/60: loss ") and ", val " in progress[-1]


def test_resuming_a_finished_run_says_so_and_trains_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    metrics = (run / "metrics.jsonl").read_text()
    checkpoint = run / "checkpoints" / "step_00000004" / "state.json"
    written = checkpoint.stat().st_mtime_ns
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert f"{run} is already finished (its last checkpoint is at step 4 of 4): nothing to train" in captured.err
    assert (run / "metrics.jsonl").read_text() == metrics and checkpoint.stat().st_mtime_ns == written
    summary = json.loads((run / "summary.json").read_text())
    assert f"final validation loss {summary['final_val_loss']:.4f}" in captured.out


def test_the_watchdog_heartbeats_from_its_thread_and_names_a_silent_peer(monkeypatch):
    """A main thread busy for many silence periods (a checkpoint write) trips nothing; a peer
    whose heartbeats stop is named after `dist.peer_silence_s`."""
    import threading

    import torch.distributed as dist

    from isoloco.watchdog import PeerWatchdog

    stops: dict[int, str] = {}
    monkeypatch.setattr(PeerWatchdog, "_stop_process", lambda self, reason: stops.setdefault(self.rank, reason))
    store = dist.HashStore()
    watchdogs = [PeerWatchdog(store, rank, 2, silence_s=0.5) for rank in range(2)]
    for watchdog in watchdogs:
        watchdog.register()
    for watchdog in watchdogs:
        watchdog.start()
    threading.Event().wait(2.0)  # the main thread blocked for 4 silence periods
    assert stops == {}
    watchdogs[1].stop(done=False)  # rank 1 falls silent without saying it is done
    deadline = time.monotonic() + 5
    while 0 not in stops and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdogs[0].stop(done=True)
    assert stops[0] == "rank 1 stopped answering (no heartbeat for 0.5s): it died or hung (dist.peer_silence_s)"


def test_a_stopped_run_says_how_to_continue_it_on_its_processes(monkeypatch):
    run = Path("runs/r")
    assert _resume_command(run, 1) == "isoloco train --resume runs/r"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _resume_command(run, 2) == "isoloco launch --nproc 2 -- train --resume runs/r"
    assert _resume_command(run, 4).startswith("isoloco launch --nproc 2 --nnodes 2 --node-rank I --master-addr HOST")
