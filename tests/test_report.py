"""`isoloco report`: gaps to the matching dp run, mean ± std over seeds, identical bytes on rerun;
paired comparisons that call a difference, or a tie only by an equivalence test; unstable runs flagged."""

import csv
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from isoloco.cli import main
from isoloco.config import resolve, to_dict
from isoloco.report import (compare_markdown, group_runs, load_runs, results_csv, results_markdown, summary_csv,
                            t_quantile, write_report)

TOKENS = 6 * 8 * 32  # steps x global_batch x seq_len of the runs below
UNIGRAM = 7.0  # the unigram baseline the fake runs report: a loss above it is an unstable run


def _fake_run(root: Path, name: str, loss: float | None, finished: bool = True, processes: int = 1,
              summary: dict | None = None, **keys) -> None:
    """A run directory as `isoloco train` leaves it, without training (losses are made up: 0.5 above
    the final one at the mid-run evaluation)."""
    cfg = resolve(None, {"model": "tiny", "steps": 6, "global_batch": 8, "seq_len": 32, **keys})
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    curve = [(3, loss + 0.5), (6, loss)] if loss is not None else []
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "tokens": s * 256, "train_loss": 9.0, **({"val_loss": v} if s in (3, 6) else {})}) + "\n"
        for s in range(1, 7) for v in [dict(curve).get(s)]))
    if finished:
        (run / "summary.json").write_text(json.dumps({"final_val_loss": loss, "wall_time_s": 12.5, "cpu_time_s": 10.0,
                                                      "tokens": TOKENS, "processes": processes,
                                                      "unigram_baseline": UNIGRAM, **(summary or {})}))


def _grid(root: Path) -> None:
    for seed, dp_loss in ((0, 4.0), (1, 5.0)):
        _fake_run(root, f"dp-s{seed}", dp_loss, method="dp", seed=seed, workers=1)
        for method, offset in (("diloco", 0.2), ("isoloco", 0.1)):
            for r in (1, 2, 4):
                _fake_run(root, f"{method}-R{r}-H3-s{seed}", dp_loss + offset * r, method=method, workers=r,
                          inner_steps=3, seed=seed)
    _fake_run(root, "isoloco-R8-H3-s0", 4.5, finished=False, method="isoloco", workers=8, inner_steps=3)
    (root / "logs").mkdir()  # not a run directory: ignored


def _outputs(root: Path) -> dict[str, bytes]:
    files = [root / "results.csv", root / "summary.csv", root / "results.md", *sorted((root / "plots").glob("*.png"))]
    return {p.name: p.read_bytes() for p in files}


