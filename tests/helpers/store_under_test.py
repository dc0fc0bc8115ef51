"""The store under test, on every backend: the parametrized ``backend`` fixture (``file://``, ``oss://`` on the OSS test
server, ``gs://`` on fake-gcs-server; registered for every test module by ``pytest_plugins`` in tests/conftest.py)."""

from __future__ import annotations

import time

import pytest

PART_KB = 128  # >= OSS's 100 KiB minimum part; a multiple of GCS's 256 KiB chunk rounding is applied there


class Backend:
    """One store under test: its root URI, the env the step needs, and direct access to stored bytes."""

    def __init__(self, name, root_uri, env, read, tamper, open_uploads=lambda prefix: []):
        self.name, self.root_uri, self.env = name, root_uri, env
        self.read, self.tamper, self.open_uploads = read, tamper, open_uploads


@pytest.fixture(params=["file", "oss", "gs"])
def backend(request, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    common = {
        "PIPELINE_CACHE_DIR": str(cache),
        "PIPELINE_STORE_PART_MB": str(PART_KB / 1024),
        "PIPELINE_STORE_PARALLEL": "2",
        "PIPELINE_STORE_CONN_ID": "test_store",
    }
    name = request.param
    if name == "file":
        root = tmp_path / "store"

        def read(key):
            return (root / key).read_bytes()

        def tamper(key, data):
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(data)

        b = Backend(name, f"file://{root}", common, read, tamper)
    elif name == "oss":
        srv = request.getfixturevalue("oss_server")
        prefix = f"t{time.monotonic_ns()}"
        client = srv.client()
        import alibabacloud_oss_v2 as oss

        def read(key):
            return client.get_object(oss.GetObjectRequest(bucket="test-bucket", key=f"{prefix}/{key}")).body.read()

        def tamper(key, data):
            client.put_object(oss.PutObjectRequest(bucket="test-bucket", key=f"{prefix}/{key}", body=data))

        b = Backend(
            name,
            f"oss://test-bucket/{prefix}",
            {**common, **srv.env()},
            read,
            tamper,
            lambda p: srv.open_uploads("test-bucket", f"{prefix}/{p}"),
        )
    else:
        srv = request.getfixturevalue("gcs_server")
        prefix = f"t{time.monotonic_ns()}"
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        bucket = storage.Client(project="test-project", credentials=AnonymousCredentials()).bucket("test-bucket")

        def read(key):
            return bucket.blob(f"{prefix}/{key}").download_as_bytes()

        def tamper(key, data):
            bucket.blob(f"{prefix}/{key}").upload_from_string(data)

        b = Backend(name, f"gs://test-bucket/{prefix}", {**common, **srv.env()}, read, tamper)
    for k, v in b.env.items():
        monkeypatch.setenv(k, v)
    return b
