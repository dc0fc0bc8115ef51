"""PostgreSQL for the tests: a cluster of Debian's PostgreSQL 15 started in a temporary directory on a free port, for
the module that asks for the ``postgres`` fixture (its SQLAlchemy URL; the production profile's metadata database).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _as_postgres(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """PostgreSQL refuses to run as root: run its programs as the postgres user when we are root."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    from scripts.local_profile import _free_port

    assert (PG_BIN / "initdb").is_file(), "PostgreSQL 15 is not installed: apt-get install -y postgresql"
    base = Path(f"/tmp/pg-{os.getpid()}")  # short: the Unix socket path is limited to 107 bytes
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    data, port = base / "data", _free_port()
    r = _as_postgres([str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"])
    assert r.returncode == 0, r.stderr
    r = _as_postgres(
        [
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(base / "pg.log"),
            "-w",
            "-o",
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=200",
            "start",
        ]
    )
    assert r.returncode == 0, r.stderr + (base / "pg.log").read_text()
    try:
        r = _as_postgres([str(PG_BIN.parent / "bin" / "createdb"), "-h", "127.0.0.1", "-p", str(port), "airflow"])
        assert r.returncode == 0, r.stderr
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/airflow"
    finally:
        _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(base, ignore_errors=True)
