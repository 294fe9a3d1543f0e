"""When an overlapped synchronisation runs, as a real slow link needs it: never in flight while
the loop's own cross-island collectives run (the round's losses, its link counts, a stop signal,
an evaluation), which would queue behind its traffic, seconds no counter reports; its stages at
steps in proportion to their traffic; and a round's compute timed apart from what it waited."""

import torch

from isoloco.config import resolve
from isoloco.distributed import Distributed
from isoloco.trainer import Trainer
import helpers


def test_the_loops_collectives_never_meet_a_synchronisation_in_flight(tmp_path, monkeypatch):
    cfg = resolve(None, {**helpers.SMALL, "method": "isoloco", "workers": 2, "inner_steps": 3, "steps": 12,
                         "eval_every": 6, "outer.overlap_steps": 2})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    (tmp_path / "run").mkdir()
    in_flight = trainer.algorithm.in_flight
    seen: list[tuple[str, bool]] = []
    for name in ("sum", "max", "mean_link_counts"):
        original = getattr(Distributed, name)

        def recorded(self, *args, _name=name, _original=original, **kwargs):
            seen.append((_name, in_flight.running))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Distributed, name, recorded)
    landed = []
    monkeypatch.setattr(type(in_flight), "land", lambda self, _land=type(in_flight).land: landed.append(
        self.running) or _land(self))
    trainer.run()
    called = {name for name, _ in seen}
    assert {"sum", "max", "mean_link_counts"} <= called
    assert not any(running for _, running in seen), seen
    # and the synchronisations did overlap the rounds: each landed while in flight, mid-round
    assert landed.count(True) >= 2


def overlapped_rounds(tmp_path) -> tuple[list[dict], list[float]]:
    """Three overlapped rounds of two workers: their metrics lines and wall seconds."""
    import json

    cfg = resolve(None, {**helpers.SMALL, "method": "isoloco", "workers": 2, "inner_steps": 3, "steps": 9,
                         "eval_every": 9, "outer.overlap_steps": 2})
    (tmp_path / "run").mkdir()
    Trainer(cfg, tmp_path / "run", progress=False).run()
    rounds = [line for line in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "compute_s" in line]
    return rounds, [b["wall_time_s"] - a["wall_time_s"] for a, b in zip([{"wall_time_s": 0.0}, *rounds], rounds)]


def test_a_rounds_compute_seconds_leave_out_what_it_waited_for_the_synchronisation(tmp_path, monkeypatch):
    """`compute_s` times the inner steps alone: a synchronisation's stage that takes 0.3 s more
    shows in the round's wall time and its exposed seconds, not in its compute."""
    import time

    from isoloco.sync.inflight import InFlight

    from contextlib import contextmanager

    @contextmanager
    def slow_stage(self):  # a stage's work, inside the time the run counts as the synchronisation's
        time.sleep(0.3)
        yield

    monkeypatch.setattr(InFlight, "_on_stream", slow_stage)
    rounds, walls = overlapped_rounds(tmp_path)
    # round 1 lands round 0's synchronisation mid-round, which waited at least one slow stage
    assert rounds[1]["sync_exposed_s"] >= 0.3
    assert all(line["compute_s"] > 0 for line in rounds)
    assert walls[1] - rounds[1]["compute_s"] >= rounds[1]["sync_exposed_s"] >= 0.3


def test_the_wait_for_a_slower_peer_is_its_own_count_not_compute_nor_synchronisation(tmp_path, monkeypatch):
    """With overlap on, a process that finished its steps first waits for the slowest at the round's
    closing loss sum: `peer_wait_s` holds that wait (0.3 s here, a stand-in for a peer 0.3 s
    slower), and neither the compute nor the exposed synchronisation does."""
    import time

    original = Distributed.sum
    closing = []

    def slower_peer(self, tensor):
        if tensor.dim() == 2 and tensor.shape[0] == 2:  # the round's losses and step counts
            closing.append(True)
            time.sleep(0.3)
        return original(self, tensor)

    monkeypatch.setattr(Distributed, "sum", slower_peer)
    rounds, walls = overlapped_rounds(tmp_path)
    assert len(closing) == len(rounds) == 3
    for wall, line in zip(walls, rounds):
        assert 0.3 <= line["peer_wait_s"] < 0.3 + 0.1, line
        assert wall - line["compute_s"] - line["sync_exposed_s"] >= 0.3, line  # in neither of those


def test_a_stage_that_only_computes_waits_for_the_landing_so_the_transfers_have_the_window():
    """Stages run at steps in proportion to the traffic before them: with Iso-C's finalize last
    (no traffic), the sum's transfer has all τ steps; equal shares spread evenly, as before."""
    from isoloco.sync.handles import Sync
    from isoloco.sync.inflight import resume_steps

    def sync(stages, traffic=None):
        return Sync(iter(()), stages, traffic)

    assert resume_steps(5, sync(2, (1.0, 0.0))) == []  # the finalize runs at the landing, step 5
    assert resume_steps(4, sync(3, (1.0, 1.0, 0.0))) == [2]  # two transfers share the window
    assert resume_steps(4, sync(3)) == [2, 3]  # ⌈4/3⌉, ⌈8/3⌉
    assert resume_steps(6, sync(3, (0.0, 0.0, 0.0))) == [2, 4]


def test_an_iso_c_merge_says_its_finalize_carries_no_traffic(tmp_path):
    cfg = resolve(None, {**helpers.SMALL, "method": "isoloco", "workers": 2, "inner_steps": 3, "steps": 6,
                         "outer.overlap_steps": 2})
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    algorithm = trainer.algorithm
    algorithm._kept(torch.zeros(2, 3), 0)
    participation = algorithm._participation(0, steps=3)
    sync = algorithm._merge(participation, 0)
    assert sync.traffic is not None and len(sync.traffic) == sync.stages
    assert sync.traffic[-1] == 0.0 and sum(sync.traffic) > 0
    sync.steps.close()