@pytest.mark.slow
def test_report_twice_gives_identical_bytes(tmp_path):
    _grid(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    first = _outputs(tmp_path)
    assert set(first) == {"results.csv", "summary.csv", "results.md", "val_loss_vs_R.png", "gap_vs_R.png",
                          "val_curves.png"}
    for png in (v for k, v in first.items() if k.endswith(".png")):
        assert png.startswith(b"\x89PNG") and b"Matplotlib" not in png
    write_report(tmp_path)
    assert _outputs(tmp_path) == first


def test_gaps_are_to_the_dp_run_of_the_same_seed_and_averaged_over_seeds(tmp_path):
    _grid(tmp_path)
    write_report(tmp_path)
    rows = {r["run"]: r for r in csv.DictReader((tmp_path / "results.csv").open())}
    assert rows["dp-s0"]["R"] == "" and float(rows["dp-s0"]["gap_to_dp_pct"]) == 0.0
    assert float(rows["diloco-R2-H3-s0"]["gap_to_dp_pct"]) == 10.0  # (4.4 - 4) / 4
    assert float(rows["diloco-R2-H3-s1"]["gap_to_dp_pct"]) == 8.0  # (5.4 - 5) / 5
    assert rows["isoloco-R8-H3-s0"]["status"] == "incomplete" and rows["isoloco-R8-H3-s0"]["final_val_loss"] == ""
    order = list(rows)
    assert order[:2] == ["dp-s0", "dp-s1"] and order.index("diloco-R4-H3-s1") < order.index("isoloco-R1-H3-s0")
    summary = {(r["method"], r["R"]): r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert float(summary["diloco", "2"]["gap_to_dp_pct_mean"]) == 9.0
    assert abs(float(summary["diloco", "2"]["gap_to_dp_pct_std"]) - 2 ** 0.5) < 1e-4
    assert summary["isoloco", "8"]["seeds"] == "0" and summary["isoloco", "8"]["final_val_loss_mean"] == ""
    md = (tmp_path / "results.md").read_text()
    # The peak: seed 1's mid-run evaluation, 5.4 + 0.5.
    assert "| diloco | 2 | 3 | 2 | 4.9000 ± 0.7071 | +9.00 ± 1.41 | 5.9000 | 1,536 | 12 ± 0 | 10 ± 0 |" in md
    assert float(summary["diloco", "2"]["cpu_time_s_mean"]) == 10.0
    assert "| isoloco-R8-H3-s0 | isoloco | 8 | 3 | 0 | incomplete | — |" in md
    assert "![Gap to DP vs R](plots/gap_vs_R.png)" in md
    assert "15 runs, 14 finished; 140 s of CPU time in the training rounds of the 14 that record it" in md


def test_several_inner_steps_add_plots_against_h(tmp_path):
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    for h in (1, 2, 3):
        _fake_run(tmp_path, f"isoloco-R2-H{h}-s0", 4.0 + h / 10, method="isoloco", workers=2, inner_steps=h)
    write_report(tmp_path)
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "val_loss_vs_R.png", "gap_vs_R.png", "val_loss_vs_H.png", "gap_vs_H.png", "val_curves.png"}
    assert [r.inner_steps for r in load_runs(tmp_path)] == [None, 1, 2, 3]


def test_a_directory_without_runs_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "holds no run directories" in err and len(err.splitlines()) == 1


def test_plots_have_titles_and_each_token_budget_its_own_style_in_its_methods_colour(tmp_path):
    from isoloco.report.plots import _against, _curves

    for steps in (6, 12):
        _fake_run(tmp_path, f"dp-steps{steps}", 4.0, method="dp", workers=1, steps=steps)
        for r in (1, 2):
            _fake_run(tmp_path, f"isoloco-R{r}-H3-steps{steps}", 4.0 + r / 10 + steps / 100, method="isoloco",
                      workers=r, inner_steps=3, steps=steps)
    runs = load_runs(tmp_path)
    for gap in (False, True):
        ax = _against(runs, "workers", gap).axes[0]
        assert ax.get_title() in ("Final validation loss against workers R", "Gap to DP against workers R")
        budgets = ax.containers  # one errorbar per series: isoloco at each budget
        assert len(budgets) == 2 and len({c.lines[0].get_color() for c in budgets}) == 1
        assert len({(c.lines[0].get_marker(), c.lines[0].get_linestyle()) for c in budgets}) == 2
    curves = [line for ax in _curves(runs).axes for line in ax.get_lines() if line.get_color() != "black"]
    assert len({line.get_color() for line in curves}) == 1 and len({line.get_linestyle() for line in curves}) == 2


def test_runs_that_differ_in_more_than_the_seed_are_separate_points(tmp_path):
    """A knob (outer lr) or the number of processes makes its own row and series; execution-only
    keys (micro_batch) do not."""
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    _fake_run(tmp_path, "dp-s1", 5.0, method="dp", workers=1, seed=1)
    for seed in (0, 1):
        base = 4.0 + seed
        _fake_run(tmp_path, f"a-s{seed}", base + 0.2, method="diloco", workers=2, inner_steps=3, seed=seed)
        _fake_run(tmp_path, f"b-s{seed}", base + 0.4, method="diloco", workers=2, inner_steps=3, seed=seed,
                  processes=2, micro_batch=2)
        _fake_run(tmp_path, f"c-s{seed}", base + 0.8, method="diloco", workers=2, inner_steps=3, seed=seed,
                  **{"outer.lr": 0.4})
    write_report(tmp_path)
    summary = {r["variant"]: r for r in csv.DictReader((tmp_path / "summary.csv").open()) if r["method"] == "diloco"}
    assert set(summary) == {"outer.lr=0.7 processes=1", "outer.lr=0.7 processes=2", "outer.lr=0.4 processes=1"}
    assert all(row["seeds"] == "2" for row in summary.values())
    assert float(summary["outer.lr=0.4 processes=1"]["gap_to_dp_pct_mean"]) == (20.0 + 16.0) / 2
    md = (tmp_path / "results.md").read_text()
    assert "| diloco | 2 | 3 | outer.lr=0.7 processes=2 | 2 |" in md
    assert "| dp | — | — | processes=1 | 2 |" in md  # dp has no outer step: outer.lr says nothing of it
    # --compare names a variant as the tables write it.
    pair = "diloco outer.lr=0.4 processes=1:diloco outer.lr=0.7 processes=1"
    assert main(["report", str(tmp_path), "--compare", pair]) == 0
    assert ("| 2 | 3 | 2 | +0.6000 ± 0.0000 | [+12.77%, +12.77%] fail | diloco outer.lr=0.7 processes=1 lower |"
            in (tmp_path / "compare.md").read_text())  # 0.6 / 4.7, B's mean loss


def test_gaps_are_to_the_strongest_dp_variant_when_dp_ran_with_several_settings(tmp_path):
    """An inner-lr search of dp in the folder: every gap is to the dp lr with the lowest mean loss,
    for every seed (not to whichever dp run sorts last), and results.md says which one."""
    for seed in (0, 1):
        _fake_run(tmp_path, f"dp-lr1-s{seed}", 4.0 + seed, method="dp", workers=1, seed=seed, **{"inner.lr": 0.001})
        _fake_run(tmp_path, f"dp-lr2-s{seed}", 5.0 - 0.5 * seed, method="dp", workers=1, seed=seed,
                  **{"inner.lr": 0.002})
        _fake_run(tmp_path, f"diloco-s{seed}", 6.0, method="diloco", workers=2, inner_steps=3, seed=seed)
    # Means: inner.lr=0.001 4.5, inner.lr=0.002 4.75 -> 0.001, even though seed 1 alone favours 0.002.
    gaps = {r.seed: r.gap_pct for r in load_runs(tmp_path) if r.method == "diloco"}
    assert gaps == {0: pytest.approx(50.0), 1: pytest.approx(20.0)}
    write_report(tmp_path)
    assert "the gaps are to `inner.lr=0.001`, the one with the lowest mean final loss" in (
        tmp_path / "results.md").read_text()
    # dp runs that differ only between budgets (two models) are one setting per budget: nothing to say.
    for name in ("dp-lr2-s0", "dp-lr2-s1"):
        shutil.rmtree(tmp_path / name)
    _fake_run(tmp_path, "dp-small-s0", 3.0, method="dp", workers=1, model="small")
    write_report(tmp_path)
    assert "dp ran with several settings" not in (tmp_path / "results.md").read_text()


def test_a_knob_searched_over_several_values_gets_its_own_plot(tmp_path):
    """A density grid of ties is drawn against merge.density, with dp and the methods not searched at
    the same R as flat lines; a non-numeric setting or the process count gets no plot."""
    from isoloco.report.plots import _against_knob, _knobs

    for seed in (0, 1):
        _fake_run(tmp_path, f"dp-s{seed}", 4.0 + seed, method="dp", workers=1, seed=seed)
        _fake_run(tmp_path, f"base-s{seed}", 4.5 + seed, method="diloco_sgd", workers=2, inner_steps=3, seed=seed)
        for density in (0.2, 0.5, 0.9):
            _fake_run(tmp_path, f"ties-d{density}-s{seed}", 5.0 - density + seed, method="ties", workers=2,
                      inner_steps=3, seed=seed, **{"merge.density": density})
        for ortho in ("svd", "gram"):
            _fake_run(tmp_path, f"isoc-{ortho}-s{seed}", 4.2 + seed, method="isoc", workers=2, inner_steps=3,
                      seed=seed, **{"merge.ortho": ortho})
        _fake_run(tmp_path, f"tsv-s{seed}", 4.4 + seed, method="tsv", workers=2, inner_steps=3, seed=seed,
                  processes=1 + seed)
        for rate in (0.1, 0.5):
            _fake_run(tmp_path, f"dare-p{rate}-s{seed}", 4.6 + seed, method="dare", workers=2, inner_steps=3,
                      seed=seed, **{"merge.drop_rate": rate})
    runs = load_runs(tmp_path)
    assert _knobs(runs) == {"merge.density": ["ties"], "merge.drop_rate": ["dare"]}
    ax = _against_knob(runs, "merge.density", _knobs(runs)).axes[0]
    assert ax.get_title() == "Final validation loss against merge.density"
    (ties,) = ax.containers
    assert list(ties.lines[0].get_xdata()) == [0.2, 0.5, 0.9]
    assert list(ties.lines[0].get_ydata()) == pytest.approx([4.8 + 0.5, 4.5 + 0.5, 4.1 + 0.5])
    flat = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() in ("--", ":")}
    # Each reference named by what differs between the lines shown (ortho only where a method sets it).
    assert flat["dp"] == pytest.approx(4.5) and flat["diloco_sgd processes=1"] == pytest.approx(5.0)
    assert flat["isoc ortho=svd processes=1"] == pytest.approx(4.7) and flat["tsv processes=2"] == pytest.approx(5.4)
    assert not any(label.startswith("dare") for label in flat)  # searched itself: a plot of its own
    write_report(tmp_path)
    assert "![Final validation loss vs merge.density](plots/val_loss_vs_merge.density.png)" in (
        tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_compare_pairs_seeds_and_calls_a_difference_only_outside_its_interval(tmp_path):
    for seed in range(3):
        _fake_run(tmp_path, f"dp-s{seed}", 4.0, method="dp", workers=1, seed=seed)
    # isoloco − diloco per seed: R=1: −0.1, +0.1, 0.0 (not distinguishable); R=4: −0.30, −0.32, −0.28 (called)
    for seed, (d1, d4) in enumerate(((-0.1, -0.30), (0.1, -0.32), (0.0, -0.28))):
        for r, diff in ((1, d1), (4, d4)):
            _fake_run(tmp_path, f"diloco-R{r}-H3-s{seed}", 4.5, method="diloco", workers=r, inner_steps=3, seed=seed)
            _fake_run(tmp_path, f"isoloco-R{r}-H3-s{seed}", 4.5 + diff, method="isoloco", workers=r, inner_steps=3,
                      seed=seed)
    assert main(["report", str(tmp_path), "--compare", "isoloco:diloco"]) == 0
    text = (tmp_path / "compare.md").read_text()
    # R = 1: mean 0, s = 0.1, half-width 4.303 · 0.1 / √3 = 0.2484; the 90% one, 2.920 · 0.1 / √3 = 0.1686,
    # is 3.75% of diloco's 4.5: outside ±1%; t = 0, p = 1
    assert ("| 1 | 3 | 3 | +0.0000 ± 0.2484 | [-3.75%, +3.75%] fail | not distinguishable with 3 seeds | 1.000 (1.000) | "
            "not distinguishable with 3 seeds | +12.50 | +12.50 | 1.00 |") in text
    # R = 4: mean −0.30, s = 0.02, half-width 4.303 · 0.02 / √3 = 0.0497; 90%: (−0.30 ± 0.0337) / 4.5;
    # t = 0.3 / (0.02 / √3) = 25.98 with 2 df: p = 1 − t/√(2 + t²) = 0.0015, × 2 tests / rank 1 = 0.0030
    assert ("| 4 | 3 | 3 | -0.3000 ± 0.0497 | [-7.42%, -5.92%] fail | isoloco lower | 0.001 (0.003) | isoloco lower | "
            "+5.00 | +12.50 | 0.40 |") in text
    assert "from R = 1 to R = 4 (3 seeds): -0.3000 ± 0.2766 (isoloco gains on diloco as R grows)" in text
    # Against dp: its run of the same seed, at every R.
    assert main(["report", str(tmp_path), "--compare", "diloco:dp"]) == 0
    assert ("| 4 | 3 | 3 | +0.5000 ± 0.0000 | [+12.50%, +12.50%] fail | dp lower | 0 (0) | dp lower | "
            "+12.50 | +0.00 | — |" in (tmp_path / "compare.md").read_text())
    assert "## Every pair" not in text  # one pair: its own table is the whole story
    # Several pairs: one table of every pair's rows first, each row named by its pair.
    assert main(["report", str(tmp_path), "--compare", "isoloco:diloco", "--compare", "diloco:dp"]) == 0
    text = (tmp_path / "compare.md").read_text()
    joined = text.split("## Every pair")[1].split("## isoloco − diloco")[0]
    # Four tests now (p 1.0, 0.0015, 0, 0): R = 4's isoloco − diloco is rank 3 of 4, 0.0015 · 4/3 = 0.002
    assert ("| isoloco − diloco | 4 | 3 | 3 | -0.3000 ± 0.0497 | [-7.42%, -5.92%] fail | isoloco lower | 0.001 (0.002) | "
            "isoloco lower | +5.00 | +12.50 | 0.40 |") in joined
    assert ("| diloco − dp | 4 | 3 | 3 | +0.5000 ± 0.0000 | [+12.50%, +12.50%] fail | dp lower | 0 (0) | "
            "dp lower | +12.50 | +0.00 | — |") in joined
    assert len([line for line in joined.splitlines() if line.startswith(("| isoloco − ", "| diloco − "))]) == 4
    assert main(["report", str(tmp_path), "--compare", "isoloco"]) == 2


def _student_t_cdf(t: float, df: int, steps: int = 2000) -> float:
    """P(T ≤ t) for t ≥ 0: 1/2 plus Simpson's rule over the density from 0 to t."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    density = [scale * (1 + (t * i / steps) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
    weights = [1 if i in (0, steps) else 4 if i % 2 else 2 for i in range(steps + 1)]
    return 0.5 + t / steps / 3 * sum(w * d for w, d in zip(weights, density))


def test_t_quantiles_bound_the_95_and_90_percent_intervals():
    """Exact quantiles: the closed forms for 1 and 2 degrees of freedom (Cauchy: tan(π(p − 1/2)); df 2:
    (2p − 1)·√(2 / (1 − (2p − 1)²))), the printed tables' three decimals, the normal quantile far out,
    and the numerical integral of the density at every df up to 40 (the old table stopped at 30)."""
    assert t_quantile(95, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-12)  # 12.7062...
    assert t_quantile(90, 1) == pytest.approx(math.tan(0.45 * math.pi), rel=1e-12)  # 6.3137...
    for confidence, p in ((95, 0.975), (90, 0.95)):
        closed_form = (2 * p - 1) * math.sqrt(2 / (1 - (2 * p - 1) ** 2))
        assert t_quantile(confidence, 2) == pytest.approx(closed_form, rel=1e-12)
    assert t_quantile(95, 2) == pytest.approx(4.302652729749464, rel=1e-12)  # not the table's 4.303
    printed = {(95, 4): 2.776, (95, 9): 2.262, (95, 30): 2.042, (90, 4): 2.132, (90, 12): 1.782, (95, 60): 2.000,
               (95, 120): 1.980, (90, 120): 1.658}
    assert {key: round(t_quantile(*key), 3) for key in printed} == printed
    assert t_quantile(95, 10**7) == pytest.approx(1.959964, abs=1e-5) and t_quantile(90, 10**7) == pytest.approx(
        1.644854, abs=1e-5)
    for confidence, p in ((95, 0.975), (90, 0.95)):
        for df in range(1, 41):
            assert _student_t_cdf(t_quantile(confidence, df), df, steps=20000) == pytest.approx(p, abs=1e-7), (
                confidence, df)


def _paired_grid(root: Path, differences: dict[int, tuple[float, ...]], b_loss: float = 4.5) -> None:
    """dp at 4.0, and diloco (B) at `b_loss` and isoloco (A) at b_loss + d, per R (up to 16) and seed."""
    run = {"global_batch": 16, "inner_steps": 3}
    for seed in range(3):
        _fake_run(root, f"dp-s{seed}", 4.0, method="dp", workers=1, seed=seed, global_batch=16)
    for r, per_seed in differences.items():
        for seed, d in enumerate(per_seed):
            _fake_run(root, f"diloco-R{r}-H3-s{seed}", b_loss, method="diloco", workers=r, seed=seed, **run)
            _fake_run(root, f"isoloco-R{r}-H3-s{seed}", b_loss + d, method="isoloco", workers=r, seed=seed, **run)


def _row(text: str, r: int) -> list[str]:
    """The cells of the row of R = r in the first table of `text`."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {r} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_tie_is_called_only_by_the_equivalence_test_at_the_margin(tmp_path):
    _paired_grid(tmp_path, {
        1: (0.001,),  # one seed: no test
        2: (0.001, -0.002, 0.0015),  # tiny differences, small spread: 90% interval ±0.07% of 4.5
        4: (0.2, -0.25, 0.05),  # mean 0, but a spread far wider than the margin
        8: (-0.30, -0.32, -0.28),  # clearly lower
        16: (0.010, 0.011, 0.009),  # called (its 95% interval excludes 0), yet inside ±1%
    })
    runs = load_runs(tmp_path)
    text = compare_markdown(runs, [("isoloco", "diloco")])
    assert "| R | H | seeds | isoloco − diloco (final loss) | equivalence (±1%) | call |" in text
    assert _row(text, 1)[3:6] == ["+0.0010", "one seed: no call", "one seed: no call"]
    assert _row(text, 2)[4:6] == ["[-0.07%, +0.07%] pass", "equivalent within ±1%"]
    assert _row(text, 4)[4:6] == ["[-8.58%, +8.58%] fail", "not distinguishable with 3 seeds"]
    assert _row(text, 8)[4:6] == ["[-7.42%, -5.92%] fail", "isoloco lower"]
    assert _row(text, 16)[4:6] == ["[+0.18%, +0.26%] pass", "diloco lower"]
    assert "TOST" in text and "the call is then the difference, and the equivalence column still says pass" in text
    # A tighter margin: the tie at R = 2 still passes, R = 16 is called and now fails the test.
    tight = compare_markdown(runs, [("isoloco", "diloco")], margin_pct=0.2)
    assert "equivalence (±0.2%)" in tight and "at a margin of ±0.2% of B's mean final loss" in tight
    assert _row(tight, 2)[4:6] == ["[-0.07%, +0.07%] pass", "equivalent within ±0.2%"]
    assert _row(tight, 16)[4:6] == ["[+0.18%, +0.26%] fail", "diloco lower"]


def test_unstable_runs_are_marked_and_support_no_call(tmp_path):
    """A run that ended above its unigram baseline: marked in results.md, and the points it is part
    of get no call, no equivalence test and no place in the change with R."""
    _paired_grid(tmp_path, {1: (-0.1, -0.12, -0.08), 8: (-0.3, -0.32, -0.28), 16: (-0.5, -0.52, -0.48)})
    shutil.rmtree(tmp_path / "diloco-R16-H3-s2")
    _fake_run(tmp_path, "diloco-R16-H3-s2", UNIGRAM + 0.5, method="diloco", workers=16, inner_steps=3, seed=2,
              global_batch=16)
    runs = load_runs(tmp_path)
    assert [r.name for r in runs if r.unstable] == ["diloco-R16-H3-s2"]
    assert [r.name for r in runs if r.above_after_first] == ["diloco-R16-H3-s2"]  # its final evaluation
    ended = {row["run"]: row["ended_above_unigram"] for row in csv.DictReader(io.StringIO(results_csv(runs)))}
    assert ended["diloco-R16-H3-s2"] == "true" and ended["diloco-R16-H3-s1"] == "false"
    by_group = {(row["method"], row["R"]): row["runs_ended_above_unigram"]
                for row in csv.DictReader(io.StringIO(summary_csv(group_runs(runs))))}
    assert by_group["diloco", "16"] == "1" and by_group["diloco", "8"] == "0" and by_group["isoloco", "16"] == "0"
    md = results_markdown("x", runs, group_runs(runs), None, [])
    assert "| diloco | 16 | 3 | 3 | 5.5000 ± 1.7321 † |" in md
    assert "| diloco | 8 | 3 | 3 | 4.5000 ± 0.0000 | +12.50" in md
    assert "| diloco-R16-H3-s2 | diloco | 16 | 3 | 2 | 7.5000 † |" in md
    assert "| diloco-R16-H3-s1 | diloco | 16 | 3 | 1 | 4.5000 |" in md
    by_method, every_run = md.split("## Every run")
    note = "† ended above the unigram baseline (unstable){}: not counted as support."
    assert f"|\n\n{note.format(' in at least one seed')}\n" in by_method and f"|\n\n{note.format('')}\n" in every_run
    text = compare_markdown(runs, [("isoloco", "diloco")])
    assert _row(text, 16)[4:6] == ["unstable run(s): no call", "unstable run(s): no call"]
    assert _row(text, 8)[5] == "isoloco lower"
    # The change with R stops at R = 8, the largest R without an unstable run: (−0.3 − −0.1) per seed.
    assert "Change of the difference from R = 1 to R = 8 (3 seeds): -0.2000 ± 0.0000 (isoloco gains on diloco" in text
    # Nothing unstable, nothing marked.
    stable = [r for r in runs if not r.unstable]
    assert "†" not in results_markdown("x", stable, group_runs(stable), None, [])


@pytest.mark.parametrize("margin", ["abc", "0", "-1", "100", "nan"])
def test_a_bad_margin_exits_2_naming_the_value_and_the_fix(tmp_path, capsys, margin):
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    assert main(["report", str(tmp_path), "--compare", "isoloco:dp", "--margin", margin]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --margin {margin!r} is not a percentage of the loss between 0 and 100; example: "
                   "--margin 1 (equivalence within ±1% of B's mean final loss)")
    assert not (tmp_path / "results.md").exists()  # refused before any work


def test_published_gaps_are_drawn_beside_the_gap_against_r(tmp_path):
    """`--published`: hollow stars at the published R and gap, in the colour of the method the
    label starts with (a label of no method gets a colour of its own), on the gap plot only."""
    from isoloco.report.plots import _against

    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    for method, base in (("diloco", 4.2), ("isoloco", 4.1)):
        for r in (1, 2):
            _fake_run(tmp_path, f"{method}-R{r}-H3-s0", base + r / 10, method=method, workers=r, inner_steps=3)
    runs = load_runs(tmp_path)
    published = [("isoloco (paper, 178M)", {128: 9.7, 64: 8.0}), ("someone else", {4: 1.5})]
    ax = _against(runs, "workers", True, published).axes[0]
    colors = {c.get_label(): c.lines[0].get_color() for c in ax.containers}
    stars = {line.get_label(): line for line in ax.get_lines() if line.get_marker() == "*"}
    assert list(stars["isoloco (paper, 178M)"].get_xdata()) == [64, 128]
    assert list(stars["isoloco (paper, 178M)"].get_ydata()) == [8.0, 9.7]
    assert stars["isoloco (paper, 178M)"].get_color() == colors["isoloco"] != colors["diloco"]
    assert stars["someone else"].get_color() not in colors.values()
    assert [int(tick) for tick in ax.get_xticks()] == [1, 2, 4, 64, 128]
    assert main(["report", str(tmp_path), "--published", "isoloco (paper, 178M)@128=9.7,64=8"]) == 0
    assert (tmp_path / "plots" / "gap_vs_R.png").is_file()


@pytest.mark.parametrize("points", ["isoloco", "@128=9.7", "isoloco@128", "isoloco@R=9.7", "isoloco@0=9.7",
                                    "isoloco@128=nan"])
def test_a_bad_published_point_exits_2_naming_the_value_and_the_fix(tmp_path, capsys, points):
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    assert main(["report", str(tmp_path), "--published", points]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --published {points!r}") and "example: --published" in err
    assert not (tmp_path / "results.md").exists()  # refused before any work


def _tuned_grid(root: Path) -> None:
    """dp and two methods at R = 1, 2, 4 over two seeds: DiLoCo's outer lr chosen per R (0.7 up to
    R = 2, 0.4 at R = 4), IsoLoCo's one setting throughout."""
    for seed, dp_loss in ((0, 4.0), (1, 5.0)):
        _fake_run(root, f"dp-s{seed}", dp_loss, method="dp", seed=seed, workers=1)
        for r in (1, 2, 4):
            _fake_run(root, f"diloco-R{r}-H3-s{seed}", dp_loss + 0.2 * r, method="diloco", workers=r,
                      inner_steps=3, seed=seed, **{"outer.lr": 0.7 if r <= 2 else 0.4})
            _fake_run(root, f"isoloco-R{r}-H3-s{seed}", dp_loss + 0.1 * r, method="isoloco", workers=r,
                      inner_steps=3, seed=seed)


def test_settings_tuned_per_r_make_one_series_that_shows_each_rs_choice(tmp_path):
    """`--tuned outer.lr`: DiLoCo's runs at two outer lrs are one row per R and one series, each
    row showing its lr; without it they are two variants (two series)."""
    from isoloco.report.plots import _against

    _tuned_grid(tmp_path)
    apart = {r.label for r in load_runs(tmp_path) if r.method == "diloco"}
    assert apart == {"diloco outer.lr=0.7", "diloco outer.lr=0.4"}
    runs = load_runs(tmp_path, tuned=["outer.lr"])
    assert {r.label for r in runs if r.method == "diloco"} == {"diloco"}
    assert {(r.workers, r.tuned) for r in runs if r.method == "diloco"} == {
        (1, "outer.lr=0.7"), (2, "outer.lr=0.7"), (4, "outer.lr=0.4")}
    ax = _against(runs, "workers", True).axes[0]
    series = {c.get_label(): [round(x) for x in c.lines[0].get_xdata()] for c in ax.containers}  # dodged apart
    assert series == {"diloco (lr tuned per R)": [1, 2, 4], "isoloco": [1, 2, 4]}
    assert main(["report", str(tmp_path), "--tuned", "outer.lr", "--compare", "diloco:dp"]) == 0
    summary = [(r["method"], r["R"], r["variant"], r["seeds"]) for r in csv.DictReader((tmp_path / "summary.csv").open())]
    assert ("diloco", "4", "outer.lr=0.4", "2") in summary and ("diloco", "2", "outer.lr=0.7", "2") in summary
    assert "| diloco | 4 | 3 | outer.lr=0.4 | 2 |" in (tmp_path / "results.md").read_text()
    compared = (tmp_path / "compare.md").read_text()
    assert "| 4 | 3 | 2 | +0.8000 ± 0.0000 |" in compared  # R = 4 at its own lr against dp
    assert "from R = 1 to R = 4" in compared


def test_a_tuned_setting_with_two_values_at_one_r_or_an_unknown_key_exits_2(tmp_path, capsys):
    _tuned_grid(tmp_path)
    _fake_run(tmp_path, "diloco-R4-H3-s0-lr1", 4.9, method="diloco", workers=4, inner_steps=3,
              **{"outer.lr": 1.0})
    assert main(["report", str(tmp_path), "--tuned", "outer.lr"]) == 2
    err = capsys.readouterr().err
    assert "diloco-R4-H3-s0 (outer.lr=0.4) and diloco-R4-H3-s0-lr1 (outer.lr=1.0)" in err
    assert "leave outer.lr out of --tuned" in err
    assert main(["report", str(tmp_path), "--tuned", "outer.lrr"]) == 2
    assert "--tuned outer.lrr: not a setting" in capsys.readouterr().err
    assert not (tmp_path / "results.md").exists()  # refused before any work


def test_a_margin_is_a_percentage():
    from isoloco.report.command import _margin

    assert _margin("0.5") == 0.5 and _margin("1") == 1.0


def test_a_contrast_pairs_two_differences_by_seed(tmp_path):
    """(isoloco int8 − isoloco) − (diloco int8 − diloco): what compression costs one method
    against what it costs the other, per seed."""
    costs = {"isoloco": (0.01, 0.02, 0.00), "diloco": (0.11, 0.12, 0.10)}
    for seed in range(3):
        for method, cost in costs.items():
            _fake_run(tmp_path, f"{method}-s{seed}", 4.5, method=method, workers=2, inner_steps=3, seed=seed)
            _fake_run(tmp_path, f"{method}-int8-s{seed}", 4.5 + cost[seed], method=method, workers=2, inner_steps=3,
                      seed=seed, **{"merge.quantize": "int8"})
    pair = "{0} merge.quantize=int8:{0} merge.quantize=none"  # labels name what differs between runs
    assert main(["report", str(tmp_path), "--contrast", f"{pair.format('isoloco')}::{pair.format('diloco')}"]) == 0
    text = (tmp_path / "contrast.md").read_text()
    assert ("## (isoloco merge.quantize=int8 − isoloco merge.quantize=none) − (diloco merge.quantize=int8 − diloco "
            "merge.quantize=none)") in text
    # −0.10 in every seed: no spread, called.
    assert "| 2 | 3 | 3 | -0.1000 ± 0.0000 | isoloco merge.quantize=int8 − isoloco merge.quantize=none lower |" in text
    assert main(["report", str(tmp_path), "--contrast", "isoloco:diloco"]) == 2


def test_the_paired_t_test_and_tost_against_closed_forms():
    """Three seeds (2 degrees of freedom, P(T ≤ −t) = (1 − t/√(t² + 2))/2): differences 0.1, 0.2, 0.3
    have mean 0.2 and standard error 0.1/√3, so t = 2√3; TOST at ±0.5 tests t = (0.2 + 0.5)·√3/0.1 and
    (0.2 − 0.5)·√3/0.1, and its p is the larger one-sided p. No spread: certain either way."""
    from isoloco.report import paired_p, tost_p

    def lower_tail(t):  # P(T ≤ t), 2 degrees of freedom
        return (1 + t / math.sqrt(t * t + 2)) / 2

    assert paired_p([0.1, 0.2, 0.3]) == pytest.approx(2 * lower_tail(-2 * math.sqrt(3)), rel=1e-9)
    assert paired_p([-0.1, -0.2, -0.3]) == paired_p([0.1, 0.2, 0.3])
    above, below = 1 - lower_tail(7 * math.sqrt(3)), lower_tail(-3 * math.sqrt(3))
    assert tost_p([0.1, 0.2, 0.3], 0.5) == pytest.approx(max(above, below), rel=1e-9)
    assert tost_p([0.1, 0.2, 0.3], 0.5) == pytest.approx(0.017549, abs=1e-6)
    assert paired_p([0.5, 0.5, 0.5]) == 0.0 and paired_p([0.0, 0.0]) == 1.0
    assert tost_p([0.2, 0.2], 0.5) == 0.0 and tost_p([0.5, 0.5], 0.5) == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_tost_passes_exactly_when_the_90_percent_interval_lies_inside_the_margin(seed):
    """Two one-sided tests at level 0.05 against the interval they are equivalent to (away from the edge)."""
    import random

    from isoloco.report import mean_ci, tost_p

    rng = random.Random(seed)
    for _ in range(200):
        values = [rng.gauss(rng.uniform(-1, 1), rng.uniform(0.01, 1)) for _ in range(rng.randint(2, 8))]
        margin = rng.uniform(0.05, 2)
        mean, half = mean_ci(values, 90)
        if min(abs(mean - half + margin), abs(mean + half - margin)) < 1e-9:
            continue
        assert (tost_p(values, margin) < 0.05) == (-margin < mean - half and mean + half < margin)


def _plain_bh(pvalues: list[float]) -> list[float]:
    """Benjamini–Hochberg by its definition, one p at a time: the least p_j · m / rank_j over the
    p_j at least as large as it (rank_j: how many p are ≤ p_j), at most 1."""
    m = len(pvalues)
    return [min(1.0, min(pj * m / sum(pl <= pj for pl in pvalues) for pj in pvalues if pj >= pi)) for pi in pvalues]


def test_benjamini_hochberg_adjusts_by_rank():
    from isoloco.report import benjamini_hochberg

    # Sorted 0.01, 0.03, 0.04, 0.20 (m = 4): × 4/1, 4/2, 4/3, 4/4 = 0.04, 0.06, 0.0533, 0.20, then the
    # running minimum from the largest down: 0.06 becomes 0.0533.
    assert benjamini_hochberg([0.01, 0.04, 0.03, 0.20]) == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.20])
    assert benjamini_hochberg([0.5, 0.9]) == pytest.approx([0.9, 0.9]) and benjamini_hochberg([]) == []
    assert benjamini_hochberg([0.6, 0.7, 0.8]) == pytest.approx([0.8, 0.8, 0.8])  # never above 1, never below p
    from isoloco.report.compare import format_p

    assert [format_p(0.0312), format_p(3.14e-5), format_p(0.0)] == ["0.031", "3.1e-05", "0"]


