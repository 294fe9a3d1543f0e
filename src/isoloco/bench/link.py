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

Two tables take the link to many islands. One counts the cross-island wire bytes of one
synchronisation per process for P = 2, 4 and 8 islands (one gloo process each) and R up to 32
workers, for float32 and every codec, measured beside the cost model's prediction
(`isoloco.sync.compressed`): each island adds up its workers first, so the bytes are flat in R,
and the compressed sum's route keeps them flat in P. The other times rounds (wall clock) of 4
islands of one process, R = 8, behind an emulated link, with and without overlap.

A further table measures what overlap hides on the `quick` preset's run (the tiny model, H = 30)
with R = 2 workers on 2 processes (2 islands of one) behind a 0.05 Gbit/s, 20 ms link: the
exposed synchronisation at τ = 5 against τ = 0. A third checks the cost model (`isoloco.sync.cost.Link`) against the
emulated link: the seconds it predicts for the float32 merge's collectives against the
measured `sync_s` at τ = 0. The last times one process's compute of a compressed sum per bucket
at P·G = 64 chunks against one (`isoloco.bench.island_compute`): it must not grow with the chunks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from isoloco.bench import island_compute
from isoloco.bench.comm import job_config, join_job, spawn_job
from isoloco.bench.workload import parameter_shapes, worker_deltas
from isoloco.bench.table import Table, kibibytes, megabytes
from isoloco.config import resolve
from isoloco.distributed import Distributed, process_group
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig
from isoloco.sync.codec import Quantization, wire_nbytes
from isoloco.sync.cost import Link, wire_bytes
from isoloco.sync.slowlink import mean_wire_bytes
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
#: The many-islands byte table: P islands of one process, R workers (the `tiny` model's deltas).
ISLANDS, ISLAND_WORKERS = (2, 4, 8), (8, 16, 32)
QUICK_ISLANDS = {"islands": (2, 4), "workers": (8, 16)}
#: The many-islands round table: 4 islands of one process, R = 8, a 0.1 Gbit/s, 20 ms link.
ROUND_ISLANDS, ROUND_WORKERS, ROUND_LINK, ROUND_TAUS = 4, 8, (0.1, 20.0), (0, 2)
#: The compression table: every setting of the loss-against-bytes science (`MergeConfig` keys),
#: measured at P islands of one process and computed for the 178M model.
COMPRESSIONS = {
    "float32": {},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
    **{f"lowrank r={rank}, int8": {"compress": "lowrank", "compress_rank": rank, "quantize": "int8"}
       for rank in (1, 2, 4, 8)},
    **{f"topk {density:.0%}, int8": {"compress": "topk", "compress_density": density, "quantize": "int8"}
       for density in (0.1, 0.03, 0.01)},
}
COMPRESS_ISLANDS, COMPRESS_COMPUTED = (2, 4), (("tiny", 8), ("178m", 2), ("178m", 8))


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
               for key in ("sync_s", "sync_exposed_s", "wire_bytes_cross_island", "collectives_cross_island",
                           "compute_s", "peer_wait_s") if key in steady[0]}
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
            run.mkdir(parents=True, exist_ok=True)
            Trainer(resolve(preset, overrides), run, progress=False).run()
            if rank == 0:
                lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                results[name] = steady_rounds(lines)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


#: The parts of the benchmark, each one job of processes: `--parts` picks some.
PARTS = ("link", "overlap", "islands", "rounds", "compress")


