"""IsoLoCo inside torchft's DiLoCo: the simulator's numbers, and recovery of a killed group.

Replica groups are real processes talking through a torchft lighthouse and gloo on 127.0.0.1.
Select these tests with ``pytest -m torchft`` (they need the extra: ``pip install -e '.[torchft]'``).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from isoloco.config import TrainConfig, resolve
from isoloco.errors import ConfigError
from isoloco.data import load_token_data
from isoloco.merge import MergeConfig
from isoloco.model import build_model
from isoloco.outer import OuterConfig
from isoloco.torchft import RULE_FIT, outer_optimizer
from isoloco.trainer import Trainer

import helpers

pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")

from isoloco.torchft.replica import GroupRun, run_replica_group, start_lighthouse  # noqa: E402

pytestmark = [pytest.mark.torchft, pytest.mark.multiprocess]

# The simulator tests' tiny setting (tests/test_trainer.py): 2 workers, 3 outer steps.
TINY = {**helpers.SMALL, "steps": 6, "inner_steps": 2, "workers": 2, "eval_every": 6, "device": "cpu"}

#: Outer steps checked against the simulator: IsoLoCo exact and fast, both placements, and the mean.
EQUIVALENT = {
    "isoloco": {"method": "isoloco"},
    "isoloco_update": {"method": "isoloco", "outer.iso_placement": "update"},
    "isoloco_fast": {"method": "isoloco_fast"},
    "diloco": {"method": "diloco"},
}

INIT_SYNC = "init_sync"  # the first EQUIVALENT config with torchft's default init_sync=True
SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 300  # every process here finishes in well under a minute; this only bounds a hang


def config(**overrides) -> TrainConfig:
    return resolve(None, {**TINY, **overrides})


def _group(configs: dict[str, TrainConfig], replica: int, lighthouse: str, out: Path) -> None:
    """A replica group's process: train each config in turn (one process start for all), and
    the first once more with torchft's default init_sync=True."""
    torch.set_num_threads(1)
    for name, cfg in configs.items():
        run_replica_group(cfg, replica, lighthouse).save(out / f"{name}-{replica}")
    name, cfg = next(iter(configs.items()))
    run_replica_group(cfg, replica, lighthouse, init_sync=True).save(out / f"{INIT_SYNC}-{replica}")


def _join(processes: list, deadline_s: float = JOIN_S) -> None:
    """Wait for every process; kill any still running at the deadline and fail."""
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
    assert not hung, f"replica group process(es) {hung} did not finish within {deadline_s} s"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


@pytest.fixture(scope="module")
def torchft_runs(tmp_path_factory) -> dict[str, list[GroupRun]]:
    """Every `EQUIVALENT` config trained by 2 torchft replica groups (spawned once)."""
    out = tmp_path_factory.mktemp("torchft")
    configs = {name: config(**overrides) for name, overrides in EQUIVALENT.items()}
    load_token_data(next(iter(configs.values())).data)  # prepare the corpus before the groups read it
    server, address = start_lighthouse(min_replicas=2)
    groups = [SPAWN.Process(target=_group, args=(configs, r, address, out)) for r in range(2)]
    try:
        for group in groups:
            group.start()
        _join(groups)
    finally:
        server.shutdown()
    assert [g.exitcode for g in groups] == [0, 0]
    return {name: [GroupRun.load(out / f"{name}-{r}") for r in range(2)] for name in [*configs, INIT_SYNC]}


def simulate(tmp_path: Path, name: str) -> Trainer:
    simulator = Trainer(config(**EQUIVALENT[name]), tmp_path / name, progress=False)
    (tmp_path / name).mkdir()
    simulator.run()
    return simulator


@pytest.mark.parametrize("name", sorted(EQUIVALENT))
def test_torchft_diloco_equals_the_simulator(tmp_path, torchft_runs, name):
    simulator = simulate(tmp_path, name)
    groups = torchft_runs[name]
    for run in groups:
        assert run.steps == list(range(TINY["steps"])) and run.outer_steps == 3
        for (param_name, _), theta in zip(simulator.named_params, simulator.global_params, strict=True):
            assert relative_error(run.params[param_name], theta.detach()) <= 1e-5, param_name
    # Both groups hold the same θ, and it moved away from the initial weights.
    for param_name, value in groups[0].params.items():
        assert torch.equal(value, groups[1].params[param_name])
    cfg = config(**EQUIVALENT[name])
    initial = dict(build_model(cfg.model, load_token_data(cfg.data).vocab_size, cfg.seq_len, cfg.seed).named_parameters())
    assert all(relative_error(value, initial[n].detach()) > 1e-3 for n, value in groups[0].params.items()
               if value.ndim == 2)


