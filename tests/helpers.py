"""Helpers shared by test modules."""

import os

#: Where device-agnostic training tests run (see conftest.py).
TEST_DEVICE = os.environ.get("ISOLOCO_TEST_DEVICE", "cpu")
