"""`isoloco export`: a Hugging Face directory whose special ids are the tokenizer's."""

import json
import os
import stat

import torch

from isoloco.cli import main

RUN = ["model=tiny", "seq_len=32", "global_batch=8", "steps=2", "inner_steps=2", "workers=2", "eval_every=2",
       "data.vocab_size=512", "data.val_tokens=256", "device=cpu"]


def test_exported_model_stops_generating_at_end_of_text(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, exported = tmp_path / "run", tmp_path / "hf"
    assert main(["train", *RUN, "--out", str(run), "--quiet"]) == 0
    assert main(["export", str(run), str(exported)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(exported)
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == end_of_text
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((exported / name).read_text())
        assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (end_of_text,) * 3, name

    model = AutoModelForCausalLM.from_pretrained(exported)
    # With the final norm zeroed every logit is 0 and greedy decoding picks id 0 (the first
    # maximum), which is <|endoftext|>: generation must stop after that one token.
    assert end_of_text == 0
    with torch.no_grad():
        model.model.norm.weight.zero_()
    prompt = tokenizer("In the beginning", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out[0, prompt.input_ids.shape[1]:].tolist() == [end_of_text]


def test_every_exported_file_gets_the_mode_the_umask_gives(tmp_path):
    run, exported = tmp_path / "run", tmp_path / "hf"
    assert main(["train", *RUN, "--out", str(run), "--quiet"]) == 0
    previous = os.umask(0o027)
    try:
        assert main(["export", str(run), str(exported)]) == 0
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in exported.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o640)


def test_export_where_it_would_overwrite_or_cannot_write_exits_2_in_one_line_and_changes_nothing(tmp_path, capsys):
    run, exported, afile = tmp_path / "run", tmp_path / "hf", tmp_path / "notes.txt"
    exported.mkdir()
    (exported / "config.json").write_text("written by hand")
    afile.write_text("mine")
    assert main(["train", *RUN, "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    for out, said in ((exported, "already exists and is not empty: pass --force"),
                      (afile, "is a file, not a directory"), (afile / "hf", f"cannot be made: {afile} is a file"),
                      ("/proc/isoloco-test/hf", "cannot be written: /proc refuses new folders")):
        assert main(["export", str(run), str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {out} {said}") and len(err.splitlines()) == 1, err
    assert afile.read_text() == "mine" and [path.name for path in exported.iterdir()] == ["config.json"]
    assert (exported / "config.json").read_text() == "written by hand"
    assert main(["export", str(run), str(exported), "--force"]) == 0
    assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"
