"""Upload/skip/resume/repair/verify for every store backend, against real servers.

- ``file://``: a temporary directory.
- ``gs://``: fake-gcs-server (real GCS JSON API emulator, subprocess). It does not check credentials.
- ``oss://``: pipeline_steps/local/oss_stand_in.py, an OSS-dialect layer over moto's S3 backend (see its docstring for
  what it does and does not cover); the real alibabacloud-oss-v2 client, its upload/download managers and CRC64 checks
  run. Part uploads are slowed by 50 ms on that server so a test can kill an upload midway.
- the last test runs that OSS layer with its objects in SeaweedFS, a real S3 server (the upload benchmark's
  throughput reference), so the layer the benchmark measures is tested, against S3 semantics that are not moto's
  (SeaweedFS enforces S3's 5 MiB minimum part, so that test uses 5 MiB parts).

The step runs as ``python -m pipeline_steps upload`` in a subprocess (as in production); the kill test SIGKILLs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_steps.errors import TransientError, UserError
from pipeline_steps.store import open_store
from tests.helpers.budget import scaled
from tests.helpers.storage_servers import ROOT, run_step
from tests.helpers.store_under_test import Backend


def _write_tree(root: Path, seed: int = 0, n_small: int = 6, big_kb: int = 1100) -> Path:
    import random

    rnd = random.Random(seed)
    (root / "data").mkdir(parents=True)
    for i in range(n_small):
        (root / "data" / f"part-{i:03d}.jsonl").write_bytes(rnd.randbytes(2000 + i * 100))
    (root / "README.md").write_text("dataset card\n")
    (root / "weights.bin").write_bytes(rnd.randbytes(big_kb * 1024))  # several parts: exercises multipart/resumable
    return root


def _upload(backend: Backend, src: Path, dest: str) -> dict:
    r = run_step(["upload", "--src", str(src), "--dest", dest], backend.env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _files(src: Path) -> dict[str, bytes]:
    return {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}


def test_upload_skip_download_roundtrip(backend, tmp_path):
    from pipeline_steps.store import open_store

    src = _write_tree(tmp_path / "src")
    dest = f"{backend.root_uri}/datasets/demo/v1/abc123"
    first = _upload(backend, src, dest)
    total = sum(len(b) for b in _files(src).values())
    assert (first["uploaded"], first["skipped"], first["files"]) == (8, 0, 8)
    assert first["bytes_uploaded"] > total  # the files plus the manifest

    second = _upload(backend, src, dest)
    assert (second["uploaded"], second["skipped"], second["bytes_uploaded"]) == (0, 8, 0)
    assert second["manifest_sha256"] == first["manifest_sha256"]

    store = open_store(backend.root_uri)
    manifest = store.read_manifest(dest)
    assert {e["path"]: e["size"] for e in manifest["files"]} == {k: len(v) for k, v in _files(src).items()}
    assert store.list_versions(f"{backend.root_uri}/datasets/demo/v1") == [dest]
    for rel, data in _files(src).items():
        assert backend.read(f"datasets/demo/v1/abc123/{rel}") == data

    out = tmp_path / "out"
    got = store.download_dir(dest, out)
    assert got["files"] == 8 and _files(out) == _files(src)

    store.write_bytes(f"{backend.root_uri}/models/exported/e/latest.json", b'{"v": 1}')
    assert store.read_bytes(f"{backend.root_uri}/models/exported/e/latest.json") == b'{"v": 1}'
    assert store.read_bytes(f"{backend.root_uri}/models/exported/e/none.json") is None

    assert store.delete_prefix(dest) == 10  # the 8 files, the manifest and the upload claim (store/claim.py)
    assert store.read_manifest(dest) is None and store.list_versions(f"{backend.root_uri}/datasets/demo/v1") == []


def test_incomplete_version_is_never_read(backend, tmp_path):
    from pipeline_steps.store import open_store

    src = _write_tree(tmp_path / "src", n_small=1, big_kb=10)
    store = open_store(backend.root_uri)
    # objects without a manifest: what an interrupted first upload leaves behind
    for rel, data in _files(src).items():
        backend.tamper(f"half/v1/{rel}", data)
    assert store.read_manifest(f"{backend.root_uri}/half/v1") is None
    assert store.list_versions(f"{backend.root_uri}/half") == []
    with pytest.raises(UserError, match="incomplete"):
        store.download_dir(f"{backend.root_uri}/half/v1", tmp_path / "out")
    # the re-run finds them already right: zero file bytes sent, only the manifest
    summary = _upload(backend, src, f"{backend.root_uri}/half/v1")
    assert (summary["uploaded"], summary["skipped"]) == (0, len(_files(src)))
    assert store.list_versions(f"{backend.root_uri}/half") == [f"{backend.root_uri}/half/v1"]


def test_corrupted_object_is_repaired_and_caught_on_download(backend, tmp_path):
    from pipeline_steps.store import open_store

    src = _write_tree(tmp_path / "src")
    dest = f"{backend.root_uri}/datasets/demo/v2"
    _upload(backend, src, dest)
    good = (src / "data" / "part-002.jsonl").read_bytes()
    bad = bytes([good[0] ^ 0xFF]) + good[1:]  # same size, one byte flipped
    backend.tamper("datasets/demo/v2/data/part-002.jsonl", bad)

    store = open_store(backend.root_uri)
    with pytest.raises(TransientError, match="does not match the manifest"):  # retried: may be the transfer
        store.download_dir(dest, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing that looks complete is left behind
    _, problems = store.verify(dest)
    assert problems == ["data/part-002.jsonl: size/checksum differs from the manifest"]

    repaired = _upload(backend, src, dest)
    assert (repaired["uploaded"], repaired["skipped"]) == (1, 7)
    assert backend.read("datasets/demo/v2/data/part-002.jsonl") == good
    assert store.verify(dest)[1] == []


def test_killed_upload_rerun_matches_clean_run(backend, tmp_path):
    from pipeline_steps.store import open_store

    src = _write_tree(tmp_path / "src", n_small=40, big_kb=4096)
    killed, clean = f"{backend.root_uri}/kill/v1", f"{backend.root_uri}/clean/v1"
    env = {**os.environ, **backend.env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline_steps", "upload", "--src", str(src), "--dest", killed],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    store = open_store(backend.root_uri)
    # The upload runs in slices of 50 ms (SIGCONT ... SIGSTOP) and is looked at only while stopped, so a loaded
    # machine cannot let it finish unseen between a look and the kill (a free-running upload did, under load).
    deadline, after_open = time.monotonic() + scaled(120), None
    try:
        while time.monotonic() < deadline:  # kill once some objects (OSS: some parts) are stored
            time.sleep(0.05)
            proc.send_signal(signal.SIGSTOP)
            if proc.poll() is not None:
                pytest.fail("upload finished within one 50 ms slice; enlarge the test data")
            if backend.name == "oss":
                # an open multipart upload, then 8 more slices so a few parts land (50 ms each on the test server)
                if after_open is not None:
                    after_open += 1
                elif backend.open_uploads("kill/v1/"):
                    after_open = 0
                if after_open == 8:
                    break
            elif len(store._list(store._join(store._parse(killed).key, ""), None)[0]) >= 3:
                break
            proc.send_signal(signal.SIGCONT)
        else:
            pytest.fail(f"the upload stored nothing to interrupt within {scaled(120):.0f} s")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert store.read_manifest(killed) is None  # interrupted: not a version yet

    files = _files(src)
    total = sum(len(b) for b in files.values())
    stored_whole = 0  # bytes of objects the killed run completed (OSS: its parts are in an open multipart upload)
    for rel, data in files.items():
        try:
            stored_whole += len(data) if backend.read(f"kill/v1/{rel}") == data else 0
        except Exception:
            pass
    resumed = _upload(backend, src, killed)
    assert resumed["skipped"] >= 1 and resumed["uploaded"] + resumed["skipped"] == 42
    # resumed, not restarted: what the killed run stored is not sent again (an upload from zero sends everything;
    # the allowance is the manifest, written anew)
    if backend.name == "oss":
        assert resumed["bytes_uploaded"] < total, (resumed["bytes_uploaded"], total)
    else:
        assert stored_whole > 0
        assert resumed["bytes_uploaded"] <= total - stored_whole + 64 * 1024, (resumed, total, stored_whole)
    _upload(backend, src, clean)
    assert store.read_manifest(killed) == store.read_manifest(clean)
    for rel in _files(src):
        assert backend.read(f"kill/v1/{rel}") == backend.read(f"clean/v1/{rel}") == (src / rel).read_bytes()
    assert backend.open_uploads("") == []  # no multipart upload left open


def test_upload_rejects_bad_names(backend, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("x")
    (src / "bad\x07name.txt").write_text("y")
    r = run_step(["upload", "--src", str(src), "--dest", f"{backend.root_uri}/v1"], backend.env)
    assert r.returncode == 2 and "control characters" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    for dest in (f"{backend.root_uri}/a/../b", f"{backend.root_uri}/a//b"):
        r = run_step(["upload", "--src", str(tmp_path), "--dest", dest], backend.env)
        assert r.returncode == 2 and "segment" in r.stderr, r.stderr


def test_oss_layer_on_seaweedfs(oss_seaweed_server, tmp_path, monkeypatch):
    import alibabacloud_oss_v2 as oss

    from pipeline_steps.store import open_store

    srv = oss_seaweed_server
    env = {
        **srv.env(),
        "PIPELINE_CACHE_DIR": str(tmp_path / "cache"),
        "PIPELINE_STORE_PART_MB": "5",
        "PIPELINE_STORE_PARALLEL": "2",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    backend = Backend("oss", "oss://test-bucket/sw", env, None, None)
    src = _write_tree(tmp_path / "src", n_small=2, big_kb=12 * 1024)  # 3 parts of 5 MiB: a real multipart upload
    dest = "oss://test-bucket/sw/datasets/demo/v1"
    first = _upload(backend, src, dest)
    assert (first["uploaded"], first["skipped"]) == (4, 0)
    assert _upload(backend, src, dest)["bytes_uploaded"] == 0

    client = srv.client()
    stored = client.head_object(oss.HeadObjectRequest(bucket="test-bucket", key="sw/datasets/demo/v1/weights.bin"))
    manifest = open_store("oss://test-bucket/sw").read_manifest(dest)
    assert {e["path"]: e["crc64ecma"] for e in manifest["files"]}["weights.bin"] == stored.hash_crc64
    client.put_object(
        oss.PutObjectRequest(bucket="test-bucket", key="sw/datasets/demo/v1/README.md", body=b"tampered\n")
    )
    assert _upload(backend, src, dest)["uploaded"] == 1
    got = open_store("oss://test-bucket/sw").download_dir(dest, tmp_path / "out")
    assert got["files"] == 4 and _files(tmp_path / "out") == _files(src)
    assert srv.open_uploads("test-bucket") == []


def test_oss_virtual_hosted_addressing_as_on_alibaba_cloud(oss_server, tmp_path, monkeypatch):
    """On an endpoint name (not an IP address or localhost) the store addresses OSS virtual-hosted, as Alibaba Cloud
    requires (``<bucket>.oss-<region>.aliyuncs.com/<key>``): the upload step, a re-run that skips, a download, and
    a wrong secret refused in one line. The stand-in reads the bucket from the host and logs each request's form:
    every request for this test's prefix came virtual-hosted, none path-style."""
    from pipeline_steps.store import open_store
    from tests.helpers.storage_servers import OSS_KEY_ID

    env = {**oss_server.env(virtual_hosted=True), "PIPELINE_CACHE_DIR": str(tmp_path / "cache")}
    backend = Backend("oss", "oss://test-bucket/vhost", env, None, None)
    src = _write_tree(tmp_path / "src", n_small=2, big_kb=64)
    dest = "oss://test-bucket/vhost/datasets/demo/v1"
    first = _upload(backend, src, dest)
    assert (first["uploaded"], first["skipped"]) == (4, 0), first
    assert _upload(backend, src, dest)["bytes_uploaded"] == 0
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert open_store("oss://test-bucket/vhost").download_dir(dest, tmp_path / "out")["files"] == 4
    assert _files(tmp_path / "out") == _files(src)
    bad = run_step(
        ["upload", "--src", str(src), "--dest", dest + "x"],
        {**env, **oss_server.env(OSS_KEY_ID, "wrong", virtual_hosted=True)},
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr[-2000:]
    seen = [line for line in Path(oss_server.log.name).read_text().splitlines() if "/vhost/" in line]
    assert seen and all(line.startswith("virtual-hosted ") for line in seen), seen[:5]
    assert all(" test-bucket.oss-cn-test.aliyuncs.com/vhost/" in line for line in seen), seen[:5]


def test_source_changed_during_upload_is_refused(backend, tmp_path):
    from pipeline_steps.store import open_store

    src = _write_tree(tmp_path / "src", n_small=1, big_kb=10)
    dest = f"{backend.root_uri}/race/v1"
    store = open_store(backend.root_uri)
    put = store._put_file

    def racing_put(path, key, size):  # another writer edits the file while it is being sent
        if path.name == "README.md":
            path.write_text("edited while uploading\n")
        return put(path, key, size)

    store._put_file = racing_put
    with pytest.raises(UserError, match="README.md changed while it was uploaded"):
        store.upload_dir(src, dest)
    assert store.read_manifest(dest) is None  # nothing that looks complete
    store._put_file = put
    assert store.upload_dir(src, dest)["uploaded"] >= 1  # once the source is stable, the re-run commits it
    assert store.verify(dest)[1] == []


def test_oss_test_server_crc64_is_the_sdks():
    """The test layer answers with fastcrc's CRC-64/XZ; the SDK checks against its own crcmod-based CRC64-ECMA."""
    import random

    from alibabacloud_oss_v2.crc import Crc64

    from pipeline_steps.local.oss_stand_in import _combine, crc64

    rnd = random.Random(7)
    for data in (b"", b"123456789", rnd.randbytes(1), rnd.randbytes(100_003)):
        sdk = Crc64(0)
        sdk.update(data)
        assert crc64(data) == sdk.sum64()
    a, b = rnd.randbytes(5000), rnd.randbytes(777)
    assert crc64(b, crc64(a)) == crc64(a + b) == _combine(crc64(a), crc64(b), len(b))


def test_transfer_corruption_is_caught_end_to_end(backend, tmp_path):
    """The server's checksum of the stored object must equal the file's; a mismatch fails (retryable), no manifest."""
    from pipeline_steps.store import open_store

    src = _write_tree(tmp_path / "src", n_small=1, big_kb=10)
    dest = f"{backend.root_uri}/corrupt/v1"
    store = open_store(backend.root_uri)
    put = store._put_file
    store._put_file = lambda path, key, size: (put(path, key, size), "not-the-checksum")[
        1
    ]  # as if bytes changed in flight
    with pytest.raises(TransientError, match="corrupted in transfer"):
        store.upload_dir(src, dest)
    assert store.read_manifest(dest) is None
    store._put_file = put
    assert store.upload_dir(src, dest)["files"] == 3 and store.verify(dest)[1] == []


# -- concurrent promotions: the store's conditional create ----------------------------------------------------
def _race(backend, monkeypatch, scores: list[float], tmp_path) -> tuple[list, str]:
    """Export candidates with ``scores`` promote at the same moment (threads released by one barrier)."""
    import threading

    from pipeline_steps.evaluation import promotion
    from tests.helpers.eval_results import BASE, results

    for k, v in backend.env.items():
        monkeypatch.setenv(k, v)
    exp_uri = f"{backend.root_uri}/models/exported/race"
    for i in range(len(scores)):  # a promotion points only at a version that is there
        (tmp_path / f"v{i}").mkdir()
        (tmp_path / f"v{i}" / "model.safetensors").write_bytes(b"w%d" % i)
        open_store(backend.root_uri).upload_dir(tmp_path / f"v{i}", f"{exp_uri}/v{i}")
    barrier = threading.Barrier(len(scores))
    outcomes: list = [None] * len(scores)

    def export(i: int, score: float) -> None:
        store = open_store(backend.root_uri)  # each exporter its own client, as separate tasks have
        barrier.wait()
        outcomes[i] = promotion.promote(
            store,
            exp_uri,
            f"v{i}",
            f"{exp_uri}/v{i}",
            results(score),
            f"2026-01-01T00:00:0{i}+00:00",
            lambda current: promotion.decide(results(score), BASE, current, 0.0),
        )

    threads = [threading.Thread(target=export, args=(i, s)) for i, s in enumerate(scores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outcomes, exp_uri


def test_two_exports_promoting_at_once_leave_one_consistent_pointer(backend, monkeypatch, tmp_path):
    from pipeline_steps.evaluation import promotion

    outcomes, exp_uri = _race(backend, monkeypatch, [0.6, 0.5], tmp_path)
    store = open_store(backend.root_uri)
    seq, latest = promotion.newest(store, exp_uri)
    assert latest["version"] == "v0" and latest["avg@k"] == 0.6  # the better model, whoever won the first race
    records = store.list_names(f"{exp_uri}/latest")
    assert records == [f"{n:08d}.json" for n in range(1, seq + 1)]  # contiguous, none lost or overwritten
    for name in records:
        assert json.loads(store.read_bytes(f"{exp_uri}/latest/{name}"))["seq"] == int(name[:8])  # none torn
    assert json.loads(store.read_bytes(f"{exp_uri}/latest.json")) == latest  # the mirror agrees
    (d0, p0), (d1, p1) = outcomes
    assert d0.promote and p0 is not None
    assert not d1.promote or seq == 2  # v1 won the first race and v0 then beat it, or v1 lost and re-decided
    if not d1.promote:
        assert "latest v0" in d1.reason  # the loser re-read the new latest and decided against it


def test_many_exports_at_once_end_with_the_best(backend, monkeypatch, tmp_path):
    from pipeline_steps.evaluation import promotion

    scores = [0.3, 0.7, 0.5, 0.6]
    outcomes, exp_uri = _race(backend, monkeypatch, scores, tmp_path)
    store = open_store(backend.root_uri)
    seq, latest = promotion.newest(store, exp_uri)
    assert latest["version"] == "v1" and latest["avg@k"] == 0.7
    avgs = [json.loads(store.read_bytes(f"{exp_uri}/latest/{n:08d}.json"))["avg@k"] for n in range(1, seq + 1)]
    assert avgs == sorted(avgs) and len(set(avgs)) == len(avgs)  # every promotion beat the one before it
