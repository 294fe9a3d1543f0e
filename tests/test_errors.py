"""How a command reports errors (`isoloco.errors`) and writes its messages (`isoloco.logs`)."""

import logging

from isoloco import logs
from isoloco.cli import main
from isoloco.errors import (EXIT_PEER_LOST, CheckpointError, ConfigError, NonFiniteDeltaError, PeerLostError,
                            describe, first_line)

logger = logging.getLogger("isoloco.test")


def test_each_kind_of_error_has_its_lines_and_exit_status():
    assert describe(ConfigError("a=1 is not allowed\nb=2 is not allowed"), rank=0) == (
        ["a=1 is not allowed", "b=2 is not allowed"], 2)
    assert describe(CheckpointError("checkpoint x is damaged"), rank=0)[1] == 2
    assert describe(PeerLostError("rank 1 stopped answering"), rank=1) == (["rank 1 stopped answering"], EXIT_PEER_LOST)
    assert describe(NonFiniteDeltaError("worker 0: delta is nan"), rank=0) == (
        ["worker 0: delta is nan; the last checkpoint is intact"], 1)
    assert describe(FloatingPointError("loss is inf"), rank=0)[1] == 1


def test_only_rank_0_reports_a_user_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "workers=0", "--quiet"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "workers=0", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_messages_keep_the_plain_form_and_quiet_keeps_how_a_command_ended(capsys):
    logs.setup(quiet=True)
    logger.info("started")
    logger.log(logs.NOTICE, "stopped by SIGTERM")
    logger.warning("a corpus repeats")
    logger.error("a peer is lost")
    assert capsys.readouterr().err.splitlines() == ["stopped by SIGTERM", "warning: a corpus repeats",
                                                   "error: a peer is lost"]


def test_other_ranks_say_their_own_warnings_marked_with_their_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    logs.setup()
    logger.info("started")
    logger.warning("svd retried in float64")
    assert capsys.readouterr().err.splitlines() == ["warning: [rank 1] svd retried in float64"]


def test_a_backend_error_becomes_its_first_sentence_without_the_source_path():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:36239. This is typically caused by a remote worker crashing. Check the logs of "
                        "the remote worker before reporting an error. GLHF! 🏖️")
    assert first_line(gloo) == "Connection closed by peer [127.0.0.1]:36239"
    assert first_line(ValueError("bad value. See the docs.\nmore")) == "bad value. See the docs."


def test_a_long_line_is_cut_at_a_word():
    words = " ".join(f"word{i}" for i in range(100))
    line = first_line(RuntimeError(words))
    assert len(line) <= 200 and line.endswith(" ...") and words.startswith(line[:-4] + " ")
