"""Running a DAG through Airflow's CLI (``airflow dags test``) from the repository root, its output in a log file."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path


def dags_test(airflow: str | list[str], dag_id: str, conf: dict, env: dict, log: Path) -> int:
    """``airflow dags test``; ``airflow`` is the CLI's path, or an argv that runs Airflow's CLI (a wrapper)."""
    logical = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    cli = [airflow] if isinstance(airflow, str) else list(airflow)
    with open(log, "w") as f:
        return subprocess.run(
            [*cli, "dags", "test", dag_id, logical, "--conf", json.dumps(conf)],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=1200,
        ).returncode
