"""The slow link, real: islands in network namespaces joined by kernel-shaped links, each run's
time per round, exposed synchronisation and the bytes the kernel counted, beside what the cost
model and the planning model predict for the same run.

    python -m isoloco.bench.reallink [--islands 2] [--rates 10,100,1000] [--settings float32,int4]
                                     [--taus 0,2] [--repeats 3] [--markdown FILE]
    python -m isoloco.bench.reallink --probe [--rates 10,100]     # gloo's collectives alone

Needs root and iproute2 (`ip`, `tc`): it refuses in one line, exit status 2, where namespaces
cannot be made. Each island is a namespace (`isoloco.bench.islandnet`); its processes are one node
of an `isoloco launch` job on torchrun's static rendezvous (`--master-addr` island 0's address,
`--node-rank` the island), gloo bound to the island's link (`GLOO_SOCKET_IFNAME`). Every island's
egress goes through the kernel's token-bucket shaper at the rate; the link adds no delay (netem
is not used), so latency stays the cost model's. Nothing is left behind: the namespaces go when
the benchmark ends, however it ends (`islandnet`).

A case is one setting (a compressor) at one rate and one overlap τ; each runs `--repeats` times,
and the tables give the median and range. Per run, from rank 0's metrics lines of the steady
rounds (all but the first and the last, as `isoloco.bench.link`): seconds per round, `sync_s`
and `sync_exposed_s`; and the kernel's count of the bytes TCP carried out of each island
(headers taken off), per process per synchronisation, beside the run's own `wire_bytes_cross_island`
(the cost model's count). What a round takes beyond its inner steps' seconds (the run's
`compute_s`) is set beside the exposed seconds the run reports: the two should agree. The same
case on an unshaped link gives the compute of a round on a link of no cost (its round less its
exposed seconds) and the merge's own compute (its `sync_s`). The model's synchronisation is that
merge compute plus the wire bytes at the rate with TCP's headers (`isoloco.sync.cost.Link` with
`TCP_FRAMING`, no latency); its round is the compute plus what of that the τ overlapped steps do
not hide. Each run also counts the loss on the links: packets the shapers dropped, and TCP's
retransmitted segments and retransmission timeouts (`IslandNet.tcp_losses`). And each round
records `peer_wait_s`, what its closing loss sum waited for the slowest process: with overlap on,
the wait for a slower island that a blocking synchronisation would have absorbed.

`--probe` trains nothing: it times gloo's all-reduce and all-gather alone, each sized to put the
same bytes on a process's link (`isoloco.bench.linkprobe`), beside the model's seconds for them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from isoloco import logs
from isoloco.bench.islandnet import IslandNet, require_namespaces
from isoloco.bench.link import steady_rounds
from isoloco.bench.table import Table
from isoloco.errors import UsageError
from isoloco.sync.cost import TCP_FRAMING, Link

#: Each compressor as `isoloco train` items (error feedback wherever rounding loses something).
SETTINGS = {
    "float32": [],
    "bf16": ["merge.quantize=bf16"],
    "int8+EF": ["merge.quantize=int8", "merge.error_feedback=true"],
    "int4+EF": ["merge.quantize=int4", "merge.error_feedback=true"],
    "lowrank4+int8+EF": ["merge.compress=lowrank", "merge.compress_rank=4", "merge.quantize=int8",
                         "merge.error_feedback=true"],
    "topk": ["merge.compress=topk", "merge.error_feedback=true"],
    "SparseLoCo": ["method=sparseloco"],
}
#: A generous cap on one run: a run that neither ends nor fails by then is reported as hung.
RUN_TIMEOUT_S = 1800
PORT_BASE = 29600
#: What a table's title says of a run, kept with its figures in --json.
SETUP = ("islands", "processes", "model", "inner_steps", "global_batch", "seq_len")
#: The loss counters `IslandNet.tcp_losses` reads, in the order a table shows them.
LOSSES = ("dropped", "retransmitted", "timeouts")


@dataclass
class IslandJob:
    """One training run across the islands of `net`: `isoloco launch` started inside each island's
    namespace, the islands its nodes."""

    net: IslandNet
    out: Path
    items: list[str]
    processes: int = 1
    port: int = PORT_BASE
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, island: int) -> list[str]:
        return [sys.executable, "-m", "isoloco", "launch", "--nproc", str(self.processes),
                "--nnodes", str(self.net.islands), "--node-rank", str(island), "--master-addr", self.net.address(0),
                "--master-port", str(self.port), "--", "train", *self.items, "--out", str(self.out)]

    def log(self, island: int) -> Path:
        return self.out.parent / f"{self.out.name}.island{island}.log"

    def start(self) -> IslandJob:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **self.env}
        for island in range(self.net.islands):
            with open(self.log(island), "w") as log:
                self.procs.append(subprocess.Popen(self.net.argv(island, self.command(island), env),
                                                   stdout=log, stderr=subprocess.STDOUT))
        return self

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[int]:
        """Every island's exit status; those still running after `timeout` are killed (status None
        becomes -9)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return [proc.returncode for proc in self.procs]

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]


