"""The pipeline's own settings read from the environment, one home each (more move here as they are touched).

``PIPELINE_HOME``: where the local profile keeps its state (store, work, MLflow, sandboxes). The Makefile sets
``./.demo`` for `make demo` / `make airflow`; a worker or pod without it uses ``~/.verl-grpo-pipeline``.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "PIPELINE_HOME"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".verl-grpo-pipeline")


def cache_dir() -> Path:
    """``PIPELINE_CACHE_DIR``: the best-effort caches (checksums, OSS resume checkpoints); losing it costs time only."""
    return Path(os.environ.get("PIPELINE_CACHE_DIR") or Path.home() / ".cache" / "pipeline_steps")
