"""Preparing corpora into token shards, loading them, and every way a prepared dataset can be bad."""

import json
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from isoloco.data import (  # noqa: E402
    Batches, DataConfig, DataError, load_token_data, load_tokenizer_file, open_shards, prepare, read_meta)
from isoloco.data.corpus import is_validation  # noqa: E402
from isoloco.data.shards import dtype_for_vocab  # noqa: E402

VOCAB = 512
SYLLABLES = "ka lo mi ne ru sa ti vo be da fe gu hi jo ku le ma no pe qui ra se to".split()
# Pseudo-words from syllables: varied enough for a 512-token BPE to fill its vocabulary.
WORDS = sorted({"".join(np.random.default_rng(i).choice(SYLLABLES, size=1 + i % 4)) for i in range(400)})


def make_documents(count=120, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))) + "." for _ in range(count)]


pytestmark = pytest.mark.usefixtures("cache")  # a cache of this test's own (conftest)


def write_corpus(tmp_path, kind, documents):
    if kind == "txt":
        path = tmp_path / "corpus.txt"
        path.write_text("\n\n".join(documents) + "\n")
    elif kind == "jsonl":
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"body": d}) + "\n" for d in documents))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"body": documents}), path, row_group_size=16)
    return path


@pytest.fixture
def prepared(tmp_path):
    documents = make_documents()
    source = write_corpus(tmp_path, "jsonl", documents)
    out = tmp_path / "prepared"
    prepare(str(source), out, vocab_size=VOCAB, val_fraction=0.2, progress=False, text_field="body")
    return out, documents


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_prepare_local_sources_round_trip(tmp_path, kind):
    documents = make_documents()
    source = write_corpus(tmp_path, kind, documents)
    out = tmp_path / "out"
    meta = prepare(str(source), out, vocab_size=VOCAB, val_fraction=0.2, progress=False, text_field="body")
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"
    data = open_shards(out)
    assert data.meta == meta and meta["dtype"] == "uint16" and data.train.dtype == np.uint16
    assert data.vocab_size == VOCAB and data.tokenizer_id == meta["tokenizer_id"]
    # Documents keep their order within each split, each followed by exactly one EOS.
    tokenizer = load_tokenizer_file(data.tokenizer_path)
    for split, array in (("train", data.train), ("val", data.val)):
        expected = [d for d in documents if is_validation(d, 0.2) == (split == "val")]
        assert meta["documents"][split] == len(expected) > 0
        assert meta["tokens"][split] == len(array)
        assert array[-1] == data.eos_id and int((array == data.eos_id).sum()) == len(expected)
        pieces = np.split(np.asarray(array), np.flatnonzero(array == data.eos_id) + 1)[:-1]
        assert [tokenizer.backend.decode(p[:-1].tolist()) for p in pieces] == expected
    batch = Batches(data.train, 16, 8, seed=0).worker_batch(3, 1, 2)
    assert batch.shape == (4, 17) and int(batch.max()) < VOCAB