@pytest.mark.parametrize("seed", range(5))
def test_benjamini_hochberg_matches_the_definition_one_p_at_a_time(seed):
    """Against a plain loop, on p-values with ties, zeros and ones."""
    import random

    from isoloco.report import benjamini_hochberg

    rng = random.Random(seed)
    for m in (1, 2, 3, 7, 25):
        pvalues = [rng.choice([0.0, 1.0, 0.05, round(rng.random(), 2), rng.random() ** 3]) for _ in range(m)]
        assert benjamini_hochberg(pvalues) == pytest.approx(_plain_bh(pvalues), rel=1e-12, abs=1e-15), pvalues


def test_compare_adds_the_benjamini_hochberg_call_beside_the_raw_one(tmp_path):
    """Four tests in the file: the R = 2 difference is called alone (p = 0.031) but not once its p is
    adjusted for the four (× 4/2 = 0.062); R = 8's survives."""
    _paired_grid(tmp_path, {2: (0.13, 0.2, 0.25), 4: (0.2, -0.25, 0.05), 8: (-0.30, -0.32, -0.28),
                            16: (0.2, -0.3, 0.1)})
    text = compare_markdown(load_runs(tmp_path), [("isoloco", "diloco")])
    assert "| call | p (BH) | call after BH |" in text and "Benjamini–Hochberg" in text
    d = [0.13, 0.2, 0.25]
    mean = sum(d) / 3
    t = mean / (math.sqrt(sum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3))
    p = 2 * (1 - _student_t_cdf(t, 2))
    assert f"{p:.3f}" == "0.031"
    assert _row(text, 2)[5:8] == ["diloco lower", f"0.031 ({p * 2:.3f})", "not called after BH"]
    assert _row(text, 8)[5] == _row(text, 8)[7] == "isoloco lower"
    assert _row(text, 4)[5] == _row(text, 4)[7] == "not distinguishable with 3 seeds"


