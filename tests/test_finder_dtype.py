"""`merge.finder_dtype`: what `auto` resolves to is decided by public torch APIs, recorded in the
run directory, and a resume says when it resolves differently; the merge's float32 matmuls
run at full precision whatever the host set."""

import json
import logging

import pytest
import torch

from helpers import SMALL_ARGS
from isoloco import merge_config, merge_functions, svd
from isoloco.cli import main
from isoloco.factors import FactorSettings, fast_bfloat16
from isoloco.svd import full_float32_matmuls

CPU = torch.device("cpu")


def test_auto_never_counts_a_cpu_as_native_bfloat16():
    """torch's public CPU capability names the vector code (AVX2, AVX512, ...), not bfloat16
    support, so auto is float32 on every CPU: the same numbers on every CPU."""
    assert torch.backends.cpu.get_cpu_capability() in {"DEFAULT", "VSX", "Z VECTOR", "NO AVX", "AVX2", "AVX512",
                                                       "SVE256"}
    assert not fast_bfloat16(CPU)
    assert FactorSettings().finder_precision(CPU) == "float32"
    assert FactorSettings(finder_dtype="bfloat16").finder_precision(CPU) == "bfloat16"


@pytest.mark.parametrize("rule, factors, recorded", [("tsv", "auto", "float32"), ("iso_cts", "randomized", "float32"),
                                                     ("tsv", "exact", None), ("iso_c", "auto", None)])
def test_only_rules_that_run_the_finder_report_its_precision(rule, factors, recorded):
    assert merge_config.MergeConfig(rule=rule, factors=factors).finder_precision(CPU) == recorded


def run_dir_records(run) -> tuple[dict, list[dict]]:
    summary = json.loads((run / "summary.json").read_text())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return summary, lines


def test_a_tsv_run_records_the_finder_dtype_and_a_resume_warns_when_it_changes(tmp_path, caplog):
    run = tmp_path / "run"
    args = [*SMALL_ARGS, "method=tsv", "workers=2", "steps=4", "inner_steps=2", "checkpoint_every=2"]
    assert main(["train", *args, "--out", str(run), "--quiet"]) == 0
    summary, lines = run_dir_records(run)
    assert summary["merge_finder_dtype"] == "float32"  # auto, on a CPU
    recorded = [line["merge_finder_dtype"] for line in lines if "merge_finder_dtype" in line]
    assert recorded == ["float32", "float32"]  # one per round, on its last line

    newest = max((run / "checkpoints").iterdir())
    state_file = newest / "state.json"
    state = json.loads(state_file.read_text())
    assert state["merge_finder_dtype"] == "float32"

    caplog.set_level(logging.INFO, logger="isoloco")
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert "range finder" not in caplog.text  # the same precision: nothing to say

    # As if the run had started where auto resolves to bfloat16 (a GPU).
    state_file.write_text(json.dumps({**state, "merge_finder_dtype": "bfloat16"}))
    caplog.clear()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "bfloat16 before this resume" in warnings[0] and "float32 on this device" in warnings[0]
    assert "merge.finder_dtype: bfloat16" in warnings[0]


def test_the_merge_pins_full_float32_matmuls_and_restores_the_hosts_setting(monkeypatch):
    """A host that allows TF32 (or bfloat16 passes on oneDNN) keeps its setting outside the
    merge; inside, float32 matmuls are IEEE, also when pins nest."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    settings = lambda: [backend.fp32_precision for backend in backends]  # noqa: E731
    before = settings()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        seen = []
        with full_float32_matmuls():
            with full_float32_matmuls():
                seen.append(settings())
            seen.append(settings())
        assert seen == [["ieee", "ieee"]] * 2
        assert settings() == ["tf32", "bf16"]

        lapack_svd = svd.lapack_svd
        monkeypatch.setattr(svd, "lapack_svd", lambda matrix: (seen.append(settings()), lapack_svd(matrix))[1])
        seen.clear()
        merge_functions.tsv([torch.randn(64, 48, generator=torch.Generator().manual_seed(i)) for i in range(4)])
        assert seen and all(inside == ["ieee", "ieee"] for inside in seen)
        assert settings() == ["tf32", "bf16"]
    finally:
        for backend, saved in zip(backends, before):
            backend.fp32_precision = saved
