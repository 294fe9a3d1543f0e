"""What a GPU run needs, checked on the CPU: device checks before CUDA is touched, the
bucketed gradient all-reduce, and scripts/gpu_check.py, which must fail on a broken input."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isoloco import distributed
from isoloco.errors import ConfigError


def test_one_named_gpu_is_refused_for_several_processes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ConfigError, match="device=cuda:1 names one GPU, but this run has 2 processes"):
        distributed.process_gpu("cuda:1", world_size=2)


def test_a_process_without_a_gpu_of_its_own_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="LOCAL_RANK=2 has no GPU of its own \\(2 visible\\)"):
        distributed.process_gpu("cuda", world_size=4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.process_gpu("auto", world_size=4) == torch.device("cuda", 1)


def test_gradient_buckets_pack_small_tensors_and_leave_large_ones_alone():
    sizes = [10, 10, 300, 5, 3, 40]  # floats; a limit of 256 bytes = 64 floats
    tensors = [torch.zeros(n) for n in sizes] + [torch.zeros(4, dtype=torch.float64)]
    from isoloco.comm import nbytes
    from isoloco.sync.plan import buckets

    groups = buckets([(nbytes(t), t.dtype) for t in tensors], 256)
    assert [[tensors[i].numel() for i in b] for b in groups] == [[10, 10], [300], [5, 3, 40], [4]]
    assert [i for b in groups for i in b] == list(range(len(tensors)))  # order kept, nothing lost


@pytest.mark.parametrize("rule", ["mean", "ties", "dare", "tsv", "iso_c", "iso_cts"])
def test_the_merge_holds_one_parameter_of_fetched_deltas_at_a_time(rule):
    """Offloaded workers keep their deltas in host memory; the merge fetches them to the
    compute device one parameter at a time (counted here through the fetch), and the result
    is the same as merging deltas that were already there."""
    import weakref

    from isoloco.comm import LocalCommunicator
    from isoloco.merge_config import MergeConfig
    from isoloco.outer import OuterConfig, OuterStep

    workers, shapes = 4, {"embed": (96, 16), "attn": (16, 16), "norm": (16,), "head": (96, 16)}
    g = torch.Generator().manual_seed(0)
    deltas = {name: [torch.randn(shape, generator=g) for _ in range(workers)] for name, shape in shapes.items()}
    live = {"now": 0, "peak": 0}

    def fetch(delta: torch.Tensor) -> torch.Tensor:
        copy = delta.clone()
        size = copy.numel() * copy.element_size()
        live["now"] += size
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(copy, lambda: live.__setitem__("now", live["now"] - size))
        return copy

    def merged(with_fetch: bool) -> list[torch.Tensor]:
        params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in shapes.items()]
        step = OuterStep(params, MergeConfig(rule=rule), OuterConfig(optimizer="sgd", lr=1.0), LocalCommunicator(workers), 0)
        step.step(deltas, round=0, fetch=fetch if with_fetch else None)
        return [p.detach() for _, p in params]

    for a, b in zip(merged(True), merged(False)):
        assert torch.equal(a, b)
    one_parameter = workers * 96 * 16 * 4
    assert 0 < live["peak"] <= one_parameter < sum(d.numel() * 4 for ds in deltas.values() for d in ds)


def test_a_deterministic_run_trains_and_repeats_its_bits(tmp_path):
    from isoloco.config import resolve
    from isoloco.trainer import Trainer

    from helpers import SMALL

    small = {**SMALL, "steps": 4, "inner_steps": 2, "workers": 2, "eval_every": 4, "deterministic": True}
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(resolve(None, small), tmp_path / name, progress=False)
        (tmp_path / name).mkdir()
        trainer.run()
        runs.append(trainer)
    assert torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)  # process-wide: leave the other tests as they were
    for a, b in zip(runs[0].global_params, runs[1].global_params):
        assert torch.equal(a, b)
    assert runs[0].last_val_loss == runs[1].last_val_loss


def test_checkpoint_files_are_safetensors_written_without_copies_of_the_state(tmp_path):
    """Every dtype a checkpoint holds, scalars, empty tensors, views that share storage and
    non-contiguous ones: `load_file` gives them back exactly."""
    from safetensors.torch import load_file

    from isoloco.checkpoint import write_safetensors

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "w": base, "row": base[1], "columns": base[:, ::2], "transposed": base.T,
        "step": torch.tensor(7.0), "empty": torch.zeros(0, 3), "half": torch.randn(5, dtype=torch.bfloat16),
        "f16": torch.randn(3, dtype=torch.float16), "f64": torch.randn(2, 2, dtype=torch.float64),
        "ids": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32), "bytes": torch.arange(9, dtype=torch.uint8),
        "mask": torch.tensor([True, False]),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors)
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["svd", "gram"])
def test_exact_orthogonalisation_on_the_gpu_matches_the_cpu(method):
    from isoloco.ortho import IsoSettings, iso_correct

    matrix = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    on_gpu = iso_correct(matrix.cuda(), IsoSettings(method)).cpu()
    on_cpu = iso_correct(matrix, IsoSettings(method))
    assert ((on_gpu - on_cpu).norm() / on_cpu.norm()).item() <= 1e-4


@pytest.mark.cuda
def test_dare_masks_on_the_gpu_are_the_cpu_masks():
    from isoloco.comm import LocalCommunicator
    from isoloco.merge import Merger
    from isoloco.merge_config import MergeConfig

    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(32, 16, generator=g) for _ in range(3)]
    merger = Merger(MergeConfig(rule="dare", drop_rate=0.5), LocalCommunicator(3), seed=1)
    on_gpu = merger.merge("w", [d.cuda() for d in deltas], round=2).cpu()
    on_cpu = merger.merge("w", deltas, round=2)
    assert torch.equal(on_gpu != 0, on_cpu != 0)
    torch.testing.assert_close(on_gpu, on_cpu)


GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_fails_fast_orthogonalisations_that_return_noise(monkeypatch, capsys):
    from isoloco import ortho, svd

    def noise(matrix, steps, dtype):
        factor = torch.randn(matrix.shape, generator=torch.Generator().manual_seed(0))
        return svd.Polar(factor / factor.norm() * min(matrix.shape) ** 0.5, None)

    gpu_check = _gpu_check(monkeypatch)
    for method in ("newton_schulz", "polar_express"):
        monkeypatch.setitem(ortho.POLAR_METHODS, method, noise)
    assert gpu_check.main(["--dry-run", "--only", "fast"]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fast Iso-C")]
    assert rows and all("| **no** |" in row for row in rows)
    assert all("error ≤" in row for row in rows)  # each row prints the bound it failed


def test_the_gpu_check_refuses_an_unknown_check():
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--dry-run", "--only", "fast,speed"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "choose from exact, fast" in done.stderr.strip().splitlines()[-1]


#: The dry run's checks in two halves that run at once: the suite runs one test at a time, so the
#: second half takes the core it would leave idle.
DRY_RUN_HALVES = ("exact,fast,methods,offload,resume,offloaded_overlap,torchtitan,sync_free",
                  "round,merge,deterministic,island,overlap,structured")
#: The checks `make test` dry-runs: all but those that train every method or in fresh processes
#: (methods, offload, merge, deterministic, offloaded_overlap, island, overlap: about nine tenths
#: of the dry run's time), whose code the nightly run dry-runs. What they hold on a GPU has CPU
#: tests of its own in `make test`: every method trains (test_trainer.py), offloaded workers give
#: the same bits, deterministic runs repeat theirs, the merge holds one parameter of deltas (here),
#: an island of two processes and overlapped islands train the simulator's numbers
#: (test_distributed.py).
QUICK_CHECKS = "exact,fast,resume,round,structured,torchtitan,sync_free"
#: Checks that need a GPU even in a dry run, each with the CPU test that covers it instead.
CUDA_ONLY = {"torchtitan recipe": "tests/test_torchtitan.py"}


def dry_run(parts: tuple[str, ...]) -> None:
    """Dry-run the checks of each part (comma-separated names), the parts at once: every row
    passes, but those skipped for want of a GPU, which another test covers."""
    runs = [subprocess.Popen([sys.executable, str(GPU_CHECK), "--dry-run", "--only", part], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for part in parts]
    outputs = [run.communicate(timeout=1800) for run in runs]
    rows = []
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, out + err
        rows += [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    skipped = {row.split(" | ")[0].removeprefix("| "): row for row in rows if row.split(" | ")[-2] == "skipped"}
    assert all(any(name.startswith(check) and covered in row for check, covered in CUDA_ONLY.items())
               for name, row in skipped.items()), skipped
    verdicts = [row.split(" | ")[-2] for row in rows if row not in skipped.values()]
    assert len(verdicts) >= 9 and set(verdicts) == {"yes"}, "\n".join(out for out, _ in outputs)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpu_check_dry_run_passes_its_quick_checks_on_the_cpu(monkeypatch):
    every = [check for half in DRY_RUN_HALVES for check in half.split(",")]
    assert sorted(every) == sorted(_gpu_check(monkeypatch).CHECKS)  # each check in one half, none left out
    assert set(QUICK_CHECKS.split(",")) < set(every)
    dry_run((QUICK_CHECKS,))


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpu_check_dry_run_passes_every_check_on_the_cpu():
    dry_run(DRY_RUN_HALVES)


def _offload_runs(tmp_path, device: str, **overrides) -> dict:
    from isoloco.config import resolve
    from isoloco.trainer import Trainer

    from helpers import SMALL

    runs = {}
    for offload in (False, True):
        cfg = {**SMALL, "device": device, "steps": 4, "inner_steps": 2, "workers": 4, "eval_every": 4,
               "offload_workers": offload, **overrides}
        (tmp_path / f"offload-{offload}").mkdir()
        runs[offload] = Trainer(resolve(None, cfg), tmp_path / f"offload-{offload}", progress=False)
        runs[offload].run()
    return runs


def test_offload_on_the_cpu_keeps_off_pinned_memory_and_side_streams(tmp_path, monkeypatch):
    """Pinned buffers and the prefetch stream serve offload from a GPU: a CPU run with
    offload_workers=true reaches neither, and gives the bits of a run without it."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU run reached a CUDA API")

    for api in ("cudart", "Stream", "current_stream"):
        monkeypatch.setattr(torch.cuda, api, no_cuda)
    runs = _offload_runs(tmp_path, "cpu")
    for a, b in zip(runs[False].global_params, runs[True].global_params, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_offload_with_pinned_memory_and_prefetch_gives_the_bits_of_no_offload(tmp_path):
    runs = _offload_runs(tmp_path, "cuda", deterministic=True)
    torch.use_deterministic_algorithms(False)  # process-wide: leave the other tests as they were
    for a, b in zip(runs[False].global_params, runs[True].global_params, strict=True):
        assert torch.equal(a, b)
    worker = runs[True].workers[-1]
    moments = [v for opt in worker.optimizer.optimizers for s in opt.state.values() for v in s.values()
               if v.ndim > 0]
    assert moments and all(t.device.type == "cpu" and t.is_pinned() for t in moments + worker.delta)
