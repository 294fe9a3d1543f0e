"""The slow link: what a round costs when islands talk through one, and how much of the
synchronisation training still waits for, as the merge is bucketed, compressed and overlapped.

`python -m isoloco.bench --only link` prints the tables; `python -m isoloco.bench.link
[--quick] [--plot PNG]` prints them and draws the round times.

Two islands of two processes (R = 2 workers, G = 2; gloo on this machine) train DiLoCo and
IsoLoCo for a few rounds of H steps, every collective between islands delayed as a link of
the given bandwidth and latency would delay it (`dist.emulate_link`: an emulation on
loopback, not a network). Each case is one setting of `merge.bucket_mb` (per tensor: every
tensor a collective of its own; bucketed: the default), `merge.quantize` and
`outer.overlap_steps` τ. The figures come from the runs' metrics lines: seconds per round
(`wall_time_s`), `sync_s` and `sync_exposed_s`, and the cross-island wire bytes, as medians
over the steady rounds (the first, which starts the processes' caches, and the last, whose
synchronisation has no next round to overlap with, are left out).

A second table measures what overlap hides on the `quick` preset's run (the tiny model, H = 30)
with R = 2 workers on 2 processes (2 islands of one) behind a 0.05 Gbit/s, 20 ms link: the
exposed synchronisation at τ = 5 against τ = 0. A third checks the planning model (`isoloco.bench.planning.Link`) against the
emulated link: the seconds it predicts for the float32 merge's collectives against the
measured `sync_s` at τ = 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Iterator

from isoloco.bench.comm import join_job, spawn_job
from isoloco.bench.planning import Link
from isoloco.bench.table import Table, megabytes
from isoloco.config import resolve
from isoloco.distributed import process_group
from isoloco.trainer import Trainer

METHODS = ("diloco", "isoloco")
#: merge.bucket_mb: below every tensor's size (one collective each), and the default.
BUCKETING = {"per tensor": 1e-6, "bucketed": 64.0}
QUANTIZE = ("none", "bf16", "int8", "int4")
#: Emulated slow links (Gbit/s, ms) between the two islands.
LINKS = ((0.1, 20.0), (1.0, 20.0))
INNER_STEPS, ROUNDS = 12, 5
#: τ: none, and H/6.
OVERLAPS = (0, INNER_STEPS // 6)
PROCESSES, GPUS_PER_WORKER = 4, 2
QUICK = {"methods": ("diloco",), "quantize": ("none", "int8"), "links": LINKS[:1]}
#: The overlap table: the quick preset's run, 2 workers on 2 processes, a 0.05 Gbit/s link.
OVERLAP_LINK, OVERLAP_TAUS, OVERLAP_ROUNDS = (0.05, 20.0), (0, 5), 4


def case_config(method: str, link: tuple[float, float], bucket_mb: float, quantize: str, tau: int,
                rounds: int = ROUNDS) -> dict:
    """The run of one case: the tiny model on the embedded corpus, 2 islands of 2 processes."""
    return {"method": method, "model": "tiny", "workers": PROCESSES // GPUS_PER_WORKER,
            "gpus_per_worker": GPUS_PER_WORKER, "global_batch": 16, "seq_len": 64, "steps": rounds * INNER_STEPS,
            "inner_steps": INNER_STEPS, "eval_every": rounds * INNER_STEPS, "checkpoint_every": 0,
            "data.val_tokens": 1024, "device": "cpu", "dist.backend": "gloo", "dist.timeout_s": 300,
            "dist.emulate_link": f"{link[0]},{link[1]}", "merge.bucket_mb": bucket_mb, "merge.quantize": quantize,
            "outer.overlap_steps": tau}


def steady_rounds(metrics: list[dict]) -> dict[str, float]:
    """Medians over the steady rounds of a run's round lines (those with `sync_s`): seconds
    per round, `sync_s`, `sync_exposed_s`, cross-island wire bytes and collectives. The
    first and the last round are left out (see the module docstring)."""
    rounds = [line for line in metrics if "sync_s" in line]
    seconds = [b["wall_time_s"] - a["wall_time_s"] for a, b in zip(rounds, rounds[1:])]
    steady = rounds[1:-1]
    figures = {key: statistics.median(line[key] for line in steady)
               for key in ("sync_s", "sync_exposed_s", "wire_bytes_cross_island", "collectives_cross_island")}
    return {"round_s": statistics.median(seconds[:-1]), **figures}


def overlap_config(method: str, tau: int) -> dict:
    """The overlap table's run: the quick preset's, shortened, on 2 processes behind the link."""
    return {"method": method, "workers": 2, "steps": OVERLAP_ROUNDS * 30, "eval_every": OVERLAP_ROUNDS * 30,
            "checkpoint_every": 0, "device": "cpu", "dist.backend": "gloo", "dist.timeout_s": 300,
            "dist.emulate_link": f"{OVERLAP_LINK[0]},{OVERLAP_LINK[1]}", "outer.overlap_steps": tau}


def _run_cases(rank: int, world_size: int, port: int, cases: dict[str, tuple[str | None, dict]], root: str,
               out: str) -> None:
    """One process of the job: train every case (a preset and overrides) in a run folder under
    `root`, which every process shares (checkpoints are written by several); rank 0 writes
    the steady figures."""
    join_job(rank, world_size, port)
    results = {}
    with process_group(resolve(*next(iter(cases.values())))):
        for index, (name, (preset, overrides)) in enumerate(cases.items()):
            run = Path(root) / str(index)
            run.mkdir(exist_ok=True)
            Trainer(resolve(preset, overrides), run, progress=False).run()
            if rank == 0:
                lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                results[name] = steady_rounds(lines)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def measure(quick: bool) -> dict[str, dict[str, float]]:
    """Every case's steady figures, keyed by `_key`."""
    methods, quantize, links = ((QUICK["methods"], QUICK["quantize"], QUICK["links"]) if quick
                                else (METHODS, QUANTIZE, LINKS))
    cases = {_key(m, link, bucketing, q, tau): (None, case_config(m, link, BUCKETING[bucketing], q, tau))
             for link in links for m in methods for bucketing in BUCKETING for q in quantize for tau in OVERLAPS}
    overlap = {f"overlap|{m}|{tau}": ("quick", overlap_config(m, tau)) for m in methods for tau in OVERLAP_TAUS}
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as other:
        return {**spawn_job(_run_cases, PROCESSES, cases, root), **spawn_job(_run_cases, 2, overlap, other)}