def measure(quick: bool, parts: tuple[str, ...] = PARTS) -> dict[str, dict[str, float]]:
    """Every case's steady figures, keyed by `_key` (and the parts' own keys)."""
    methods, quantize, links = ((QUICK["methods"], QUICK["quantize"], QUICK["links"]) if quick
                                else (METHODS, QUANTIZE, LINKS))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        if "link" in parts:
            cases = {_key(m, link, bucketing, q, tau): (None, case_config(m, link, BUCKETING[bucketing], q, tau))
                     for link in links for m in methods for bucketing in BUCKETING for q in quantize for tau in OVERLAPS}
            results.update(spawn_job(_run_cases, PROCESSES, cases, f"{root}/link"))
        if "overlap" in parts:
            overlap = {f"overlap|{m}|{tau}": ("quick", overlap_config(m, tau)) for m in methods for tau in OVERLAP_TAUS}
            results.update(spawn_job(_run_cases, 2, overlap, f"{root}/overlap"))
        if "rounds" in parts:
            rounds = {f"rounds|{q}|{tau}": (None, islands_config(q, tau)) for q in quantize for tau in ROUND_TAUS}
            results.update(spawn_job(_run_cases, ROUND_ISLANDS, rounds, f"{root}/rounds"))
    if "islands" in parts:
        sizes = QUICK_ISLANDS if quick else {"islands": ISLANDS, "workers": ISLAND_WORKERS}
        for islands in sizes["islands"]:
            results.update(spawn_job(_count_island_bytes, islands, sizes["workers"],
                                     {q: {"quantize": q} for q in QUANTIZE}, "islands"))
    if "compress" in parts:
        for islands in COMPRESS_ISLANDS:
            results.update(spawn_job(_count_island_bytes, islands, (islands,), COMPRESSIONS, "compress"))
    return results


def islands_config(quantize: str, tau: int) -> dict:
    """The many-islands round table's run: 4 islands of one process, R = 8, behind the link."""
    rounds = ROUNDS * INNER_STEPS
    return {"method": "isoloco", "model": "tiny", "workers": ROUND_WORKERS, "global_batch": 16, "seq_len": 64,
            "steps": rounds, "inner_steps": INNER_STEPS, "eval_every": rounds, "checkpoint_every": 0,
            "data.val_tokens": 1024, "device": "cpu", "dist.backend": "gloo", "dist.timeout_s": 300,
            "dist.emulate_link": f"{ROUND_LINK[0]},{ROUND_LINK[1]}", "merge.quantize": quantize,
            "outer.overlap_steps": tau}


def _count_island_bytes(rank: int, world_size: int, port: int, workers_list: tuple[int, ...],
                        settings: dict[str, dict], prefix: str, out: str) -> None:
    """One process of the job (an island of one process): merge the `tiny` model's deltas of
    every R once under each of `settings` (a label's `MergeConfig` keys); rank 0 writes each
    merge's cross-island wire bytes per process, keyed `prefix|P|R|label`."""
    join_job(rank, world_size, port)
    shapes = parameter_shapes("tiny")
    counts = {}
    with process_group(resolve(None, job_config("tiny", workers_list[0]))):
        for workers in workers_list:
            deltas = worker_deltas(shapes, workers)
            for label, keys in settings.items():
                run = Distributed(resolve(None, {**job_config("tiny", workers),
                                                 **{f"merge.{key}": value for key, value in keys.items()}}))
                local = {name: [tensors[w] for w in run.comm.local_worker_ids] for name, tensors in deltas.items()}
                run.comm.reset_link_bytes()
                Merger(MergeConfig(**keys), run.comm, seed=0).merge_all(local)
                counts[f"{prefix}|{world_size}|{workers}|{label}"] = {
                    "wire": run.link_bytes(run.comm)["wire_bytes_cross_island"]}
    if rank == 0:
        Path(out).write_text(json.dumps(counts))


def predicted_wire_bytes(islands: int, fmt: str) -> float:
    """The cost model's cross-island wire bytes per process of one merge of the `tiny` model's
    sum over `islands` islands of one process: a float32 all-reduce, or the compressed sum, per bucket."""
    return modelled([shape for _, shape in parameter_shapes("tiny")], MergeConfig(quantize=fmt), islands)


def modelled(shapes: list[torch.Size], cfg: MergeConfig, islands: int) -> float:
    """The cost model's cross-island wire bytes per process of one merge by the mean of tensors
    of `shapes` under `cfg`, over `islands` islands of one process."""
    return mean_wire_bytes(shapes, cfg.lossy_compression, cfg.bucket_bytes, islands)


def _key(method: str, link: tuple[float, float], bucketing: str, quantize: str, tau: int) -> str:
    return f"{method}|{link[0]}|{bucketing}|{quantize}|{tau}"


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    del device  # one run per case, on gloo processes on the CPU
    yield from results_tables(measure(quick))
    yield island_compute.table(max(repeats, 3))


