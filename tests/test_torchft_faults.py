"""A replica group SIGKILLed mid-round under torchft, for every rule (`FAULT_METHODS`): the
survivor merges alone, the restarted group heals from it, and every committed round equals the
simulator's partial merge of the groups that committed it.

Replica groups are real processes talking through a torchft lighthouse and gloo on 127.0.0.1
(they need the extra: ``pip install -e '.[torchft]'``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from isoloco.comm import LocalCommunicator
from isoloco.train_config import TrainConfig
from isoloco.data import load_token_data
from isoloco.merge_config import Participation
from isoloco.model import build_model
from isoloco.outer import OuterStep

pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")

from isoloco.torchft.replica import GroupRun, model_fragments, run_replica_group, start_lighthouse  # noqa: E402
from torchft_groups import HEARTBEAT_MS, JOIN_S, SPAWN, config, join_groups, record_synchronisations  # noqa: E402

pytestmark = [pytest.mark.torchft, pytest.mark.multiprocess]

FAULT = {"steps": 8}  # 4 outer steps of H = 2
KILL_AT = 2  # replica group 1 dies after this step: the middle of round 1
ALONE = 3  # the survivor's step whose synchronisation it commits alone: the end of round 1
#: The groups each round merges: both; the survivor alone while group 1 is dead; both again
#: from round 2, where group 1's second life heals from the survivor.
QUORUMS = {0: [0, 1], 1: [0], 2: [0, 1], 3: [0, 1]}
REJOIN = 2
#: Every rule. `make test` runs one per way a synchronisation goes through torchft: Iso-C on
#: torchft's all-reduce of the mean, DARE merged in the quorum (its masks drawn from the step, so
#: a recovered group must draw the survivor's) and Iso-CTS (two stages in the quorum); the mean
#: (Iso-C's path, another outer step), TIES and TSV (DARE's path, no state of their own) are nightly.
FAULT_METHODS = ["isoloco", "dare", "isocts",
                 *(pytest.param(method, marks=pytest.mark.nightly) for method in ("diloco", "ties", "tsv"))]


def _meet(out: Path, mine: str, theirs: str) -> None:
    """Say `mine` and wait until the other process has said `theirs` (files in `out`): a group
    heartbeating to the lighthouse is waited for by a quorum, so this orders who joins which."""
    (out / mine).touch()
    _await(out, theirs)


def _await(out: Path, theirs: str) -> None:
    """Wait until the other process has said `theirs` (a file in `out`)."""
    end = time.monotonic() + JOIN_S
    while not (out / theirs).exists():
        assert time.monotonic() < end, f"{theirs} never came"
        time.sleep(0.05)


class _Survivor:
    """Replica group 0: it starts training once group 1 has, so both are in the first quorum;
    once it has committed round 1 alone, it waits for group 1's second life to be training, and
    before the step that asks for round 2's quorum, for that life to have asked for it: torchft
    forms a quorum at once when the groups of the last one ask (a fast quorum), so asking first
    would give a third round alone, not one of both."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        if step == 0:
            _meet(self.out, "started-0", "started-1")
        if step == ALONE:
            _meet(self.out, "alone", "back")
        if step == ALONE + 1:
            _await(self.out, "asked")


class _Killed:
    """The first life of replica group 1: SIGKILL mid-round, as a crashed machine."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        if step == 0:
            _meet(self.out, "started-1", "started-0")
        if step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class _Restarted:
    """The second life of replica group 1: after its first step it waits until the survivor has
    committed round 1 alone, so its first synchronisation can only join the survivor's round 2."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = False

    def __call__(self, step: int, loss: float, model: torch.nn.Module) -> None:
        if not self.started:
            self.started = True
            _meet(self.out, "back", "alone")

    def asking(self) -> None:
        """torchft's Manager is about to ask for a quorum: after the first step, say so."""
        if self.started:
            (self.out / "asked").touch()


def _fault_group(cfg: TrainConfig, replica: int, lighthouse: str, out: Path, on_step, name: str) -> None:
    torch.set_num_threads(1)
    if isinstance(on_step, _Restarted):
        from torchft.manager import Manager

        ask = Manager.start_quorum

        def start_quorum(manager: Manager, *args, **kwargs) -> None:
            on_step.asking()
            return ask(manager, *args, **kwargs)

        Manager.start_quorum = start_quorum  # this process is this group's alone
    record_synchronisations(out / name)
    run_replica_group(cfg, replica, lighthouse, on_step=on_step).save(out / name)


