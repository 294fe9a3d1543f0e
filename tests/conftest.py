"""Suite-wide settings: offline hub, one shared data cache per test session."""

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
