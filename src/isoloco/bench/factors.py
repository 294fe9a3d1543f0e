"""Factors: what TSV's and Iso-CTS's default `merge.factors=auto` costs against `exact`, and
every rule on recorded pseudo-gradients.

* **auto ÷ exact** on issue 43's deltas: K = 16 workers, one 1024×2688 matrix, a rank-16
  signal shared by the workers plus 0.3 of each one's own Gaussian noise (`--quick`: 512×1344),
  and on deltas where the finder runs to the end and is turned down (`slowly_decaying`).
  Seconds of TSV and Iso-CTS with each setting, the best and the worst of the repeats (the
  rules in turns), Iso-C's for scale, the paths auto's factors took (`factors.FACTOR_PATHS`) and
  both settings' distance to the float64 definition.
* **The stop against the certificate**: how often the finder's stop after one iteration
  agrees with the certificate after three, over synthetic spectra.
* **The finder against LAPACK's SVD by rank**: where `factors.RANDOMIZED_MIN_RANK` sits.
* **Every rule on recorded pseudo-gradients**: one round's deltas of a `repro-cpu` run (its
  tiny model, IsoLoCo, R = 8 and 16), recorded once into `runs/pseudo-gradients/` and read
  from there after. Seconds of each rule's merge of the whole model ÷ Iso-C's, the spread of
  that ratio over the repeats, and the paths TSV's and Iso-CTS's factors took.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from isoloco.bench.table import Table, ratio
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import trained_deltas
from isoloco.comm import LocalCommunicator
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig
from isoloco.factors import FACTOR_PATHS, FactorSettings, _randomized_svd, top_factors

#: Every merge rule, in the order the tables list them.
from isoloco.svd import null_rtol
RULE_NAMES = ("mean", "dare", "ties", "iso_c", "tsv", "iso_cts")
#: The run whose pseudo-gradients are recorded: `repro-cpu`'s method and the round taken.
RECORDED = {"preset": "repro-cpu", "method": "isoloco", "round": 4}
RECORD_DIR = Path("runs/pseudo-gradients")
FULL = {"shape": (1024, 2688), "decaying_shape": (512, 512), "stop_shapes": [(1024, 1024), (1024, 2688)],
        "recorded_workers": (8, 16)}
QUICK = {"shape": (512, 1344), "decaying_shape": (512, 512), "stop_shapes": [(512, 1344)], "recorded_workers": (8,)}


def shared_signal_under_noise(shape: tuple[int, int], workers: int) -> list[torch.Tensor]:
    """Issue 43's deltas: a rank-16 signal shared by the workers plus 0.3 of each one's own noise."""
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(shape[0], 16, generator=g) @ torch.randn(16, shape[1], generator=g)
    return [signal + 0.3 * torch.randn(shape, generator=g) for _ in range(workers)]


def slowly_decaying(shape: tuple[int, int], workers: int) -> list[torch.Tensor]:
    """Each worker's own rank-64 spectrum 0.95^i under 1e-2 noise: a TSV worker keeping 32
    directions there runs the finder to the end and the certificate turns it down (the
    stop's costliest miss, `stop_against_check`)."""
    g = torch.Generator().manual_seed(2)

    def delta() -> torch.Tensor:
        u = torch.linalg.qr(torch.randn(shape[0], 64, generator=g))[0]
        v = torch.linalg.qr(torch.randn(shape[1], 64, generator=g))[0]
        return (u * 0.95 ** torch.arange(64.0)) @ v.T + 1e-2 / max(shape) ** 0.5 * torch.randn(shape, generator=g)

    return [delta() for _ in range(workers)]


def recorded_deltas(workers: int) -> dict[str, list[torch.Tensor]]:
    """Every parameter's per-worker pseudo-gradients (float32, as the outer step receives them)
    of `RECORDED`'s round at R = `workers`: trained on the CPU and saved the first time."""
    path = RECORD_DIR / f"{RECORDED['preset']}-{RECORDED['method']}-R{workers}-round{RECORDED['round']}.safetensors"
    if not path.exists():
        deltas = trained_deltas(RECORDED["round"], RECORDED["preset"], method=RECORDED["method"], workers=workers)
        path.parent.mkdir(parents=True, exist_ok=True)
        # safetensors, not torch.save: nothing this package reads back is unpickled.
        save_file({f"{name}/{worker}": delta.float().contiguous() for name, per_worker in deltas.items()
                   for worker, delta in enumerate(per_worker)}, str(path), metadata={"names": json.dumps(list(deltas))})
    with safe_open(str(path), "pt") as stored:
        return {name: [stored.get_tensor(f"{name}/{worker}") for worker in range(workers)]
                for name in json.loads(stored.metadata()["names"])}


def paths_taken(counts: Counter, merges: int) -> str:
    """The paths of one merge's factorisations, from `counts` over `merges` merges."""
    return ", ".join(f"{path} {counts[path] // merges}" for path in FACTOR_PATHS if counts[path]) or "—"


def _merge_case(rule: str, deltas: dict[str, list[torch.Tensor]], device: str,
                **settings: str) -> tuple[Callable[[], dict[str, torch.Tensor]], Merger]:
    merger = Merger(MergeConfig(rule=rule, **settings), LocalCommunicator(len(next(iter(deltas.values())))), seed=0)
    moved = {name: [delta.to(device) for delta in per_worker] for name, per_worker in deltas.items()}
    return (lambda: merger.merge_all(moved)), merger


def auto_against_exact(title: str, matrices: list[torch.Tensor], repeats: int, device: str) -> Table:
    deltas = {"weight": [matrix.to(device) for matrix in matrices]}
    workers, shape = len(matrices), tuple(matrices[0].shape)
    cases, mergers = {}, {}
    for rule in ("tsv", "iso_cts"):
        for factors in ("auto", "exact"):
            cases[rule, factors], mergers[rule, factors] = _merge_case(rule, deltas, device, factors=factors)
    cases["iso_c", "auto"], _ = _merge_case("iso_c", deltas, device)
    timings = interleaved(cases, repeats)
    table = Table(f"Factors: `merge.factors=auto` against `exact`, K = {workers}, one {shape[0]}×{shape[1]} matrix, "
                  f"{title}",
                  ["rule", "auto, s (best – worst)", "exact, s (best – worst)", "auto ÷ exact, best of each",
                   "auto ÷ Iso-C, best of each", "auto's paths per merge", "auto: error", "exact: error",
                   "‖auto − exact‖ ÷ ‖exact‖"])
    iso_c = min(timings["iso_c", "auto"].samples)
    in_float64 = {name: [delta.double() for delta in per_worker] for name, per_worker in deltas.items()}
    for rule in ("tsv", "iso_cts"):
        auto, exact = timings[rule, "auto"], timings[rule, "exact"]
        truth = _merge_case(rule, in_float64, device, factors="exact")[0]()["weight"]
        merged = {factors: timings[rule, factors].result["weight"].double() for factors in ("auto", "exact")}
        error = {factors: float((merged[factors] - truth).norm() / truth.norm()) for factors in merged}
        apart = float((merged["auto"] - merged["exact"]).norm() / merged["exact"].norm())
        table.add(rule, f"{min(auto.samples):.2f} – {max(auto.samples):.2f}",
                  f"{min(exact.samples):.2f} – {max(exact.samples):.2f}",
                  ratio(min(auto.samples) / min(exact.samples)), ratio(min(auto.samples) / iso_c),
                  paths_taken(mergers[rule, "auto"].factor_paths, repeats + 1), f"{error['auto']:.1e}",
                  f"{error['exact']:.1e}", f"{apart:.1e}")
    table.notes.append(
        f"Each merge times one Merger over the {workers} deltas (float32, default settings but `merge.factors`); the "
        f"cases in turns, {repeats} repeats after one warm-up. Iso-C's best: {iso_c:.2f} s. `exact` is LAPACK's SVD "
        "for every worker's factors and every polar factor; `auto` runs the range finder where a worker keeps at "
        "most 1/16 of the rank, keeps its factors where the certificate passes, stops it after one iteration "
        "where it cannot, and otherwise takes the exact top k by the faster exact route for the shape. Error: "
        "‖merged − reference‖ ÷ ‖reference‖, the reference the rule's definition in float64 (the same merge of the "
        "deltas in float64 with `exact`, which tests/test_merge.py holds to the numpy definition).")
    return table


def stop_cases(shape: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, matrix, k): shared rank-16 signals under 0.3 noise, and rank-64 geometric spectra
    under noise, at several k up to r/16."""
    g = torch.Generator().manual_seed(1)
    signal = torch.randn(shape[0], 16, generator=g) @ torch.randn(16, shape[1], generator=g)
    for k in (8, 16, 32, 64):
        if 16 * k <= min(shape):
            yield f"rank 16 + noise, k = {k}", signal + 0.3 * torch.randn(shape, generator=g), k
    u = torch.linalg.qr(torch.randn(shape[0], 64, generator=g))[0]
    v = torch.linalg.qr(torch.randn(shape[1], 64, generator=g))[0]
    for rate in (0.7, 0.85, 0.9, 0.95):
        for noise in (1e-4, 1e-2, 3e-2):
            for k in (12, 32):
                if 16 * k <= min(shape):
                    matrix = (u * rate ** torch.arange(64.0)) @ v.T
                    yield (f"{rate}^i + {noise:g} noise, k = {k}",
                           matrix + noise / max(shape) ** 0.5 * torch.randn(shape, generator=g), k)


def stop_against_check(shapes: list[tuple[int, int]]) -> Table:
    """How often the finder's stop after one iteration (`factors._hopeless`) agrees with the
    certificate it predicts (`factors._Found.accurate` after the whole finder)."""
    settings = FactorSettings()
    outcomes = Counter()
    for shape in shapes:
        for _, matrix, k in stop_cases(shape):
            run = [_randomized_svd(matrix, k + settings.oversample, settings.power_iters, None, torch.float32, judged)
                   for judged in (k, None)]
            passes = run[1].accurate(k, null_rtol(matrix) * run[1].s[..., :1])
            outcomes["stopped" if run[0] is None else "run on", "passes" if passes else "fails"] += 1
    table = Table("Factors: the finder's stop after one iteration against the certificate after three",
                  ["", "the certificate passes", "the certificate fails"])
    for decision in ("stopped", "run on"):
        table.add(decision, outcomes[decision, "passes"], outcomes[decision, "fails"])
    listed = ", ".join(f"{m}×{n}" for m, n in shapes)
    table.notes.append(
        f"Matrices {listed} (`isoloco.bench.factors.stop_cases`: shared rank-16 signals under 0.3 noise, rank-64 "
        "geometric spectra 0.7^i to 0.95^i under noise; k from 8 to 64, at most r/16), float32, the default finder "
        "(16 extra columns, 3 iterations). A stopped finder whose certificate would pass costs speed, never "
        "accuracy; a finder run on whose certificate fails is work thrown away.")
    return table


def _certified(matrix: torch.Tensor, k: int) -> bool:
    """The default finder's work on `matrix` where `auto` keeps its factors: the finder and the certificate."""
    settings = FactorSettings()
    found = _randomized_svd(matrix, k + settings.oversample, settings.power_iters, None, torch.float32)
    return found.accurate(k, null_rtol(matrix) * found.s[..., :1])


def finder_against_svd(ranks: tuple[int, ...], repeats: int, device: str) -> Table:
    """The range finder's top k (k = r/16, forced by ``randomized``) against LAPACK's SVD, by
    rank, on matrices whose finder passes the certificate: where `RANDOMIZED_MIN_RANK` sits."""
    g = torch.Generator().manual_seed(3)
    table = Table("Factors: the range finder against LAPACK's SVD by rank (k = r/16, a decaying spectrum)",
                  ["rank r", "shape", "finder ÷ SVD"])
    for rank in ranks:
        for shape in ((rank, rank), (rank, 3 * rank)):
            u = torch.linalg.qr(torch.randn(shape[0], 64, generator=g))[0]
            v = torch.linalg.qr(torch.randn(shape[1], 64, generator=g))[0]
            matrix = ((u * 0.8 ** torch.arange(64.0)) @ v.T + 1e-4 * torch.randn(shape, generator=g)).to(device)
            k = rank // 16
            timings = interleaved({"finder": lambda: _certified(matrix, k),
                                   "svd": lambda: top_factors(matrix, k, FactorSettings("exact"))}, repeats)
            table.add(rank, f"{shape[0]}×{shape[1]}", ratio(timings["finder"].median / timings["svd"].median))
    table.notes.append(f"The finder and its certificate (what `auto` runs where they pass) against `top_factors` with "
                       f"`merge.factors=exact`, medians of {repeats} repeats in turns; a rank-64 spectrum 0.8^i under "
                       "1e-4 noise, where the certificate passes.")
    return table


def recorded_rule_seconds(workers: int, repeats: int, device: str) -> Table:
    deltas = recorded_deltas(workers)
    cases, mergers = {}, {}
    for rule in RULE_NAMES:
        cases[rule], mergers[rule] = _merge_case(rule, deltas, device)
    for rule in ("tsv", "iso_cts"):
        cases[f"{rule}, exact"], mergers[f"{rule}, exact"] = _merge_case(rule, deltas, device, factors="exact")
    timings = interleaved(cases, repeats)
    table = Table(f"Factors: every rule on recorded pseudo-gradients, {RECORDED['preset']} ({RECORDED['method']}), "
                  f"R = {workers}, round {RECORDED['round']}",
                  ["rule", "seconds per merge", "÷ Iso-C", "÷ Iso-C, lowest – highest repeat", "paths per merge"])
    for rule in cases:
        ratios = [mine / theirs for mine, theirs in zip(timings[rule].samples, timings["iso_c"].samples)]
        table.add(rule, f"{timings[rule].median:.3f}", ratio(timings[rule].median / timings["iso_c"].median),
                  f"{ratio(min(ratios))} – {ratio(max(ratios))}",
                  paths_taken(mergers[rule].factor_paths, repeats + 1))
    matrices = sum(1 for per_worker in deltas.values() if per_worker[0].ndim == 2)
    table.notes.append(
        f"The whole model's {len(deltas)} parameters ({matrices} matrices) merged by one Merger per rule, default "
        f"settings (the rows marked exact: `merge.factors=exact`); median of {repeats} repeats in turns after one "
        f"warm-up. The deltas: `isoloco.bench.factors.recorded_deltas({workers})`, round {RECORDED['round']} of "
        f"`isoloco train {RECORDED['preset']} "
        f"method={RECORDED['method']} workers={workers}` on the CPU (the first {RECORDED['round']} of its 16 "
        "synchronisations).")
    return table


def tables(quick: bool, repeats: int, device: str) -> Iterator[Table]:
    setting = QUICK if quick else FULL
    yield auto_against_exact("rank-16 shared signal + 0.3 noise", shared_signal_under_noise(setting["shape"], 16),
                             repeats, device)
    yield auto_against_exact("each worker's 0.95^i + 1e-2 noise", slowly_decaying(setting["decaying_shape"], 16),
                             repeats, device)
    yield stop_against_check(setting["stop_shapes"])
    yield finder_against_svd((64, 128, 256), max(repeats, 5), device)
    for workers in setting["recorded_workers"]:
        yield recorded_rule_seconds(workers, repeats, device)