def run_items(model: str, islands: int, processes: int, inner_steps: int, rounds: int, tau: int,
              setting: str, global_batch: int = 16, seq_len: int = 64) -> list[str]:
    """The run of one case: `model` on the embedded corpus, one worker per island."""
    method = [] if any(item.startswith("method=") for item in SETTINGS[setting]) else ["method=isoloco"]
    steps = rounds * inner_steps
    return ["quick", *method, f"model={model}", f"workers={islands}", f"dist.gpus_per_worker={processes}",
            f"global_batch={global_batch}", f"seq_len={seq_len}", f"steps={steps}", f"inner_steps={inner_steps}", f"eval_every={steps}",
            # A timing run: a batch large enough to fill the overlap window may repeat the corpus.
            "checkpoint_every=0", "data.val_tokens=1024", "data.allow_repeat=true", "device=cpu", "dist.backend=gloo", "dist.timeout_s=300",
            f"outer.overlap_steps={tau}", *SETTINGS[setting]]


def measure_run(net: IslandNet, job: IslandJob) -> dict[str, float]:
    """Train `job` and read its steady figures and the kernel's byte counts."""
    before = [net.payload_bytes(k) for k in range(net.islands)]
    losses_before = [net.tcp_losses(k) for k in range(net.islands)]
    statuses = job.start().wait()
    if any(status != 0 for status in statuses):
        tails = {k: job.log(k).read_text().strip().splitlines()[-3:] for k in range(net.islands)}
        raise RuntimeError(f"a real-link run failed (exit statuses {statuses}): {tails}")
    sent = sum(net.payload_bytes(k) - before[k] for k in range(net.islands))
    lines = job.metrics()
    rounds = [line for line in lines if "sync_s" in line]
    syncs = sum(line.get("synchronisations", 1) for line in rounds)
    reported = sum(line["wire_bytes_cross_island"] for line in rounds)
    figures = steady_rounds(lines)
    # Loss on the links, all islands together, per synchronisation (start-up and evaluation included).
    losses = {f"{name}_per_sync": sum(net.tcp_losses(k)[name] - losses_before[k][name]
                                      for k in range(net.islands)) / syncs for name in losses_before[0]}
    return {**figures, "kernel_bytes_per_sync": sent / (net.islands * job.processes) / syncs,
            "reported_bytes_per_sync": reported / syncs, **losses}


@dataclass(frozen=True)
class Case:
    setting: str
    rate_mbit: float | None  # None: the link unshaped (the compute reference)
    tau: int