def results_tables(results: dict[str, dict[str, float]]) -> Iterator[Table]:
    """The tables of whichever parts `results` holds."""
    overlap = {key: figures for key, figures in results.items() if key.startswith("overlap|")}
    islands = {key: figures for key, figures in results.items() if key.startswith("islands|")}
    rounds = {key: figures for key, figures in results.items() if key.startswith("rounds|")}
    compress = {key: figures for key, figures in results.items() if key.startswith("compress|")}
    results = {key: figures for key, figures in results.items()
               if key not in overlap and key not in islands and key not in rounds and key not in compress}
    links = sorted({float(key.split("|")[1]) for key in results})
    methods = [m for m in METHODS if any(key.startswith((f"{m}|", f"overlap|{m}|")) for key in {**results, **overlap})]
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
            f"{ROUNDS}. The link is emulated: each cross-island collective's result is held back until a link "
            "busy with the ones before it would have delivered it: its wire bytes at the bandwidth plus a "
            "latency per latency-bound step of its algorithm (`dist.emulate_link`, `isoloco.sync.cost`). With τ > 0 a round's synchronisation runs while the next round's "
            "first τ steps train, and is counted in the round it lands in. "
            "Wire bytes and collectives: one process's, per synchronisation.")
        yield table
    if overlap:
        yield overlap_table(overlap, methods)
    if results:
        yield planning_table(results, links, methods)
    if islands:
        yield islands_table(islands)
    if rounds:
        yield rounds_table(rounds)
    if compress:
        yield compress_table(compress)


def compress_table(results: dict[str, dict[str, float]]) -> Table:
    """Cross-island wire bytes per process of one merge under each compression setting."""
    measured_at = sorted({int(key.split("|")[1]) for key in results})
    table = Table("Compression: cross-island wire bytes per process of one merge, against float32",
                  ["setting", *[f"tiny, P={p}: measured (predicted), ×float32" for p in measured_at],
                   *[f"{model}, P={p}: computed, ×float32" for model, p in COMPRESS_COMPUTED]])
    shapes = {model: [shape for _, shape in parameter_shapes(model)] for model, _ in COMPRESS_COMPUTED}
    for label, keys in COMPRESSIONS.items():
        cells = []
        for p in measured_at:
            wire, float32 = (results[f"compress|{p}|{p}|{name}"]["wire"] for name in (label, "float32"))
            predicted = modelled([shape for _, shape in parameter_shapes("tiny")], MergeConfig(**keys), p)
            cells.append(f"{kibibytes(wire)} ({kibibytes(predicted)}), {float32 / wire:.1f}×")
        for model, p in COMPRESS_COMPUTED:
            wire, float32 = (modelled(shapes[model], MergeConfig(**k), p) for k in (keys, {}))
            cells.append(f"{kibibytes(wire)}, {float32 / wire:.1f}×")
        table.add(label, *cells)
    table.notes.append(
        "One merge (mean) of the model's deltas over P islands of one gloo process each; measured: "
        "`wire_bytes_cross_island` averaged over the processes; predicted and computed: the cost model "
        "(`isoloco.sync.slowlink.mean_wire_bytes`), for the same buckets. ×float32: how many times fewer bytes "
        "than float32's ring all-reduce. Vectors travel under merge.quantize in every setting. Low rank sends "
        "two compressed sums (of the m×k and n×k factors), flat in R; its ratio falls with P where a factor has "
        "fewer scale groups than there are islands (whole groups are not split among the P owners, and the "
        "all-gather sends every owner the largest chunk). Top-k all-gathers every island's entries, so its bytes "
        "per process grow as P − 1 while float32's stay about flat.")
    return table