def _key(method: str, link: tuple[float, float], bucketing: str, quantize: str, tau: int) -> str:
    return f"{method}|{link[0]}|{bucketing}|{quantize}|{tau}"


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    del repeats, device  # one run per case, on gloo processes on the CPU
    yield from results_tables(measure(quick))


def results_tables(results: dict[str, dict[str, float]]) -> Iterator[Table]:
    overlap = {key: figures for key, figures in results.items() if key.startswith("overlap|")}
    results = {key: figures for key, figures in results.items() if key not in overlap}
    links = sorted({float(key.split("|")[1]) for key in results})
    methods = [m for m in METHODS if any(key.startswith(m + "|") for key in results)]
    quantize = [q for q in QUANTIZE if any(f"|{q}|" in key for key in results)]
    for gbps in links:
        table = Table(f"The slow link at {gbps:g} Gbit/s, {LINKS[0][1]:g} ms: seconds per round and seconds "
                      f"training waits for the synchronisation (exposed), 2 islands × 2 processes",
                      ["method", "merge", "pseudo-gradients"]
                      + [f"τ={tau}: round s (exposed s)" for tau in OVERLAPS]
                      + ["cross-island wire per process", "cross-island collectives"])
        for method in methods:
            for bucketing in BUCKETING:
                for q in quantize:
                    by_tau = [results[_key(method, (gbps, LINKS[0][1]), bucketing, q, tau)] for tau in OVERLAPS]
                    table.add(method, bucketing, "float32" if q == "none" else q,
                              *(f"{r['round_s']:.2f} ({r['sync_exposed_s']:.2f})" for r in by_tau),
                              megabytes(by_tau[0]["wire_bytes_cross_island"]),
                              f"{by_tau[0]['collectives_cross_island']:g}")
        table.notes.append(
            f"H = {INNER_STEPS} steps of the `tiny` model per round, global batch 16 × 64 tokens, R = 2 workers, "
            f"each an island of 2 gloo processes on this machine; medians over rounds 2 to {ROUNDS - 1} of "
            f"{ROUNDS}. The link is emulated: each cross-island collective is followed by a wait of the latency "
            "plus its wire bytes at the bandwidth (`dist.emulate_link`). With τ > 0 a round's synchronisation "
            "runs while the next round's first τ steps train, and is counted in the round it lands in. "
            "Wire bytes and collectives: one process's, per synchronisation.")
        yield table
    yield overlap_table(overlap, methods)
    yield planning_table(results, links, methods)


