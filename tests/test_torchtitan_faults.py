"""A replica group of isoloco's torchtitan recipe SIGKILLed mid-round and restarted: the survivor
commits alone, the restarted group heals from it through torchft (its weights, inner optimizer,
step, and IsoLoCo's outer momentum) and both end bit-identical.

Processes as in tests/test_torchtitan.py (one per group, `torchtitan_cpu.py`, gloo on 127.0.0.1).
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

import torchtitan_cpu
from torchft_groups import HEARTBEAT_MS, JOIN_S

pytestmark = [pytest.mark.torchtitan, pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(torchtitan_cpu.MISSING, reason=torchtitan_cpu.SKIP_REASON)]

#: torchtitan's steps 1..8, a synchronisation after every second one: rounds 0..3.
FLAGS = ["--training.steps", "8", "--isoloco.placement", "update"]  # Iso-C of the momentum update: momentum matters
KILL_AT = 3  # group 1 dies after this step: the middle of round 1
ALONE = 4  # the survivor's step whose synchronisation it commits alone: the end of round 1


def test_a_killed_group_heals_from_the_survivor_and_both_end_identical(tmp_path):
    from isoloco.torchft.replica import start_lighthouse

    assets = tmp_path / "assets"
    torchtitan_cpu.prepare_assets(assets)
    # min_replicas=1: the survivor's round 1 forms a quorum of one once the killed group has
    # missed its heartbeats for 1 s. The meetings (files) order who joins which quorum.
    server, address = start_lighthouse(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_MS)

    def start(replica: int, life: str, hooks: dict[str, str]):
        hooks = {**hooks, "ISOLOCO_TT_OUT": str(tmp_path / life), "ISOLOCO_TT_RECORD": str(tmp_path / life)}
        return torchtitan_cpu.start_group(replica, address, assets, tmp_path / f"dump-{replica}", FLAGS, hooks,
                                          tmp_path / f"{life}.log")

    def meet(step: int, mine: str, theirs: str) -> str:
        return f"{step}:{tmp_path / mine}:{tmp_path / theirs}"

    processes = []
    try:
        processes.append(start(0, "survivor", {"ISOLOCO_TT_MEET": ",".join(
            [meet(1, "started-0", "started-1"), meet(ALONE, "alone", "back")])}))
        processes.append(start(1, "killed", {"ISOLOCO_TT_MEET": meet(1, "started-1", "started-0"),
                                             "ISOLOCO_TT_KILL_AT": str(KILL_AT)}))
        assert processes[1].wait(timeout=JOIN_S) == -signal.SIGKILL
        processes.append(start(1, "restarted", {"ISOLOCO_TT_MEET": meet(1, "back", "alone")}))
        codes = [process.wait(timeout=JOIN_S) for process in processes]
    finally:
        for process in processes:
            process.kill()
        server.shutdown()
    logs = {life: (tmp_path / f"{life}.log").read_text()[-3000:] for life in ("survivor", "killed", "restarted")}
    assert codes == [0, -signal.SIGKILL, 0], logs
    survivor, restarted = (json.loads((tmp_path / f"{life}.json").read_text()) for life in ("survivor", "restarted"))
    # The survivor trained every step and committed every round; the restarted group trained a
    # round of its own (discarded): the synchronisation after its second step, the survivor's
    # round 2, healed it to the survivor's step 6, and it trained the last round with it.
    assert survivor == {"steps": list(range(1, 9)), "outer_steps": 4}
    assert restarted == {"steps": [1, 6, 7, 8], "outer_steps": 4}
    committed = {life: sorted(json.loads(path.read_text())["round"] for path in tmp_path.glob(f"{life}-sync*.json")
                              if json.loads(path.read_text())["committed"]) for life in ("survivor", "restarted")}
    assert committed == {"survivor": [0, 1, 2, 3], "restarted": [2, 3]}
    final = [load_file(tmp_path / f"{life}.safetensors") for life in ("survivor", "restarted")]
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
    # Round 3's update carried momentum from every round: a restarted group without the survivor's
    # momentum would have applied another update than the survivor's.
    last = [load_file(tmp_path / f"{life}-sync3.safetensors") for life in ("survivor", "restarted")]
    for name in (key.removeprefix("before.") for key in last[0] if key.startswith("before.")):
        assert torch.equal(last[0][f"before.{name}"], last[1][f"before.{name}"]), name
        assert torch.equal(last[0][f"after.{name}"], last[1][f"after.{name}"]), name
