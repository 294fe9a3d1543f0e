"""`isoloco data prepare` / `data info`: success, and one `error:` line with exit code 2 on bad input."""

import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from isoloco.cli import main  # noqa: E402

DOCUMENTS = [f"line {i} of the corpus, with words like river and stone number {i * 7}" for i in range(60)]


pytestmark = pytest.mark.usefixtures("cache")  # a cache of this test's own (conftest)


def run(*argv):
    return main(["data", *argv])


def assert_one_error_line(capsys, *fragments):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCUMENTS))
    return path


def test_prepare_and_info(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    assert run("prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.2",
               "--text-field", "content", "--quiet") == 0
    assert "prepared" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 300
    assert run("info", str(out)) == 0
    assert "unigram baseline" in capsys.readouterr().out


def test_existing_output_needs_force(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("something")
    args = ("prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.2",
            "--text-field", "content", "--quiet")
    assert run(*args) == 2
    assert_one_error_line(capsys, str(out), "--force")
    assert run(*args, "--force") == 0
    assert not (out / "keep.txt").exists()


def test_bad_inputs_give_one_line_and_exit_code_2(tmp_path, corpus, capsys):
    out = str(tmp_path / "out")
    assert run("prepare", str(tmp_path / "missing.txt"), "--out", out, "--quiet") == 2
    assert_one_error_line(capsys, "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert run("prepare", str(empty), "--out", out, "--quiet") == 2
    assert_one_error_line(capsys, "empty.txt", "no documents")
    assert run("prepare", str(corpus), "--out", out, "--quiet") == 2  # default field "text" is absent
    assert_one_error_line(capsys, "corpus.jsonl:1", "--text-field")
    assert run("prepare", str(corpus), "--out", out, "--val-fraction", "0.7", "--quiet") == 2
    assert_one_error_line(capsys, "val_fraction")
    assert run("prepare", "someone/dataset", "--out", out, "--quiet") == 2
    assert_one_error_line(capsys, "someone/dataset", "offline")


def test_info_on_a_damaged_dataset(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    assert run("prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.2",
               "--text-field", "content", "--quiet") == 0
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
    capsys.readouterr()
    assert run("info", str(out)) == 2
    assert_one_error_line(capsys, "meta.json", "unknown dtype 'int8'")