def overlap_table(results: dict[str, dict[str, float]], methods: list[str]) -> Table:
    """Exposed synchronisation seconds at τ = 5 against τ = 0 (the quick preset's run)."""
    none, tau = OVERLAP_TAUS
    table = Table(f"What overlap hides: the `quick` run, R = 2 on 2 processes, {OVERLAP_LINK[0]:g} Gbit/s, "
                  f"{OVERLAP_LINK[1]:g} ms", ["method", "sync_s", f"exposed, τ={none}", f"exposed, τ={tau}",
                                              "exposed ratio", "round s, τ=0 → 5"])
    for method in methods:
        blocking, overlapped = results[f"overlap|{method}|{none}"], results[f"overlap|{method}|{tau}"]
        table.add(method, f"{blocking['sync_s']:.2f}", f"{blocking['sync_exposed_s']:.2f}",
                  f"{overlapped['sync_exposed_s']:.2f}",
                  f"{overlapped['sync_exposed_s'] / blocking['sync_exposed_s']:.2f}",
                  f"{blocking['round_s']:.2f} → {overlapped['round_s']:.2f}")
    table.notes.append(
        f"The `quick` preset (tiny model, global batch 32 × 128 tokens, H = 30) with workers=2, "
        f"{OVERLAP_ROUNDS} rounds; each process is an island holding one worker; medians over the steady rounds. "
        "Exposed ratio: the seconds training waits for a synchronisation with τ = 5, over those with τ = 0.")
    return table


def planning_table(results: dict[str, dict[str, float]], links: list[float], methods: list[str]) -> Table:
    """The planning model's seconds for the float32 merge against the emulated link's."""
    table = Table("The planning model against the emulated link: seconds of a float32 synchronisation at τ = 0",
                  ["link", "method", "merge", "collectives across", "planned s", "measured sync_s", "measured ÷ planned"])
    latency = LINKS[0][1] / 1000
    for gbps in links:
        link = Link(gbps * 1e9 / 8, latency)
        for method in methods:
            for bucketing in BUCKETING:
                measured = results[_key(method, (gbps, LINKS[0][1]), bucketing, "none", 0)]
                # A ring all-reduce over 2 members puts its whole tensor on each member's link
                # (2(k − 1)/k of it), in as many messages as the merge makes collectives across.
                crossing = measured["collectives_cross_island"]
                planned = link.all_reduce(measured["wire_bytes_cross_island"], 2, round(crossing))
                table.add(f"{gbps:g} Gbit/s", method, bucketing, f"{crossing:g}", f"{planned:.2f}",
                          f"{measured['sync_s']:.2f}", f"{measured['sync_s'] / planned:.2f}")
    table.notes.append(
        "Planned: `planning.Link.all_reduce` of a process's cross-island wire bytes over 2 islands, one message "
        "per collective that crosses (a ring of 2 members: 2 latency steps each; the emulation charges one); "
        "measured: the run's "
        "`sync_s`, which also holds the merge's own compute (IsoLoCo's orthogonalisations) and the in-island "
        "all-gathers over loopback.")
    return table


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    """Seconds per round of every case, one panel per link: a bar per τ, its exposed
    synchronisation drawn darker at the bar's end."""
    import matplotlib.style
    from matplotlib.figure import Figure

    results = {key: figures for key, figures in results.items() if not key.startswith("overlap|")}
    links = sorted({float(key.split("|")[1]) for key in results})
    cases = sorted({tuple(key.split("|")[i] for i in (0, 2, 3)) for key in results},
                   key=lambda c: (METHODS.index(c[0]), list(BUCKETING).index(c[1]), QUANTIZE.index(c[2])))
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(11, 0.32 * len(cases) + 1.6), layout="constrained")
        axes = fig.subplots(1, len(links), sharey=True, squeeze=False)[0]
        height = 0.8 / len(OVERLAPS)
        for ax, gbps in zip(axes, links):
            for j, tau in enumerate(OVERLAPS):
                figures = [results[_key(m, (gbps, LINKS[0][1]), b, q, tau)] for m, b, q in cases]
                rows = [i + (j - (len(OVERLAPS) - 1) / 2) * height for i in range(len(cases))]
                color = f"C{j}"
                ax.barh(rows, [f["round_s"] - f["sync_exposed_s"] for f in figures], height, color=color, alpha=0.45,
                        label=f"τ = {tau}: training and merge compute")
                ax.barh(rows, [f["sync_exposed_s"] for f in figures], height,
                        left=[f["round_s"] - f["sync_exposed_s"] for f in figures], color=color,
                        label=f"τ = {tau}: waiting for the synchronisation")
            ax.set(title=f"{gbps:g} Gbit/s, {LINKS[0][1]:g} ms", xlabel="seconds per round")
            ax.grid(True, axis="x", alpha=0.3)
        axes[0].set_yticks(range(len(cases)), [f"{m}, {b}, {'float32' if q == 'none' else q}" for m, b, q in cases])
        axes[0].invert_yaxis()
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize="small")
        fig.savefig(path, dpi=110, metadata={"Software": None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isoloco.bench.link", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="DiLoCo only, float32 and int8, the slower link")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the round times to this PNG file")
    args = parser.parse_args(argv)
    results = measure(args.quick)
    for table in results_tables(results):
        print("\n" + table.markdown(), flush=True)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
