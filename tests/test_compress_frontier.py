"""scripts/compress_frontier.py: a run's stability read from its evaluations against the unigram loss
and ln(vocabulary), counted per setting, and each setting's bytes and tests taken from its own runs."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from isoloco.config import apply_values, to_dict
from isoloco.train_config import TrainConfig
from isoloco.merge_config import MergeConfig
from isoloco.sync.slowlink import mean_wire_bytes
from isoloco.outer import OuterConfig
from isoloco.sync import sparseloco

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
UNIGRAM, VOCAB = 6.0, 8192  # ln(8192) = 9.01


@pytest.fixture
def frontier(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports claim_reports from beside itself
    spec = importlib.util.spec_from_file_location("compress_frontier", SCRIPTS / "compress_frontier.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while built
    spec.loader.exec_module(module)
    return module


def test_a_rise_mid_run_is_told_from_a_slow_fall_and_from_a_first_evaluation_above_a_uniform_guess(frontier):
    dipped_then_rose = frontier.stability([8.0, 5.5, 6.4, 5.2], UNIGRAM, VOCAB)
    assert (dipped_then_rose.above_mid_run, dipped_then_rose.rose_mid_run) == (True, True)
    assert dipped_then_rose.peak_mid_run == 6.4
    assert not dipped_then_rose.first_above_uniform and not dipped_then_rose.ended_above

    still_falling = frontier.stability([8.0, 7.0, 6.5, 5.9], UNIGRAM, VOCAB)  # above at 2 later evaluations, never up
    assert (still_falling.above_mid_run, still_falling.rose_mid_run, still_falling.peak_mid_run) == (True, False, 7.0)

    rose_from_above = frontier.stability([6.4, 11.8, 5.9], UNIGRAM, VOCAB)  # never below, but went up
    assert rose_from_above.rose_mid_run

    above_uniform = frontier.stability([math.log(VOCAB) + 0.5, 5.8, 5.5], UNIGRAM, VOCAB)
    assert above_uniform.first_above_uniform and not above_uniform.above_mid_run
    learning = frontier.stability([8.9, 5.8, 5.5], UNIGRAM, VOCAB)  # above the unigram loss at the first only
    assert not learning.first_above_uniform and not learning.above_mid_run

    diverged = frontier.stability([7.0, 6.5, 8.0, 9.5], UNIGRAM, VOCAB)
    assert diverged.ended_above and diverged.rose_mid_run and diverged.peak_mid_run == 9.5
    below_and_rising = frontier.stability([8.0, 5.0, 5.5], UNIGRAM, VOCAB)  # up, but below the unigram loss
    assert not below_and_rising.rose_mid_run and not below_and_rising.above_mid_run


def _run(view: Path, name: str, settings: dict, seed: int, losses: list[float], summary: dict | None = None) -> None:
    cfg = TrainConfig()
    apply_values(cfg, {"model": "tiny", "workers": 8, "seed": seed, **settings})
    run = view / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (run / "summary.json").write_text(json.dumps({"unigram_baseline": UNIGRAM, **(summary or {})}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 60 * (i + 1), "val_loss": loss}) + "\n"
                                               for i, loss in enumerate(losses)))


def _csv(path: Path, header: list[str], rows: list[list]) -> None:
    path.write_text("\n".join(",".join(map(str, row)) for row in [header, *rows]) + "\n")


def test_a_settings_row_counts_its_own_runs_and_takes_its_own_tests(frontier, tmp_path):
    view = tmp_path / frontier.VIEW
    exact = "merge.compress=none merge.compress_rank=4"
    low = "merge.compress=lowrank merge.compress_rank=4"
    low_settings = {"merge.compress": "lowrank", "merge.compress_rank": 4, "merge.quantize": "int8",
                    "merge.error_feedback": True}
    _run(view, "exact-s1", {}, 1, [8.0, 5.5, 5.0])
    _run(view, "low-s1", low_settings, 1, [9.5, 5.8, 5.6])  # above ln(vocab) first, then fine
    _run(view, "low-s2", low_settings, 2, [7.0, 5.5, 6.5, 5.7])  # dipped below, rose above mid-run
    _run(view, "low-s3", low_settings, 3, [7.0, 6.8, 6.2, 5.8], {"slow_link_bytes_per_round": 1000.0})
    _csv(view / "results.csv", ["run", "method", "R", "variant", "seed", "status"],
         [["exact-s1", "diloco", 8, exact, 1, "finished"],
          *([f"low-s{seed}", "diloco", 8, low, seed, "finished"] for seed in (1, 2, 3)),
          ["low-s4", "diloco", 8, low, 4, "running"]])  # not finished: not read
    _csv(view / "summary.csv", ["method", "R", "variant", "final_val_loss_mean", "final_val_loss_std"],
         [["diloco", 8, exact, 5.0, ""], ["diloco", 8, low, 5.7, 0.1]])
    header = "| A − B | R | equivalence (±1%) | A − B (final loss) | call after BH |\n|---|---|---|---|---|\n"
    (view / "compare.md").write_text("## Every pair\n\n" + header + "".join(
        f"| {frontier.compress_label('diloco', 'lowrank', 4, quantize='int8', feedback=True)} − "
        f"{frontier.compress_label('diloco')} | {count} | {interval} | +0.5 ± 0.1 | x |\n"
        for count, interval in ((8, "[+9.00%, +11.00%] fail"), (16, "[-0.10%, +0.10%] pass"))))

    rows = {r["setting"]: r for r in frontier.frontier(view)}
    compressed = rows["low rank 4, int8 factors, error feedback"]
    assert (compressed["seeds"], compressed["mid_run"]) == (3, "2 (1 rose; peak 6.80)")
    assert (compressed["rose"], compressed["first_above_uniform"], compressed["ended_above"]) == (1, 1, 0)
    assert compressed["to_exact"] == "[+9.00%, +11.00%] fail"  # R = 8's row, not R = 16's
    names, shapes = zip(*frontier.parameter_shapes("tiny"))
    sent = MergeConfig(compress="lowrank", compress_rank=4, quantize="int8", error_feedback=True)
    modelled = mean_wire_bytes(shapes, sent.lossy_compression, sent.bucket_bytes, 8, names)
    assert compressed["bytes"] == pytest.approx((2 * modelled + 1000.0) / 3)  # a recorded figure beats the model
    assert rows["float32"]["mid_run"] == "0" and rows["float32"]["ratio"] == pytest.approx(1.0)

    text = frontier.markdown(list(rows.values()))
    assert "| 8 | diloco | low rank 4, int8 factors, error feedback |" in text
    assert "1 of 4 runs: diloco low rank 4, int8 factors, error feedback at R = 8, seed 1 (9.50)" in text
    assert "In all, 2 of the 4 runs were above the unigram loss after their first evaluation, 1 of them having " \
           "risen to it, and 0 ended above it." in text


def test_the_largest_compression_is_the_one_that_passes_per_r_and_method(frontier):
    rows = [{"R": 8, "method": "diloco", "ratio": 3.9, "to_exact": "[-0.02%, +0.25%] pass"},
            {"R": 8, "method": "diloco", "ratio": 7.7, "to_exact": "[-0.46%, +0.59%] pass"},
            {"R": 8, "method": "diloco", "ratio": 23.2, "to_exact": "[+2.79%, +5.47%] fail"},
            {"R": 16, "method": "diloco", "ratio": 3.9, "to_exact": "[-0.56%, +0.17%] pass"},
            {"R": 16, "method": "diloco", "ratio": 7.7, "to_exact": "unstable run(s): no call"},
            {"R": 8, "method": "isoloco", "ratio": 1.0, "to_exact": "—"}]
    best = frontier.largest_equivalent(rows)
    assert {key: r["ratio"] for key, r in best.items()} == {(8, "diloco"): 7.7, (16, "diloco"): 3.9}


def test_a_setting_is_named_by_what_crosses_the_link_then_its_other_settings(frontier):
    cfg = TrainConfig()
    apply_values(cfg, {"merge.compress": "lowrank", "merge.compress_rank": 2, "merge.quantize": "int4",
                       "merge.compress_exclude": ["*embed_tokens*", "lm_head.weight"]})
    variant = "merge.compress=lowrank merge.compress_exclude=... outer.lr=1.0"
    assert frontier.setting_name(cfg, variant) == \
        "low rank 2, int4 factors, *embed_tokens* lm_head.weight whole as int4 (outer.lr=1.0)"
    apply_values(cfg, {"merge.compress": "none", "merge.compress_exclude": [], "merge.quantize": "none",
                       "outer.transport": "sparseloco", "outer.sparse_tile": 64, "outer.sparse_topk": 32})
    assert frontier.setting_name(cfg, "outer.transport=sparseloco outer.sparse_topk=32") == \
        "SparseLoCo top-32 of 64×64 tiles"
    assert frontier.compressor(cfg) == "sparseloco"


def test_sparseloco_is_held_against_dilocos_exact_runs_and_its_iso_c_against_it(frontier, tmp_path):
    view = tmp_path / frontier.VIEW
    sparse = {"outer.transport": "sparseloco", "outer.optimizer": "sgd", "outer.momentum": 0.0}
    for method, settings in (("sparseloco", sparse), ("sparseloco_isoc", {**sparse, "merge.rule": "iso_c"})):
        _run(view, f"{method}-s1", {"method": method, **settings}, 1, [8.0, 5.5, 5.2])
    _csv(view / "results.csv", ["run", "method", "R", "variant", "seed", "status"],
         [[f"{m}-s1", m, 8, "", 1, "finished"] for m in ("sparseloco", "sparseloco_isoc")])
    _csv(view / "summary.csv", ["method", "R", "variant", "final_val_loss_mean", "final_val_loss_std"],
         [["sparseloco", 8, "", 5.2, ""], ["sparseloco_isoc", 8, "", 5.1, ""]])
    label = frontier.compress_label
    header = "| A − B | R | equivalence (±1%) | A − B (final loss) | call after BH |\n|---|---|---|---|---|\n"
    (view / "compare.md").write_text("## Every pair\n\n" + header + "".join(
        f"| {a} − {b} | 8 | {interval} | {difference} | {call} |\n" for a, b, interval, difference, call in (
            (label("sparseloco"), label("diloco"), "[+3.00%, +5.00%] fail", "+0.2 ± 0.05", "x"),
            (label("sparseloco_isoc"), label("isoloco"), "[+1.00%, +2.00%] fail", "+0.1 ± 0.05", "y"),
            (label("sparseloco_isoc"), label("sparseloco"), "", "-0.1 ± 0.02",
             f"{label('sparseloco_isoc')} lower"))))

    rows = {r["method"]: r for r in frontier.frontier(view)}
    assert rows["sparseloco"]["to_exact"] == "[+3.00%, +5.00%] fail"
    assert rows["sparseloco_isoc"]["to_exact"] == "[+1.00%, +2.00%] fail"
    assert rows["sparseloco"]["head_to_head"] == rows["sparseloco_isoc"]["head_to_head"] == \
        "-0.1 ± 0.02, sparseloco_isoc lower"
    names, shapes = zip(*frontier.parameter_shapes("tiny"))
    tiling = OuterConfig(transport="sparseloco").tiling
    assert rows["sparseloco"]["compressor"] == "sparseloco"
    assert rows["sparseloco"]["bytes"] == sparseloco.sparseloco_wire_bytes(shapes, tiling, 8)
    assert rows["sparseloco"]["ratio"] == pytest.approx(mean_wire_bytes(shapes, None, MergeConfig().bucket_bytes, 8) /
                                                        rows["sparseloco"]["bytes"])
    matched = "\n".join(frontier.matched_bytes(list(rows.values())))
    assert "| 8 | sparseloco_isoc, SparseLoCo top-64 of 64×64 tiles" in matched
    assert matched.endswith("| -0.1 ± 0.02, sparseloco_isoc lower |")


def test_only_settings_within_the_factor_of_each_others_bytes_are_matched(frontier):
    tested = {"A − B (final loss)": "-0.1 ± 0.05", "call after BH": "x"}
    pairs = {f"isoloco 200000 − {b}": tested for b in ("diloco 290000", "sparseloco 310000", "diloco 10000000")}

    def row(method, sent, loss):
        return {"R": 8, "method": method, "bytes": sent, "ratio": 1e7 / sent, "loss": loss, "sd": 0.0,
                "setting": f"{sent:.0f} bytes", "label": f"{method} {sent:.0f}", "pairs": pairs}

    rows = [row("isoloco", 200_000, 4.9), row("diloco", 290_000, 4.8), row("sparseloco", 310_000, 4.7),
            row("diloco", 10_000_000, 4.5),  # float32 (ratio 1): never a compressed baseline
            row("diloco", 250_000, 4.6)]  # within the bytes, but the report does not pair it
    lines = frontier.matched_bytes(rows)[2:]
    assert [line.split(" | ")[3].split(",")[0] for line in lines] == ["diloco"]  # 310k is 1.55× 200k
    assert "290,000" not in lines[0] and "(34.5×)" in lines[0]
    assert frontier.matched_bytes(rows[:1]) == [f"No merging-aware setting has a paired baseline within "
                                                f"{frontier.MATCHED_BYTES}× of its bytes yet."]
