"""Islands on a real slow link (issue 59): network namespaces joined by kernel-shaped links
(`isoloco.bench.islandnet`), each island one node of an `isoloco launch` job
(`isoloco.bench.reallink`).

The harness leaves no namespace behind however it ends. A two-island run sends what it
reports (the kernel's byte counter against `wire_bytes_cross_island`), and int4 with error
feedback exposes less synchronisation than float32. Faults on the link: taken down
mid-synchronisation, every process exits 3 naming the island it lost, the last checkpoint is
intact and a resume ends with an uninterrupted run's bits; down for less than the timeout, the
run goes on with those bits; the rate cut tenfold, it finishes and says its synchronisation
slowed; under torchft, the survivor of a cut goes on and the cut group heals when the link is
back.

Needs root and iproute2 (CI runs as root); elsewhere the module is skipped with the harness's
own one-line reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from isoloco import checkpoint as ckpt
from isoloco.bench.islandnet import IslandNet, owned_namespaces, remove_namespaces, unavailable_reason
from isoloco.bench.reallink import IslandJob, probe_seconds, run_items
from isoloco.config import parse_overrides, resolve, split_items
from isoloco.data import load_token_data

REASON = unavailable_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

pytestmark = pytest.mark.multiprocess

TAG = str(os.getpid())  # the harness names its namespaces after the process that builds them
H = 4  # inner steps per round: two rounds, a checkpoint after each
RATE = 20  # Mbit/s: float32's 5 MB round takes 2 s on the link, int4's 0.65 MB a quarter of one
#: The run every fault is held to: tiny, two islands of one process, two rounds, a checkpoint
#: after each; a lost peer is found after 20 s of silence (the collectives' own timeout, 30 s,
#: is the last resort).
FAULT_ITEMS = [f"checkpoint_every={H}", "dist.peer_silence_s=20", "dist.timeout_s=30"]
#: What the tiny model's float32 synchronisation sends per process (its parameters, 4 bytes each).
FLOAT32_BYTES = 1_262_144 * 4
CAP_S = 600  # a cap on any wait: a run here takes well under a minute; this only bounds a hang
LOST_WITHIN_S = 60  # issue 59: every process exits within this of the link going down
DOWN_S = 6  # a short outage: well inside dist.peer_silence_s and dist.timeout_s


def items(setting: str) -> list[str]:
    return [*run_items("tiny", 2, 1, H, 2, 0, setting), *FAULT_ITEMS]


class ResumedJob(IslandJob):
    """The same islands continuing the run in `out` (`train --resume`)."""

    def command(self, island: int) -> list[str]:
        command = super().command(island)
        return [*command[:command.index("train")], "train", "--resume", str(self.out)]


def wait_for(condition: Callable[[], bool], what: str, job: IslandJob | None = None, cap_s: float = CAP_S) -> None:
    """Wait until `condition()`; fail after `cap_s`, or at once when `job` has ended meanwhile."""
    end = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < end, f"{what} never happened"
        if job is not None and all(proc.poll() is not None for proc in job.procs):
            pytest.fail(f"the run ended before {what} (exit statuses {[p.returncode for p in job.procs]}): "
                        f"{[job.log(k).read_text()[-1500:] for k in range(len(job.procs))]}")
        time.sleep(0.05)


def round_lines(out: Path) -> list[dict]:
    """The metrics lines that end a round (they carry its synchronisation)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"sync_s"' in line]


