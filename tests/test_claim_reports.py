"""scripts/claim_reports.py: the tables of docs/claims.md are copies of the reports' tables."""

import importlib.util
import math
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


COMPARE = """## Every pair

| A − B | R | H | seeds | A − B (final loss) | equivalence (±1%) | call | p (BH) | call after BH |
|---|---|---|---|---|---|---|---|---|
| a − b | 8 | 30 | 3 | -0.3000 ± 0.0497 | [-7.42%, -5.92%] fail | a lower | 0.010 (0.015) | a lower |
| a − c | 8 | 30 | 3 | -0.1000 ± 0.0900 | [-3.00%, -1.00%] fail | a lower | 0.040 (0.040) | a lower |
| c − b | 8 | 30 | 3 | +0.0100 ± 0.2000 | [-3.00%, +3.00%] fail | not distinguishable with 3 seeds | 0.300 (0.300) | x |
| c − b | 1 | 30 | 1 | +0.0100 | one seed: no call | one seed: no call | — | one seed: no call |

## a − b

| R | H | seeds | a − b (final loss) | equivalence (±1%) | call | p (BH) | call after BH |
|---|---|---|---|---|---|---|---|
| 8 | 30 | 3 | -0.3000 ± 0.0497 | [-7.42%, -5.92%] fail | a lower | 0.010 (0.015) | a lower |
"""


def test_the_page_tests_are_adjusted_together_each_once(doc):
    """Three tests (a − b quoted twice, a one-seed row is none): p 0.010, 0.040, 0.300 adjust to 0.030,
    0.060, 0.300, so a − c loses its call; every test is listed with its adjusted p."""
    Path("compare.md").write_text(COMPARE)
    doc.write_text('<!-- table: compare.md "Every pair" -->\n\n| x |\n\n<!-- table: compare.md "a − b" -->\n\n| x |\n')
    script = _script()
    assert [test["pair"] for test in script.quoted_tests(doc)] == ["a − b", "a − c", "c − b"]
    text = script.page_tests_markdown(doc)
    assert "3 paired tests in the compare tables the page quotes" in text and "2 of them called" in text
    assert "at a false discovery rate of 0.05, 1 stay called" in text
    assert "| compare.md | a − c | 8 | 30 | 3 | -0.1000 ± 0.0900 | 0.040 | 0.0600 | a lower |" in text
    dropped, every = text.split("## The contrasts")[0].split("## Called")[1].split("## Every test")
    assert "| a − b |" not in dropped
    assert [line.split(" | ")[1] + " " + line.split(" | ")[7] for line in every.splitlines()[4:] if line] == [
        "a − b 0.0300", "a − c 0.0600", "c − b 0.3000"]  # every test, by adjusted p


@pytest.mark.parametrize("page", ["docs/claims.md", "docs/results.md"])
def test_the_docs_tables_match_the_committed_reports(page):
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", page], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "<!-- table: " in (ROOT / page).read_text()  # the page has tables to check


CONTRAST = """# Contrasts

## (a − b) − (c − d)

| R | H | seeds | contrast (final loss) | call |
|---|---|---|---|---|
| 8 | 30 | 3 | +0.2000 ± 0.1000 | c − d lower |
| 16 | 30 | 3 | +0.1200 ± 0.1000 | c − d lower |
| 32 | 30 | 3 | +0.0100 ± 0.2000 | not distinguishable with 3 seeds |
| 4 | 30 | 3 | +5.0000 ± 9.0000 | unstable run(s): no call |
| 1 | 30 | 1 | +0.0100 | one seed: no call |
"""


def test_the_page_contrasts_are_adjusted_together_each_once(doc):
    """p of a contrast from its printed interval: with 3 seeds, t = mean · t₀.₉₇₅ / half-width and
    P(|T| < t) = t / √(t² + 2) for 2 degrees of freedom; the two called ones (p 0.013 and 0.036)
    adjust over the three tests to 0.040 and 0.053, so the second loses its call. A row quoted twice
    counts once; one with an unstable run or one seed is no test."""
    Path("contrast.md").write_text(CONTRAST)
    doc.write_text('<!-- table: contrast.md "(a − b) − (c − d)" -->\n\n| x |\n\n'
                   '<!-- table: contrast.md "(a − b) − (c − d)" rows: ^\\| 8 -->\n\n| x |\n')
    script = _script()

    def p(ratio):  # mean ÷ half-width, 3 seeds
        t = ratio * 4.303
        return 1 - t / math.sqrt(t * t + 2)

    contrasts = script.quoted_contrasts(doc)
    assert [c["R"] for c in contrasts] == ["8", "16", "32"]
    assert [c["p"] for c in contrasts] == pytest.approx([p(2.0), p(1.2), p(0.05)], abs=1e-4)
    text = script.page_tests_markdown(doc).split("## The contrasts, adjusted together")[1]
    assert "3 contrasts in the contrast tables the page quotes" in text and "2 of them called (unadjusted)" in text
    assert "over the 3 at a false discovery rate of 0.05, 1 stay called" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| contrast.md")]
    assert [(row[2], row[7]) for row in rows] == [
        ("8", f"{3 * p(2.0):.4f}"), ("16", f"{1.5 * p(1.2):.4f}"), ("32", f"{p(0.05):.4f}")]
