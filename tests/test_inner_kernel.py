"""`inner.kernel`: AdamW's fused kernel is the default; a config written before the key existed
retrains with the foreach kernel it was made with, bit for bit against its committed losses."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from isoloco.config import from_dict, resolve
from isoloco.inner import InnerConfig, InnerOptimizer
from isoloco.trainer import Trainer

COMMITTED = Path(__file__).resolve().parents[1] / "results" / "claims" / "main" / "isoloco-R8-H30-s1"


def test_new_runs_default_to_fused_and_the_committed_grids_presets_keep_foreach():
    assert resolve(None, {}).inner.kernel == "fused"
    assert resolve("repro-cpu-r128", {}).inner.kernel == "fused"
    assert resolve("repro-cpu", {}).inner.kernel == resolve("repro-cpu-h", {}).inner.kernel == "foreach"
    saved = yaml.safe_load((COMMITTED / "config.yaml").read_text())
    assert "kernel" not in saved["inner"] and from_dict(saved).inner.kernel == "foreach"
    saved["inner"]["kernel"] = "fused"  # a config that names the key keeps what it names
    assert from_dict(saved).inner.kernel == "fused"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_the_kernel_named_is_the_kernel_adamw_runs(optimizer, kernel):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    inner = InnerOptimizer(list(model.named_parameters()), InnerConfig(optimizer=optimizer, kernel=kernel), 10)
    adamw = inner.optimizers[-1]
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults[kernel] is True and not adamw.defaults[{"fused": "foreach", "foreach": "fused"}[kernel]]


def _round_losses(tmp_path: Path, tree: dict) -> list[float]:
    cfg = from_dict(tree)
    trainer = Trainer(cfg, tmp_path / cfg.inner.kernel, progress=False)
    h = cfg.inner_steps
    worker_losses = [trainer.take_turn(worker, 0, h) for worker in trainer.workers]
    return torch.stack(worker_losses).mean(dim=0).tolist()


#: The CPU the committed grids ran on, as its vector capability (`torch.backends.cpu.get_cpu_capability()`)
#: and vendor: there a committed run retrains bit for bit. Elsewhere torch's kernels move the last
#: bits by themselves (on AVX2, both kernels land up to 3e-5 from the logged losses; an AMD CPU at
#: AVX512 also differs in the last bits).
COMMITTED_CPU = ("AVX512", "GenuineIntel")


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def test_a_committed_run_retrains_its_first_round_bit_for_bit(tmp_path):
    """The committed run's config.yaml predates inner.kernel: on the CPU it ran on, its first
    round's logged losses come back exactly and the fused kernel moves them (so the comparison
    can tell the kernels apart); on another CPU both come back within float32 noise."""
    saved = yaml.safe_load((COMMITTED / "config.yaml").read_text())
    lines = [json.loads(line) for line in (COMMITTED / "metrics.jsonl").read_text().splitlines()]
    logged = [line["train_loss"] for line in lines if line.get("round") == 0 and "train_loss" in line]
    assert len(logged) == saved["inner_steps"]
    retrained = _round_losses(tmp_path, saved)
    saved["inner"]["kernel"] = "fused"
    fused = _round_losses(tmp_path, saved)
    if (torch.backends.cpu.get_cpu_capability(), cpu_vendor()) == COMMITTED_CPU:
        assert retrained == logged
        assert fused != logged
    for losses in (retrained, fused):
        assert max(abs(a - b) for a, b in zip(losses, logged)) < 1e-4


def test_a_committed_config_yaml_given_as_a_file_trains_with_its_kernel_and_a_partial_file_with_the_default(tmp_path):
    assert resolve(str(COMMITTED / "config.yaml"), {}).inner.kernel == "foreach"
    partial = tmp_path / "mine.yaml"
    partial.write_text("inner:\n  lr: 0.01\n  beta2: 0.99\n")  # names some keys only: a new file
    assert resolve(str(partial), {}).inner.kernel == "fused"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_a_restored_state_lies_where_torchs_loader_puts_it(optimizer, kernel):
    """A resume puts `step` where torch's own `load_state_dict` does: on the parameter's device for
    the fused kernel, which refuses it elsewhere (a GPU run would fail at its first inner step).
    Played with the parameters on the meta device; the moments go to the worker's storage, its
    parameters' device here, as torch's would."""
    from isoloco.checkpoint import flatten_optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    trained = InnerOptimizer(list(model.named_parameters()), InnerConfig(optimizer=optimizer, kernel=kernel), 10)
    model(torch.randn(3, 4)).square().sum().backward()
    trained.step(0)
    saved, scalars = {}, {}
    for j, state in enumerate(trained.state_dicts()):
        tensors, plain = flatten_optimizer_state(state, f"w0.opt{j}")
        saved.update(tensors)
        scalars.update(plain)
    model.to("meta")
    ours = InnerOptimizer(list(model.named_parameters()), InnerConfig(optimizer=optimizer, kernel=kernel), 10)
    ours.load_state(saved, scalars, "w0", torch.device("meta"))
    torchs = InnerOptimizer(list(model.named_parameters()), InnerConfig(optimizer=optimizer, kernel=kernel), 10)
    torchs.load_state_dicts(trained.state_dicts())
    placed = [(key, value.device, value.dtype) for opt in ours.optimizers for param in opt.state
              for key, value in sorted(opt.state[param].items())]
    expected = [(key, value.device, value.dtype) for opt in torchs.optimizers for param in opt.state
                for key, value in sorted(opt.state[param].items())]
    assert placed == expected
    steps = {device.type for key, device, _ in placed if key == "step"}
    assert steps == ({"meta"} if kernel == "fused" else {"cpu"})