def in_second_synchronisation(net: IslandNet, job: IslandJob) -> None:
    """Return once the run is in its second synchronisation: rank 0 has logged the first round,
    and island 1 has since sent a fifth of a float32 synchronisation."""
    wait_for(lambda: len(round_lines(job.out)) >= 1, "the first round's metrics line", job)
    before = net.kernel_bytes(1)[0]
    wait_for(lambda: net.kernel_bytes(1)[0] > before + FLOAT32_BYTES // 5, "the second synchronisation", job)


def finish(job: IslandJob) -> list[int]:
    statuses = job.wait(CAP_S)
    assert statuses == [0, 0], [job.log(k).read_text()[-2000:] for k in range(2)]
    return statuses


def deterministic(lines: list[dict]) -> list[dict]:
    """Metrics lines without what the clock measures (every `*_s` key)."""
    return [{key: value for key, value in line.items() if not key.endswith("_s")} for line in lines]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_bits(out: Path, reference: Path) -> None:
    """`out` ended where the uninterrupted `reference` run did: θ bit for bit, the validation
    loss, and every metrics line but its timings."""
    final = f"step_{2 * H:08d}"
    mine = load_file(out / "checkpoints" / final / "global.safetensors")
    theirs = load_file(reference / "checkpoints" / final / "global.safetensors")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs), "θ differs from the uninterrupted run's"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] == json.loads((reference / "summary.json").read_text())["final_val_loss"]
    assert deterministic(metrics(out)) == deterministic(metrics(reference))


# ------------------------------------------------------------------------------- the harness


def reapers(tag: str) -> list[int]:
    """Processes running the reaper of the harness `tag`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = [arg for arg in (entry / "cmdline").read_bytes().split(b"\0") if arg]
        except OSError:
            continue
        if b"isoloco.bench.islandnet" in argv and argv[-2:] == [b"reap", tag.encode()]:
            found.append(int(entry.name))
    return found


def test_the_harness_removes_its_namespaces_when_its_block_ends():
    with IslandNet(2, 10) as net:
        assert sorted(owned_namespaces(TAG)) == sorted([net.hub, net.namespace(0), net.namespace(1)])
    assert owned_namespaces(TAG) == []
    with pytest.raises(RuntimeError, match="boom"):
        with IslandNet(2, None):
            assert len(owned_namespaces(TAG)) == 3
            raise RuntimeError("boom")
    assert owned_namespaces(TAG) == []
    assert reapers(TAG) == []


#: A harness that builds its islands and waits, saying when its block has ended.
HARNESS = textwrap.dedent("""
    import time
    from isoloco.bench.islandnet import IslandNet
    try:
        with IslandNet(2, 10):
            print("up", flush=True)
            time.sleep(600)
    finally:
        print("closed", flush=True)
""")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_harness_leaves_no_namespace_behind(how):
    """SIGTERM ends the block as an exception does, which removes the namespaces; after SIGKILL
    the reaper does."""
    harness = subprocess.Popen([sys.executable, "-c", HARNESS], stdout=subprocess.PIPE, text=True)
    tag = str(harness.pid)
    try:
        assert harness.stdout.readline().strip() == "up"
        assert len(owned_namespaces(tag)) == 3 and len(reapers(tag)) == 1
        harness.send_signal(how)
        harness.wait(CAP_S)  # not its output's end: the reaper holds the pipe until it is done
        if how == signal.SIGTERM:
            assert harness.stdout.readline().strip() == "closed" and owned_namespaces(tag) == []
        # The reaper takes a fraction of a second; the cap is for a loaded machine.
        wait_for(lambda: owned_namespaces(tag) == [] and reapers(tag) == [], "the namespaces' removal", cap_s=60)
    finally:  # whatever failed, nothing is left behind
        harness.kill()
        harness.wait()
        for pid in reapers(tag):
            os.kill(pid, signal.SIGKILL)
        remove_namespaces(owned_namespaces(tag))


def test_the_benchmark_explains_itself():
    shown = subprocess.run([sys.executable, "-m", "isoloco.bench.reallink", "--help"], capture_output=True,
                           text=True, timeout=CAP_S)
    assert shown.returncode == 0, shown.stderr
    assert "network namespaces" in shown.stdout and "--rates" in shown.stdout and "root" in shown.stdout


def test_the_probe_takes_the_shapers_time_and_a_short_queue_drops_what_the_counters_count():
    """gloo's collectives alone cannot beat the shaper: each takes at least 90% of its bytes' time
    at the rate. Behind a queue of 5 ms (6 KB at 10 Mbit/s) the shaper drops packets, which the
    loss counters see, and TCP sends them again."""
    size = 650_820  # tiny's int4 synchronisation per process
    with IslandNet(2, 10, queue_ms=5) as net:
        before = [net.tcp_losses(k) for k in range(2)]
        seconds = probe_seconds(net, size, 1, 29647)
        losses = [{name: net.tcp_losses(k)[name] - before[k][name] for name in before[k]} for k in range(2)]
    assert set(seconds) == {"all_reduce", "all_gather", "all_gather in pieces"}
    for name, (taken,) in seconds.items():
        assert taken >= 0.9 * size * 8 / 10e6, (name, taken)
    assert sum(loss["dropped"] for loss in losses) > 0 and sum(loss["retransmitted"] for loss in losses) > 0, losses


# ------------------------------------------------------------------------ runs on the link


@pytest.fixture(scope="module")
def data_ready() -> None:
    """The run's corpus prepared once, before two islands would prepare it at once."""
    preset, rest = split_items(items("float32"))
    load_token_data(resolve(preset, parse_overrides(rest)).data)


