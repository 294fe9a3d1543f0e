"""Tokenizers: BPE training and its cache, tokenizer files, hub names offline, export."""

import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from isoloco.data import DataError  # noqa: E402
from isoloco.data import tokenizer as tokenizer_module  # noqa: E402
from isoloco.data.tokenizer import (  # noqa: E402
    EOS_TOKEN, bpe_cache_path, cached_bpe, load_hub_tokenizer, load_tokenizer_file, pretrained_tokenizer,
    resolve_tokenizer, tokenizer_id_of, tokenizer_kind, train_bpe)

DOCUMENTS = [f"the cat {i} sat on the mat and the dog {i % 7} ran after it" for i in range(200)]




def test_bpe_is_byte_level_with_an_eos_token():
    tokenizer = train_bpe(iter(DOCUMENTS), 300)
    assert tokenizer.get_vocab_size() == 300
    assert tokenizer.token_to_id(EOS_TOKEN) is not None
    text = "unseen ünïcode ✓ text"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    with pytest.raises(DataError, match="at least 257"):
        train_bpe(iter(DOCUMENTS), 200)


def test_bpe_cache_is_reused_without_retraining(cache, monkeypatch):
    calls = []
    real_train = tokenizer_module.train_bpe

    def counting_train(*args, **kwargs):
        calls.append(1)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "train_bpe", counting_train)
    first = cached_bpe("corpus-a", lambda: iter(DOCUMENTS), 300)
    mtime = first.path.stat().st_mtime_ns
    second = cached_bpe("corpus-a", lambda: iter(DOCUMENTS), 300)
    assert len(calls) == 1
    assert second.path == first.path and second.path.stat().st_mtime_ns == mtime
    assert second.tokenizer_id == first.tokenizer_id
    assert first.path.is_relative_to(cache)
    # Another corpus or vocabulary is another cache entry.
    assert bpe_cache_path("corpus-b", 300) != first.path
    assert bpe_cache_path("corpus-a", 301) != first.path
    cached_bpe("corpus-a", lambda: iter(DOCUMENTS), 320)
    assert len(calls) == 2


def test_tokenizer_file_and_its_id(tmp_path, cache):
    loaded = resolve_tokenizer("bpe", "corpus", lambda: iter(DOCUMENTS), 300)
    copy = tmp_path / "mine" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(loaded.path.read_bytes())
    for spec in (str(copy), str(copy.parent)):
        assert tokenizer_kind(spec) == "file"
        from_file = resolve_tokenizer(spec, "ignored", None, 0)
        assert from_file.tokenizer_id == loaded.tokenizer_id == tokenizer_id_of(copy)
        assert from_file.eos_id == loaded.eos_id
        assert from_file.encode_batch(["the cat"]) == loaded.encode_batch(["the cat"])


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.json: tokenizer file not found"):
        load_tokenizer_file(tmp_path / "nope.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{}")
    with pytest.raises(DataError, match=r"garbage\.json: not a valid tokenizer\.json"):
        load_tokenizer_file(garbage)
    from tokenizers import Tokenizer, models

    no_eos = tmp_path / "no_eos.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(no_eos))
    with pytest.raises(DataError, match=r"no_eos\.json: no end-of-document token"):
        load_tokenizer_file(no_eos)


def test_tokenizer_kind():
    assert tokenizer_kind("bpe") == "bpe"
    assert tokenizer_kind("meta-llama/Llama-2-7b-hf") == "hub"
    assert tokenizer_kind("gpt2") == "hub"
    assert tokenizer_kind("./missing/tokenizer.json") == "file"


def test_hub_tokenizer_offline_says_so(cache):
    with pytest.raises(DataError, match=r"could not load the Hugging Face tokenizer 'gpt2'.*offline"):
        load_hub_tokenizer("gpt2")


def test_pretrained_tokenizer_exports(tmp_path, cache):
    loaded = resolve_tokenizer("bpe", "corpus", lambda: iter(DOCUMENTS), 300)
    hf = pretrained_tokenizer(loaded.path)
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == loaded.eos_id
    assert hf("the cat sat")["input_ids"] == loaded.encode_batch(["the cat sat"])[0]
    hf.save_pretrained(tmp_path / "export")
    saved = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == EOS_TOKEN
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert again("the cat sat")["input_ids"] == hf("the cat sat")["input_ids"]