def test_a_run_above_the_unigram_baseline_mid_run_is_marked_with_its_peak(tmp_path):
    """Ending below the baseline (no †) does not hide an evaluation above it (‡)."""
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    _fake_run(tmp_path, "isoloco-s0", UNIGRAM - 0.2, method="isoloco", workers=2, inner_steps=3)  # peak 7.3
    _fake_run(tmp_path, "diloco-s0", 4.5, method="diloco", workers=2, inner_steps=3)
    write_report(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| isoloco-s0 | isoloco | 2 | 3 | 0 | 6.8000 | +70.00 | 7.3000 (step 3) ‡ |" in md
    assert "| diloco-s0 | diloco | 2 | 3 | 0 | 4.5000 | +12.50 | 5.0000 (step 3) |" in md
    assert "| isoloco | 2 | 3 | 1 | 6.8000 | +70.00 | 7.3000 ‡ |" in md and "† ended" not in md
    assert md.count("‡ validation loss above the unigram baseline at an evaluation") == 2
    # Its first evaluation (step 3) was the one above: not one after it.
    assert "1 of the 3 finished runs were above their unigram baseline at an evaluation (‡), 0 of them at an " \
           "evaluation after their first; 0 ended above it (†)." in md
    rows = {r["run"]: r for r in csv.DictReader((tmp_path / "results.csv").open())}
    assert rows["isoloco-s0"]["above_unigram_at_an_evaluation"] == "true" and rows["isoloco-s0"]["peak_step"] == "3"
    assert rows["isoloco-s0"]["above_unigram_after_first_evaluation"] == "false"
    assert rows["diloco-s0"]["above_unigram_at_an_evaluation"] == "false"


def test_link_bytes_and_exposed_seconds_are_shown_only_where_runs_record_them(tmp_path):
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    _fake_run(tmp_path, "old-s0", 4.5, method="diloco", workers=2, inner_steps=3)
    write_report(tmp_path)
    assert "wire bytes" not in (tmp_path / "results.md").read_text()
    assert "wire" not in (tmp_path / "results.csv").read_text()  # an old folder's report stays as it was
    for seed, (wire, exposed) in enumerate(((10_097_152, 0.5), (10_097_152.0, 1.5))):  # an int, or a float sum
        _fake_run(tmp_path, f"new-s{seed}", 4.5, method="diloco", workers=2, inner_steps=3, seed=seed,
                  summary={"cross_island_wire_bytes": wire, "exposed_sync_seconds": exposed}, **{"outer.lr": 0.4})
    write_report(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| wall time (s) | CPU time (s) | wire bytes | exposed sync (s) |" in md
    assert "| 12 ± 0 | 10 ± 0 | 10,097,152 ± 0 | 1.00 ± 0.71 |" in md  # the two seeds' mean and std
    assert "| old-s0 | diloco | 2 | 3 | outer.lr=0.7 | 0 | 4.5000 |" in md and "| 12 | 10 | — | — |" in md
    assert "| new-s1 | diloco | 2 | 3 | outer.lr=0.4 | 1 |" in md and "| 12 | 10 | 10,097,152 | 1.50 |" in md
    rows = {r["run"]: r for r in csv.DictReader((tmp_path / "results.csv").open())}
    assert rows["new-s0"]["cross_island_wire_bytes"] == "10097152" and rows["old-s0"]["exposed_sync_seconds"] == ""


def test_two_runs_of_one_seed_count_as_one_seed_with_a_warning(tmp_path, capsys):
    """A rerun of seed 0 beside the first run: the point has one seed, not "2, ± 0.0000"."""
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    _fake_run(tmp_path, "diloco-s0", 4.5, method="diloco", workers=2, inner_steps=3)
    _fake_run(tmp_path, "diloco-s0-again", 4.5, method="diloco", workers=2, inner_steps=3)
    assert main(["report", str(tmp_path), "--compare", "diloco:dp"]) == 0
    err = capsys.readouterr().err
    assert "warning: diloco-s0-again repeats seed 0 of diloco-s0" in err and "counted once" in err
    md = (tmp_path / "results.md").read_text()
    assert "| diloco | 2 | 3 | 1 | 4.5000 | +12.50 |" in md and "diloco-s0-again (seed 0, as diloco-s0)" in md
    assert "| diloco-s0-again |" not in md
    assert _row((tmp_path / "compare.md").read_text(), 2)[2] == "1"  # one pair: one seed


def test_a_method_run_with_one_setting_shows_it_beside_the_others(tmp_path, capsys):
    """results.md does not write "—" for DiLoCo beside IsoLoCo's quantisation settings, and --compare
    names runs by any of the settings the table shows; a label that names several is refused."""
    _fake_run(tmp_path, "dp-s0", 4.0, method="dp", workers=1)
    _fake_run(tmp_path, "diloco-s0", 4.5, method="diloco", workers=2, inner_steps=3)
    for quantize, loss in (("none", 4.3), ("int8", 4.35)):
        _fake_run(tmp_path, f"isoloco-{quantize}-s0", loss, method="isoloco", workers=2, inner_steps=3,
                  **{"merge.quantize": quantize})
    write_report(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| diloco | 2 | 3 | merge.quantize=none | 1 |" in md and "| dp | — | — | — | 1 |" in md
    assert "| isoloco | 2 | 3 | merge.quantize=int8 | 1 |" in md
    assert [r.label for r in load_runs(tmp_path)] == ["dp", "diloco", "isoloco merge.quantize=int8",
                                                     "isoloco merge.quantize=none"]  # what --compare matches first
    pair = "isoloco merge.quantize=int8:diloco merge.quantize=none"
    assert main(["report", str(tmp_path), "--compare", pair, "--compare", "isoloco merge.quantize=int8:diloco"]) == 0
    text = (tmp_path / "compare.md").read_text()
    assert text.count("| 2 | 3 | 1 | -0.1500 | one seed: no call |") == 4  # each pair's table, and every pair's
    assert main(["report", str(tmp_path), "--compare", "isoloco:diloco"]) == 2
    err = capsys.readouterr().err
    assert "--compare 'isoloco' names runs of several settings at one point" in err and "name one of them" in err


def test_plots_name_series_by_what_differs_and_keep_coinciding_points_apart(tmp_path):
    """Six series that differ in three long settings and end at the same loss: distinct legend names
    that give each differing setting's value as the command line spells it, one x position each at
    every R, and no layout warning; without dp, no gap chart."""
    import warnings

    from isoloco.report.plots import _against, save_png

    settings = [{"merge.quantize": q, "merge.error_feedback": ef, "outer.overlap_steps": ov}
                for q, ef, ov in (("none", False, 0), ("int8", False, 0), ("int8", True, 0), ("int4", False, 0),
                                  ("int4", True, 0), ("none", False, 2))]
    for i, keys in enumerate(settings):
        for r in (2, 4):
            _fake_run(tmp_path, f"isoloco-{i}-R{r}", 4.5, method="isoloco", workers=r, inner_steps=3, **keys)
    runs = load_runs(tmp_path)
    fig = _against(runs, "workers", False)
    ax = fig.axes[0]
    names = [text.get_text() for text in fig.legends[0].get_texts()]
    # The series in the order of their settings, each differing key by its last part with its value;
    # then the key to their hollow points (one seed each).
    assert names == [*(f"isoloco error_feedback={ef} quantize={q} overlap_steps={ov}" for ef, ov, q in (
        ("false", 0, "int4"), ("false", 0, "int8"), ("false", 0, "none"), ("false", 2, "none"), ("true", 0, "int4"),
        ("true", 0, "int8"))), "hollow: one seed (no spread)"]
    at_r2 = [container.lines[0].get_xdata()[0] for container in ax.containers]
    assert len(set(at_r2)) == 6 and all(1.8 < x < 2.2 for x in at_r2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "constrained_layout not applied" would raise here
        save_png(fig, tmp_path / "check.png")
    write_report(tmp_path)
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"val_loss_vs_R.png", "val_curves.png"}
    assert "gap_vs_R" not in (tmp_path / "results.md").read_text()


#: Seven settings of IsoLoCo's slow link, with the bytes per round their runs record (made up).
SEVEN_SETTINGS = [({}, 7_572_864.0), ({"merge.quantize": "int8"}, 1_924_215.0),
                  ({"merge.quantize": "int4", "merge.error_feedback": True}, 990_000.0),
                  ({"merge.compress": "lowrank", "merge.compress_rank": 2}, 300_000.0),
                  ({"merge.compress": "lowrank", "merge.compress_rank": 4, "merge.quantize": "int8",
                    "merge.error_feedback": True}, 67_000.0),
                  ({"merge.compress": "topk", "merge.compress_density": 0.01}, 230_928.0),
                  ({"outer.overlap_steps": 2}, 7_572_864.0)]


def _seven_settings(root: Path, workers: tuple[int, ...] = (2, 4)) -> None:
    """dp, and IsoLoCo in the seven settings at each R; the first two end 0.0004 apart."""
    _fake_run(root, "dp-s0", 4.0, method="dp", workers=1)
    for index, (keys, wire) in enumerate(SEVEN_SETTINGS):
        for r in workers:
            _fake_run(root, f"isoloco-{index}-R{r}", 4.5 + 0.0004 * (index == 1) + 0.01 * (index > 1),
                      method="isoloco", workers=r, inner_steps=3, summary={
                          "slow_link_bytes_per_round": wire, "slow_link_fewer_than_float32": 7_572_864.0 / wire},
                      **keys)


def test_a_report_of_many_settings_keeps_its_plots_readable(tmp_path, monkeypatch):
    """Seven settings of long names: every plot keeps at least half the figure's width for its axes
    (matplotlib's own geometry, after its layout), no layout warning, no offset on a loss axis, and
    a difference of 0.0004 drawn on an axis at least ±1% of the loss tall."""
    import warnings

    from isoloco.report import plots

    figures = {}
    save = plots.save_png
    monkeypatch.setattr(plots, "save_png", lambda fig, path: (figures.__setitem__(path.name, fig), save(fig, path)))
    _seven_settings(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "constrained_layout not applied" would raise here
        assert main(["report", str(tmp_path)]) == 0
    assert set(figures) == {"val_loss_vs_R.png", "gap_vs_R.png", "val_curves.png", "val_loss_vs_bytes.png"}
    for name, fig in figures.items():
        (legend,) = fig.legends  # inside the figure, under the axes
        box, axes_bottom = legend.get_window_extent(), min(ax.get_window_extent().y0 for ax in fig.axes)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0 and box.y1 < axes_bottom, name
        shown = [ax for ax in fig.axes if ax.get_visible()]
        top = max(ax.get_position().y1 for ax in shown)
        row = [ax.get_position() for ax in shown if ax.get_position().y1 == top]
        assert sum(box.width for box in row) >= 0.5, name
        for ax in shown:
            assert ax.yaxis.get_major_formatter().get_offset() == "", name
            low, high = ax.get_ylim()
            assert high - low >= (0.02 * 4.5 if "gap" not in name else 2.0), name
    (legend,) = figures["val_loss_vs_R.png"].legends
    names = [text.get_text().replace("\n", " ") for text in legend.get_texts()]
    # Only the settings that differ, each with its value; a compression knob only where it acts.
    assert "isoloco compress=lowrank compress_rank=2 error_feedback=false quantize=none overlap_steps=0" in names
    assert "isoloco compress=none error_feedback=false quantize=none overlap_steps=2" in names
    assert "isoloco compress=topk error_feedback=false quantize=none overlap_steps=0" in names  # one density: unnamed
    (ax,) = figures["val_loss_vs_bytes.png"].axes
    drawn = sorted(c.lines[0].get_xdata()[0] for c in ax.containers)
    assert len(set(drawn)) == len(drawn)  # settings that send the same bytes stand side by side
    for x, sent in zip(drawn, sorted([w for _, w in SEVEN_SETTINGS] * 2)):
        assert abs(math.log2(x / sent)) <= 0.15  # each beside its bytes, within ±0.15 of a factor 2
    md = (tmp_path / "results.md").read_text()
    assert "| slow link per round (bytes) | × fewer than float32 |" in md and "| 1,924,215 | 3.9× |" in md


def test_a_negligible_gap_is_drawn_on_a_plain_axis_at_least_two_margins_tall(tmp_path):
    """Two settings 0.0004 apart and nothing else: no `+4.5` offset above the axis, and the axis
    spans ±1% (the equivalence margin) of the loss rather than the 0.0004."""
    from isoloco.report.plots import _against

    for index, (keys, _) in enumerate(SEVEN_SETTINGS[:2]):
        for r in (2, 4):
            _fake_run(tmp_path, f"isoloco-{index}-R{r}", 4.5 + 0.0004 * index, method="isoloco", workers=r,
                      inner_steps=3, **keys)
    fig = _against(load_runs(tmp_path), "workers", False)
    fig.canvas.draw()
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    assert ax.yaxis.get_major_formatter().get_offset() == "" and high - low == pytest.approx(0.02 * 4.5004)


def test_compare_takes_the_command_lines_spellings_and_is_checked_before_anything_is_written(tmp_path, capsys):
    _seven_settings(tmp_path, workers=(4,))
    for label in ("isoloco merge.error_feedback=true merge.quantize=int4:isoloco merge.quantize=int8 merge.compress=none",
                  "isoloco merge.error_feedback=True merge.quantize=int4:isoloco merge.quantize=int8 merge.compress=none"):
        assert main(["report", str(tmp_path), "--compare", label]) == 0
        assert "| 4 | 3 | 1 | +0.0096 | one seed: no call |" in (tmp_path / "compare.md").read_text()
    for bad, said in (("isoloco:dp", "'isoloco' names runs of several settings at one point"),
                      ("isoloco merge.quantise=int8:dp", "unknown key 'merge.quantise' (did you mean merge.quantize"),
                      ("isoloco merge.error_feedback=maybe:dp", "merge.error_feedback='maybe' is not allowed"),
                      ("isoloc:dp", "unknown method 'isoloc'")):
        for written in ("results.md", "results.csv", "summary.csv", "compare.md", "plots"):
            shutil.rmtree(tmp_path / written) if written == "plots" else (tmp_path / written).unlink()
        capsys.readouterr()
        assert main(["report", str(tmp_path), "--compare", bad]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and said in err, err
        assert not any((tmp_path / written).exists() for written in ("results.md", "plots", "compare.md"))
        assert main(["report", str(tmp_path), "--compare", "isoloco merge.quantize=int4:dp"]) == 0


def test_the_curves_mark_what_their_cut_hides_and_name_dps_budget(tmp_path, monkeypatch):
    """An evaluation far above the rest early on (loss 9 at step 1 of 6): the y axis is cut at the
    losses after a quarter of training, and the evaluation it cuts is drawn as ▲ on the top edge,
    with a title that says so; dp's legend entry names its token budget."""
    from isoloco.report import plots

    figures = {}
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.__setitem__(path.name, fig))
    for name, method, workers, loss in (("dp-s0", "dp", 1, 4.0), ("isoloco-R2-H3-s0", "isoloco", 2, 4.5)):
        _fake_run(tmp_path, name, loss, method=method, workers=workers, inner_steps=3)
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "tokens": s * 256, "train_loss": 9.0, "val_loss": v}) + "\n"
            for s, v in ((1, 9.0), (3, loss + 0.5), (6, loss))))
    assert main(["report", str(tmp_path)]) == 0
    fig = figures["val_curves.png"]
    (ax,) = [ax for ax in fig.axes if ax.get_visible()]
    top = ax.get_ylim()[1]
    assert top < 9.0
    marked = [line for line in ax.lines if line.get_marker() == "^"]
    assert len(marked) == 2 and all(list(line.get_ydata()) == [top] for line in marked)  # dp's and IsoLoCo's
    assert "▲" in fig._suptitle.get_text()
    (legend,) = fig.legends
    assert f"dp ({TOKENS:,} tokens)" in [text.get_text() for text in legend.get_texts()]


