"""`compile=true`: the model runs compiled (torch.compile, inductor), which trains what the eager
model trains to float32 noise, repeats itself bit for bit, resumes to the bits of an uninterrupted
run, and is recorded in the run; eager stays the default, so committed runs retrain as they were
made."""

import json
import shutil

import yaml

from helpers import assert_close_relative, final_params
from isoloco.cli import main
from isoloco.config import resolve

#: A short DiLoCo run at many workers (one sequence each), where compiling pays most.
RUN = ["train", "quick", "method=diloco", "workers=8", "inner_steps=3", "steps=6", "global_batch=8", "seq_len=32",
       "eval_every=0", "checkpoint_every=3", "seed=5"]


def _loss(run) -> float:
    return json.loads((run / "summary.json").read_text())["final_val_loss"]


def test_a_compiled_run_trains_what_eager_trains_and_repeats_bit_for_bit(tmp_path):
    assert resolve(None, {}).compile is False and resolve("repro-cpu-r128", {}).compile is False
    assert main([*RUN, "--out", str(tmp_path / "eager")]) == 0
    for name in ("compiled", "again"):
        assert main([*RUN, "compile=true", "--out", str(tmp_path / name)]) == 0
    for name, compiled in (("eager", False), ("compiled", True)):  # recorded in the run
        assert yaml.safe_load((tmp_path / name / "config.yaml").read_text())["compile"] is compiled
    eager, compiled, again = (final_params(tmp_path / name) for name in ("eager", "compiled", "again"))
    assert all(compiled[name].equal(again[name]) for name in compiled)  # the same config and seed: the same bits
    assert _loss(tmp_path / "compiled") == _loss(tmp_path / "again")
    # Fused kernels round differently, so the bits differ from eager's, by float32 noise only.
    assert any(not compiled[name].equal(eager[name]) for name in eager)
    assert_close_relative([compiled[name] for name in eager], list(eager.values()), rtol=1e-4, names=list(eager))
    assert abs(_loss(tmp_path / "compiled") - _loss(tmp_path / "eager")) < 1e-5
    # A crash after step 3's checkpoint: the resumed run compiles again and ends on the same bits.
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / "compiled", crashed)
    (crashed / "summary.json").unlink()
    shutil.rmtree(crashed / "checkpoints" / "step_00000006")
    assert main(["train", "--resume", str(crashed)]) == 0
    resumed = final_params(crashed)
    assert all(resumed[name].equal(compiled[name]) for name in compiled)
