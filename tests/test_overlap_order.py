"""An overlapped synchronisation is never in flight while the loop's own cross-island collectives
run (the round's losses, its link counts, a stop signal, an evaluation): on a real slow link
each of them would queue behind the synchronisation's traffic, seconds no counter reports."""

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


def test_a_rounds_compute_seconds_leave_out_what_it_waited_for_the_synchronisation(tmp_path, monkeypatch):
    """`compute_s` times the inner steps alone: a synchronisation's stage that takes 0.3 s more
    shows in the round's wall time and its exposed seconds, not in its compute."""
    import json
    import time

    from isoloco.sync.inflight import InFlight

    from contextlib import contextmanager

    @contextmanager
    def slow_stage(self):  # a stage's work, inside the time the run counts as the synchronisation's
        time.sleep(0.3)
        yield

    monkeypatch.setattr(InFlight, "_on_stream", slow_stage)
    cfg = resolve(None, {**helpers.SMALL, "method": "isoloco", "workers": 2, "inner_steps": 3, "steps": 9,
                         "eval_every": 9, "outer.overlap_steps": 2})
    (tmp_path / "run").mkdir()
    Trainer(cfg, tmp_path / "run", progress=False).run()
    rounds = [line for line in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "compute_s" in line]
    walls = [b["wall_time_s"] - a["wall_time_s"] for a, b in zip([{"wall_time_s": 0.0}, *rounds], rounds)]
    # round 1 lands round 0's synchronisation mid-round, which waited at least one slow stage
    assert rounds[1]["sync_exposed_s"] >= 0.3
    assert all(line["compute_s"] > 0 for line in rounds)
    assert walls[1] - rounds[1]["compute_s"] >= rounds[1]["sync_exposed_s"] >= 0.3