#: A finished IsoLoCo run at R = 2 with nothing else known, for tests of one plot helper.
_BLANK_RUN = {"name": "run", "method": "isoloco", "workers": 2, "inner_steps": 3, "seed": 0, "model": "tiny",
              "tokens": TOKENS, "final_val_loss": 4.5, "unigram_baseline": UNIGRAM, "wall_time_s": None,
              "cpu_time_s": None, "curve": ()}


def test_a_legend_leaves_out_a_setting_a_series_holds_no_value_of():
    """Two series apart by merge.compress_exclude: the one without patterns is not named
    `compress_exclude=` (an empty value), the other is named with its patterns."""
    from isoloco.report.plots import _legend_names
    from isoloco.report.runs import RunResult

    def series(exclude: list[str]) -> RunResult:
        settings = {"algorithm": "diloco", "merge.compress": "lowrank", "merge.compress_exclude": tuple(exclude)}
        variant = "merge.compress=lowrank merge.compress_exclude=" + ",".join(exclude)
        return RunResult(**{**_BLANK_RUN, "settings": tuple(settings.items()), "variant": variant})

    names = _legend_names({"a": series([]), "b": series(["lm_head.weight"])}, [])
    assert names == {"a": "isoloco", "b": "isoloco compress_exclude=lm_head.weight"}


