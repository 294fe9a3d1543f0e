"""The command line: help lists every key; user errors exit 2 with one line, before any work."""

import pytest

from isoloco.cli import main
from isoloco.config import list_keys, resolve
from isoloco.configbase import ConfigError

REQUIRED_KEYS = ["method", "workers", "inner_steps", "global_batch", "seq_len", "steps", "seed", "model",
                 "eval_every", "inner.optimizer", "inner.lr", "outer.optimizer", "outer.lr", "outer.momentum"]


def test_required_keys_exist_and_help_lists_every_key(capsys):
    names = {k.name for k in list_keys()}
    assert set(REQUIRED_KEYS) <= names
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
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


def test_resume_refuses_overrides(tmp_path, capsys):
    assert main(["train", "workers=2", "--resume", str(tmp_path), "--quiet"]) == 2
    assert "--resume continues a run" in capsys.readouterr().err


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="workers=2.5"):
        resolve(None, {"workers": 2.5})
