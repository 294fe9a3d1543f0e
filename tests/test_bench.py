"""The benchmark suite's pieces on tiny sizes: each table's measurement runs and returns
sane figures (positive, finite ratios; exact byte counts). Nothing here is timed."""

import math
import sys

import pytest
import torch

from isoloco.bench import comm, memory, ortho, outer, throughput
from isoloco.bench.table import Table
from isoloco.bench.timing import interleaved
from isoloco.bench.workload import RULE_METHODS, matrix_shapes, parameter_shapes, worker_deltas

#: A small vocabulary keeps the data preparation of this test session short.
DATA = {"data.vocab_size": 512, "data.val_tokens": 256}


def positive_finite(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_interleaved_runs_every_case_warmup_plus_repeats_times_in_turns():
    calls = []
    timings = interleaved({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, repeats=2)
    assert calls == ["a", "b", "a", "b", "b", "a"]  # warm-up, then every other repeat reversed
    assert timings["a"].result == 1 and timings["b"].result == 2
    assert all(t.median >= 0 and len(t.samples) == 2 for t in timings.values())


def test_merge_seconds_are_per_repeat_rounds_of_every_rule():
    from collections import Counter

    from isoloco.bench import scale

    seconds, paths = scale.merge_seconds(Counter({(24, 16): 3, (16, 40): 1}), workers=4, repeats=2, device="cpu")
    assert set(seconds) == set(paths) == set(scale.RULE_NAMES)
    assert all(len(rounds) == 2 and all(positive_finite(s) for s in rounds) for rounds in seconds.values())
    # A round factors each of its 4 matrices once per worker, under one path each.
    assert all(sum(paths[rule].values()) == 4 * 4 for rule in ("tsv", "iso_cts"))
    assert not any(paths[rule] for rule in ("mean", "dare", "ties", "iso_c"))


def test_the_merge_scale_table_times_every_compressed_merge_at_every_r(monkeypatch):
    from isoloco.bench import merge_scale

    seconds = merge_scale.merge_scale_seconds(merge_scale.CASES["int8 + error feedback"], (2, 4), tensors=2,
                                              shape=(8, 8), repeats=1)
    assert list(seconds) == [2, 4] and all(positive_finite(s) for s in seconds.values())
    monkeypatch.setattr(merge_scale, "merge_scale_seconds", lambda keys, workers, *rest: {2: 0.5, 4: 0.75, 8: 2.0})
    table = merge_scale.merge_scale_table((2, 4, 8), tensors=2, shape=(8, 8), repeats=1)
    assert table.columns == ["merge", "R = 2", "R = 4", "R = 8", "4 / 2", "8 / 2"]
    assert table.rows == [[name, "0.500 s", "0.750 s", "2.000 s", "1.5×", "4×"] for name in merge_scale.CASES]


def test_the_factors_table_times_both_settings_and_names_autos_paths():
    """Every worker's factors are counted once per merge under the path auto took, and both
    settings stay near the float64 definition (exact to float32 rounding)."""
    from isoloco.bench import factors

    table = factors.auto_against_exact("test", factors.shared_signal_under_noise((96, 240), 16), 1, "cpu")
    assert [row[0] for row in table.rows] == ["tsv", "iso_cts"]
    for row in table.rows:
        counts = [int(part.split()[-1]) for part in row[5].split(", ")]
        assert sum(counts) == 16
        assert float(row[6]) < 1e-3 and float(row[7]) < 1e-3 and float(row[8]) < 1e-3


def test_table_renders_markdown_and_refuses_ragged_rows():
    table = Table("T", ["x", "y"], notes=["n"])
    table.add(1, "2")
    assert table.markdown() == "### T\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\nn"
    with pytest.raises(ValueError):
        table.add(1)


def test_preset_shapes_come_from_the_models():
    assert matrix_shapes("178m") == [(32000, 1024), (1024, 1024), (2688, 1024), (1024, 2688)]
    assert (512, 2048) in matrix_shapes("1b")  # grouped-query key/value projections
    deltas = worker_deltas(parameter_shapes("tiny"), workers=20, distinct=16)
    embedding = deltas["model.embed_tokens.weight"]
    assert len(embedding) == 20 and embedding[16] is embedding[0] and not torch.equal(embedding[1], embedding[0])


def test_ortho_reference_is_exact_and_fast_paths_have_sane_figures():
    results = ortho.benchmark_shape(64, 192, repeats=1)
    assert [(r.path, r.scale) for r in results][:2] == [("svd", "exact"), ("gram", "exact")]
    reference, gram = results[0], results[1]
    assert reference.time_ratio == 1 and reference.error == 0 and reference.isotropy < 1e-4
    assert gram.error < 1e-4 and gram.scale_ratio == pytest.approx(1, abs=1e-4)
    for r in results:
        assert positive_finite(r.time_ratio) and positive_finite(r.scale_ratio)
        assert math.isfinite(r.error) and 0 <= r.isotropy < 1.5


@pytest.mark.slow
def test_outer_step_fractions_for_every_rule():
    setting = outer.OuterSetting(("tiny",), (4,), global_batch=8, seq_len=16, inner_steps=2, block_steps=1)
    fractions = outer.outer_fractions("tiny", 4, setting, RULE_METHODS, repeats=1, **DATA)
    assert set(fractions) == set(RULE_METHODS)
    assert all(positive_finite(f) for f in fractions.values())


def test_throughput_ratio_is_positive_and_finite():
    case = throughput.ThroughputCase("tiny", 2, global_batch=4, seq_len=16, inner_steps=2)
    assert positive_finite(throughput.throughput_ratio(case, repeats=1, **DATA))


@pytest.mark.multiprocess
def test_bytes_counted_on_two_processes_match_the_analytic_counts(monkeypatch):
    monkeypatch.setattr(comm, "START_METHOD", "forkserver")  # conftest.py: torch already imported
    counts = comm.bytes_per_round("tiny", (2, 4), methods=("diloco", "ties", "tsv", "isoloco", "isoloco_fast"))
    one_model = comm.model_bytes("tiny")
    assert one_model == 4 * sum(shape.numel() for _, shape in parameter_shapes("tiny"))
    per_worker = {w: {method: c["per_worker"] for method, c in by_method.items()} for w, by_method in counts.items()}
    wire = {w: {method: c["wire"] for method, c in by_method.items()} for w, by_method in counts.items()}
    for workers in (2, 4):
        # mean and Iso-C: one all-reduce of every parameter; TIES: three. A ring all-reduce over
        # 2 processes puts 2·(2 − 1)/2 of its tensor on the wire: what it hands in.
        for counted in (per_worker, wire):
            assert counted[workers]["diloco"] == counted[workers]["isoloco"] == counted[workers]["isoloco_fast"] \
                == one_model
            assert counted[workers]["ties"] == 3 * one_model
    # TSV: each worker's top-(rank/R) factors of each matrix, the mean of the rest; on the wire
    # a process sends its R/2 workers' factors to the other process.
    factors = {w: sum(4 * (min(shape) // w) * (sum(shape) + 1) for _, shape in parameter_shapes("tiny") if len(shape) == 2)
               for w in (2, 4)}
    rest = sum(4 * shape.numel() for _, shape in parameter_shapes("tiny") if len(shape) != 2)
    assert {w: per_worker[w]["tsv"] for w in (2, 4)} == {w: factors[w] + rest for w in (2, 4)}
    assert {w: wire[w]["tsv"] for w in (2, 4)} == {w: w // 2 * factors[w] + rest for w in (2, 4)}


@pytest.mark.multiprocess
def test_memory_peak_of_a_round_runs_in_a_fresh_process():
    [(growth, params)] = memory.fresh_process_peaks([("tiny", 2, True, 4, 16, "cpu", DATA)])
    # At least the two workers' pseudo-gradients and AdamW moments (12 bytes per parameter each).
    assert params > 0 and growth >= 2 * memory.WORKER_BYTES_PER_PARAM * params


def test_bench_refuses_an_unknown_device_before_running_anything(capsys):
    from isoloco.bench.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["--device", "tpu", "--only", "ortho"])
    assert stopped.value.code == 2
    assert "tpu" in capsys.readouterr().err


# -- the slow link ------------------------------------------------------------------------------


def round_lines(rounds: list[tuple[float, float, float]]) -> list[dict]:
    """Metrics round lines from (seconds, sync_s, sync_exposed_s) per round, with a step line
    between them as the trainer writes."""
    lines, clock = [], 0.0
    for seconds, ran, waited in rounds:
        clock += seconds
        lines += [{"step": len(lines)}, {"step": len(lines) + 1, "wall_time_s": clock, "sync_s": ran,
                                         "sync_exposed_s": waited, "wire_bytes_cross_island": 100.0 * ran,
                                         "collectives_cross_island": 2}]
    return lines


def test_the_link_benchmark_reads_the_steady_rounds_only():
    from isoloco.bench.link import steady_rounds

    # The first round (warm-up) and the last (its synchronisation blocks) are left out.
    figures = steady_rounds(round_lines([(9.0, 5.0, 5.0), (2.0, 1.0, 0.2), (3.0, 1.5, 0.4), (2.5, 1.2, 0.3),
                                         (8.0, 4.0, 4.0)]))
    assert figures == {"round_s": 2.5, "sync_s": 1.2, "sync_exposed_s": 0.3, "wire_bytes_cross_island": 120.0,
                       "collectives_cross_island": 2}


def test_the_link_tables_and_plot_cover_every_case(tmp_path):
    from isoloco.bench import link

    results = {link._key(m, l, b, q, t): {"round_s": 2.0, "sync_s": 0.5, "sync_exposed_s": 0.5 - 0.1 * t,
                                          "wire_bytes_cross_island": 1e6, "collectives_cross_island": 3}
               for m in link.METHODS for l in link.LINKS for b in link.BUCKETING for q in link.QUANTIZE
               for t in link.OVERLAPS}
    results.update({f"overlap|{m}|{t}": {"round_s": 3.0, "sync_s": 0.8, "sync_exposed_s": 0.8 - 0.1 * t}
                    for m in link.METHODS for t in link.OVERLAP_TAUS})
    tables = list(link.results_tables(results))
    assert len(tables) == len(link.LINKS) + 2
    assert tables[-2].rows[0] == ["diloco", "0.80", "0.80", "0.30", "0.38", "3.00 → 3.00"]
    assert all(len(t.rows) == len(link.METHODS) * len(link.BUCKETING) * len(link.QUANTIZE) for t in tables[:-2])
    assert tables[0].rows[0][3:5] == ["2.00 (0.50)", "2.00 (0.30)"]
    # A ring of 2 members: each of the 3 collectives takes 2 latency steps of 20 ms, plus 1 MB at 0.1 Gbit/s.
    planned = 1e6 * 8 / 0.1e9 + 3 * 2 * 0.02
    assert tables[-1].rows[0][4:] == [f"{planned:.2f}", "0.50", f"{0.5 / planned:.2f}"]
    # The many-islands tables, when measured: a row per (P, R), one per format.
    many = {f"islands|{p}|{r}|{q}": {"wire": 1e6 if q == "none" else 2.5e5} for p in (2, 4) for r in (8, 16)
            for q in link.QUANTIZE}
    many.update({f"rounds|{q}|{t}": {"round_s": 4.0, "sync_exposed_s": 1.0 - 0.5 * t, "wire_bytes_cross_island": 1e6}
                 for q in link.QUANTIZE for t in link.ROUND_TAUS})
    islands, rounds = list(link.results_tables({**results, **many}))[-2:]
    assert len(islands.rows) == 4 and islands.rows[0][:2] == ["2", "8"]
    assert islands.rows[0][4].endswith("0.250×")
    assert rounds.rows[0] == ["float32", "4.00 (1.00)", "4.00 (0.00)", "1.0 MiB"]
    # The compression table: a row per setting, measured against float32 beside the cost model.
    measured = {f"compress|{p}|{p}|{label}": {"wire": 2**20 if label == "float32" else 2**15}
                for p in link.COMPRESS_ISLANDS for label in link.COMPRESSIONS}
    compress = list(link.results_tables(measured))[-1]
    assert [row[0] for row in compress.rows] == list(link.COMPRESSIONS)
    assert compress.rows[1][1].startswith("32.0 KiB (") and compress.rows[1][1].endswith(", 32.0×")
    link.plot(results, tmp_path / "link.png")
    assert (tmp_path / "link.png").stat().st_size > 10_000


def test_goodput_keeps_the_rounds_a_life_committed_and_went_on_from():
    from isoloco.bench.goodput import healed_at, kept_steps

    H = 3
    # Stopped in round 2: rounds 0 and 1 went on to the next, round 2 is cut short.
    assert kept_steps(list(range(8)), H) == [True] * 6 + [False] * 2
    # Killed after step 4: its unfinished round 1 is lost.
    assert kept_steps([0, 1, 2, 3, 4], H) == [True] * 3 + [False] * 2
    # A failed commit: round 1 trained again, only the second attempt counts.
    assert kept_steps([0, 1, 2, 3, 4, 5, 3, 4, 5, 6], H) == [True] * 3 + [False] * 3 + [True] * 3 + [False]
    # A restarted life: its own round 0 is replaced when it heals and jumps to the survivor's round 3.
    restarted = [0, 1, 2, 9, 10, 11, 12]
    assert kept_steps(restarted, H) == [False] * 3 + [True] * 3 + [False]
    assert healed_at(restarted) == 3 and healed_at([0, 1, 2, 3]) is None


def test_goodput_counts_a_carried_late_round_only_when_its_worker_arrives_later():
    from isoloco.bench.goodput import late_config, work_kept

    for quick in (True, False):
        drop, carry = late_config("diloco", "drop", quick), late_config("diloco", "carry", quick)
        rounds = drop.train_steps // drop.inner_steps
        late = [[drop.faults.is_late(drop.seed, r, w) for w in range(drop.workers)] for r in range(rounds)]
        on_time = sum(not x for row in late for x in row)
        assert work_kept(drop) == on_time / (rounds * drop.workers)
        lost = sum(late[r][w] and all(late[later][w] for later in range(r + 1, rounds))
                   for r in range(rounds) for w in range(drop.workers))
        assert work_kept(carry) == 1 - lost / (rounds * drop.workers)
        assert work_kept(late_config("diloco", "none", quick)) == 1


def test_goodput_sends_what_its_runs_write_to_its_log_file(tmp_path):
    """By file descriptor: Python's prints and a child process's writes (as torchft's lighthouse
    and managers make) reach the log, and nothing reaches the terminal until it is restored."""
    import subprocess

    log = tmp_path / "goodput.log"
    script = (f"import os, subprocess, sys\n"
              f"from pathlib import Path\n"
              f"from isoloco.bench.goodput import output_to\n"
              f"print('before', flush=True)\n"
              f"with output_to(Path({str(log)!r})):\n"
              f"    print('from python')\n"
              f"    print('to stderr', file=sys.stderr)\n"
              f"    subprocess.run([sys.executable, '-c', 'import os; os.write(1, b\"from a child\\\\n\")'])\n"
              f"print('after')\n")
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert (shown.stdout, shown.stderr) == ("before\nafter\n", "")
    assert log.read_text() == "from python\nto stderr\nfrom a child\n"


def test_seconds_per_token_of_dp_and_many_workers_on_either_kernel():
    cases = [throughput.ScaleCase("dp", 1), throughput.ScaleCase("diloco", 8),
             throughput.ScaleCase("diloco", 8, kernel="foreach")]
    seconds = throughput.seconds_per_token(cases, global_batch=8, seq_len=16, h=2, repeats=1, device="cpu", **DATA)
    assert list(seconds) == cases and all(positive_finite(value) for value in seconds.values())


def test_the_optimizer_floor_and_the_batched_passes_are_measured():
    assert all(positive_finite(throughput.optimizer_step_seconds(1, "cpu", kernel, steps=2, **DATA))
               for kernel in ("fused", "foreach"))
    table = throughput.batched_passes_table(4, 8, 1, "cpu", **DATA)
    assert [row[0].split(",")[0].split(" (")[0] for row in table.rows] == [
        "dp", "one worker after another", "all workers at once"]
    assert all(positive_finite(float(row[1])) for row in table.rows)