def test_a_ratio_of_a_negative_gap_is_not_printed_and_the_table_says_why(tmp_path):
    """dp at 4.0: at R = 1 IsoLoCo ends below it (a negative gap), at R = 2 both methods above it. The
    ratio of R = 1's gaps (−2.5% over +2.5%, −1.00) is "—" with a note; R = 2's is printed."""
    _paired_grid(tmp_path, {1: (-0.2, -0.2, -0.2), 2: (0.1, 0.1, 0.1)}, b_loss=4.1)
    text = compare_markdown(load_runs(tmp_path), [("isoloco", "diloco")])
    assert _row(text, 1)[-3:] == ["-2.50", "+2.50", "—"]
    assert _row(text, 2)[-3:] == ["+5.00", "+2.50", "2.00"]
    assert "the ratio of a negative gap is no such share" in text
    positive = tmp_path / "positive"
    _paired_grid(positive, {2: (0.1, 0.1, 0.1)}, b_loss=4.1)
    assert "negative gap" not in compare_markdown(load_runs(positive), [("isoloco", "diloco")])


def _captured_figures(monkeypatch) -> dict[str, object]:
    """The figures `isoloco report` draws, by file name, instead of PNG files."""
    from isoloco.report import plots

    figures = {}
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.__setitem__(path.name, fig))
    return figures