def test_torchft_default_init_sync_makes_the_first_round_group_0s_alone(tmp_path, torchft_runs):
    # With init_sync=True the first synchronisation copies group 0's state (its trained
    # weights included) into group 1, so both send group 0's pseudo-gradient: far from the
    # simulator's first outer step, which merges both workers'.
    name = next(iter(EQUIVALENT))
    simulator = simulate(tmp_path, name)
    run = torchft_runs[INIT_SYNC][0]
    assert run.steps == list(range(TINY["steps"]))
    errors = [relative_error(run.params[n], theta.detach())
              for (n, _), theta in zip(simulator.named_params, simulator.global_params)]
    assert statistics.median(errors) > 0.1


def test_rules_that_need_more_than_the_mean_are_refused_in_one_line():
    params = [("w", torch.nn.Parameter(torch.zeros(2, 2)))]
    for rule, reason in RULE_FIT.items():
        merge = MergeConfig(rule=rule)
        if reason is None:
            assert isinstance(outer_optimizer(params, merge, OuterConfig()), torch.optim.Optimizer)
            continue
        with pytest.raises(ConfigError) as error:
            outer_optimizer(params, merge, OuterConfig())
        assert f"merge.rule={rule} does not fit" in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------------------ the fault

FAULT = {"method": "isoloco", "steps": 8}  # 4 outer steps of H = 2
KILL_AT = 2  # replica group 1 dies after this step: the middle of round 1
HEALED = 3  # the survivor's step whose synchronisation brings group 1 back


def _save_theta(out: Path, name: str, model: torch.nn.Module) -> None:
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"{name}.safetensors")


class _Survivor:
    """Keeps θ after the synchronisation at which the restarted group comes back."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        if step == HEALED:
            _save_theta(self.out, "survivor", model)


class _Killed:
    """The first life of replica group 1: SIGKILL mid-round, as a crashed machine."""

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        if step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class _Restarted:
    """The second life: keeps θ after the synchronisation that ends its first round (its own,
    from step 0), where it heals from the survivor."""

    def __init__(self, out: Path, inner_steps: int) -> None:
        self.out = out
        self.inner_steps = inner_steps
        self.trained = 0

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        self.trained += 1
        if self.trained == self.inner_steps:
            _save_theta(self.out, "restarted", model)


def _fault_group(cfg: TrainConfig, replica: int, lighthouse: str, out: Path, on_step, name: str) -> None:
    torch.set_num_threads(1)
    run_replica_group(cfg, replica, lighthouse, on_step=on_step).save(out / name)


def test_a_killed_group_recovers_through_torchft(tmp_path):
    cfg = config(**FAULT)
    load_token_data(cfg.data)
    # A quorum needs both groups, so the survivor's round 1 waits for the restarted group rather
    # than racing it (with min_replicas=1 it would commit alone and be rejoined a round later);
    # the killed one counts as gone 1 s after its last heartbeat.
    server, address = start_lighthouse(min_replicas=2, heartbeat_timeout_ms=1000)

    def start(replica: int, on_step, name: str):
        process = SPAWN.Process(target=_fault_group, args=(cfg, replica, address, tmp_path, on_step, name))
        process.start()
        return process

    processes = []
    try:
        processes.append(start(0, _Survivor(tmp_path), "survivor"))
        processes.append(start(1, _Killed(), "killed"))
        _join(processes[1:])
        assert processes[1].exitcode == -signal.SIGKILL
        processes.append(start(1, _Restarted(tmp_path, cfg.inner_steps), "restarted"))
        _join(processes)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        server.shutdown()
    assert [p.exitcode for p in processes] == [0, -signal.SIGKILL, 0]
    survivor, restarted = GroupRun.load(tmp_path / "survivor"), GroupRun.load(tmp_path / "restarted")
    # The survivor trained every step once, committed every outer step, at a finite loss.
    assert survivor.steps == list(range(8)) and survivor.outer_steps == 4
    assert all(math.isfinite(loss) for loss in survivor.losses + restarted.losses)
    # The restarted group trained one round of its own (discarded), recovered the survivor's
    # state at the synchronisation after HEALED and continued at the survivor's step.
    assert restarted.steps == [0, 1, 4, 5, 6, 7] and restarted.outer_steps == 4
    healed = load_file(tmp_path / "restarted.safetensors"), load_file(tmp_path / "survivor.safetensors")
    for name, value in healed[0].items():
        assert torch.equal(value, healed[1][name]), name
    for name, value in restarted.params.items():
        assert torch.equal(value, survivor.params[name]) and torch.isfinite(value).all(), name