def link_run(root: Path, setting: str, port: int) -> dict:
    """One uninterrupted run at `RATE`: its directory and what the kernel counted leaving the
    islands, per process per synchronisation, beside what the run reports."""
    with IslandNet(2, RATE) as net:
        job = IslandJob(net, root / setting, items(setting), 1, port)
        before = [net.payload_bytes(k) for k in range(2)]
        finish(job.start())
        sent = sum(net.payload_bytes(k) - before[k] for k in range(2))
    rounds = round_lines(job.out)
    syncs = sum(line["synchronisations"] for line in rounds)
    return {"out": job.out, "kernel": sent / 2 / syncs,
            "reported": sum(line["wire_bytes_cross_island"] for line in rounds) / syncs}


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory, data_ready) -> dict:
    """The uninterrupted float32 run: the one every fault is held to."""
    return link_run(tmp_path_factory.mktemp("reallink"), "float32", 29641)


@pytest.fixture(scope="module")
def int4_run(tmp_path_factory, data_ready) -> dict:
    return link_run(tmp_path_factory.mktemp("reallink"), "int4+EF", 29642)


@pytest.mark.slow
def test_the_link_carries_what_the_run_reports_and_int4_exposes_less(float32_run, int4_run):
    """At 20 Mbit/s the kernel's count of what TCP carried out of the islands (start-up,
    metrics and heartbeats included) is within 2% of the run's own wire bytes, and int4 with
    error feedback waits less for its synchronisations than float32."""
    for run in (float32_run, int4_run):
        assert run["kernel"] == pytest.approx(run["reported"], rel=0.02), run
    assert float32_run["reported"] == FLOAT32_BYTES
    exposed = {name: json.loads((run["out"] / "summary.json").read_text())["exposed_sync_seconds"]
               for name, run in (("float32", float32_run), ("int4", int4_run))}
    assert exposed["int4"] < exposed["float32"], exposed


