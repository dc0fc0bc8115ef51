"""Real storage servers for the store tests, started per test module and stopped at the end: the fixtures
``gcs_server``, ``oss_server`` and ``oss_seaweed_server`` over the servers of
:mod:`pipeline_steps.local.object_store_stand_ins` (fake-gcs-server; the OSS dialect of
:mod:`pipeline_steps.local.oss_stand_in` over moto's S3 backend or over SeaweedFS), shared with the benchmarks.

The fixtures are registered for every test module by ``pytest_plugins`` in tests/conftest.py: use them by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_steps.local import object_store_stand_ins
from pipeline_steps.local.object_store_stand_ins import (  # noqa: F401 - also used by importers of this module
    OSS_KEY_ID,
    OSS_REGION,
    OSS_SECRET,
    GcsServer,
    OssServer,
    SeaweedServer,
)
from tests.helpers.budget import scaled
from tests.helpers.ports import free_port  # noqa: F401 - also used by importers of this module

ROOT = Path(__file__).resolve().parents[2]
# the servers' time to stop on SIGTERM, on the suite's time scale (PIPELINE_TEST_BUDGET_SCALE)
object_store_stand_ins.STOP_TIMEOUT = scaled(15)


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    srv = GcsServer(tmp_path_factory.mktemp("gcs"))
    try:
        srv.create_bucket("test-bucket")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oss_server(tmp_path_factory):
    srv = OssServer(tmp_path_factory.mktemp("oss"), part_delay=0.05)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oss_seaweed_server(tmp_path_factory):
    """The same OSS-dialect layer with its objects in SeaweedFS, a real S3 server, instead of moto."""
    tmp = tmp_path_factory.mktemp("oss-seaweed")
    weed = SeaweedServer(tmp)
    try:
        srv = OssServer(tmp, part_delay=0.05, s3_url=weed.url)
        try:
            yield srv
        finally:
            srv.stop()
    finally:
        weed.stop()


def run_step(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m pipeline_steps ...`` in a clean subprocess with ``env`` on top of a minimal environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OSS_", "GOOGLE_", "STORAGE_EMULATOR", "GCS_"))}
    base.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pipeline_steps", *args],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
