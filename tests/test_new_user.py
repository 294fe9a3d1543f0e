"""What a new user saw (issue 51): settings that cannot act are refused in one line before any
work, naming the value and a fix that works; the start-up line and the divergence warning say
what the run does; torchtitan's refusals come before torchtitan is imported; signals during
start-up and in the last round are acknowledged; and a test waits on an event, not a clock."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from isoloco.cli import _recipe, main
from isoloco.config import resolve
from isoloco.config_checks import divergence_causes, matrix_names
from isoloco.errors import ConfigError
from isoloco.torchtitan.settings import check_flags

from helpers import wait_for

TINY_RUN = ["model=tiny", "seq_len=32", "global_batch=8", "steps=4", "inner_steps=2", "workers=2", "eval_every=4",
            "data.vocab_size=512", "data.val_tokens=256", "device=cpu"]


def refused(tmp_path: Path, capsys, *args: str) -> str:
    """The one `error:` line `isoloco train ARGS` exits 2 with, having written nothing."""
    out = tmp_path / "run"
    assert main(["train", *args, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert not out.exists(), "nothing may be written for a bad config"
    return err


# -- 1, 2: merge.compress_exclude ----------------------------------------------------------------

@pytest.mark.parametrize("patterns, said", [
    ("[nomatch*]", "the pattern 'nomatch*' names no parameter of model=tiny; the matrices are named like "
                   "lm_head.weight, model.embed_tokens.weight"),
    ("lm_head.weigth", "the pattern 'lm_head.weigth' names no parameter of model=tiny; did you mean lm_head.weight?"),
    ("[*embed_token,lm_head.weight]", "the pattern '*embed_token' names no parameter of model=tiny; did you mean "
                                      "model.embed_tokens.weight?"),
    ("*norm*", "the pattern '*norm*' names no matrix of model=tiny, only vectors (model.layers.0.input_layernorm"),
])
def test_a_compress_exclude_pattern_that_names_no_matrix_is_refused_with_what_it_could_have_meant(
        tmp_path, capsys, patterns, said):
    err = refused(tmp_path, capsys, "merge.compress=topk", f"merge.compress_exclude={patterns}")
    assert err.startswith(f"error: merge.compress_exclude={patterns.strip('[]')} is not allowed: ") and said in err


def test_a_merge_exclude_pattern_that_names_no_matrix_is_refused_too(tmp_path, capsys):
    err = refused(tmp_path, capsys, "method=isoloco", "merge.exclude=*q_prj*")
    assert "the pattern '*q_prj*' names no parameter of model=tiny; did you mean" in err and "q_proj" in err


@pytest.mark.parametrize("patterns", ["[*]", "[model.*,lm_head.weight]"])
def test_a_compress_exclude_that_keeps_every_matrix_whole_is_refused(tmp_path, capsys, patterns):
    err = refused(tmp_path, capsys, "merge.compress=topk", f"merge.compress_exclude={patterns}")
    assert (f"merge.compress_exclude={patterns.strip('[]')} is not allowed: it keeps every matrix of model=tiny "
            "whole, so merge.compress=topk would compress nothing") in err


def test_a_refused_pattern_leaves_an_existing_run_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("method: isoloco\n")
    (out / "keep.txt").write_text("results")
    assert main(["train", "merge.compress=topk", "merge.compress_exclude=lm_head.weigth", "--out", str(out),
                 "--force", "--quiet"]) == 2
    assert "did you mean lm_head.weight?" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "results"


def test_patterns_that_name_matrices_are_taken():
    cfg = resolve(None, {"merge.compress": "lowrank", "merge.compress_exclude": "*embed_tokens*,lm_head.weight"})
    assert cfg.merge.compress_exclude == ["*embed_tokens*", "lm_head.weight"]
    assert {"model.embed_tokens.weight", "lm_head.weight"} < set(matrix_names("tiny"))


# -- 3: keys that cannot act ----------------------------------------------------------------------

@pytest.mark.parametrize("args, said", [
    (["method=dp", "merge.compress=lowrank"],
     "merge.compress=lowrank is ignored with algorithm=dp (method=dp): the data-parallel baseline has no merge and no "
     "outer step; drop merge.compress, or choose a DiLoCo method (e.g. method=diloco)"),
    (["method=dp", "outer.lr=2"], "outer.lr=2.0 is ignored with algorithm=dp (method=dp)"),
    (["method=isoloco", "outer.sparse_topk=16"],
     "outer.sparse_topk=16 is ignored with outer.transport=merge: it applies only with outer.transport=sparseloco; add "
     "outer.transport=sparseloco (method=sparseloco sets it), or drop outer.sparse_topk"),
    (["method=diloco", "outer.sparse_tile=32"], "outer.sparse_tile=32 is ignored with outer.transport=merge"),
    (["method=diloco", "outer.sparse_decay=0.9"], "outer.sparse_decay=0.9 is ignored with outer.transport=merge"),
])
def test_a_key_that_cannot_act_is_refused(tmp_path, capsys, args, said):
    assert said in refused(tmp_path, capsys, *args)


def test_the_keys_are_taken_where_they_act():
    assert resolve(None, {"method": "sparseloco", "outer.sparse_topk": 16}).outer.sparse_topk == 16
    assert resolve(None, {"method": "diloco", "merge.compress": "lowrank"}).merge.compress == "lowrank"
    assert resolve("quick", {"method": "dp"}).algorithm == "dp"  # the preset's outer lrs are other methods'


# -- 4: outer.sparse_topk in range -----------------------------------------------------------------

@pytest.mark.parametrize("topk, runs", [(1, 2), (3, 2), (5000, 4096)])
def test_a_sparse_topk_that_would_be_clamped_is_refused_naming_the_range(tmp_path, capsys, topk, runs):
    err = refused(tmp_path, capsys, "method=sparseloco", f"outer.sparse_topk={topk}")
    assert (f"outer.sparse_topk={topk} is not allowed with outer.sparse_tile=64: SparseLoCo sends an even number of "
            f"entries per tile, from 2 to the 4096 of a 64×64 tile, so it would run as k={runs}; use an even "
            "outer.sparse_topk in [2, 4096]") in err


@pytest.mark.parametrize("topk", [2, 64, 4096])
def test_a_sparse_topk_in_range_is_taken(topk):
    assert resolve(None, {"method": "sparseloco", "outer.sparse_topk": topk}).outer.sparse_topk == topk


# -- 5: a fix that works ---------------------------------------------------------------------------

def test_sparseloco_with_error_feedback_suggests_a_fix_that_sparseloco_takes():
    with pytest.raises(ConfigError) as error:
        resolve(None, {"method": "sparseloco", "merge.error_feedback": True})
    message = str(error.value)
    assert message.startswith("merge.error_feedback=true is not allowed with outer.transport=sparseloco: SparseLoCo "
                              "keeps its own error feedback")
    assert "set merge.quantize" not in message and "merge.error_feedback=false" in message
    assert not resolve(None, {"method": "sparseloco", "merge.error_feedback": False}).merge.error_feedback


# -- 6, 7: the start-up line and the divergence warning ------------------------------------------

def test_the_start_up_line_names_compress_exclude_and_sparseloco_settings():
    excluded = resolve("quick", {"method": "diloco", "merge.compress": "lowrank",
                                 "merge.compress_exclude": "model.embed_tokens.weight,lm_head.weight"})
    assert _recipe(excluded).endswith("merge.compress=lowrank (low rank 4), merge.compress_exclude="
                                      "model.embed_tokens.weight,lm_head.weight (2 of 30 matrices whole)")
    sparse = resolve("quick", {"method": "sparseloco", "outer.sparse_topk": 32})
    assert _recipe(sparse).endswith("outer.transport=sparseloco (SparseLoCo: top 32 of every 64×64 tile, 2-bit "
                                    "values, accumulator decay 0.95)")


def test_sparselocos_divergence_warning_names_it_and_its_tuned_step():
    causes = divergence_causes(resolve("quick", {"method": "sparseloco"}))
    assert ("SparseLoCo (outer.transport=sparseloco) at outer.lr=1: its step tuned on the tiny model is "
            "outer.lr=0.5 at R = 8, 0.3 at R = 16") in causes
    assert "merge.compress" not in divergence_causes(resolve("quick", {"method": "dp"}))


# -- 8: torchtitan's refusals before torchtitan ---------------------------------------------------

#: The entry point with torchtitan made unimportable: a refusal must come before any import of it.
WITHOUT_TORCHTITAN = textwrap.dedent("""
    import sys
    sys.modules["torchtitan"] = None
    sys.argv = ["isoloco.torchtitan", *sys.argv[1:]]
    from isoloco.torchtitan.__main__ import main
    main()
