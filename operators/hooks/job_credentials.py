"""Credentials handed to a local Ray job in a file only the worker's user can read: the Ray dashboard shows a job's
environment, so they cannot travel there. One directory per kind (``mlflow``, ``store``) and Airflow deployment
(its home), one file per job named by its submission name, which two deployments on one machine running the same DAG
run id share; the job loads the file by name and the train task removes it when the job is over."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def directory(kind: str) -> Path:
    """``$TMPDIR/verl-pipeline-<kind>-<uid>-<hash of AIRFLOW_HOME>``."""
    from airflow.configuration import get_airflow_home

    deployment = hashlib.sha256(str(Path(get_airflow_home()).resolve()).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"verl-pipeline-{kind}-{os.getuid()}-{deployment}"


def write(kind: str, name: str, values: dict) -> Path:
    """``values`` as JSON in ``directory(kind)/<name>.json`` (the directory 0700, the file 0600, replaced whole)."""
    d = directory(kind)
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".cred-")  # created 0600
    with os.fdopen(fd, "w") as f:
        json.dump(values, f)
    path = d / f"{name}.json"
    os.replace(tmp, path)
    return path


def remove(kind: str, name: str) -> None:
    """Remove the file :func:`write` wrote for ``name`` (if any): the job is over."""
    (directory(kind) / f"{name}.json").unlink(missing_ok=True)