def _legend_colors(fig) -> dict[str, str]:
    """Legend name -> the colour of its entry, in one figure."""
    from matplotlib.colors import to_hex

    (legend,) = fig.legends
    return {text.get_text(): to_hex(handle.get_color()) for text, handle in zip(legend.get_texts(),
                                                                               legend.legend_handles)
            if hasattr(handle, "get_color")}


def test_a_method_has_one_colour_in_every_plot_of_a_report(tmp_path, monkeypatch):
    """diloco, isoc and isoloco against R, but only diloco and isoloco against H (isoc ran one H):
    isoloco is the third series in one plot and the second in the other, and keeps its colour."""
    figures = _captured_figures(monkeypatch)
    for seed in (0, 1):
        _fake_run(tmp_path, f"dp-s{seed}", 4.0, method="dp", workers=1, seed=seed)
        for method, base in (("diloco", 4.3), ("isoc", 4.2), ("isoloco", 4.1)):
            for r, h in ((1, 3), (2, 3)) + (((2, 6),) if method != "isoc" else ()):
                _fake_run(tmp_path, f"{method}-R{r}-H{h}-s{seed}", base + r / 10 + h / 100 + seed / 100,
                          method=method, workers=r, inner_steps=h, seed=seed)
    assert main(["report", str(tmp_path)]) == 0
    assert {"gap_vs_R.png", "gap_vs_H.png", "val_curves.png"} <= set(figures)
    colors: dict[str, set[str]] = {}
    for fig in figures.values():
        for name, color in _legend_colors(fig).items():
            if name.split()[0] in ("diloco", "isoc", "isoloco"):
                colors.setdefault(name.split()[0], set()).add(color)
    assert all(len(found) == 1 for found in colors.values()), colors
    assert len({found.pop() for found in colors.values()}) == 3


