"""Export a checkpoint's global model as a Hugging Face `save_pretrained` directory."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from isoloco import checkpoint as ckpt
from isoloco.config import from_dict
from isoloco.data.config import umask_mode
from isoloco.data.tokenizer import pretrained_tokenizer
from isoloco.errors import CheckpointError, UsageError
from isoloco.fileutil import output_dir_problem
from isoloco.model import build_model
from isoloco.rundir import CHECKPOINT_DIR, TOKENIZER_FILE


def _find_checkpoint(path: Path) -> Path:
    if (path / ckpt.STATE_FILE).is_file():
        return path
    found = ckpt.load_latest(path / CHECKPOINT_DIR)
    if found is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor a run directory with a valid checkpoint")
    return found[0]


def _check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse a directory that cannot be written, or one that holds files unless `force`, as
    `isoloco train --out` does, before reading the checkpoint."""
    problem = output_dir_problem(out_dir)
    if problem:
        raise UsageError(f"{out_dir} {problem}; choose another output directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UsageError(f"{out_dir} already exists and is not empty: pass --force to write the model into it "
                         "(replacing the files of the same names), or choose another output directory")


def export(path: Path, out_dir: Path, force: bool) -> None:
    """Write model weights, config and tokenizer of the checkpoint at `path` to `out_dir`
    (which may hold files already only with `force`)."""
    _check_out_dir(out_dir, force)
    checkpoint = _find_checkpoint(path)
    state = ckpt.verify(checkpoint)
    cfg = from_dict(state["config"])
    run_dir = checkpoint.parent.parent
    tokenizer_file = run_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{run_dir} has no {TOKENIZER_FILE}; was it written by isoloco train?")
    tokenizer = pretrained_tokenizer(tokenizer_file)
    weights = ckpt.load_tensors(checkpoint, "global")
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    model = build_model(cfg.model, vocab_size, cfg.seq_len, cfg.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    # The special ids come from the tokenizer (the model config's defaults are Llama's 1 and 2,
    # bytes in our BPE): generate() stops on eos_token_id.
    for role in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{role}_token_id")
        setattr(model.config, f"{role}_token_id", token_id)
        setattr(model.generation_config, f"{role}_token_id", token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    # safetensors writes the weights through a temporary file of mode 0600: give them the mode
    # their siblings got from a plain open.
    for weights in out_dir.glob("model*.safetensors"):
        os.chmod(weights, umask_mode(0o666))
    tokenizer.save_pretrained(out_dir)
    (out_dir / "isoloco.yaml").write_text(yaml.safe_dump({"step": state["step"], "config": state["config"]},
                                                         sort_keys=False))
