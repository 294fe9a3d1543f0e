"""examples/torchft_isoloco.py as a user runs it: what it cannot carry through torchft and a bad
--fragments are refused in one line before any work; torchft's own log lines only on request;
each rule merged in the quorum leaves both groups equal; the validation loss it prints is
isoloco's evaluation of what the groups trained."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from isoloco.config import parse_overrides, resolve
from isoloco.trainer import Trainer

import helpers

pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")

EXAMPLE = Path(__file__).parents[1] / "examples" / "torchft_isoloco.py"
TINY = [*helpers.SMALL_ARGS, "steps=6", "inner_steps=2"]
FRAGMENTS = "is not allowed: choose 1 to 4 (a fragment is a block of model=tiny's 4 layers)"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchft_isoloco", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_env() -> dict[str, str]:
    """A user's environment: one thread, and no RUST_LOG of a test's choosing."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RUST_LOG", None)
    return env


@pytest.mark.parametrize("args, message", [
    (["merge.quantize=int8"], "merge.quantize=int8 is not supported under torchft: torchft's DiLoCo all-reduces "
                              "float32 pseudo-gradients; drop it, or compress with isoloco train / isoloco launch"),
    (["merge.compress=topk"], "merge.compress=topk is not supported under torchft: torchft's DiLoCo all-reduces "
                              "whole pseudo-gradients; drop it, or compress with isoloco train / isoloco launch"),
    (["outer.overlap_steps=1"], "outer.overlap_steps=1 is not supported under torchft: torchft overlaps a "
                                "synchronisation its own way: drop it and use its fragments and sync delay (the "
                                "example's --fragments N --sync-delay STEPS)"),
    (["merge.weighting=tokens"], "merge.weighting=tokens is not supported under torchft: torchft's quorum "
                                 "merges its groups with equal weights; drop it, or weigh by tokens with isoloco train "
                                 "/ isoloco launch"),
    (["faults.late_rate=0.3"], "faults.late_rate=0.3 is not supported under torchft: torchft's own quorum "
                               "decides who merges; drop it, or simulate late workers with isoloco train"),
    (["worker_speeds=1,0.5"], "worker_speeds=[1.0, 0.5] is not supported under torchft: every group trains "
                              "H steps a round under torchft; drop it, or simulate unequal workers with isoloco train"),
    (["--fragments", "0"], f"--fragments 0 {FRAGMENTS}"),
    (["--fragments", "-1"], f"--fragments -1 {FRAGMENTS}"),
    (["--fragments", "5"], f"--fragments 5 {FRAGMENTS}"),
])
def test_what_the_example_cannot_do_is_refused_in_one_line_before_any_work(capsys, monkeypatch, args, message):
    example = load_example()
    monkeypatch.setattr(example, "torchft_replica", lambda show_logs: pytest.fail("torchft was started"))
    assert example.main([*TINY, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {message}\n"


def test_fragments_0_exits_2_with_one_line_and_no_traceback():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--fragments", "0"], env=example_env(),
                            capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: --fragments 0 {FRAGMENTS}\n")


@pytest.mark.torchft
@pytest.mark.multiprocess
def test_the_example_is_quiet_and_scores_the_groups_as_isoloco_train_does(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLE), *TINY], env=example_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "[INFO]" not in result.stderr and "torchft" not in result.stderr, result.stderr
    last = result.stdout.splitlines()[-1]
    assert last.startswith("validation loss: group 0: ") and "(unigram baseline of the corpus: " in last, last
    printed = [float(part.split(": ")[1]) for part in last.split(" (")[0].removeprefix("validation loss: ").split(", ")]
    # The simulator trains the same workers to the same θ (to 1e-5, tests/test_torchft.py);
    # `isoloco train`'s final validation loss of it is the reference.
    cfg = resolve("quick", {**load_example().DEFAULTS, **parse_overrides(TINY)})
    (tmp_path / "simulator").mkdir()
    reference = Trainer(cfg, tmp_path / "simulator", progress=False).run()["final_val_loss"]
    assert len(printed) == 2 and all(abs(loss - reference) <= 2e-4 for loss in printed), (printed, reference)


#: The example on each rule merged in the quorum: `make test` runs Iso-CTS, the one with the most
#: stages there; the others are nightly (every rule's numbers under torchft, through the same
#: `run_replica_group`, are the simulator's: tests/test_torchft.py).
EXAMPLE_METHODS = ["isocts", *(pytest.param(method, marks=pytest.mark.nightly) for method in ("dare", "ties", "tsv"))]


@pytest.mark.torchft
@pytest.mark.multiprocess
@pytest.mark.parametrize("method", EXAMPLE_METHODS)
def test_the_example_trains_every_rule_and_shows_torchfts_lines_on_request(method):
    result = subprocess.run([sys.executable, str(EXAMPLE), f"method={method}", *TINY, "--torchft-logs"],
                            env=example_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{method}: 2 replica groups")
    assert any(line.startswith("outer steps committed: [3, 3]") for line in lines), result.stdout
    assert "largest difference between the groups' final parameters: 0" in lines
    assert "[INFO] [torchft::lighthouse]" in result.stderr and "[INFO] [torchft::manager]" in result.stderr