@pytest.fixture(scope="module", params=FAULT_METHODS)
def killed_group(request, tmp_path_factory) -> tuple[TrainConfig, Path]:
    """One run per rule of 2 replica groups whose group 1 is SIGKILLed mid-round 1 and restarted
    (`QUORUMS`): the config, and the folder of the groups' runs and synchronisations."""
    out = tmp_path_factory.mktemp(f"killed-{request.param}")
    cfg = config(**FAULT, method=request.param)
    load_token_data(cfg.data)
    # min_replicas=1: the survivor's round 1 forms a quorum of one once the killed group has
    # missed its heartbeats for 1 s.
    server, address = start_lighthouse(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_MS)

    def start(replica: int, on_step, name: str):
        process = SPAWN.Process(target=_fault_group, args=(cfg, replica, address, out, on_step, name))
        process.start()
        return process

    processes = []
    try:
        processes.append(start(0, _Survivor(out), "survivor"))
        processes.append(start(1, _Killed(out), "killed"))
        join_groups(processes[1:])
        assert processes[1].exitcode == -signal.SIGKILL
        processes.append(start(1, _Restarted(out), "restarted"))
        join_groups(processes)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        server.shutdown()
    assert [p.exitcode for p in processes] == [0, -signal.SIGKILL, 0]
    return cfg, out


def test_a_killed_group_recovers_through_torchft(killed_group):
    _, out = killed_group
    survivor, restarted = GroupRun.load(out / "survivor"), GroupRun.load(out / "restarted")
    # The survivor trained every step once, committed every outer step, at a finite loss.
    assert survivor.steps == list(range(8)) and survivor.outer_steps == 4
    assert all(math.isfinite(loss) for loss in survivor.losses + restarted.losses)
    # The restarted group trained one round of its own (discarded), recovered the survivor's
    # state at its first synchronisation (the survivor's round 2) and continued at its step.
    assert restarted.steps == [0, 1, 6, 7] and restarted.outer_steps == 4
    for name, value in restarted.params.items():
        assert torch.equal(value, survivor.params[name]) and torch.isfinite(value).all(), name


def _committed(out: Path, lives: list[str]) -> dict[int, tuple[dict, dict[str, torch.Tensor]]]:
    """A replica group's committed synchronisations over its lives, by round: (record, tensors)."""
    syncs = {}
    for life in lives:
        for path in out.glob(f"{life}-sync*.json"):
            record = json.loads(path.read_text())
            if record["committed"]:
                syncs[record["round"]] = record, load_file(path.with_suffix(".safetensors"))
    return syncs


def test_a_changing_quorum_merges_as_the_simulators_partial_merge(killed_group):
    """Every committed round, in every group, is the simulator's outer step on the pseudo-gradients
    of the groups that committed it, merged as a partial merge of those workers (`Participation`):
    recomputed here, in one process, from what the groups recorded."""
    cfg, out = killed_group
    groups = {0: _committed(out, ["survivor"]), 1: _committed(out, ["killed", "restarted"])}
    assert {round: [r for r in groups if round in groups[r]] for round in range(4)} == QUORUMS
    # torchft's recovery copies the survivor's state, its trained weights included, so the group
    # that rejoins sends the survivor's pseudo-gradient: that round merges it twice.
    rejoin = [groups[r][REJOIN][1] for r in (0, 1)]
    assert all(torch.equal(value, rejoin[1][key]) for key, value in rejoin[0].items() if key.startswith("delta."))
    model = build_model(cfg.model, load_token_data(cfg.data).vocab_size, cfg.seq_len, cfg.seed)
    names = {param: name for name, param in model.named_parameters()}
    torchft_names = {name: names[param] for name, param in model_fragments(model, 1)[0].named_parameters()}
    params = dict(model.named_parameters())
    outer = OuterStep(list(params.items()), cfg.merge, cfg.outer, LocalCommunicator(cfg.workers), cfg.seed)
    for round, arrived in QUORUMS.items():
        for replica in arrived:
            record, tensors = groups[replica][round]
            assert record["participants"] == len(arrived)
            for name, ours in torchft_names.items():  # every group starts the round from the reference's θ
                assert torch.equal(tensors[f"before.{name}"], params[ours].detach()), (round, replica, name)
        deltas = {ours: [groups[r][round][1][f"delta.{name}"] if r in arrived else torch.zeros_like(params[ours])
                         for r in range(cfg.workers)] for name, ours in torchft_names.items()}
        outer.step(deltas, round, participation=Participation(tuple(arrived)))
        for replica in arrived:
            tensors = groups[replica][round][1]
            for name, ours in torchft_names.items():
                assert torch.equal(tensors[f"after.{name}"], params[ours].detach()), (round, replica, name)
