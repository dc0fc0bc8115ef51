"""stage-model streams a Hub model to the store file by file, with local disk bounded by the largest file.

The real Hub is unreachable here: pipeline_steps/local/hub_stand_in.py is the smallest faithful stand-in, a local
HTTP server serving the Hub routes the real huggingface_hub client calls (``/api/models/{repo}/revision/{rev}``,
``/{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``, ``ETag``/``X-Linked-Etag``, ``X-Linked-Size``), with
``HF_ENDPOINT`` pointed at it. The step runs in-process so the disk budget can be set (a monkeypatched free-space
figure smaller than the model, larger than its largest file) and the scratch usage measured at every file's peak.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_steps.data import hub_stream
from pipeline_steps.errors import TransientError, UserError
from pipeline_steps.local.hub_stand_in import COMMIT, HubStandIn
from pipeline_steps.steps import stage_model
from pipeline_steps.store import open_store

REPO = "org/streamy"
MB = 1 << 20
FILES = {
    "config.json": b'{"model_type": "qwen2"}',
    "tokenizer.json": b'{"v": 1}' * 1000,
    "model-00001-of-00003.safetensors": os.urandom(3 * MB),
    "model-00002-of-00003.safetensors": os.urandom(3 * MB),
    "model-00003-of-00003.safetensors": os.urandom(2 * MB),
    "sub/extra.bin": os.urandom(MB + 5),
}
LARGEST = 3 * MB
TOTAL = sum(len(v) for v in FILES.values())


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def hub(monkeypatch, tmp_path):
    def make(corrupt=()):
        h = HubStandIn(REPO, FILES, corrupt=set(corrupt))
        # huggingface_hub reads HF_ENDPOINT at import (this test runs in-process): set its two derived constants too
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", h.url)
        monkeypatch.setattr(
            "huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE", h.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        # and offline mode, which it also reads at import: a test before this one in the worker (an offline_hub
        # download run in-process) left it on, and every test here failed "offline mode is enabled" (issue 27)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        made.append(h)
        return h

    made: list[HubStandIn] = []
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    # a disk smaller than the model, bigger than its largest file plus the margin
    monkeypatch.setattr(hub_stream, "MARGIN", MB)
    budget = LARGEST + 2 * MB
    assert budget < TOTAL
    monkeypatch.setattr(hub_stream.shutil, "disk_usage", lambda p: type("U", (), {"free": budget})())
    peaks: list[int] = []
    real = hub_stream.file_checksums

    def measured(path, native, cache=None):  # called with the downloaded file on disk: its peak moment
        peaks.append(_du(scratch))
        return real(path, native, cache)

    monkeypatch.setattr(hub_stream, "file_checksums", measured)
    make.peaks, make.scratch = peaks, scratch
    yield make
    for h in made:
        h.close()


def _run(dest: str) -> dict:
    args = argparse.Namespace(model=REPO, hub_only=True, revision="main", dest=dest)
    return stage_model.run(args)


def _check_staged(store, uri: str) -> dict:
    manifest, problems = store.verify(uri)
    assert manifest is not None and problems == []
    assert {e["path"]: e["size"] for e in manifest["files"]} == {k: len(v) for k, v in FILES.items()}
    return manifest


@pytest.mark.parametrize("backend", ["file", "oss"])
def test_streams_a_model_larger_than_the_disk(hub, tmp_path, request, backend, monkeypatch):
    if backend == "oss":
        srv = request.getfixturevalue("oss_server")
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        dest = f"oss://test-bucket/{tmp_path.name}"
    else:
        dest = f"file://{tmp_path}/store"
    h = hub()
    out = _run(dest)
    uri = f"{dest}/models/{REPO}/{COMMIT}"
    assert (out["uri"], out["skipped"], out["uploaded"], out["bytes_uploaded"]) == (uri, False, len(FILES), TOTAL)
    store = open_store(dest)
    _check_staged(store, uri)
    assert store.read_bytes(f"{uri}/{hub_stream.PROGRESS}") is None
    assert store.read_bytes(f"{uri}/sub/extra.bin") == FILES["sub/extra.bin"]
    assert len(hub.peaks) == len(FILES) and max(hub.peaks) <= LARGEST + MB, hub.peaks
    assert _du(hub.scratch) == 0
    again = _run(dest)  # staged: skipped, nothing downloaded
    assert again["skipped"] is True and sorted(h.gets) == sorted(FILES)


def test_an_interrupted_run_resumes_and_equals_a_clean_run(hub, tmp_path, monkeypatch):
    h = hub()
    clean = f"file://{tmp_path}/clean"
    _run(clean)
    h.gets.clear()

    class Killed(BaseException):  # an interrupt in the 4th upload (the SIGKILL test below has no cleanup at all)
        pass

    calls = []
    from pipeline_steps.store.local_disk import LocalStore

    orig = LocalStore._put_file

    def dying(self, path, key, size):
        calls.append(key)
        if len(calls) == 4:
            raise Killed()
        return orig(self, path, key, size)

    monkeypatch.setattr(LocalStore, "_put_file", dying)
    dest = f"file://{tmp_path}/store"
    with pytest.raises(Killed):
        _run(dest)
    monkeypatch.setattr(LocalStore, "_put_file", orig)
    uri = f"{dest}/models/{REPO}/{COMMIT}"
    assert open_store(dest).read_manifest(uri) is None  # nothing committed by the killed run
    h.gets.clear()
    out = _run(dest)
    assert out["uploaded"] == len(FILES) - 3 and len(h.gets) == len(FILES) - 3  # the 3 stored files are not refetched
    store = open_store(dest)
    clean_uri = f"{clean}/models/{REPO}/{COMMIT}"
    assert store.read_bytes(f"{uri}/_manifest.json") == open_store(clean).read_bytes(f"{clean_uri}/_manifest.json")


def test_a_sigkilled_run_resumes_without_refetching_what_it_stored(hub, tmp_path):
    """The step in its own process, SIGKILLed while it downloads the 4th file (no cleanup runs, its claim stays)."""
    h = hub()
    order = sorted(FILES)
    h.stall = order[3]
    dest = f"file://{tmp_path}/store"
    env = {
        **os.environ,
        "HF_ENDPOINT": h.url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "TMPDIR": str(hub.scratch),
    }
    args = [sys.executable, "-m", "pipeline_steps", "stage-model", "--model", REPO, "--dest", dest, "--hub-only"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while order[3] not in h.gets and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert order[3] in h.gets, "the step never reached the 4th file"
    finally:
        proc.kill()
        proc.wait()
        h.release.set()
    uri = f"{dest}/models/{REPO}/{COMMIT}"
    store = open_store(dest)
    assert store.read_manifest(uri) is None and store.read_bytes(f"{uri}/_claim.json") is not None
    h.gets.clear()
    h.stall = None
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(h.gets) == order[3:]  # the 3 files stored before the kill are not fetched again
    _check_staged(store, uri)
    assert list(hub.scratch.iterdir()) == []  # the killed run's scratch dir was swept


def test_a_corrupted_download_fails_in_one_line_and_commits_nothing(hub, tmp_path):
    hub(corrupt={"model-00002-of-00003.safetensors"})
    dest = f"file://{tmp_path}/store"
    with pytest.raises(TransientError) as e:
        _run(dest)
    msg = str(e.value)
    assert "\n" not in msg and "model-00002-of-00003.safetensors" in msg and "does not match" in msg
    uri = f"{dest}/models/{REPO}/{COMMIT}"
    store = open_store(dest)
    assert store.read_manifest(uri) is None
    assert store.read_bytes(f"{uri}/_claim.json") is None  # withdrawn: a corrected source can be staged


def test_a_disk_smaller_than_the_largest_file_is_refused_in_one_line(hub, tmp_path, monkeypatch):
    hub()
    monkeypatch.setattr(hub_stream.shutil, "disk_usage", lambda p: type("U", (), {"free": MB})())
    with pytest.raises(UserError) as e:
        _run(f"file://{tmp_path}/store")
    assert "\n" not in str(e.value) and "largest file" in str(e.value)


def test_a_corrupted_staged_object_is_repaired_and_recommitted(hub, tmp_path):
    hub()
    dest = f"file://{tmp_path}/store"
    _run(dest)
    obj = tmp_path / "store" / "models" / REPO / COMMIT / "model-00001-of-00003.safetensors"
    obj.write_bytes(b"x" * obj.stat().st_size)
    out = _run(dest)
    assert out["skipped"] is False
    _check_staged(open_store(dest), f"{dest}/models/{REPO}/{COMMIT}")
    assert obj.read_bytes() == FILES["model-00001-of-00003.safetensors"]
