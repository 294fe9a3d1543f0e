"""Suite-wide settings: offline hub, one shared data cache per test session, the test device,
a package logger reset after each test, what a forkserver preloads.

`ISOLOCO_TEST_DEVICE` (default cpu) is where the device-agnostic training tests run, e.g.
`ISOLOCO_TEST_DEVICE=cuda make test` on a GPU machine; tests marked `cuda` need a GPU and are
skipped, saying so, where torch sees none.
"""

import logging
import multiprocessing
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests that start processes with the "forkserver" method fork them from one server that has
# imported these once (a spawned interpreter takes seconds of CPU to import them). The server
# starts at the first such test, and its processes inherit its environment, not the test's.
multiprocessing.set_forkserver_preload(["isoloco.trainer", "isoloco.distributed",
                                        "transformers.models.llama.modeling_llama"])


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Prepared corpora and tokenizers are cached once per session, never in the user's home."""
    path = tmp_path_factory.mktemp("isoloco-cache")
    previous = os.environ.get("ISOLOCO_CACHE")
    os.environ["ISOLOCO_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("ISOLOCO_CACHE", None)
    else:
        os.environ["ISOLOCO_CACHE"] = previous


@pytest.fixture(autouse=True)
def package_logger_level():
    """A command run in-process sets the package logger's level (`--quiet`, a rank): not for the next test."""
    yield
    logging.getLogger("isoloco").setLevel(logging.NOTSET)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A data cache of this test's own (tests that prepare corpora and check what lands there)."""
    monkeypatch.setenv("ISOLOCO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
