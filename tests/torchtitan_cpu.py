"""A process of a replica group of isoloco's torchtitan recipe, for the tests and the GPU check:
torchtitan 0.3.0 made to run without a GPU, and hooks that record what the group did.

Run as ``python tests/torchtitan_cpu.py <torchtitan flags>`` (or through torchrun): where CUDA
is not available it patches torchtitan (below); it installs the hooks its environment names,
then runs ``python -m isoloco.torchtitan``'s entry. The patches are test support, not part of
the recipe, which runs torchtitan as it is on GPUs. Stock torchtitan 0.3.0 stops on a CPU at
five places:

1. ``distributed/minimal_async_ep/kernels.py`` imports ``triton``, which it does not declare
   (every model reaches it through the MoE token dispatcher): a stand-in module takes its place;
2. ``tools/utils.py`` falls back to "cuda" when no accelerator is found, so the trainer calls
   ``torch.cuda.set_device``: the device type is "cpu";
3. ``components/metrics.py`` reads CUDA-only memory statistics: a monitor that reports none;
4. flex attention has no backward on a CPU: the same block-causal attention, dense, through
   ``scaled_dot_product_attention`` and an uncompiled block mask;
5. ``distributed/utils.py::set_pg_timeouts`` calls ``barrier(device_ids=...)``, which gloo
   refuses, and ``torch.distributed.set_timeout``, which torch 2.13.0 lacks: skipped (it only
   shortens timeouts after the first step).

Hooks, by environment variable (torchtitan counts steps from 1):

* ``ISOLOCO_TT_RECORD=PREFIX``: every synchronisation as ``PREFIX-sync<round>``
  (`torchft_groups.record_synchronisations`), written by the group's first process;
* ``ISOLOCO_TT_OUT=PATH``: the final parameters as ``PATH.safetensors`` and the steps trained
  and the outer steps committed as ``PATH.json``, written by the group's first process;
* ``ISOLOCO_TT_MEET=STEP:MINE:THEIRS,...``: after step STEP, create file MINE and wait for THEIRS;
* ``ISOLOCO_TT_KILL_AT=STEP``: SIGKILL this process after step STEP, as a crashed machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # torchft_groups, beside this file

#: Whether torchtitan is missing: its tests are skipped then, saying so (`make install`, and so CI,
#: installs it). `find_spec` imports nothing, so an installed but broken torchtitan fails them instead.
MISSING = importlib.util.find_spec("torchtitan") is None
SKIP_REASON = "the torchtitan extra is not installed: pip install -e '.[torchtitan]' (make install does)"

# The repository's tokenizer and corpus of the tests: the embedded corpus, a BPE of the debug
# model's vocabulary.
DEBUG_VOCAB = 2048
CHAPTERS = 200


def prepare_assets(folder: Path) -> tuple[Path, Path]:
    """A tokenizer folder and a dataset folder for torchtitan (``--hf_assets_path``,
    ``--dataloader.dataset_path``), from the first chapters of isoloco's embedded corpus."""
    from isoloco.data.corpus import EmbeddedBible
    from isoloco.data.tokenizer import EOS_TOKEN, train_bpe

    chapters = [text for _, text in zip(range(CHAPTERS), EmbeddedBible().documents())]
    tokenizer, corpus = folder / "tokenizer", folder / "corpus"
    tokenizer.mkdir(parents=True, exist_ok=True)
    corpus.mkdir(parents=True, exist_ok=True)
    train_bpe(chapters, DEBUG_VOCAB).save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in chapters))
    return tokenizer, corpus


#: The flags of every group of the tests: the debug model on short sequences, gloo, one
#: fragment, a synchronisation every 2 steps, checkpoints on (a restarted group heals its step and
#: inner optimizer through them), no validation.
FLAGS = ["--module", "isoloco.torchtitan", "--config", "llama3_isoloco_debugmodel", "--debug.seed", "0",
         "--training.local-batch-size", "2", "--training.seq-len", "64", "--training.steps", "6",
         "--fault-tolerance.process-group", "gloo", "--fault-tolerance.group-size", "2",
         "--fault-tolerance.sync-steps", "2", "--fault-tolerance.num-fragments", "1",
         "--checkpoint.enable", "--checkpoint.interval", "1000", "--validator.no-enable", "--metrics.log-freq", "1"]


