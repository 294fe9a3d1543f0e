"""The command line: help lists every key; user errors exit 2 with one line, before any work."""

import json
import sys

import numpy as np
import pytest
import yaml

from isoloco import __version__
from isoloco.cli import build_parser, main
from isoloco.config import DEFAULT_PRESET, list_keys, resolve, to_dict
from isoloco.data import check_run_data
from isoloco.errors import ConfigError

REQUIRED_KEYS = ["method", "workers", "inner_steps", "global_batch", "seq_len", "steps", "seed", "model",
                 "eval_every", "inner.optimizer", "inner.lr", "outer.optimizer", "outer.lr", "outer.momentum"]


def test_required_keys_exist_and_help_lists_every_key(capsys):
    names = {k.name for k in list_keys()}
    assert set(REQUIRED_KEYS) <= names
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in list_keys():
        assert f"  {key.name} = " in out
        assert key.doc and key.doc in out


@pytest.mark.parametrize("args, needle", [
    (["workers=0"], "workers=0"),
    (["wrkers=4"], "unknown key 'wrkers'"),
    (["inner.lr=fast"], "inner.lr='fast'"),
    (["inner.lr=-1"], "inner.lr=-1.0"),
    (["method=sgdd"], "method='sgdd'"),
    (["model=huge"], "model='huge'"),
    (["workers=3", "global_batch=32"], "not divisible by workers=3"),
    (["no-such-preset"], "preset 'no-such-preset' is not known"),
    (["inner.optimizer=lion"], "inner.optimizer='lion'"),
    (["quick", "steps"], "not a key=value override"),
    (["workers=2", "worker_speeds=1,0.5,0.25"],
     "worker_speeds=1,0.5,0.25 lists 3 speeds for workers=2, and the speeds after the first 2 would be ignored: "
     "give at most 2"),
    (["merge.compress_rank=4"], "merge.compress_rank=4 is ignored with merge.compress=none: it applies only with "
                                "merge.compress=lowrank; add merge.compress=lowrank, or drop merge.compress_rank"),
    (["merge.compress=lowrank", "merge.compress_density=0.1"],
     "merge.compress_density=0.1 is ignored with merge.compress=lowrank: it applies only with merge.compress=topk"),
    (["merge.compress_chunk=1024"], "merge.compress_chunk=1024 is ignored with merge.compress=none"),
    (["eval_every=-1"], "eval_every=-1 is not allowed: it must be >= 0"),
    (["inner.optimizer=sgd", "inner.kernel=foreach"],
     "inner.kernel=foreach is ignored with inner.optimizer=sgd: it applies only with inner.optimizer=adamw or muon; "
     "set inner.optimizer to adamw or muon, or drop inner.kernel"),
    (["method=diloco", "merge.exclude=*embed*"],
     "merge.exclude=*embed* is ignored with merge.rule=mean: it applies only with merge.rule=tsv, iso_c or iso_cts"),
    (["method=dp", "workers=8"], "workers=8 is ignored with algorithm=dp (method=dp): the data-parallel baseline "
                                 "trains one model on the global batch; drop workers"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    assert main(["train", *args, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err
    assert len(err.splitlines()) == 1
    assert not out.exists(), "nothing may be written for a bad config"


def test_data_alias_sets_the_source():
    assert resolve(None, {"data": "some/dir"}).data.source == "some/dir"


def test_method_values_can_be_overridden():
    cfg = resolve(None, {"method": "isoloco", "outer.lr": 0.5})
    assert cfg.merge.rule == "iso_c" and cfg.outer.optimizer == "nesterov" and cfg.outer.lr == 0.5


def test_default_method_is_isoloco():
    assert resolve(None, {}).method == "isoloco"


def test_existing_run_directory_is_refused_without_force(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["train", "quick", "--out", str(out), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["train", "quick", "--out", str(out), "--force", "--quiet"]) == 2
    assert "not an isoloco run directory" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("where", ["/proc/isoloco-test/run",  # mkdir: FileNotFoundError
                                   "/sys/isoloco-test/run",  # mkdir: PermissionError (read-only sysfs: OSError)
                                   "FILE/run"])  # under a regular file
@pytest.mark.parametrize("dry_run", [False, True])
def test_an_out_that_cannot_be_made_or_written_exits_2_in_one_line_before_any_work(tmp_path, capsys, where, dry_run):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    out = where.replace("FILE", str(afile))
    assert main(["train", "--out", out, "--quiet", *(["--dry-run"] if dry_run else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {out} cannot be ") and err.endswith("choose another --out")
    assert len(err.splitlines()) == 1
    assert afile.read_text() == "mine" and sorted(tmp_path.iterdir()) == [afile]


def test_resume_refuses_force_instead_of_ignoring_it(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path), "--force", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --force overwrites nothing with --resume {tmp_path}") and len(err.splitlines()) == 1


def test_resume_refuses_overrides(tmp_path, capsys):
    assert main(["train", "workers=2", "--resume", str(tmp_path), "--quiet"]) == 2
    assert "--resume continues a run" in capsys.readouterr().err


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="workers=2.5"):
        resolve(None, {"workers": 2.5})


# -- the first hour of a new user -------------------------------------------------------------

TINY_RUN = ["model=tiny", "seq_len=32", "global_batch=8", "steps=4", "inner_steps=2", "workers=2", "eval_every=4",
            "data.vocab_size=512", "data.val_tokens=256", "device=cpu"]


def _dry_run(capsys, *args: str) -> dict:
    assert main(["train", *args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    return yaml.safe_load(out)


def test_a_compression_knob_with_its_compression_and_speeds_for_every_worker_are_taken(tmp_path, capsys):
    cfg = _dry_run(capsys, "merge.compress=topk", "merge.compress_density=0.01", "merge.compress_chunk=1024",
                   "workers=2", "worker_speeds=1,0.5", "--out", str(tmp_path / "run"))
    assert (cfg["merge"]["compress_density"], cfg["merge"]["compress_chunk"], cfg["worker_speeds"]) == (
        0.01, 1024, [1.0, 0.5])
    # A preset's file writes every key: a saved config.yaml resumes whatever its compression.
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(to_dict(resolve(None, {}))))
    assert _dry_run(capsys, str(saved), "--out", str(tmp_path / "run"))["merge"]["compress_rank"] == 4


def test_a_config_file_and_the_same_keys_as_items_resolve_to_the_same_config(tmp_path, capsys):
    out = ["--out", str(tmp_path / "run")]
    mine = tmp_path / "mine.yaml"
    mine.write_text("method: diloco\nworkers: 2\nmerge:\n  bucket_mb: 8\n")
    items = _dry_run(capsys, "method=diloco", "workers=2", "merge.bucket_mb=8", *out)
    assert _dry_run(capsys, str(mine), *out) == items and items["inner"]["lr"] == 0.016  # quick's, not the method's
    # A file names another base with `preset:`, as a preset named on the command line is.
    mine.write_text("preset: repro-cpu\nmethod: diloco\nworkers: 2\n")
    assert _dry_run(capsys, str(mine), *out) == _dry_run(capsys, "repro-cpu", "method=diloco", "workers=2", *out)
    mine.write_text("preset: quikc\nworkers: 2\n")
    assert main(["train", str(mine), *out, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: preset: 'quikc' in {mine} is not a shipped preset") and len(err.splitlines()) == 1


def test_dp_records_the_one_model_it_trains_whatever_a_preset_says(tmp_path, capsys):
    assert _dry_run(capsys, "method=dp", "--out", str(tmp_path / "run"))["workers"] == 1
    assert resolve("paper-178m", {"method": "dp"}).workers == 1  # the preset's workers=8 are its DiLoCo runs'


def test_inner_steps_beyond_steps_is_warned_before_the_run():
    from isoloco.config_checks import run_warnings

    (line,) = run_warnings(resolve(None, {"steps": 20}), islands=1)
    assert line.startswith("inner_steps=30 is more than steps=20: the workers train every step apart and "
                           "synchronise once, at the end")
    assert run_warnings(resolve(None, {"steps": 30}), islands=1) == []
    assert run_warnings(resolve(None, {"steps": 20, "method": "dp"}), islands=1) == []


def test_a_shipped_presets_key_that_a_method_ignores_is_not_refused():
    assert resolve("repro-cpu", {"inner.optimizer": "sgd"}).inner.kernel == "foreach"  # the preset's, inert


def test_overrides_on_a_bare_command_apply_on_top_of_the_quick_preset(tmp_path, capsys):
    cfg = _dry_run(capsys, "seed=1", "--out", str(tmp_path / "run"))
    assert (cfg["seed"], cfg["steps"], cfg["inner"]["lr"]) == (1, resolve(DEFAULT_PRESET, {}).steps, 0.016)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("method, outer_lr", [("isoloco", 1.2), ("isoloco_fast", 1.2), ("diloco", 0.7)])
def test_quick_preset_uses_learning_rates_tuned_for_the_tiny_model(method, outer_lr):
    cfg = resolve("quick", {"method": method})
    assert (cfg.model, cfg.inner.lr, cfg.outer.lr) == ("tiny", 0.016, outer_lr)


def test_a_folder_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quick").mkdir()  # e.g. an earlier run's --out quick
    assert resolve("quick", {}).model == "tiny"  # the shipped preset, not an error about the folder


def test_help_shows_the_values_of_the_preset_and_method(capsys):
    assert main(["train", "quick", "method=diloco", "--help"]) == 0
    out = capsys.readouterr().out
    for line in ("  method = 'diloco'", "  merge.rule = 'mean'", "  outer.lr = 0.7", "  inner.lr = 0.016"):
        assert line in out
    assert "178M" in out and "tiny model" in out


def test_dry_run_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    cfg = _dry_run(capsys, "quick", "method=diloco", "--out", str(tmp_path / "run"))
    assert cfg == to_dict(resolve("quick", {"method": "diloco"}))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [
    ["quick", "--quiet", "workers=8"],
    ["--out", "OUT", "quick", "workers=8"],
    ["quick", "--out", "OUT", "workers=8", "--quiet"],
])
def test_overrides_are_accepted_anywhere_on_the_line(tmp_path, capsys, args):
    args = [str(tmp_path / "run") if a == "OUT" else a for a in args]
    assert _dry_run(capsys, *args)["workers"] == 8


@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_a_logger_without_its_extra_is_refused_before_any_work(tmp_path, capsys, monkeypatch, key):
    monkeypatch.setitem(sys.modules, key, None)  # as if the extra were not installed
    out = tmp_path / "run"
    assert main(["train", *TINY_RUN, f"log.{key}=true", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"log.{key}=true needs the {key} package" in err[0] and f"isoloco[{key}]" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["worker=8"], "unknown key 'worker' (did you mean workers?)"),
    (["inner.lrr=0.1"], "unknown key 'inner.lrr' (did you mean inner.lr?)"),
    (["--resume", "/does-not-exist"], "--resume /does-not-exist: no such directory"),
    (["--resume", "RUN", "--out", "RUN"], "both name the run directory"),
])
def test_more_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    args = [str(tmp_path) if a == "RUN" else a for a in args]
    assert main(["train", *args, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1


def test_top_level_help_lists_every_command_and_version_is_shown(capsys):
    parser = build_parser()
    text = parser.format_help()
    for command in ("train", "launch", "sweep", "report", "data", "export"):
        assert f"    {command} " in text and command in text.splitlines()[2]  # listed, and in the description
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"isoloco {__version__}"


def test_banner_names_the_recipe_and_timing_is_on_the_round_lines(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "method=diloco", "--out", str(run)]) == 0
    banner = capsys.readouterr().err.splitlines()[0]  # a message, on stderr
    assert banner.startswith("diloco (merge mean, outer nesterov lr 0.7, inner adamw lr 0.016): model tiny")
    assert banner.endswith(", from preset quick (the default)")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [("wall_time_s" in r, "tokens_per_s" in r) for r in records] == [(r["step"] % 2 == 0,) * 2
                                                                           for r in records]


def test_launch_refuses_a_resume_with_another_layout_before_starting_processes(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["launch", "--nproc", "2", "--", "train", "--resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint ") and len(err.splitlines()) == 1
    assert ("written by 2 workers on 1 process, 2 workers per process, and this run has 2 workers on 2 processes, "
            "1 worker per process") in err


def test_every_data_problem_is_reported_at_once(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Verse {i}: and the light was good, number {i}." for i in range(200)))
    out = tmp_path / "run"
    assert main(["train", f"data={corpus}", *TINY_RUN, "steps=400", "data.val_tokens=100000", "data.vocab_size=300",
                 "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "400 steps x global_batch 8" in err[0] and "data.allow_repeat=true" in err[0]
    assert "the validation split has" in err[1] and "val_tokens=100000" in err[1]
    assert not out.exists()


def test_a_repeated_corpus_is_a_plain_warning_line():
    train, val = np.arange(50, dtype=np.uint16), np.arange(100, dtype=np.uint16)
    notice = check_run_data(train, val, seq_len=4, global_batch=5, steps=20, val_tokens=8, allow_repeat=True)
    assert notice.startswith("20 steps x global_batch 5") and "repeating the data" in notice


@pytest.mark.parametrize("raw", ["*embed_tokens*,lm_head.weight", "[*embed_tokens*, lm_head.weight]",
                                 "['*embed_tokens*', 'lm_head.weight']"])
def test_list_keys_take_comma_or_bracket_forms(raw):
    from isoloco.config import parse_overrides, resolve

    cfg = resolve(None, parse_overrides([f"merge.exclude={raw}"]))
    assert cfg.merge.exclude == ["*embed_tokens*", "lm_head.weight"]
