"""The environment variables of the libraries the pipeline drives (verl, MLflow, the Hugging Face Hub, TensorBoard):
named once here and read or set by these names everywhere else, and the one way to set some of them for a while.

The pipeline's own variables (``PIPELINE_*``) live in :mod:`pipeline_steps.settings`. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"  # MLflow's server (mlflow, verl's mlflow logger)
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"  # MLflow resumes this run instead of starting one (verl's logger on a resumed run)
HF_HUB_CACHE = "HF_HUB_CACHE"  # huggingface_hub's download cache
TENSORBOARD_DIR = "TENSORBOARD_DIR"  # where verl's tensorboard logger writes its event files
VERL_FILE_LOGGER_PATH = "VERL_FILE_LOGGER_PATH"  # where verl's file logger writes one JSON line per step


@contextlib.contextmanager
def scoped(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside the block, the previous values (or their absence) restored after it,
    for a library that reads its settings from the environment only (verl's loggers, MLflow). Not for credentials:
    a client that takes them is handed them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
