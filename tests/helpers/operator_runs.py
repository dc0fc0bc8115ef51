"""Driving the training operator as Airflow does (tests/unit/operators/test_train_operator.py and the MLflow tests): the
run id, a small gsm8k-style parquet, and the module fixture ``ray_cluster``, a private local Ray cluster (registered for
every test module by ``pytest_plugins`` in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests.helpers.ports import free_port

RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def write_parquet(path: Path, n: int = 4) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f'What is {i} + {i + 1}? Answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A private local Ray cluster (own ports, own temp dir), stopped at the end."""
    from pipeline_steps.local import ray_cluster as local_ray

    temp = Path(f"/tmp/rb2-{uuid.uuid4().hex[:6]}")  # short: Ray puts Unix sockets below it
    old = {k: os.environ.get(k) for k in ("RAY_ADDRESS",)}
    os.environ.pop("RAY_ADDRESS", None)
    address = local_ray.ensure_cluster(
        port=free_port(), dashboard_port=free_port(), num_cpus=2, temp_dir=temp, timeout=240
    )
    yield address
    local_ray.shutdown_cluster(temp_dir=temp)
    shutil.rmtree(temp, ignore_errors=True)  # its logs and sockets: 2 MB a module otherwise left in /tmp
    for k, v in old.items():
        if v is not None:
            os.environ[k] = v
