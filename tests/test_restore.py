"""Restores stream: tensor files are read a tensor at a time, into memory of their own, and a
restore's peak host memory stays within 1.2× the state it loads."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from isoloco import checkpoint as ckpt
from isoloco.config import resolve
from isoloco.errors import CheckpointError
from isoloco.trainer import Trainer

from helpers import SMALL


def test_a_tensor_file_reads_only_what_is_asked_for(tmp_path, monkeypatch):
    tensors = {"b": torch.randn(3, 4), "a": torch.arange(5), "c": torch.tensor(2.0)}
    ckpt.write_safetensors(tmp_path / "x.safetensors", tensors)
    with ckpt.open_tensors(tmp_path, "x") as saved:
        reads = []
        handle = saved._handle
        monkeypatch.setattr(saved, "_handle", type("Counted", (), {
            "get_tensor": lambda _, name: reads.append(name) or handle.get_tensor(name),
            "get_slice": lambda _, name: handle.get_slice(name)})())
        assert "a" in saved and "z" not in saved and list(saved) == ["a", "b", "c"]  # in file order
        assert saved.shape("b") == (3, 4)
        assert saved.nbytes() == sum(t.numel() * t.element_size() for t in tensors.values())
        assert reads == []  # names, shapes and sizes come from the header
        assert torch.equal(saved["b"], tensors["b"]) and reads == ["b"]
        with pytest.raises(KeyError):
            saved["z"]


def _trained(tmp_path: Path, **overrides) -> tuple[Trainer, dict]:
    cfg = {**SMALL, "steps": 2, "inner_steps": 1, "workers": 4, "eval_every": 2, "device": "cpu", **overrides}
    out = tmp_path / "run"
    out.mkdir()
    Trainer(resolve(None, cfg), out, progress=False).run()
    return Trainer(resolve(None, cfg), out, progress=False), cfg


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_restore_places_every_saved_tensor_and_maps_no_file(tmp_path, optimizer):
    """The restored optimizer state is the saved one, bit for bit, with AdamW's `step` on the
    CPU as torch keeps it; and no checkpoint file stays memory-mapped (its pages would count
    twice, and a tensor viewing them would keep a pruned checkpoint on disk)."""
    trainer, _ = _trained(tmp_path, **{"inner.optimizer": optimizer})
    trainer.restore()
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert str(path) not in Path("/proc/self/maps").read_text()
    saved = load_file(str(path / "workers-0.safetensors"))
    restored = {}
    for worker in trainer.workers:
        for j, state in enumerate(worker.optimizer.state_dicts()):
            restored.update(ckpt.flatten_optimizer_state(state, f"w{worker.index}.opt{j}")[0])
    assert restored.keys() == saved.keys() and saved
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor) and restored[name].device.type == "cpu", name


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    trainer, cfg = _trained(tmp_path)  # AdamW: one optimizer over every parameter
    muon = Trainer(resolve(None, {**cfg, "inner.optimizer": "muon"}), tmp_path / "run", progress=False)
    with pytest.raises(CheckpointError, match="written for another model or inner optimizer"):
        muon.restore()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_restore_peaks_within_1_2_times_the_state_it_loads():
    from isoloco.bench.restore import restore_peak_ratio

    # 32 workers' AdamW moments of the tiny model at a 512-token vocabulary: about 69 MB.
    ratio = restore_peak_ratio(workers=32, overrides={"data.vocab_size": SMALL["data.vocab_size"]})
    assert 1.0 <= ratio <= 1.2