def start_group(replica: int, lighthouse: str, assets: Path, dump: Path, flags: list[str], hooks: dict[str, str],
                log: Path) -> subprocess.Popen:
    """Replica group `replica` as one process of this file, as torchrun would start it (one
    process), with the tokenizer and corpus of `prepare_assets(assets)`, its outputs in `dump`,
    `FLAGS` and then `flags`, the hooks `hooks` name, and its output in `log`."""
    from isoloco.launch import free_port

    env = {**os.environ, **hooks, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")), "TORCHFT_LIGHTHOUSE": lighthouse,
           "RUST_LOG": "error", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, __file__, *FLAGS, "--hf-assets-path", str(assets / "tokenizer"),
               "--dataloader.dataset", "c4_test", "--dataloader.dataset-path", str(assets / "corpus"),
               "--dump-folder", str(dump), "--fault-tolerance.replica-id", str(replica), *flags]
    dump.mkdir(parents=True, exist_ok=True)  # also its working directory: torchtitan writes ./outputs
    return subprocess.Popen(command, env=env, cwd=dump, stdout=log.open("a"), stderr=subprocess.STDOUT)


class _Stub(types.ModuleType):
    """A module whose every name is a placeholder (never called on a CPU)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _NoMemoryMonitor:
    """torchtitan's device memory monitor, without CUDA: nothing to report."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def _dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None and not return_aux.lse, "the CPU stand-in computes plain masked attention only"
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput()


def patch_for_cpu() -> None:
    """Apply the five patches; call before torchtitan is imported."""
    sys.modules["torchtitan.distributed.minimal_async_ep.kernels"] = _Stub("torchtitan.distributed.minimal_async_ep.kernels")
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention

    metrics.build_device_memory_monitor = _NoMemoryMonitor
    attention.FlexAttention._compiled_flex_attn = _dense_flex_attention
    attention._compiled_create_block_mask = create_block_mask
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


def _meet(mine: Path, theirs: Path, deadline_s: float = 300) -> None:
    import time

    mine.touch()
    end = time.monotonic() + deadline_s
    while not theirs.exists():
        assert time.monotonic() < end, f"{theirs} never came"
        time.sleep(0.05)


def install_hooks(environ: dict[str, str]) -> None:
    """Install the hooks `environ` names (see the module's docstring)."""
    from safetensors.torch import save_file

    from isoloco.torchtitan.trainer import IsoLoCoTrainer
    from torchft_groups import first_process, record_synchronisations, whole

    if "ISOLOCO_TT_RECORD" in environ:
        record_synchronisations(Path(environ["ISOLOCO_TT_RECORD"]))
    meets = {int(step): (Path(mine), Path(theirs)) for step, mine, theirs
             in (entry.split(":") for entry in environ.get("ISOLOCO_TT_MEET", "").split(",") if entry)}
    kill_at = int(environ.get("ISOLOCO_TT_KILL_AT", "0"))
    steps: list[int] = []
    train_step, train = IsoLoCoTrainer.train_step, IsoLoCoTrainer.train

    def hooked_step(trainer, data_iterator) -> None:
        train_step(trainer, data_iterator)
        steps.append(trainer.step)
        if trainer.step in meets:
            _meet(*meets[trainer.step])
        if trainer.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def hooked_train(trainer) -> None:
        train(trainer)
        if "ISOLOCO_TT_OUT" in environ:
            out = Path(environ["ISOLOCO_TT_OUT"])
            params = {name: whole(param) for name, param in trainer.model_parts[0].named_parameters()}
            if not first_process():
                return
            save_file(params, out.with_suffix(".safetensors"))
            out.with_suffix(".json").write_text(json.dumps(
                {"steps": steps, "outer_steps": trainer.ft_manager.manager.current_step()}))

    IsoLoCoTrainer.train_step, IsoLoCoTrainer.train = hooked_step, hooked_train


if __name__ == "__main__":
    if not torch.cuda.is_available():
        patch_for_cpu()
    install_hooks(dict(os.environ))
    from isoloco.torchtitan.__main__ import main

    main()