def test_dtype_follows_the_vocabulary(tmp_path):
    assert dtype_for_vocab(65536) == "uint16" and dtype_for_vocab(65537) == "uint32"
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: 70000 - i for i, w in enumerate(WORDS)}}
    vocab.update({f"filler{i}": i + 2 for i in range(70000 - 2 - len(WORDS) + 1)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "big.json"
    tokenizer.save(str(path))
    source = write_corpus(tmp_path, "txt", make_documents(40))
    meta = prepare(str(source), tmp_path / "out", tokenizer=str(path), val_fraction=0.3, progress=False)
    data = open_shards(tmp_path / "out")
    assert meta["dtype"] == "uint32" and data.train.dtype == np.uint32 and data.vocab_size > 65536
    assert int(data.train.max()) > 65535


def test_limits(tmp_path):
    source = write_corpus(tmp_path, "jsonl", make_documents(200))
    meta = prepare(str(source), tmp_path / "a", vocab_size=VOCAB, val_fraction=0.2, progress=False,
                   text_field="body", max_documents=50)
    assert sum(meta["documents"].values()) == 50
    meta = prepare(str(source), tmp_path / "b", vocab_size=VOCAB, val_fraction=0.2, progress=False,
                   text_field="body", max_tokens=1500)
    total = sum(meta["tokens"].values())
    assert 1500 <= total < 1500 + 200


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        prepare(str(tmp_path / "missing.jsonl"), tmp_path / "out", progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(DataError, match=r"empty\.txt: no documents"):
        prepare(str(empty), tmp_path / "out", progress=False)
    few = tmp_path / "few.txt"
    few.write_text("just one document")
    with pytest.raises(DataError, match=r"few\.txt.*split is empty"):
        prepare(str(few), tmp_path / "out", vocab_size=VOCAB, progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_existing_output_is_refused_unless_forced(tmp_path, prepared):
    out, documents = prepared
    source = tmp_path / "corpus.jsonl"
    with pytest.raises(DataError, match=r"prepared: already exists and is not empty.*--force"):
        prepare(str(source), out, vocab_size=VOCAB, progress=False, text_field="body")
    meta = prepare(str(source), out, vocab_size=VOCAB, val_fraction=0.3, progress=False, text_field="body",
                   force=True)
    assert read_meta(out)["val_fraction"] == 0.3 == meta["val_fraction"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def edit_meta(directory, **changes):
    meta = json.loads((directory / "meta.json").read_text())
    meta.update(changes)
    (directory / "meta.json").write_text(json.dumps(meta))


def test_truncated_split(prepared):
    out, _ = prepared
    data = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(data[:-2])
    with pytest.raises(DataError, match=r"train\.bin: .* bytes, but meta\.json records .*truncated"):
        open_shards(out)


def test_unknown_dtype_in_header(prepared):
    out, _ = prepared
    edit_meta(out, dtype="float32")
    with pytest.raises(DataError, match=r"meta\.json: unknown dtype 'float32'"):
        open_shards(out)


def test_tokenizer_mismatch(prepared):
    out, _ = prepared
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))  # same tokenizer, other bytes
    with pytest.raises(DataError, match=r"tokenizer\.json: tokenizer id .* does not match"):
        open_shards(out)


def test_out_of_vocabulary_ids(prepared):
    out, _ = prepared
    tokens = np.fromfile(out / "val.bin", dtype="<u2")
    tokens[len(tokens) // 2] = VOCAB + 5
    tokens.tofile(out / "val.bin")
    with pytest.raises(DataError, match=rf"val\.bin: token id {VOCAB + 5} is outside the vocabulary"):
        open_shards(out)


def test_missing_files_and_empty_split(prepared):
    out, _ = prepared
    (out / "val.bin").rename(out / "val.bak")
    with pytest.raises(DataError, match=r"val\.bin: missing"):
        open_shards(out)
    (out / "val.bak").rename(out / "val.bin")
    edit_meta(out, tokens={"train": read_meta(out)["tokens"]["train"], "val": 0})
    with pytest.raises(DataError, match=r"val\.bin: the val split is empty"):
        open_shards(out)
    (out / "meta.json").unlink()
    with pytest.raises(DataError, match=r"meta\.json: missing"):
        open_shards(out)
    with pytest.raises(DataError, match=r"nowhere: no such directory"):
        open_shards(out.parent / "nowhere")


def test_losing_a_race_keeps_the_winner(tmp_path, prepared):
    out, _ = prepared
    from isoloco.data.shards import write_shards

    tokenizer = load_tokenizer_file(out / "tokenizer.json")
    winner = read_meta(out)
    meta = write_shards(out, tokenizer, [("train", "x y"), ("val", "y z")], source="late", progress=False)
    assert meta == winner and read_meta(out) == winner
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_token_data_opens_prepared_directories_and_caches_local_corpora(tmp_path, prepared, cache):
    out, _ = prepared
    data = load_token_data(DataConfig(source=str(out), tokenizer="ignored-for-prepared", vocab_size=300))
    assert data.directory == out and data.vocab_size == VOCAB

    source = write_corpus(tmp_path, "txt", make_documents(80, seed=1))
    cfg = DataConfig(source=str(source), vocab_size=VOCAB, val_fraction=0.2)
    first = load_token_data(cfg, progress=False)
    assert first.directory.is_relative_to(cache / "datasets")
    stamp = (first.directory / "train.bin").stat().st_mtime_ns
    second = load_token_data(cfg, progress=False)
    assert second.directory == first.directory
    assert (second.directory / "train.bin").stat().st_mtime_ns == stamp

    with pytest.raises(DataError, match=r"must be prepared first.*isoloco data prepare someone/dataset"):
        load_token_data(DataConfig(source="someone/dataset"))


def test_damaged_cache_entry_says_how_to_rebuild(tmp_path):
    source = write_corpus(tmp_path, "txt", make_documents(80))
    cfg = DataConfig(source=str(source), vocab_size=VOCAB, val_fraction=0.2)
    directory = load_token_data(cfg, progress=False).directory
    (directory / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"val\.bin: .*delete .* and run again"):
        load_token_data(cfg, progress=False)


def test_hub_datasets_are_streamed_with_limits(tmp_path, monkeypatch):
    import datasets

    documents = make_documents(300, seed=2)
    opened = []

    def fake_load_dataset(name, split, streaming):
        opened.append((name, split, streaming))
        return ({"text": d, "url": "x"} for d in documents)  # a one-pass stream, like the hub's

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    meta = prepare("someone/corpus", tmp_path / "out", vocab_size=VOCAB, val_fraction=0.2, progress=False,
                   split="train", max_documents=100)
    assert sum(meta["documents"].values()) == 100
    assert meta["source"].startswith("Hugging Face dataset someone/corpus")
    assert all(entry == ("someone/corpus", "train", True) for entry in opened) and len(opened) >= 2
    assert open_shards(tmp_path / "out").vocab_size == VOCAB