def median_range(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def tables(results: dict[Case, list[dict[str, float]]], islands: int, processes: int, model: str,
           inner_steps: int, batch: str) -> list[Table]:
    """One table per rate: every setting and τ, measured beside predicted."""
    out = []
    rates = sorted({case.rate_mbit for case in results if case.rate_mbit is not None})
    for rate in rates:
        table = Table(f"The real link at {rate:g} Mbit/s: `{model}`, {islands} islands of {processes} process"
                      f"{'es' if processes > 1 else ''}, H = {inner_steps}, {batch}",
                      ["setting", "τ", "round s", "÷ τ = 0", "exposed s", "peer wait s", "beyond compute s", "sync s",
                       "model sync s", "sync off", "model round s", "kernel bytes / sync", "reported bytes / sync",
                       "bytes off", "dropped / retransmitted / RTOs per sync"])
        for case in sorted((c for c in results if c.rate_mbit == rate), key=lambda c: (list(SETTINGS).index(c.setting),
                                                                                        c.tau)):
            runs = results[case]
            reference = results.get(Case(case.setting, None, 0))
            # On a link of no cost a round is compute, and its synchronisation the merge's own compute.
            compute = (statistics.median(r["round_s"] - r["sync_exposed_s"] for r in reference)
                       if reference else None)
            merge_compute = statistics.median(r["sync_s"] for r in reference) if reference else 0.0
            reported = statistics.median(r["reported_bytes_per_sync"] for r in runs)
            link_s = Link(bandwidth=rate * 1e6 / 8, latency=0.0, framing=TCP_FRAMING).collective_seconds(
                "all_reduce", reported, islands)
            model_sync = merge_compute + link_s
            hidden = compute / inner_steps * case.tau if compute is not None else 0.0
            kernel = statistics.median(r["kernel_bytes_per_sync"] for r in runs)
            sync = statistics.median(r["sync_s"] for r in runs)
            plain = results.get(Case(case.setting, case.rate_mbit, 0))
            table.add(case.setting, str(case.tau), median_range([r["round_s"] for r in runs], ".2f"),
                      f"{statistics.median(r['round_s'] for r in runs) / statistics.median(r['round_s'] for r in plain):.2f}"
                      if plain and case.tau else "—",
                      median_range([r["sync_exposed_s"] for r in runs], ".2f"),
                      median_range([r["peer_wait_s"] for r in runs], ".2f")
                      if all("peer_wait_s" in r for r in runs) else "—",
                      median_range([r["round_s"] - r["compute_s"] for r in runs], ".2f"),
                      median_range([r["sync_s"] for r in runs], ".2f"), f"{model_sync:.2f}",
                      f"{(sync - model_sync) / model_sync:+.0%}" if case.tau == 0 else "—",
                      f"{compute + max(0.0, model_sync - hidden):.2f}" if compute is not None else "—",
                      f"{kernel:,.0f}", f"{reported:,.0f}", f"{(kernel - reported) / reported:+.1%}",
                      " / ".join(f"{statistics.median(r[f'{name}_per_sync'] for r in runs):.1f}"
                                 for name in LOSSES) if all(f"{LOSSES[0]}_per_sync" in r for r in runs) else "—")
        table.notes.append(
            "Median (range) over the repeats of the steady rounds' medians. round s: wall seconds per round; exposed "
            "s: the synchronisation seconds the run reports training waited for; peer wait s: what the round's closing "
            "loss sum waited for the slowest process (the run's peer_wait_s; — where not recorded); beyond compute s: "
            "round s less the seconds its inner steps took (the run's compute_s), which the exposed seconds and the "
            "peer wait should account for; ÷ τ = 0: "
            "round s against the same setting's at τ = 0; sync s: "
            "the synchronisation's seconds from start to end. model sync s: the merge's own compute (the unshaped "
            "run's sync s) plus the cost model's seconds for the reported wire bytes at this rate, TCP's headers "
            "charged (`isoloco.sync.cost.TCP_FRAMING`) and no latency (no delay is added to the link); sync off: "
            "measured against it (at τ = 0 only: an overlapped synchronisation's sync s also holds the τ steps it "
            "overlaps). model round s: the compute plus what of the model's sync seconds the τ overlapped "
            "steps do not hide. kernel bytes / sync: what TCP carried out of the islands (the shaper's count less 66 "
            "header bytes a packet), per process "
            "and synchronisation, start-up and evaluation traffic included; reported: the run's own "
            "wire_bytes_cross_island (the cost model's count of what the collectives send). dropped / "
            "retransmitted / RTOs: packets the shapers' queues dropped, segments TCP sent again and its "
            "retransmission timeouts, all islands together, per synchronisation (— where not recorded).")
        out.append(table)
    return out


#: What the probe sends per process by default: tiny's float32, bf16 and int4 synchronisations.
PROBE_BYTES = "5048576,2524288,650820"


def probe_seconds(net: IslandNet, size: int, repeats: int, port: int) -> dict[str, list[float]]:
    """gloo's all-reduce and all-gather alone across `net`'s islands, one process each, sized to put
    `size` bytes on a process's link (`isoloco.bench.linkprobe`): the seconds of each call."""
    command = [sys.executable, "-m", "isoloco.bench.linkprobe"]
    procs = [subprocess.Popen(net.argv(k, [*command, str(k), str(net.islands), net.address(0), str(port), str(size),
                                           str(repeats)], {"OMP_NUM_THREADS": "1"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(net.islands)]
    outputs = [proc.communicate(timeout=RUN_TIMEOUT_S) for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"the link probe failed: {[err.strip().splitlines()[-1:] for _, err in outputs]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def probe_table(islands: int, rates: list[float], sizes: list[int], repeats: int) -> Table:
    """`probe_seconds` at each rate and size, beside the cost model's seconds for those bytes."""
    table = Table(f"gloo's collectives alone on the real link, {islands} islands of 1 process",
                  ["rate Mbit/s", "bytes / process", "collective", "s", "model s", "off"])
    with IslandNet(islands, None) as net:
        for rate in rates:
            for island in range(islands):
                net.shape(island, rate)
            for index, size in enumerate(sizes):
                seconds = probe_seconds(net, size, repeats, PORT_BASE + 300 + index)
                # The model charges every collective its bytes alone, whichever it is.
                model = Link(bandwidth=rate * 1e6 / 8, latency=0.0, framing=TCP_FRAMING).collective_seconds(
                    "all_reduce", size, islands)
                for name, values in seconds.items():
                    measured = statistics.median(values)
                    table.add(f"{rate:g}", f"{size:,}", name, median_range(values, ".2f"), f"{model:.2f}",
                              f"{(measured - model) / model:+.0%}")
    table.notes.append(f"Median (range) of {repeats} calls each, the calls interleaved, each after a barrier. "
                       "all_gather: one gloo call of the whole block; all_gather in pieces: as the engine "
                       "starts it (`isoloco.torch_comm.GLOO_PIECE_BYTES`); model: the bytes with TCP's headers "
                       "at the rate, no latency.")
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m isoloco.bench.reallink",
        description="Train isoloco across islands in network namespaces joined by kernel-shaped links (tc tbf), "
                    "and measure time per round, exposed synchronisation and the bytes the kernel counted, beside "
                    "the cost model's predictions. Needs root and iproute2; leaves no namespace behind.")
    ap.add_argument("--islands", type=int, default=2, help="islands, each a namespace (2 to 4 are sensible here)")
    ap.add_argument("--processes", type=int, default=1, help="processes per island (dist.gpus_per_worker)")
    ap.add_argument("--model", default="tiny", help="model preset (tiny, small, ...)")
    ap.add_argument("--rates", default="10,100,1000", help="egress rates in Mbit/s, comma-separated; an unshaped "
                                                           "run of each case is added as the compute reference")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    ap.add_argument("--inner-steps", type=int, default=12, help="H")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step, all islands together")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--taus", default=None, help="overlap τ values (default: 0 and H/6)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (the first and last are not steady)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe", action="store_true", help="time gloo's all-reduce and all-gather alone on the link "
                                                         "(no training), for --probe-bytes per process")
    ap.add_argument("--probe-bytes", default=PROBE_BYTES, help="bytes a probed collective puts on a process's "
                                                               "link, comma-separated")
    ap.add_argument("--markdown", type=Path, help="append the tables here too")
    ap.add_argument("--json", type=Path, help="write every run's figures here, after each run")
    ap.add_argument("--from-json", type=Path, help="print the tables of the runs a --json file holds, training "
                                                   "nothing")
    args = ap.parse_args(argv)
    try:
        args.rate_list = [float(r) for r in args.rates.split(",") if r]
        args.probe_sizes = [int(b) for b in args.probe_bytes.split(",") if b]
        args.setting_list = [s for s in args.settings.split(",") if s]
        args.tau_list = ([int(t) for t in args.taus.split(",")] if args.taus
                         else sorted({0, args.inner_steps // 6}))
    except ValueError as err:
        raise UsageError(f"--rates, --taus and --probe-bytes take comma-separated numbers: {err}") from None
    unknown = [s for s in args.setting_list if s not in SETTINGS]
    if unknown:
        raise UsageError(f"--settings {','.join(unknown)} unknown: choose from {', '.join(SETTINGS)}")
    if args.rounds < 3:
        raise UsageError(f"--rounds {args.rounds} is too few: the first and last rounds are not steady, so at "
                         "least 3 are needed")
    if any(not 0 <= t < args.inner_steps for t in args.tau_list):
        raise UsageError(f"--taus {args.taus} not allowed: each τ must be in [0, H = {args.inner_steps})")
    return args


def save(path: Path, results: dict[Case, list[dict[str, float]]], command: str, load: float, setup: dict) -> None:
    """The runs so far, with what `--from-json` needs to print their tables (written whole, then
    renamed into place: a benchmark stopped midway keeps every run it finished)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"command": command, "load": load, "setup": setup, "cases": [
        {"setting": c.setting, "rate_mbit": c.rate_mbit, "tau": c.tau, "runs": runs}
        for c, runs in results.items() if runs]}, indent=1))
    partial.replace(path)


def measure(args: argparse.Namespace, command: str, setup: dict) -> dict[Case, list[dict[str, float]]]:
    """Train every case `args.repeats` times across namespaced islands; each run's figures (after
    each run also in `args.json`, if given)."""
    # The unshaped reference gives a round's compute, which τ does not change: at τ = 0 only.
    cases = [Case(s, None, 0) for s in args.setting_list]
    cases += [Case(s, rate, tau) for rate in args.rate_list for s in args.setting_list for tau in args.tau_list]
    results: dict[Case, list[dict[str, float]]] = {case: [] for case in cases}
    port = PORT_BASE
    with tempfile.TemporaryDirectory(prefix="isoloco-reallink-") as root, \
            IslandNet(args.islands, None) as net:
        for repeat in range(args.repeats):  # repeats interleaved: a drift in load spreads over every case
            for index, case in enumerate(cases):
                for island in range(args.islands):
                    net.shape(island, case.rate_mbit)
                items = run_items(args.model, args.islands, args.processes, args.inner_steps, args.rounds, case.tau,
                                  case.setting, args.global_batch, args.seq_len)
                port = PORT_BASE + (port - PORT_BASE + 1) % 200
                job = IslandJob(net, Path(root) / f"{repeat}-{index}", items, args.processes, port)
                figures = measure_run(net, job)
                results[case].append(figures)
                if args.json:
                    save(args.json, results, command, os.getloadavg()[0], setup)
                rate = "unshaped" if case.rate_mbit is None else f"{case.rate_mbit:g} Mbit/s"
                print(f"[{repeat + 1}/{args.repeats}] {case.setting} τ={case.tau} {rate}: round "
                      f"{figures['round_s']:.2f} s, exposed {figures['sync_exposed_s']:.2f} s", file=sys.stderr,
                      flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    try:
        args = parse_args(argv)
        if args.from_json is None:
            require_namespaces()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.probe:
        command = f"python -m isoloco.bench.reallink {' '.join(argv if argv is not None else sys.argv[1:])}"
        text = probe_table(args.islands, args.rate_list, args.probe_sizes, args.repeats).markdown()
        text += f"\n\n`{command}`; load average {os.getloadavg()[0]:.2f} at the end.\n"
        print(text)
        if args.markdown:
            with args.markdown.open("a") as markdown:
                markdown.write(text)
        return 0
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        results = {Case(c["setting"], c["rate_mbit"], c["tau"]): c["runs"] for c in saved["cases"]}
        command, load, setup = saved["command"], saved["load"], saved["setup"]
    else:
        command = f"python -m isoloco.bench.reallink {' '.join(argv if argv is not None else sys.argv[1:])}"
        setup = {key: getattr(args, key) for key in SETUP}
        results = measure(args, command, setup)
        load = os.getloadavg()[0]
    made = tables(results, setup["islands"], setup["processes"], setup["model"], setup["inner_steps"],
                  f"{setup['global_batch']} × {setup['seq_len']} tokens a step")
    text = "\n\n".join(table.markdown() for table in made)
    text += f"\n\n`{command}`; load average {load:.2f} at the end.\n"
    print(text)
    if args.markdown:
        with args.markdown.open("a") as markdown:
            markdown.write(text)
    if args.json and args.from_json is None:
        save(args.json, results, command, load, setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
