"""scripts/claim_reports.py: the tables of docs/claims (and docs/results.md) are copies of the reports' tables."""

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "claim_reports.py"


def _script():
    spec = importlib.util.spec_from_file_location("claim_reports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = """# Results: x

## By method, R and H

| method | R | loss |
|---|---|---|
| dp | — | 4.0 |
| isoloco | 8 | 4.4 |
| diloco | 8 | 4.7 |

## Every run

| run | loss |
|---|---|
| dp-s0 | 4.0 |
"""


@pytest.fixture
def doc(tmp_path, monkeypatch):
    """A page to sync in an empty folder that holds one report, `report.md`."""
    monkeypatch.chdir(tmp_path)
    Path("report.md").write_text(REPORT)
    return Path("page.md")


def test_a_marked_table_is_replaced_by_the_rows_its_marker_picks(doc):
    doc.write_text('Intro.\n\n<!-- table: report.md "By method, R and H" rows: ^\\| (dp|isoloco) \\| -->\n\n'
                   "| method | R | loss |\n|---|---|---|\n| dp | — | 3.9 |\n\nAfter.\n\n"
                   '<!-- table: report.md "Every run" -->\n\n| run | loss |\n|---|---|\n| dp-s0 | 4.0 |\n')
    sync = _script().sync_tables
    assert sync(doc, write=False) == [(doc.read_text().splitlines()[2], "differs from its report")]
    assert sync(doc, write=True)[0][1] == "updated"
    text = doc.read_text()
    assert "| dp | — | 4.0 |\n| isoloco | 8 | 4.4 |\n\nAfter." in text and "diloco" not in text
    assert sync(doc, write=False) == []


def test_a_marker_naming_a_missing_section_is_reported_and_its_table_kept(doc):
    doc.write_text('<!-- table: report.md "Every pair" -->\n\n| a |\n|---|\n| 1 |\n')
    before = doc.read_text()
    (stale,) = _script().sync_tables(doc, write=True)
    assert stale[1].startswith("its report has no such table") and doc.read_text() == before


def test_a_marker_without_its_table_exits_2_and_leaves_the_page(doc):
    doc.write_text('<!-- table: report.md "Every run" -->\nNo table here.\n')
    before = doc.read_text()
    done = subprocess.run([sys.executable, str(SCRIPT), "--doc", str(doc)], capture_output=True, text=True)
    assert done.returncode == 2 and "must be followed by one blank line and the table" in done.stderr
    assert doc.read_text() == before


MARKED_REPORT = """## By method, R and H

| method | R | loss |
|---|---|---|
| dp | — | 4.0 |
| diloco | 8 | 9.0 † |

† ended above the unigram baseline (unstable): not counted as support.

## Every run
"""


def test_a_marked_row_brings_its_footnote_and_an_unmarked_table_drops_it(doc):
    Path("report.md").write_text(MARKED_REPORT)
    doc.write_text('<!-- table: report.md "By method, R and H" -->\n\n| method | R | loss |\n|---|---|---|\n'
                   '| dp | — | 4.0 |\n\nAfter.\n\n'
                   '<!-- table: report.md "By method, R and H" rows: ^\\| dp -->\n\n| method | R | loss |\n'
                   '|---|---|---|\n| dp | — | 4.0 |\n')
    sync = _script().sync_tables
    assert [problem for _, problem in sync(doc, write=True)] == ["updated"]
    text = doc.read_text()
    assert text.count("† ended above") == 1  # under the table that keeps the marked row only
    assert "| diloco | 8 | 9.0 † |\n\n† ended above the unigram baseline (unstable): not counted as support.\n\n" \
           "After." in text
    assert sync(doc, write=False) == []  # the footnote is part of the table it follows
    Path("report.md").write_text(MARKED_REPORT.replace(" †", "").replace("\n† ended above the unigram baseline "
                                                                          "(unstable): not counted as support.\n", ""))
    assert [problem for _, problem in sync(doc, write=True)] == ["updated"]
    assert "†" not in doc.read_text() and "| diloco | 8 | 9.0 |\n\nAfter." in doc.read_text()


def test_a_row_brings_the_footnotes_of_its_own_marks_only(doc):
    """† (ended unstable) and ‡ (above the unigram baseline at an evaluation) each have a footnote: a
    table keeping only ‡ rows brings only the ‡ line."""
    Path("report.md").write_text("## By method, R and H\n\n| method | loss | peak |\n|---|---|---|\n"
                                 "| dp | 4.0 | 4.5 |\n| isoloco | 4.4 | 7.3 ‡ |\n| diloco | 9.0 † | 9.1 ‡ |\n\n"
                                 "† ended unstable.\n‡ above the baseline at an evaluation.\n\n## Every run\n")
    doc.write_text('<!-- table: report.md "By method, R and H" rows: ^\\| (dp|isoloco) -->\n\n| method |\n|---|\n\n'
                   'After.\n\n<!-- table: report.md "By method, R and H" -->\n\n| method |\n|---|\n')
    sync = _script().sync_tables
    sync(doc, write=True)
    first, second = doc.read_text().split("After.")
    assert first.endswith("| isoloco | 4.4 | 7.3 ‡ |\n\n‡ above the baseline at an evaluation.\n\n")
    assert second.endswith("| diloco | 9.0 † | 9.1 ‡ |\n\n† ended unstable.\n‡ above the baseline at an evaluation.\n")
    assert sync(doc, write=False) == []


def _two_dof_p(values: list[float]) -> float:
    """The paired t-test's two-sided p over three seeds, in closed form: 1 − |t|/√(t² + 2)."""
    mean = sum(values) / 3
    t = mean / math.sqrt(sum((x - mean) ** 2 for x in values) / 2 / 3)
    return 1 - abs(t) / math.sqrt(t * t + 2)


def _plain_bh(pvalues: list[float]) -> list[float]:
    """Benjamini–Hochberg by its definition: the least p_j · m / rank_j over the p_j ≥ p_i, at most 1."""
    m = len(pvalues)
    return [min(1.0, min(pj * m / sum(pl <= pj for pl in pvalues) for pj in pvalues if pj >= pi)) for pi in pvalues]


#: isoloco − diloco per R and seed (test_report's grid: dp 4.0, diloco 4.5, isoloco 4.5 + d).
PAGE_DIFFERENCES = {2: (0.13, 0.2, 0.25), 4: (0.2, -0.25, 0.05), 8: (-0.30, -0.32, -0.28), 16: (0.2, -0.3, 0.1)}


def test_the_page_tests_are_adjusted_together_each_once_from_unrounded_p(doc):
    """Four tests (the pair's rows quoted twice, in its section and in "Every pair", count once): R = 2's
    p, 0.0309 (printed 0.031), becomes 0.0618 over the four, not the 0.0620 the printed digits give, so
    the call it has in the report is dropped page-wide; R = 8's, 0.00148 (printed 0.001), becomes 0.0059."""
    from test_report import _paired_grid

    from isoloco.report import compare_markdown, load_runs

    folder = Path("grid")
    _paired_grid(folder, PAGE_DIFFERENCES)
    (folder / "compare.md").write_text(compare_markdown(load_runs(folder), [("isoloco", "diloco"), ("diloco", "dp")]))
    doc.write_text('<!-- table: grid/compare.md "isoloco − diloco" -->\n\n| x |\n\n'
                   '<!-- table: grid/compare.md "Every pair" rows: isoloco -->\n\n| x |\n')
    script = _script()
    tests = script.quoted_tests(doc)
    exact = [_two_dof_p(PAGE_DIFFERENCES[r]) for r in (2, 4, 8, 16)]
    assert [(test["R"], test["p"]) for test in tests] == [("2", "0.031"), ("4", "1.000"), ("8", "0.001"),
                                                          ("16", "1.000")]
    assert [test["exact"] for test in tests] == pytest.approx(exact, rel=1e-9)
    adjusted = _plain_bh(exact)
    assert f"{adjusted[0]:.4f}" == "0.0618" and f"{adjusted[2]:.4f}" == "0.0059"
    text = script.page_tests_markdown(doc)
    assert "4 paired tests in the compare tables the page quotes" in text and "2 of them called" in text
    assert "at a false discovery rate of 0.05, 1 stay called" in text
    dropped, every = text.split("## The contrasts")[0].split("## Called")[1].split("## Every test")
    assert [line.split(" | ")[2] for line in dropped.splitlines() if line.startswith("| grid")] == ["2"]
    assert ("| grid/compare.md | isoloco − diloco | 2 | 3 | 3 | +0.1933 ± 0.1497 | 0.031 | 0.0618 | diloco lower |"
            in text)
    assert [(row.split(" | ")[2], row.split(" | ")[7]) for row in every.splitlines() if row.startswith("| grid")] == [
        ("8", "0.0059"), ("2", "0.0618"), ("4", "1.0000"), ("16", "1.0000")]  # every test, by adjusted p


def test_a_quoted_change_with_r_is_a_test_of_the_page_adjusted_with_the_points(doc):
    """The change of isoloco − diloco from R = 2 to R = 8, quoted from compare.md's "Change with R",
    is a fifth test: its p is the paired t-test's of the per-seed changes (closed form over three
    seeds), and "gains on" counts as a call."""
    from test_report import _paired_grid

    from isoloco.report import compare_markdown, load_runs

    folder = Path("grid")
    differences = {r: PAGE_DIFFERENCES[r] for r in (2, 4, 8)}
    _paired_grid(folder, differences)
    (folder / "compare.md").write_text(compare_markdown(load_runs(folder), [("isoloco", "diloco")]))
    doc.write_text('<!-- table: grid/compare.md "isoloco − diloco" -->\n\n| x |\n\n'
                   '<!-- table: grid/compare.md "Change with R" -->\n\n| x |\n')
    script = _script()
    assert script.sync_doc(doc, write=True)
    tests = script.quoted_tests(doc)
    changes = [high - low for high, low in zip(differences[8], differences[2])]
    assert [test["R"] for test in tests] == ["2", "4", "8", "2 → 8"]
    assert tests[-1]["difference"].startswith(f"{sum(changes) / 3:+.4f} ± ")
    assert tests[-1]["exact"] == pytest.approx(_two_dof_p(changes), rel=1e-9)
    assert tests[-1]["p"] == f"{_two_dof_p(changes):.3f}"  # as compare.md prints it
    assert tests[-1]["call"] == "isoloco gains on diloco as R grows"
    exact = [_two_dof_p(differences[r]) for r in (2, 4, 8)] + [_two_dof_p(changes)]
    text = script.page_tests_markdown(doc)
    assert "4 paired tests in the compare tables the page quotes" in text and "3 of them called" in text
    assert f"| {_plain_bh(exact)[-1]:.4f} | isoloco gains on diloco as R grows |" in text



def test_compare_md_adjusts_its_points_alone_and_says_so(doc):
    """compare.md's Benjamini–Hochberg column covers the points' tests, not the change with R (whose
    p it prints raw), and its text says which: R = 2's p is adjusted over the four points (× 4/2),
    though the file holds a fifth test. A page that quotes the change adjusts it with the points."""
    from test_report import _paired_grid, _row

    from isoloco.report import compare_markdown, load_runs

    _paired_grid(Path("grid"), PAGE_DIFFERENCES)
    text = compare_markdown(load_runs(Path("grid")), [("isoloco", "diloco")])
    changes = [high - low for high, low in zip(PAGE_DIFFERENCES[16], PAGE_DIFFERENCES[2])]
    assert f"| {_two_dof_p(changes):.3f} |" in text.split("## Change with R")[1]  # a fifth test, raw
    points = [_two_dof_p(PAGE_DIFFERENCES[r]) for r in (2, 4, 8, 16)]
    assert _row(text, 2)[6] == f"{points[0]:.3f} ({_plain_bh(points)[0]:.3f})"
    assert "every test in this file" not in text
    assert ("adjustment over the tests of every point in this file (not the changes with R, whose p is left raw)"
            in text)

def test_a_folder_of_pages_counts_its_tests_as_one_page(doc):
    """The pair's rows quoted on two pages of a folder count once, as on one page: the same four tests,
    adjusted together, whichever page quotes them."""
    from test_report import _paired_grid

    from isoloco.report import compare_markdown, load_runs

    folder = Path("grid")
    _paired_grid(folder, PAGE_DIFFERENCES)
    (folder / "compare.md").write_text(compare_markdown(load_runs(folder), [("isoloco", "diloco"), ("diloco", "dp")]))
    pages = Path("claims")
    pages.mkdir()
    (pages / "README.md").write_text('[the pair](pair.md)\n\n<!-- table: grid/compare.md "isoloco − diloco" -->\n\n'
                                     "| x |\n")
    (pages / "pair.md").write_text('<!-- table: grid/compare.md "Every pair" rows: isoloco -->\n\n| x |\n')
    doc.write_text((pages / "README.md").read_text() + "\n" + (pages / "pair.md").read_text())
    script = _script()
    assert script.quoted_tests(pages) == script.quoted_tests(doc) and len(script.quoted_tests(pages)) == 4
    assert script.page_tests_markdown(pages).replace("claims", "page.md") == script.page_tests_markdown(doc)


def test_a_quoted_test_its_runs_no_longer_give_is_an_error(doc):
    from test_report import _paired_grid

    from isoloco.report import compare_markdown, load_runs

    folder = Path("grid")
    _paired_grid(folder, {2: PAGE_DIFFERENCES[2]})
    text = compare_markdown(load_runs(folder), [("isoloco", "diloco")])
    (folder / "compare.md").write_text(text.replace("+0.1933 ± 0.1497", "+0.1900 ± 0.1497"))
    doc.write_text('<!-- table: grid/compare.md "isoloco − diloco" -->\n\n| x |\n')
    with pytest.raises(SystemExit, match="out of date: run python scripts/claim_reports.py grid"):
        _script().quoted_tests(doc)


@pytest.mark.parametrize("page", ["docs/claims", "docs/results.md"])
def test_the_docs_tables_match_the_committed_reports(page):
    # The tables alone: --check without --tables-only regenerates every report (minutes).
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", page, "--tables-only"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    pages = _script().doc_pages(ROOT / page)
    assert "<!-- table: " in "".join(path.read_text() for path in pages)  # the pages have tables to check


#: The committed view the test of --check regenerates: a small one (a few runs), with a compare.md.
CHECKED_VIEW = "r128-searched"


@pytest.mark.slow
def test_check_regenerates_a_report_and_names_each_stale_file(tmp_path):
    """--check regenerates a report into a scratch folder and compares it byte for byte with the
    committed one: a copy of a committed view passes (exit 0, nothing printed); with one file
    altered, one missing, one the report no longer writes and one link gone, it fails with one
    line for each."""
    import shutil

    script = _script()
    claims = ROOT / "results" / "claims"
    root = tmp_path / "claims"
    root.mkdir()
    for sweeps, _, _ in script.VIEWS[CHECKED_VIEW]:  # the view's sweeps, where the copy's links lead
        top = sweeps.split("/")[0]
        if not (root / top).exists():
            (root / top).symlink_to(claims / top)
    view = root / CHECKED_VIEW
    shutil.copytree(claims / CHECKED_VIEW, view, symlinks=True)
    page = tmp_path / "page.md"
    page.write_text("# A page without tables\n")
    check = [sys.executable, str(SCRIPT), "--root", str(root), "--check", str(page), CHECKED_VIEW]
    done = subprocess.run(check, cwd=ROOT, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr
    compare = (view / "compare.md").read_text()
    (view / "compare.md").write_text(compare.replace("## Change with R", "## Change with R, renamed"))
    (view / "summary.csv").unlink()
    (view / "plots" / "dropped.png").write_bytes(b"")
    next(link for link in sorted(view.iterdir()) if link.is_symlink()).unlink()
    done = subprocess.run(check, cwd=ROOT, capture_output=True, text=True)
    redo = f"run python scripts/claim_reports.py {CHECKED_VIEW}"
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"stale: {view}: its links are not the runs the view links now (1 new, 0 gone, 0 pointing elsewhere): {redo}",
        f"stale: {view / 'compare.md'} differs from its report regenerated now: {redo}",
        f"stale: {view / 'plots' / 'dropped.png'}: its report no longer writes it: delete it",
        f"stale: {view / 'summary.csv'} is missing: {redo}"]


def test_check_names_a_stale_page_tests_file_of_its_page_only(doc):
    """page-tests.md is checked against what --tests writes now when it is the checked page's."""
    script = _script()
    doc.write_text("# A page\n")
    root = Path("claims")
    root.mkdir()
    assert script.stale_page_tests(root, doc) == []  # none written
    (root / "page-tests.md").write_text(script.page_tests_markdown(doc))
    assert script.stale_page_tests(root, doc) == []
    (root / "page-tests.md").write_text(script.page_tests_markdown(doc).replace("0 paired tests", "1 paired tests"))
    assert script.stale_page_tests(root, doc) == [
        "stale: claims/page-tests.md differs from the tests page.md quotes now: run python scripts/claim_reports.py "
        "--tests page.md"]
    (root / "page-tests.md").write_text("# The tests other.md quotes\n")
    assert script.stale_page_tests(root, doc) == []  # another page's


@pytest.mark.slow
def test_the_page_wide_adjustment_is_current(monkeypatch):
    """results/claims/page-tests.md is what --tests writes from the committed reports the claims pages
    quote now (a change with R quoted since, or a report regenerated, moves it)."""
    monkeypatch.chdir(ROOT)  # the pages' markers name their reports from the repository's root
    assert _script().stale_page_tests(Path("results/claims"), Path("docs/claims")) == []


def test_every_claims_page_is_read_and_the_index_first():
    pages = _script().doc_pages(ROOT / "docs" / "claims")
    assert pages[0].name == "README.md" and set(pages) == set((ROOT / "docs" / "claims").glob("*.md"))


def test_a_folder_is_its_index_then_the_pages_it_links_in_order_of_first_link(doc):
    """--doc and --check on a folder sync every page; a page the index does not link to is an error."""
    folder = Path("claims")
    folder.mkdir()
    stale_table = '<!-- table: report.md "Every run" -->\n\n| run | loss |\n|---|---|\n| dp-s0 | 3.9 |\n'
    (folder / "README.md").write_text("* [B](b.md)\n* [A](a.md#a), [B again](b.md)\n\n" + stale_table)
    (folder / "a.md").write_text("# A\n\n" + stale_table)
    (folder / "b.md").write_text("# B\n")
    script = _script()
    assert [page.name for page in script.doc_pages(folder)] == ["README.md", "b.md", "a.md"]
    assert [marker.split(": ")[0] for marker, _ in script.sync_doc(folder, write=False)] == ["claims/README.md",
                                                                                            "claims/a.md"]
    done = subprocess.run([sys.executable, str(SCRIPT), "--doc", str(folder)], capture_output=True, text=True)
    assert done.returncode == 0 and "| dp-s0 | 4.0 |" in (folder / "a.md").read_text()
    assert script.sync_doc(folder, write=False) == []
    (folder / "c.md").write_text("# C\n")
    with pytest.raises(SystemExit, match="does not link to claims/c.md"):
        script.doc_pages(folder)
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", str(folder)], capture_output=True, text=True)
    assert done.returncode != 0 and "does not link to claims/c.md" in done.stderr


#: (isoloco int8 − isoloco) and (diloco int8 − diloco) per R and seed: what int8 costs each method.
CONTRAST_COSTS = {2: ((0.01, 0.02, 0.00), (0.11, 0.125, 0.10)), 4: ((0.05, 0.0, 0.1), (0.0, 0.1, 0.02)),
                  8: ((0.02, 0.03, 0.01), (0.04, 0.02, 0.03))}
CONTRAST = ("isoloco merge.quantize=int8:isoloco merge.quantize=none::diloco merge.quantize=int8:"
            "diloco merge.quantize=none")


def test_the_page_contrasts_are_adjusted_together_each_once(doc):
    """p of a contrast is the paired t-test's of the per-seed contrasts, recomputed from the runs: R = 2's
    (−0.100, −0.105, −0.100) is called, R = 4's and R = 8's are not, and over the three R = 2's p is
    adjusted × 3. A row quoted twice counts once; one with one seed is no test."""
    from test_report import _fake_run

    from isoloco.report import contrast_markdown, load_runs
    from isoloco.report.command import _contrast

    folder = Path("grid")
    for r, costs in CONTRAST_COSTS.items():
        for seed in range(3):
            for method, cost in zip(("isoloco", "diloco"), costs):
                keys = {"method": method, "workers": r, "inner_steps": 3, "seed": seed}
                _fake_run(folder, f"{method}-R{r}-s{seed}", 4.5, **keys)
                _fake_run(folder, f"{method}-int8-R{r}-s{seed}", 4.5 + cost[seed], **keys, **{"merge.quantize": "int8"})
    for method in ("isoloco", "diloco"):  # R = 1, one seed: no test
        _fake_run(folder, f"{method}-R1-s0", 4.5, method=method, workers=1, inner_steps=3)
        _fake_run(folder, f"{method}-int8-R1-s0", 4.6, method=method, workers=1, inner_steps=3,
                  **{"merge.quantize": "int8"})
    (folder / "contrast.md").write_text(contrast_markdown(load_runs(folder), [_contrast(CONTRAST)]))
    section = ("(isoloco merge.quantize=int8 − isoloco merge.quantize=none) − "
               "(diloco merge.quantize=int8 − diloco merge.quantize=none)")
    assert f"## {section}" in (folder / "contrast.md").read_text()
    assert "| 1 | 3 | 1 | +0.0000 | one seed: no call |" in (folder / "contrast.md").read_text()
    doc.write_text(f'<!-- table: grid/contrast.md "{section}" -->\n\n| x |\n\n'
                   f'<!-- table: grid/contrast.md "{section}" rows: ^\\| 2 -->\n\n| x |\n')
    script = _script()
    exact = [_two_dof_p([a - b for a, b in zip(*CONTRAST_COSTS[r])]) for r in (2, 4, 8)]
    contrasts = script.quoted_contrasts(doc)
    assert [c["R"] for c in contrasts] == ["2", "4", "8"]
    assert [c["p"] for c in contrasts] == pytest.approx(exact, rel=1e-9)
    text = script.page_tests_markdown(doc).split("## The contrasts, adjusted together")[1]
    assert "3 contrasts in the contrast tables the page quotes" in text and "1 of them called (unadjusted)" in text
    assert "over the 3 at a false discovery rate of 0.05, 1 stay called" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| grid")]
    adjusted = _plain_bh(exact)
    assert [(row[2], row[6], row[7]) for row in rows] == sorted(
        ((r, f"{p:.3f}", f"{adj:.4f}") for r, p, adj in zip(("2", "4", "8"), exact, adjusted)), key=lambda row: row[2])


#: A page-wide adjusted p quoted in prose: "adjusted p 0.0206", "(called, 0.0132", "0.0876 page-wide".
QUOTED_ADJUSTED_P = re.compile(r"(?:adjusted(?: p)?|called,|page's contrasts,|the page-wide adjustment,|"
                               r"the page-wide one \(|report,|report and)\s+(0\.\d{4})\b|(0\.\d{4})\s+page-wide")


def test_every_adjusted_p_the_prose_quotes_is_one_the_page_wide_adjustment_gives():
    """The claims pages and the README quote page-wide adjusted p-values in their sentences; each
    must be one that results/claims/page-tests.md holds, so that adding tests to the page (which
    moves every adjusted p) cannot leave a sentence quoting a value no longer given."""
    root = Path(__file__).resolve().parents[1]
    given = set(re.findall(r"\| (0\.\d{4}) \|", (root / "results" / "claims" / "page-tests.md").read_text()))
    quoted = [(page.name, match[1] or match[2]) for page in [*sorted((root / "docs" / "claims").glob("*.md")),
                                                              root / "README.md"]
              for match in QUOTED_ADJUSTED_P.finditer(page.read_text())]
    assert len(quoted) >= 15  # the pattern still finds the quotes
    assert [(page, p) for page, p in quoted if p not in given] == []


def test_the_readmes_plot_draws_the_gaps_it_quotes_every_point_over_the_same_seeds():
    """The README's plot and the R = 16 gaps it quotes for IsoLoCo and DiLoCo come from one report:
    every point of that report is over the same 3 seeds, and its plotted means (summary.csv) and its
    paired comparison (compare.md) give the gaps and the ratio the README quotes."""
    import csv

    readme = (ROOT / "README.md").read_text()
    folder = ROOT / re.search(r"!\[[^]]*\]\((results/claims/[^)]+)/plots/gap_vs_R\.png\)", readme)[1]
    assert (folder / "plots" / "gap_vs_R.png").is_file()
    rows = list(csv.DictReader((folder / "summary.csv").open()))
    assert {row["seeds"] for row in rows} == {"3"}
    plotted = {(row["method"], row["R"]): f"{float(row['gap_to_dp_pct_mean']):+.2f}" for row in rows}
    (paired,) = [row for row in _script().table_rows(folder / "compare.md", "isoloco − diloco") if row["R"] == "16"]
    quoted = re.findall(r"R = 16: ([+-][\d.]+)%\s+against\s+([+-][\d.]+)%, gap ratio ([\d.]+)", readme)
    assert len(quoted) >= 2  # the opening paragraph and the table of verdicts
    assert set(quoted) == {(plotted["isoloco", "16"], plotted["diloco", "16"], paired["gap ratio"])}
    assert (paired["gap isoloco (%)"], paired["gap diloco (%)"]) == (plotted["isoloco", "16"], plotted["diloco", "16"])


def test_the_index_quotes_the_page_wide_counts_page_tests_md_gives():
    """docs/claims/README.md's summary of the page-wide adjustment (how many tests, how many called,
    how many stay called) is the one results/claims/page-tests.md states, so that adding a test to the
    page cannot leave the index quoting the old counts."""
    root = Path(__file__).resolve().parents[1]
    given = re.search(r"(\d+) paired tests .*?, (\d+) of them called\. With the Benjamini–Hochberg adjustment over all "
                      r"\1 at a false discovery rate of 0\.05, (\d+) stay called",
                      (root / "results" / "claims" / "page-tests.md").read_text())
    index = " ".join((root / "docs" / "claims" / "README.md").read_text().split())
    quoted = re.search(r"(\d+) paired tests, (\d+) of them called; with the Benjamini–Hochberg adjustment over all "
                       r"\1 at a false discovery rate of 0\.05, (\d+) stay called", index)
    assert given and quoted and quoted.groups() == given.groups()
