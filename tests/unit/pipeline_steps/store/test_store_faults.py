"""Store faults a passing outage causes, injected by a fault proxy (tests/helpers/fault_proxy.py) on the loopback in
front of the real OSS and GCS test servers, and by small tmpfs mounts: each ends the step with exit 1 and one line
(Airflow retries it), never exit 2 "bad input"; a checksum cache on a full disk only costs time.

The SDKs' own retries are cut to one attempt and a one-second deadline (PIPELINE_STORE_RETRIES /
PIPELINE_STORE_RETRY_DEADLINE, as tests/unit/pipeline_steps/store/test_store_errors.py does) so an outage "longer than
the SDK's retries" is one that lasts the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from pipeline_steps.errors import TransientError
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.storage_servers import OSS_SECRET, run_step

CONN = "faulty_store"


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    for i in range(3):
        (d / f"part-{i}.txt").write_text(f"row {i}\n" * 2000)
    return d


def _env(extra, tmp_path):
    return {
        "PIPELINE_STORE_CONN_ID": CONN,
        "PIPELINE_CACHE_DIR": str(tmp_path / "cache"),
        "PIPELINE_STORE_RETRIES": "1",
        "PIPELINE_STORE_RETRY_DEADLINE": "1",
        "PIPELINE_STORE_CONNECT_TIMEOUT": "2",
        **extra,
    }


def _transient(r, *must):
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error (transient"), r.stderr[-2000:]
    for m in must:
        assert m in lines[0], lines[0]
    assert OSS_SECRET not in r.stderr + r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1])["transient"] is True
    return lines[0]


@pytest.fixture
def oss_proxy(oss_server):  # noqa: F811
    proxy = FaultProxy(oss_server.endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def gcs_proxy(gcs_server):  # noqa: F811
    proxy = FaultProxy(gcs_server.url)
    yield proxy
    proxy.close()


def _oss_env(oss_server, proxy, tmp_path):  # noqa: F811
    return _env({**oss_server.env(), "OSS_ENDPOINT": proxy.url}, tmp_path)


def _gcs_env(gcs_server, proxy, tmp_path):  # noqa: F811
    return _env({**gcs_server.env(), "STORAGE_EMULATOR_HOST": proxy.url}, tmp_path)


@pytest.mark.parametrize("status", [503, 500, 429])
def test_oss_5xx_and_throttling_are_transient(status, oss_server, oss_proxy, src, tmp_path):  # noqa: F811
    oss_proxy.set("status", status)
    r = run_step(
        ["upload", "--src", str(src), "--dest", "oss://test-bucket/faults/v1"],
        _oss_env(oss_server, oss_proxy, tmp_path),
    )
    _transient(r, CONN, f"HTTP {status}")
    assert oss_proxy.hits >= 1


@pytest.mark.parametrize("status", [503, 429])
def test_gcs_5xx_and_throttling_are_transient(status, gcs_server, gcs_proxy, src, tmp_path):  # noqa: F811
    gcs_proxy.set("status", status)
    r = run_step(
        ["upload", "--src", str(src), "--dest", "gs://test-bucket/faults/v1"],
        _gcs_env(gcs_server, gcs_proxy, tmp_path),
        timeout=120,
    )
    _transient(r, CONN)
    assert gcs_proxy.hits >= 1


def test_a_passing_outage_is_survived_by_the_retry(oss_server, oss_proxy, src, tmp_path):  # noqa: F811
    """What Airflow's retry then does: the same command after the outage succeeds and commits the version."""
    env = _oss_env(oss_server, oss_proxy, tmp_path)
    oss_proxy.set("status", 503)
    _transient(run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/outage/v1"], env))
    oss_proxy.set(None)
    r = run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/outage/v1"], env)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("backend", ["oss", "gcs"])
def test_corrupted_transfer_on_download_is_transient(backend, request, src, tmp_path, monkeypatch):
    """A body altered on the way (one byte flipped by the proxy): the SDK's CRC or our sha256 check refuses it as a
    transient fault (a retry downloads it again), never as bad input."""
    server = request.getfixturevalue(f"{backend}_server")
    proxy = request.getfixturevalue(f"{backend}_proxy")
    env = (_oss_env if backend == "oss" else _gcs_env)(server, proxy, tmp_path)
    scheme = "oss" if backend == "oss" else "gs"
    dest = f"{scheme}://test-bucket/corrupt/v1"
    assert run_step(["upload", "--src", str(src), "--dest", dest], env).returncode == 0
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from pipeline_steps.store import open_store

    proxy.set("corrupt")
    with pytest.raises(TransientError, match="mismatch|does not match"):
        open_store(dest).download_dir(dest, tmp_path / "out")
    assert proxy.hits >= 1 and not (tmp_path / "out").exists()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs: a disk that fills up."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:120]}); the disk-full cases need one")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path) -> None:
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.needs_root(reason="mounts a tmpfs")
@pytest.mark.parametrize("backend", ["file", "gcs", "oss"])
def test_disk_full_on_download_is_transient(backend, request, tmp_path, tiny_tmpfs):
    """Before: OSS re-requested the same range forever (the SDK's downloader swallowed ENOSPC); GCS and file://
    failed as "unexpected"."""
    if backend == "gcs":
        server, proxy = request.getfixturevalue("gcs_server"), request.getfixturevalue("gcs_proxy")
        env, root = _gcs_env(server, proxy, tmp_path), "gs://test-bucket"
    elif backend == "oss":
        server, proxy = request.getfixturevalue("oss_server"), request.getfixturevalue("oss_proxy")
        env, root = _oss_env(server, proxy, tmp_path), "oss://test-bucket"
    else:
        env, root = _env({}, tmp_path), f"file://{tmp_path / 'store'}"
    src = tmp_path / "big"
    src.mkdir()
    (src / "train.jsonl").write_bytes(os.urandom(1 << 20))  # 1 MiB into a 256 KiB disk
    assert run_step(["upload", "--src", str(src), "--dest", f"{root}/big/v1"], env).returncode == 0
    started = time.monotonic()
    r = run_step(
        ["download", "--train-file", f"{root}/big/v1/train.jsonl", "--dest", str(tiny_tmpfs / "snap")], env, timeout=60
    )
    _transient(r, "disk full")
    assert time.monotonic() - started < 30