""")


def test_the_torchtitan_entry_points_refusal_is_one_line_and_exit_2_before_torchtitan_is_imported():
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCHTITAN, "--module", "isoloco.torchtitan", "--config",
                           "llama3_isoloco_debugmodel", "--isoloco.lr=-1"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == ["error: --isoloco.lr=-1.0 is not allowed: it must be > 0"]


@pytest.mark.parametrize("flags, said", [
    (["--isoloco.lr", "-1"], "--isoloco.lr=-1.0 is not allowed: it must be > 0"),
    (["--isoloco.rule", "ties"], "--isoloco.rule=ties is not allowed in torchtitan"),
    (["--isoloco.placement=update", "--isoloco.rule", "mean"],
     "--isoloco.placement=update is not allowed with --isoloco.rule=mean"),
    (["--isoloco.fast", "--isoloco.rule", "mean"], "--isoloco.fast=True is not allowed with --isoloco.rule=mean"),
    (["--fault-tolerance.semi-sync-method", "local_sgd"],
     "--fault-tolerance.semi-sync-method=local_sgd is not allowed"),
    (["--fault_tolerance.no_enable"], "--fault-tolerance.enable=False is not allowed"),
])
def test_torchtitans_flags_are_checked_from_the_command_line(flags, said):
    with pytest.raises(ConfigError) as error:
        check_flags(["--module", "isoloco.torchtitan", "--config", "llama3_isoloco_debugmodel", *flags])
    assert str(error.value).startswith(said)


def test_flags_the_recipe_takes_or_tyro_will_refuse_pass_the_early_check():
    check_flags(["--config", "llama3_isoloco_debugmodel", "--isoloco.rule", "mean", "--isoloco.lr", "0.7",
                 "--isoloco.no-fast", "--isoloco.exclude", "*tok_embeddings*", "lm_head.weight",
                 "--fault-tolerance.enable", "--training.steps", "6"])
    check_flags(["--isoloco.lr", "fast"])  # not a number: tyro's own error says so


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchtitan") is None,
                    reason="the torchtitan extra is not installed")
def test_torchtitan_without_triton_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCHTITAN.replace('"torchtitan"', '"triton"'), "--module",
                           "isoloco.torchtitan", "--config", "llama3_isoloco_debugmodel"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: torchtitan 0.3.0 cannot be imported here: it imports "
                                                   "triton, which is not installed"), done.stderr[-3000:]


# -- 9: waiting on the event ---------------------------------------------------------------------

def test_waiting_for_a_run_waits_for_the_event_and_fails_at_once_when_the_run_ends_without_it(tmp_path):
    marker = tmp_path / "checkpoint"
    slow = subprocess.Popen([sys.executable, "-c", f"import time, pathlib; time.sleep(1.5); "
                                                   f"pathlib.Path({str(marker)!r}).mkdir(); time.sleep(30)"])
    try:
        wait_for(marker.is_dir, slow, "its checkpoint", cap_s=600)
        assert marker.is_dir()
    finally:
        slow.kill()
        slow.wait()
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(AssertionError, match=r"the run ended \(exit status 3\) before its checkpoint"):
        wait_for((tmp_path / "never").is_dir, ended, "its checkpoint", cap_s=600)
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(AssertionError, match="still going after 1 s without its checkpoint"):
            wait_for((tmp_path / "never").is_dir, hung, "its checkpoint", cap_s=1)
    finally:
        hung.kill()
        hung.wait()


# -- 10: signals acknowledged ----------------------------------------------------------------------

class Unhandled(Exception):
    """The test's own SIGTERM handler: raised where isoloco would leave the signal to it."""