def error_lines(job: IslandJob, island: int) -> list[str]:
    return [line for line in job.log(island).read_text().splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_link_down_mid_synchronisation_stops_every_process_and_the_run_resumes(tmp_path, float32_run):
    with IslandNet(2, RATE) as net:
        job = IslandJob(net, tmp_path / "cut", items("float32"), 1, 29643).start()
        try:
            in_second_synchronisation(net, job)
            net.set_link(1, False)
            down = time.monotonic()
            ended: dict[int, float] = {}  # island -> seconds from the link going down to its exit

            def all_ended() -> bool:
                for island, proc in enumerate(job.procs):
                    if island not in ended and proc.poll() is not None:
                        ended[island] = time.monotonic() - down
                return len(ended) == len(job.procs)

            wait_for(all_ended, "every island's exit", cap_s=5 * LOST_WITHIN_S)
        finally:
            job.wait(0)
        statuses = [proc.returncode for proc in job.procs]
        assert statuses == [3, 3], [job.log(k).read_text()[-2000:] for k in range(2)]
        assert max(ended.values()) < LOST_WITHIN_S, ended
        # One line each, naming the island lost: island 0 lost island 1, island 1 lost island 0
        # (which hosts the rendezvous store).
        for island in range(2):
            lines = error_lines(job, island)
            assert len(lines) == 1 and f"island {1 - island}" in lines[0], lines
        assert "rank 1 stopped answering" in error_lines(job, 0)[0]
        assert "lost the rendezvous store" in error_lines(job, 1)[0]
        # The last checkpoint, the first round's, is intact; the second round wrote nothing.
        assert [path.name for path in ckpt.list_checkpoints(job.out / "checkpoints")] == [f"step_{H:08d}"]
        assert ckpt.verify(job.out / "checkpoints" / f"step_{H:08d}")["step"] == H
        assert not (job.out / "summary.json").exists()
        net.set_link(1, True)
        finish(ResumedJob(net, job.out, [], 1, 29644).start())
    assert_same_bits(job.out, float32_run["out"])


@pytest.mark.slow
def test_a_short_outage_mid_synchronisation_loses_nothing(tmp_path, float32_run):
    with IslandNet(2, RATE) as net:
        job = IslandJob(net, tmp_path / "outage", items("float32"), 1, 29645).start()
        try:
            in_second_synchronisation(net, job)
            net.set_link(1, False)
            time.sleep(DOWN_S)
            net.set_link(1, True)
            finish(job)
        finally:
            job.wait(0)
    # The outage fell inside the second synchronisation, which waited it out.
    assert round_lines(job.out)[1]["sync_s"] > DOWN_S
    assert_same_bits(job.out, float32_run["out"])


def progress_sync_seconds(job: IslandJob) -> list[float]:
    """The synchronisation seconds island 0's per-round progress lines show."""
    return [float(seconds) for seconds in re.findall(r"^step \d+/\d+: .*\bsync_s ([\d.]+)",
                                                     job.log(0).read_text(), flags=re.MULTILINE)]


@pytest.mark.slow
def test_a_rate_cut_tenfold_mid_run_slows_the_synchronisation_and_loses_nothing(tmp_path, float32_run):
    fast, slow = 100, 10  # Mbit/s: float32's round takes 0.4 s on the link, then 4 s
    with IslandNet(2, fast) as net:
        job = IslandJob(net, tmp_path / "cut-rate", items("float32"), 1, 29646).start()
        try:
            wait_for(lambda: len(round_lines(job.out)) >= 1, "the first round's metrics line", job)
            for island in range(2):
                net.shape(island, slow)
            finish(job)
        finally:
            job.wait(0)
    first, second = (line["sync_s"] for line in round_lines(job.out))
    assert second >= 0.9 * FLOAT32_BYTES * 8 / (slow * 1e6) and second > 2 * first, (first, second)
    shown = progress_sync_seconds(job)
    assert len(shown) == 2 and shown[1] > 2 * shown[0], job.log(0).read_text()
    assert_same_bits(job.out, float32_run["out"])


# --------------------------------------------------------------------------------- torchft

GROUPS = Path(__file__).with_name("reallink_groups.py")
TORCHFT_RUN = {"steps": 24, "inner_steps": 2}  # 12 rounds of H = 2


def group_step(out: Path, replica: int) -> int:
    """The last inner step replica group `replica` reported (-1 before its first)."""
    path = out / f"step-{replica}"
    return int(path.read_text()) if path.exists() else -1


def group_syncs(out: Path, replica: int) -> dict[int, dict]:
    """Replica group `replica`'s recorded synchronisations, by round."""
    records = [json.loads(path.read_text()) for path in out.glob(f"group-{replica}-sync*.json")]
    return {record["round"]: record for record in records}


@pytest.mark.slow
@pytest.mark.torchft
def test_torchft_goes_on_without_a_cut_group_which_heals_when_the_link_is_back(tmp_path):
    """Two replica groups, each in its island's namespace, the lighthouse in island 0's: with
    island 1's link down, group 0 commits rounds alone; with the link back, group 1 recovers
    group 0's state and both finish together, with the same weights."""
    pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")
    from isoloco.torchft.replica import GroupRun
    from torchft_groups import config

    load_token_data(config(**TORCHFT_RUN).data)
    out = tmp_path / "groups"
    out.mkdir()
    rounds = TORCHFT_RUN["steps"] // TORCHFT_RUN["inner_steps"]
    with IslandNet(2, None) as net:
        procs = []
        try:
            for replica in range(2):
                settings = tmp_path / f"settings-{replica}.json"
                settings.write_text(json.dumps({
                    "out": str(out), "host": net.address(replica), "overrides": TORCHFT_RUN,
                    "lighthouse": f"http://{net.address(0)}:29650", "pace_s": 0.3, "linger_s": 2.0,
                    "timeout_s": 60}))
                with open(tmp_path / f"group-{replica}.log", "w") as log:
                    procs.append(subprocess.Popen(net.argv(replica, [sys.executable, str(GROUPS), str(settings),
                                                                     str(replica)], {"OMP_NUM_THREADS": "1"}),
                                                  stdout=log, stderr=subprocess.STDOUT))

            def running() -> None:
                assert all(proc.poll() is None for proc in procs), \
                    [(tmp_path / f"group-{r}.log").read_text()[-3000:] for r in range(2)]

            def both_committed() -> bool:
                running()
                return any(record["committed"] and record["participants"] == 2
                           for record in group_syncs(out, 1).values() if record["round"] >= 1)

            wait_for(both_committed, "a round both groups committed")
            net.set_link(1, False)

            def alone() -> bool:
                running()
                return any(record["committed"] and record["participants"] == 1
                           for record in group_syncs(out, 0).values())

            wait_for(alone, "a round the survivor committed alone")
            alone_at = group_step(out, 0)
            (out / "linger").touch()  # the survivor slows down until the cut group is back
            net.set_link(1, True)

            def healed() -> bool:
                running()
                return group_step(out, 1) > alone_at

            wait_for(healed, "the cut group's recovery")
            (out / "linger").unlink()
            end = time.monotonic() + CAP_S
            for proc in procs:
                proc.wait(max(0.0, end - time.monotonic()))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    logs = [(tmp_path / f"group-{r}.log").read_text()[-3000:] for r in range(2)]
    assert [proc.returncode for proc in procs] == [0, 0], logs
    survivor, healed_group = GroupRun.load(out / "group-0"), GroupRun.load(out / "group-1")
    # The survivor trained every step once and committed every round: while the link was down
    # alone, and from the group's return on with it again.
    assert survivor.steps == list(range(TORCHFT_RUN["steps"])) and survivor.outer_steps == rounds
    syncs = {replica: {r: record for r, record in group_syncs(out, replica).items() if record["committed"]}
             for replica in range(2)}
    assert sorted(syncs[0]) == list(range(rounds))
    alone_rounds = [r for r, record in syncs[0].items() if record["participants"] == 1]
    assert alone_rounds and syncs[0][rounds - 1]["participants"] == 2, syncs[0]
    # The cut group committed none of those rounds: it recovered the survivor's state instead of
    # training them (its steps jump), and ended with it, committed round for round.
    assert not set(alone_rounds) & set(syncs[1]), syncs[1]
    assert any(later > earlier + 1 for earlier, later in zip(healed_group.steps, healed_group.steps[1:])), \
        healed_group.steps
    assert healed_group.steps[-1] == survivor.steps[-1] and healed_group.outer_steps == rounds
    for name, value in survivor.params.items():
        assert torch.equal(value, healed_group.params[name]), name