def test_dps_spread_is_drawn_as_a_band_around_its_line_in_every_loss_plot(tmp_path, monkeypatch):
    """dp at 4.0 and 5.0 (mean 4.5, std 0.707): a band from mean − std to mean + std in each plot
    that draws dp's loss as a line (against R, a knob, the bytes), none in the gap plot (dp is 0)."""
    figures = _captured_figures(monkeypatch)
    for seed in (0, 1):
        _fake_run(tmp_path, f"dp-s{seed}", 4.0 + seed, method="dp", workers=1, seed=seed)
        for lr, wire in ((0.5, 1e6), (1.0, 2e6)):
            for r in (1, 2):
                _fake_run(tmp_path, f"isoloco-lr{lr}-R{r}-s{seed}", 4.6 + seed, method="isoloco", workers=r,
                          inner_steps=3, seed=seed, summary={"slow_link_bytes_per_round": wire},
                          **{"outer.lr": lr})
    assert main(["report", str(tmp_path)]) == 0
    std = 2 ** -0.5
    for name in ("val_loss_vs_R.png", "val_loss_vs_outer.lr.png", "val_loss_vs_bytes.png"):
        (ax,) = figures[name].axes
        (band,) = ax.patches
        assert (band.get_y(), band.get_height()) == (pytest.approx(4.5 - std), pytest.approx(2 * std)), name
        assert band.get_label() in [text.get_text() for text in figures[name].legends[0].get_texts()]
        assert band.get_label() == "dp: ± std over 2 seeds"
    assert not figures["gap_vs_R.png"].axes[0].patches


def test_each_point_shows_its_seed_count_and_a_point_of_one_seed_is_hollow_without_a_bar(tmp_path):
    """IsoLoCo over two seeds at R = 1 and 2, one seed at R = 4: every point is labelled with its
    seed count; R = 4's is hollow and has no error bar (a bar of zero height would read as no spread)."""
    from isoloco.report.plots import ONE_SEED, _against

    for seed in (0, 1):
        _fake_run(tmp_path, f"dp-s{seed}", 4.0, method="dp", workers=1, seed=seed)
        for r in (1, 2, 4)[:3 - seed]:
            _fake_run(tmp_path, f"isoloco-R{r}-s{seed}", 4.0 + r / 10 + seed / 10, method="isoloco", workers=r,
                      inner_steps=3, seed=seed)
    for gap in (False, True):
        fig = _against(load_runs(tmp_path), "workers", gap)
        (ax,) = fig.axes
        assert [(text.get_text(), text.xy[0]) for text in ax.texts] == [("n=2", 1), ("n=2", 2), ("n=1", 4)]
        (series,) = ax.containers
        (bars,) = series.lines[2]
        assert [len(segment) for segment in bars.get_segments()] == [2, 2, 0]  # no bar at R = 4
        hollow = [line for line in ax.lines if line.get_markerfacecolor() == "white" and len(line.get_xdata())]
        assert [list(line.get_xdata()) for line in hollow] == [[4]]
        assert [text.get_text() for text in fig.legends[0].get_texts()][-1] == ONE_SEED


def test_each_seed_has_its_own_marker_in_the_curves(tmp_path):
    """Two seeds of dp and IsoLoCo: each seed's curves share a marker, the seeds differ, and the
    legend names each seed by its marker."""
    from isoloco.report.plots import _curves

    for seed in (0, 1):
        _fake_run(tmp_path, f"dp-s{seed}", 4.0 + seed, method="dp", workers=1, seed=seed)
        _fake_run(tmp_path, f"isoloco-R2-s{seed}", 4.5 + seed, method="isoloco", workers=2, inner_steps=3, seed=seed)
    fig = _curves(load_runs(tmp_path))
    (ax,) = [ax for ax in fig.axes if ax.get_visible()]
    markers = {line.get_ydata()[-1]: line.get_marker() for line in ax.lines}
    assert markers[4.0] == markers[4.5] != markers[5.0] == markers[5.5]
    (legend,) = fig.legends
    entries = {text.get_text(): handle for text, handle in zip(legend.get_texts(), legend.legend_handles)}
    assert entries["seed 0"].get_marker() == markers[4.0] and entries["seed 1"].get_marker() == markers[5.0]