@pytest.fixture
def sigterm_to_this_test():
    """SIGTERM raises `Unhandled` (instead of ending pytest) unless isoloco handles it itself."""
    def handler(signum, frame):
        raise Unhandled

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_during_start_up_stops_at_once_saying_so(tmp_path, capsys, monkeypatch, sigterm_to_this_test):
    from isoloco.trainer import Trainer

    building = Trainer.__init__

    def build_then_signalled(trainer, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        building(trainer, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", build_then_signalled)
    out = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--out", str(out), "--quiet"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [
        "stopped by SIGTERM during start-up, before training began: nothing was trained or written; run the same "
        "command to start it"]
    assert not out.exists()


def test_sigterm_during_the_last_round_is_acknowledged(tmp_path, capsys, monkeypatch, sigterm_to_this_test):
    from isoloco.trainer import Trainer

    train_round = Trainer.train_round

    def last_round_signalled(trainer, start, end):
        if end == trainer.cfg.train_steps:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_round(trainer, start, end)

    monkeypatch.setattr(Trainer, "train_round", last_round_signalled)
    out = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--out", str(out), "--quiet"]) == 0
    assert ("SIGTERM arrived during the last round: the run finished it and wrote its final checkpoint, so it is "
            "complete (nothing to resume)") in capsys.readouterr().err.splitlines()
    assert json.loads((out / "summary.json").read_text())["final_val_loss"] > 0
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 4


# -- 12: progress inside a round -----------------------------------------------------------------

def test_a_round_says_how_far_it_has_come_and_its_metrics_reach_the_file_before_a_checkpoint(
        tmp_path, monkeypatch, caplog):
    """Where no terminal draws the bar, a line per worker step when the interval is 0 (the
    default interval is 30 s), naming the step and the worker; and a round's metrics lines are in
    metrics.jsonl as soon as the round ends, before any checkpoint syncs the file."""
    import logging

    from isoloco import trainer as trainer_module
    from isoloco.config import parse_overrides

    monkeypatch.setattr(trainer_module, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(trainer_module.logs, "interactive", lambda: False)
    cfg = resolve(None, {**parse_overrides(TINY_RUN), "checkpoint_every": 1000})
    (tmp_path / "run").mkdir()
    trainer = trainer_module.Trainer(cfg, tmp_path / "run", progress=True)
    seen_after_round = []
    original = trainer._log_round

    def log_round(log, start, end, *args):
        original(log, start, end, *args)
        seen_after_round.append(len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))

    monkeypatch.setattr(trainer, "_log_round", log_round)
    with caplog.at_level(logging.INFO, logger="isoloco.trainer"):
        trainer.run()
    said = [record.getMessage() for record in caplog.records]
    for step in (1, 2):
        for worker in (1, 2):
            assert f"step {step}/4, worker {worker} of 2" in said
    assert seen_after_round == [2, 4]  # each round's two step lines, on disk when the round ends


# -- issue 58: the demo's last line, the licence, prepared data ------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_make_demo_reads_a_result_within_its_tolerance_as_a_match_with_the_reference_the_docs_give(tmp_path):
    makefile = (ROOT / "Makefile").read_text()
    check = re.search(r"^define DEMO_CHECK\n(.*?)^endef", makefile, re.S | re.M).group(1)
    reference, tolerance = (re.search(rf"^DEMO_{name} := (\S+)$", makefile, re.M).group(1)
                            for name in ("REFERENCE", "TOLERANCE"))
    assert f"| `isoloco train` (IsoLoCo) | {reference} (" in (ROOT / "docs" / "training.md").read_text()
    assert f"within {tolerance}" in (ROOT / "README.md").read_text()

    def said(loss: float) -> str:
        summary = tmp_path / "summary.json"
        summary.write_text(json.dumps({"final_val_loss": loss}))
        return subprocess.run([sys.executable, "-c", check, str(summary), reference, tolerance], capture_output=True,
                              text=True, check=True).stdout.strip()

    near, far = float(reference) - 1e-4, float(reference) + 10 * float(tolerance)
    assert said(near) == (f"OK: final validation loss {near:.4f} matches the reference {reference} of "
                          f"docs/training.md to within {tolerance}")
    assert said(far).startswith(f"CHECK: final validation loss {far:.4f} differs from the reference {reference} of "
                                f"docs/training.md by {far - float(reference):.4f}, more than the {tolerance}")


def test_the_licence_pyproject_names_is_shipped_and_prepared_data_stays_out_of_git():
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    licence = (ROOT / "LICENSE").read_text()
    assert licence.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"] and "END OF TERMS" in licence
    # `isoloco data prepare --out data/NAME` writes there; anchored, as src/isoloco/data/ is code.
    assert "/data/" in (ROOT / ".gitignore").read_text().splitlines()