def test_oss_download_whose_body_never_comes_fails_in_bounded_time(oss_server, oss_proxy, tmp_path):  # noqa: F811
    """The server sends headers and drops the connection before the body, every time. Before: the SDK's downloader
    re-requested the same range hundreds of times a second and never returned."""
    env = _oss_env(oss_server, oss_proxy, tmp_path)
    src = tmp_path / "data"
    src.mkdir()
    (src / "train.jsonl").write_bytes(os.urandom(3 << 20))
    assert run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/drop/v1"], env).returncode == 0
    oss_proxy.set("drop_after_headers")
    started = time.monotonic()
    r = run_step(
        ["download", "--train-file", "oss://test-bucket/drop/v1/train.jsonl", "--dest", str(tmp_path / "snap")],
        {**env, "PIPELINE_STORE_RETRIES": "3"},
        timeout=90,
    )
    line = _transient(r, "oss://test-bucket/drop/v1/train.jsonl", "no progress")
    assert time.monotonic() - started < 60, line
    assert 1 <= oss_proxy.hits <= 20  # a few attempts, not a busy loop
    assert not list((tmp_path / "snap").rglob("train.jsonl"))


def test_oss_download_resumes_after_drops_that_pass(oss_server, oss_proxy, tmp_path):  # noqa: F811
    """Drops for a moment, then the body comes: the download completes and the bytes are the object's."""
    env = _oss_env(oss_server, oss_proxy, tmp_path)
    src = tmp_path / "data"
    src.mkdir()
    payload = os.urandom(3 << 20)
    (src / "train.jsonl").write_bytes(payload)
    assert run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/blip/v1"], env).returncode == 0
    oss_proxy.set("drop_after_headers", seconds=0.5)
    r = run_step(
        ["download", "--train-file", "oss://test-bucket/blip/v1/train.jsonl", "--dest", str(tmp_path / "snap")],
        {**env, "PIPELINE_STORE_RETRIES": "5"},
        timeout=90,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert oss_proxy.hits >= 1
    (got,) = (tmp_path / "snap").rglob("train.jsonl")
    assert got.read_bytes() == payload


@pytest.mark.needs_root(reason="mounts a tmpfs")
def test_checksum_cache_on_a_full_disk_degrades_to_no_cache(tmp_path, tiny_tmpfs):
    """PIPELINE_CACHE_DIR on a disk that fills up: the upload still commits, with one warning about the cache."""
    src = tmp_path / "many"
    src.mkdir()
    for i in range(3000):  # thousands of cache rows: the cache database must grow past the free space
        (src / f"f{i:05d}.txt").write_text(f"{i}\n")
    env = {"PIPELINE_CACHE_DIR": str(tiny_tmpfs / "cache")}
    first = tmp_path / "first"
    first.mkdir()
    (first / "a.txt").write_text("a")
    r = run_step(["upload", "--src", str(first), "--dest", f"file://{tmp_path / 'store' / 'v0'}"], env)
    assert r.returncode == 0 and (tiny_tmpfs / "cache" / "checksums.sqlite").is_file(), r.stderr[-2000:]
    _fill(tiny_tmpfs)  # then the disk fills up (the cache was written before)
    r = run_step(["upload", "--src", str(src), "--dest", f"file://{tmp_path / 'store' / 'v1'}"], env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [line for line in r.stderr.splitlines() if "checksum cache" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["files"] == 3000


@pytest.mark.parametrize("backend", ["oss", "file"])
def test_unusable_cache_dir_degrades_to_no_cache(backend, request, src, tmp_path):
    """PIPELINE_CACHE_DIR names a file (cannot be a directory, even for root): uploads still commit, one warning."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    if backend == "oss":
        server, proxy = request.getfixturevalue("oss_server"), request.getfixturevalue("oss_proxy")
        env, dest = _oss_env(server, proxy, tmp_path), "oss://test-bucket/nocache/v1"
    else:
        env, dest = _env({}, tmp_path), f"file://{tmp_path / 'store' / 'v1'}"
    env["PIPELINE_CACHE_DIR"] = str(blocker / "cache")
    r = run_step(["upload", "--src", str(src), "--dest", dest], env)
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [line for line in r.stderr.splitlines() if "checksum cache" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], r.stderr[-2000:]
