"""Crash safety: signals checkpoint and exit, damaged or partial checkpoints are never used,
a full disk keeps the previous checkpoint, resumes always end with the same numbers."""

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from isoloco import checkpoint as ckpt
from isoloco.config import parse_overrides, resolve
from isoloco.errors import ConfigError, NonFiniteDeltaError
from isoloco.trainer import Trainer
from helpers import ONE_THREAD_ENV, SMALL_ARGS, final_params

RUN = [*SMALL_ARGS, "steps=30", "inner_steps=5", "workers=2", "eval_every=20", "checkpoint_every=10",
       "method=isoloco"]
ENV = ONE_THREAD_ENV


def train_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "isoloco", "train", *args, "--quiet"], capture_output=True,
                          text=True, env=ENV)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    done = train_cli(*RUN, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def assert_same_result(run: Path, reference: Path) -> None:
    summary = lambda r: json.loads((r / "summary.json").read_text())
    assert summary(run)["final_val_loss"] == summary(reference)["final_val_loss"]
    ours, theirs = final_params(run), final_params(reference)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_writes_a_checkpoint_and_exits_cleanly(tmp_path, reference, signum):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "isoloco", "train", *RUN, "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.05)
    while time.time() < deadline and not (out / "metrics.jsonl").read_text().strip():
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "--resume" in err
    stopped_at = ckpt.verify(ckpt.latest_checkpoint(out / "checkpoints"))["step"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == stopped_at, "the checkpoint holds every finished step"
    resumed = train_cli("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_result(out, reference)


@pytest.mark.multiprocess
def test_partial_and_damaged_checkpoints_are_skipped(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)  # the same finished run: trained once, in the fixture
    checkpoints = ckpt.list_checkpoints(out / "checkpoints")
    assert len(checkpoints) == 2  # keep_checkpoints
    # A run killed while writing leaves a temporary directory; damage the newest one too.
    (out / "checkpoints" / ".tmp-step_00000070-123").mkdir()
    (out / "checkpoints" / ".tmp-step_00000070-123" / "global.safetensors").write_bytes(b"partial")
    newest = checkpoints[-1] / "global.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    (out / "summary.json").unlink()
    resumed = train_cli("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert "checksum does not match" in resumed.stdout + resumed.stderr
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert_same_result(out, reference)


def test_a_resume_whose_every_checkpoint_is_damaged_stops_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from isoloco import launch
    from isoloco.cli import main

    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert main(["train", *SMALL_ARGS, "steps=4", "inner_steps=2", "workers=2", "eval_every=4", "checkpoint_every=2",
                 "--out", str(out), "--quiet"]) == 0
    older, newest = ckpt.list_checkpoints(root)
    theta = bytearray((newest / "global.safetensors").read_bytes())
    theta[-1] ^= 0xFF
    (newest / "global.safetensors").write_bytes(bytes(theta))
    (older / "state.json").write_text("{")
    before = {path: path.read_bytes() if path.is_file() else None for path in out.rglob("*")}
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: every checkpoint in {root} is damaged ("), err
    assert f"{newest}: global.safetensors is missing or its checksum does not match" in err[0]
    assert f"{older}: state.json is damaged" in err[0]
    assert err[0].endswith(f"nothing was resumed; to start over from step 0, delete {root} or train into a new --out")
    # `isoloco launch` refuses it alike, before torchrun starts a process.
    monkeypatch.setattr(launch, "run_torchrun", lambda argv: pytest.fail("torchrun was started"))
    assert main(["launch", "--nproc", "2", "--", "train", "--resume", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines() == err
    # No checkpoint, metrics line or summary was written or changed.
    assert {path: path.read_bytes() if path.is_file() else None for path in out.rglob("*")} == before


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = resolve(None, parse_overrides(RUN))
    out = tmp_path / "run"
    out.mkdir()
    real_save = ckpt.write_safetensors
    calls = []

    def save_until_full(path, tensors):
        calls.append(path)
        if len(calls) > 3:  # the second checkpoint (3 tensor files each) hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(path, tensors)

    monkeypatch.setattr(ckpt, "write_safetensors", save_until_full)
    trainer = Trainer(cfg, out, progress=False)
    with pytest.raises(ckpt.CheckpointError, match="No space left on device.*step_00000010 is intact"):
        trainer.run()
    remaining = ckpt.list_checkpoints(out / "checkpoints")
    assert [p.name for p in remaining] == ["step_00000010"]
    ckpt.verify(remaining[0])
    assert not list((out / "checkpoints").glob(".tmp-*"))


def poison(trainer: Trainer, worker_index: int, round_start: int) -> Trainer:
    """Make one worker's pseudo-gradient NaN in one round, as a diverged worker's would be."""

    def spoil(worker, start, end):
        if worker.index == worker_index and start == round_start:
            worker.delta[0].fill_(float("nan"))

    trainer.after_turn.append(spoil)
    return trainer


def small_trainer(tmp_path: Path, **overrides) -> Trainer:
    cfg = resolve(None, {**parse_overrides(RUN), "workers": 4, "steps": 20, **overrides})
    out = tmp_path / "run"
    out.mkdir()
    return Trainer(cfg, out, progress=False)


def test_bad_worker_error_names_round_worker_and_parameter(tmp_path):
    trainer = poison(small_trainer(tmp_path), worker_index=1, round_start=10)
    with pytest.raises(NonFiniteDeltaError) as raised:
        trainer.run()
    message = str(raised.value)
    assert "worker 1" in message and "round 2" in message and trainer.named_params[0][0] in message
    newest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.verify(newest)["step"] == 10


@pytest.mark.slow
def test_bad_worker_drop_merges_the_others_and_resets_it(tmp_path):
    trainer = poison(small_trainer(tmp_path, on_bad_worker="drop"), worker_index=1, round_start=10)
    trainer.run()
    assert all(torch.isfinite(p).all() for p in trainer.global_params)
    assert trainer.last_val_loss is not None and trainer.last_val_loss == trainer.last_val_loss
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dropped = {r["step"]: r["dropped_workers"] for r in records if "dropped_workers" in r}
    assert dropped == {15: [1]}


def test_dropped_round_equals_merging_the_other_workers(tmp_path):
    """The round that drops worker 1 applies exactly the merge of workers 0, 2 and 3."""
    trainer = poison(small_trainer(tmp_path, on_bad_worker="drop", steps=5,
                                   **{"merge.rule": "ties", "outer.optimizer": "sgd", "outer.momentum": 0.0}),
                     worker_index=1, round_start=0)
    captured = {}
    outer = trainer.algorithm.outer
    original_start = outer.start

    def start(local_deltas, round, participation=None, **options):
        captured["deltas"] = {k: [d.clone() for d in v] for k, v in local_deltas.items()}
        captured["ids"] = list(participation.arrived)
        return original_start(local_deltas, round, participation=participation, **options)

    outer.start = start
    before = [p.detach().clone() for p in trainer.global_params]
    trainer.run()
    assert captured["ids"] == [0, 2, 3]
    from isoloco.merge_functions import ties
    lr = trainer.cfg.outer.lr
    for (name, _), old, new in zip(trainer.named_params, before, trainer.global_params):
        arrived = [captured["deltas"][name][i] for i in captured["ids"]]
        expected = old - lr * ties(arrived, density=trainer.cfg.merge.density)
        assert torch.allclose(new, expected, rtol=1e-5, atol=1e-7), name


def test_error_feedback_loses_nothing_when_a_worker_is_dropped(tmp_path):
    """The error-feedback ledger with a dropped worker: over every round, Σ delivered + Σ residuals
    = Σ meant (the deltas of the workers merged), in float64. Four workers, int4 on the exchange
    route (every island owns a chunk of the total), worker 1 dropped in round 1: it sent nothing,
    so its residual (what earlier rounds lost, and this round's owner rounding) stays, and is sent
    later. Zeroing it would lose that for good."""
    from isoloco.sync.handles import Sync

    trainer = poison(small_trainer(tmp_path, on_bad_worker="drop", steps=20, inner_steps=5,
                                   **{"method": "diloco", "merge.quantize": "int4", "merge.error_feedback": True}),
                     worker_index=1, round_start=5)
    merger, names = trainer.algorithm.outer.merger, [name for name, _ in trainer.named_params]
    meant = {name: 0 for name in names}
    delivered = {name: 0 for name in names}
    arrivals = []
    original = merger.start

    def start(local_deltas, *args, participation=None, **options):
        arrived = participation.arrived
        arrivals.append(arrived)
        for name, deltas in local_deltas.items():
            meant[name] = meant[name] + sum(deltas[w].double() for w in arrived)
        sync = original(local_deltas, *args, participation=participation, **options)

        def steps():
            merged = yield from sync.steps
            for name in names:
                delivered[name] = delivered[name] + merged[name].double() * len(arrived)
            return merged

        return Sync(steps(), sync.stages)

    merger.start = start
    trainer.run()
    assert arrivals == [(0, 1, 2, 3), (0, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)]
    dropped = trainer.algorithm.workers[1].residual
    assert all(torch.isfinite(r).all() for r in dropped) and any(r.abs().sum() > 0 for r in dropped)
    for index, name in enumerate(names):
        kept = sum(worker.residual[index].double() for worker in trainer.algorithm.workers)
        scale = meant[name].abs().max()
        assert (delivered[name] + kept - meant[name]).abs().max() <= 1e-5 * scale, name


@pytest.mark.parametrize("change, message", [
    (("workers: 2", "workers: 4"), "resume with the same number of workers"),
    (("vocab_size: 512", "vocab_size: 640"), "another model or vocabulary"),
])
@pytest.mark.multiprocess
def test_resume_of_a_different_run_is_refused_with_one_line(tmp_path, reference, change, message):
    out = tmp_path / "run"
    shutil.copytree(reference, out)  # a finished run of RUN, as training one here would be
    config = out / "config.yaml"
    config.write_text(config.read_text().replace(*change))
    resumed = train_cli("--resume", str(out))
    assert resumed.returncode == 2
    assert message in resumed.stderr and len(resumed.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("method", ["dp", "isoloco"])
def test_drop_is_refused_with_several_processes(method):
    from types import SimpleNamespace

    from isoloco.algorithms import build_algorithm

    workers = 1 if method == "dp" else 2  # dp trains one model and refuses more
    cfg = resolve(None, {**parse_overrides(RUN), "method": method, "workers": workers, "on_bad_worker": "drop"})
    with pytest.raises(ConfigError, match="on_bad_worker=drop works in a single process only"):
        build_algorithm(cfg, [], SimpleNamespace(world_size=2), None, torch.device("cpu"), torch.device("cpu"))
