"""The suite's time scale: ``PIPELINE_TEST_BUDGET_SCALE`` (tests/README.md) multiplies every test's budget and
timeout (tests/conftest.py) and the internal deadlines a test takes from :func:`scaled`: two suites sharing one
machine take about twice as long."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("PIPELINE_TEST_BUDGET_SCALE", "1"))


def scaled(seconds: float) -> float:
    return seconds * SCALE