def islands_table(results: dict[str, dict[str, float]]) -> Table:
    """Cross-island wire bytes per process of one synchronisation, by P, R and format."""
    keys = [key.split("|")[1:] for key in results]
    islands = sorted({int(p) for p, _, _ in keys})
    workers = sorted({int(r) for _, r, _ in keys})
    formats = [q for q in QUANTIZE if any(q == fmt for _, _, fmt in keys)]
    table = Table("Many islands: cross-island wire bytes per process of one synchronisation, measured "
                  "(predicted), and against float32",
                  ["P islands", "R workers", *[("float32" if q == "none" else q) for q in formats],
                   "int8 if every worker's codes were gathered (computed)"])
    for p in islands:
        for r in workers:
            measured = {q: results[f"islands|{p}|{r}|{q}"]["wire"] for q in formats
                        if f"islands|{p}|{r}|{q}" in results}
            if not measured:
                continue
            float32 = measured.get("none")
            cells = []
            for q in formats:
                ratio = f", {measured[q] / float32:.3f}×" if float32 and q != "none" else ""
                cells.append(f"{megabytes(measured[q])} ({megabytes(predicted_wire_bytes(p, q))}){ratio}")
            int8 = Quantization("int8")
            codes = sum(wire_nbytes(shape.numel(), int8, int8.group_size(shape)) for _, shape in parameter_shapes("tiny"))
            gathered = wire_bytes("all_gather", r // p * codes, p)
            table.add(str(p), str(r), *cells, megabytes(gathered))
    table.notes.append(
        "One merge (mean) of the `tiny` model's deltas on P gloo processes, each an island holding R/P workers; "
        "measured: `wire_bytes_cross_island` averaged over the processes; predicted: the cost model "
        "(`isoloco.sync.cost`, `isoloco.sync.compressed`) for the same buckets. Each island adds its workers "
        "up before anything crosses, so nothing depends on R; from P = 3 the compressed sum is an all-to-all "
        "of chunks and an all-gather of the owners' re-encoded sums, ≈ w/4 of float32's ring all-reduce. The "
        "last column is what the earlier layout (an all-gather of every worker's int8 codes) would put on the "
        "link: (P − 1) · R/P codes of the model.")
    return table


def rounds_table(results: dict[str, dict[str, float]]) -> Table:
    """Seconds per round (wall clock) at 4 islands, with and without overlap."""
    formats = [q for q in QUANTIZE if any(key.split("|")[1] == q for key in results)]
    table = Table(f"Many islands: seconds per round, {ROUND_ISLANDS} islands of one process, R = {ROUND_WORKERS}, "
                  f"{ROUND_LINK[0]:g} Gbit/s, {ROUND_LINK[1]:g} ms",
                  ["pseudo-gradients", *[f"τ={tau}: round s (exposed s)" for tau in ROUND_TAUS],
                   "cross-island wire per process"])
    for q in formats:
        by_tau = [results[f"rounds|{q}|{tau}"] for tau in ROUND_TAUS]
        table.add("float32" if q == "none" else q,
                  *(f"{r['round_s']:.2f} ({r['sync_exposed_s']:.2f})" for r in by_tau),
                  megabytes(by_tau[0]["wire_bytes_cross_island"]))
    table.notes.append(
        f"IsoLoCo on the `tiny` model, H = {INNER_STEPS}, global batch 16 × 64 tokens, {ROUNDS} rounds; "
        "medians over the steady rounds. Round s is wall clock (training, the merge's compute and what is "
        "waited for); exposed s is the synchronisation's time on the main thread (its stages and the wait at "
        "the landing). On this 2-core machine the 4 processes share the cores, so compute and transfers "
        "contend.")
    return table


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
                # (2(k − 1)/k of it), once per collective the merge makes across.
                crossing = measured["collectives_cross_island"]
                planned = link.collective_seconds("all_reduce", measured["wire_bytes_cross_island"], 2,
                                                  round(crossing))
                table.add(f"{gbps:g} Gbit/s", method, bucketing, f"{crossing:g}", f"{planned:.2f}",
                          f"{measured['sync_s']:.2f}", f"{measured['sync_s'] / planned:.2f}")
    table.notes.append(
        "Planned: the cost model's seconds (`isoloco.sync.cost.Link`) for a process's cross-island wire bytes over "
        "2 islands, a ring all-reduce per collective that crosses (2 latency steps each, as the emulation "
        "charges); "
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
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to measure, from {', '.join(PARTS)} (default: all)")
    args = parser.parse_args(argv)
    parts = tuple(part for part in args.parts.split(",") if part)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts {','.join(unknown)} is not a part: choose from {', '.join(PARTS)}")
    results = measure(args.quick, parts)
    for table in results_tables(results):
        print("\n" + table.markdown(), flush=True)
    if args.plot and "link" in parts:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
