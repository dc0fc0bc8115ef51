"""Store failures a user meets: one line naming the connection id and the problem, exit 2, no secret printed.

Servers: pipeline_steps/local/oss_stand_in.py (OSS dialect over moto; it verifies V4 signatures, so a wrong secret is
refused the way OSS refuses it) and fake-gcs-server (does not authenticate: GCS credential errors are checked with a
malformed key file, which fails before any request).
Also: key validation, and ``operators.hooks.store_connection.store_env`` reading real Airflow connections (from
AIRFLOW_CONN_* environment variables, Airflow's own secrets backend) and driving a real upload.
"""

from __future__ import annotations

import json
import os

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.store import parse_uri, validate_key
from tests.helpers.ports import free_port
from tests.helpers.storage_servers import OSS_SECRET, run_step

CONN = "my_store_conn"


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.txt").write_text("hello")
    return d


def _one_line_error(r, *must):
    assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for m in must:
        assert m in lines[0], lines[0]
    assert OSS_SECRET not in r.stderr + r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is False
    return lines[0]


def _env(extra, tmp_path):
    return {
        "PIPELINE_STORE_CONN_ID": CONN,
        "PIPELINE_CACHE_DIR": str(tmp_path / "cache"),
        "PIPELINE_STORE_RETRIES": "1",
        "PIPELINE_STORE_RETRY_DEADLINE": "1",
        "PIPELINE_STORE_CONNECT_TIMEOUT": "2",
        **extra,
    }


def test_oss_wrong_secret(oss_server, src, tmp_path):
    env = _env(oss_server.env(secret="wrong-" + OSS_SECRET), tmp_path)
    line = _one_line_error(
        run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/x/v1"], env), CONN, "SignatureDoesNotMatch"
    )
    assert "wrong-" not in line


def test_oss_unknown_key_id(oss_server, src, tmp_path):
    env = _env(oss_server.env(key_id="LTAInobody"), tmp_path)
    _one_line_error(
        run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/x/v1"], env), CONN, "InvalidAccessKeyId"
    )


def test_oss_missing_bucket(oss_server, src, tmp_path):
    env = _env(oss_server.env(), tmp_path)
    _one_line_error(
        run_step(["upload", "--src", str(src), "--dest", "oss://no-such-bucket/x/v1"], env),
        CONN,
        "no-such-bucket",
        "does not exist",
    )


def _one_line_transient(r, *must):
    """A passing fault: exit 1 (Airflow retries), one line, never the "bad input" exit 2."""
    assert r.returncode == 1, (r.returncode, r.stderr[-1500:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error (transient"), r.stderr
    for m in must:
        assert m in lines[0], lines[0]
    assert OSS_SECRET not in r.stderr + r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1])["transient"] is True
    return lines[0]


def test_oss_unreachable_endpoint(oss_server, src, tmp_path):
    env = _env({**oss_server.env(), "OSS_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, tmp_path)
    _one_line_transient(
        run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/x/v1"], env), CONN, "cannot reach"
    )


def test_oss_missing_credentials(src, tmp_path):
    env = _env({"OSS_REGION": "cn-test", "OSS_ENDPOINT": "http://127.0.0.1:9"}, tmp_path)
    _one_line_error(
        run_step(["upload", "--src", str(src), "--dest", "oss://test-bucket/x/v1"], env), CONN, "no OSS credentials"
    )


def test_gcs_missing_bucket(gcs_server, src, tmp_path):
    env = _env(gcs_server.env(), tmp_path)
    _one_line_error(
        run_step(["upload", "--src", str(src), "--dest", "gs://no-such-bucket/x/v1"], env), CONN, "does not exist"
    )


def test_gcs_unreachable_endpoint(src, tmp_path):
    env = _env({"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}", "GOOGLE_CLOUD_PROJECT": "p"}, tmp_path)
    _one_line_transient(
        run_step(["upload", "--src", str(src), "--dest", "gs://test-bucket/x/v1"], env, timeout=60),
        CONN,
        "cannot reach",
    )


def test_gcs_malformed_key(src, tmp_path):
    secret_looking = '{"type": "service_account", "private_key": "' + OSS_SECRET + '"}'
    env = _env({"GCS_KEYFILE_JSON": secret_looking, "GOOGLE_CLOUD_PROJECT": "p"}, tmp_path)
    _one_line_error(run_step(["upload", "--src", str(src), "--dest", "gs://test-bucket/x/v1"], env), CONN, "key file")


def test_missing_src_and_bad_uri(tmp_path):
    env = _env({}, tmp_path)
    _one_line_error(
        run_step(["upload", "--src", str(tmp_path / "nope"), "--dest", f"file://{tmp_path}/s/v1"], env),
        "not a directory",
    )
    _one_line_error(run_step(["upload", "--src", str(tmp_path), "--dest", "s3://b/x"], env), "not supported")
    _one_line_error(
        run_step(["upload", "--src", str(tmp_path), "--dest", "oss://Bad_Bucket/x"], env), "not a valid bucket"
    )


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "a/../b", "a//b", "./a", "a/.", "a\\b", "a\nb", "a\x00b", "tab\there", "a/"]
)
def test_bad_keys_rejected(key):
    with pytest.raises(UserError):
        validate_key(key)


@pytest.mark.parametrize(
    "key", ["a", "datasets/gsm8k/main/0a1b", "model-00001-of-00002.safetensors", ".gitattributes", "a b/c~d.json"]
)
def test_good_keys_accepted(key):
    assert validate_key(key) == key


def test_uri_parsing():
    assert parse_uri("oss://bkt/a/b/").key == "a/b"
    assert parse_uri("gs://bkt").key == ""
    assert str(parse_uri("file:///data/store").child("models/x")) == "file:///data/store/models/x"
    for bad in ("file://host/x", "oss://bkt/a?x=1", "oss://bkt/a/../b", "gs://a/x", "/plain/path"):
        with pytest.raises(UserError):
            parse_uri(bad)


# -- Airflow connections -> step environment ---------------------------------------------------------------


def test_store_env_oss_connection_drives_upload(oss_server, src, tmp_path, monkeypatch):
    from operators.hooks.store_connection import store_env

    conn = {
        "conn_type": "alibaba_cloud",
        "login": "LTAItestkeyid0000",
        "password": OSS_SECRET,
        "extra": {"region": "cn-test", "endpoint": oss_server.endpoint},
    }
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps(conn))
    env = store_env(CONN, "oss://test-bucket/conn/v1")
    assert env == {
        "PIPELINE_STORE_CONN_ID": CONN,
        "OSS_ACCESS_KEY_ID": "LTAItestkeyid0000",
        "OSS_ACCESS_KEY_SECRET": OSS_SECRET,
        "OSS_REGION": "cn-test",
        "OSS_ENDPOINT": oss_server.endpoint,
    }
    r = run_step(
        ["upload", "--src", str(src), "--dest", "oss://test-bucket/conn/v1"],
        {**env, "PIPELINE_CACHE_DIR": str(tmp_path / "c")},
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["uploaded"] == 1
    assert OSS_SECRET not in r.stdout + r.stderr


def test_store_env_gcs_connection_shapes(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from operators.hooks.store_connection import store_env

    key = {"type": "service_account", "project_id": "p1", "private_key": "k", "client_email": "a@b"}
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCS1",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": json.dumps(key), "project": "p1"}}),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCS2",
        json.dumps(
            {"conn_type": "google_cloud_platform", "extra": {"extra__google_cloud_platform__key_path": "/k.json"}}
        ),
    )
    env = store_env("gcs1", "gs://b/x")
    assert json.loads(env["GCS_KEYFILE_JSON"]) == key and env["GOOGLE_CLOUD_PROJECT"] == "p1"
    assert store_env("gcs2", "gs://b/x") == {
        "PIPELINE_STORE_CONN_ID": "gcs2",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
    }
    assert store_env("gcs1", "file:///tmp/x") == {"PIPELINE_STORE_CONN_ID": "gcs1"}
    assert store_env("undefined_conn", "gs://b/x") == {"PIPELINE_STORE_CONN_ID": "undefined_conn"}
    with pytest.raises(AirflowFailException, match="gcs1.*OSS"):
        store_env("gcs1", "oss://b/x")
    monkeypatch.setenv(
        "AIRFLOW_CONN_OSSNOREGION", json.dumps({"conn_type": "alibaba_cloud", "login": "id", "password": "sec-ret-123"})
    )
    with pytest.raises(AirflowFailException, match="region") as exc:
        store_env("ossnoregion", "oss://b/x")
    assert "sec-ret-123" not in str(exc.value)


def test_progress_of_a_cloud_run_is_read_with_the_store_connection(oss_server, monkeypatch):
    """The job triggers read training progress from ``<run>/metrics.jsonl`` in the store: on oss:// the triggerer
    has no OSS variables, only the store connection (Helm: AIRFLOW_CONN_PIPELINE_STORE)."""
    import asyncio
    import logging

    from operators.progress import ProgressTracker

    for k in ("OSS_ACCESS_KEY_ID", "OSS_ACCESS_KEY_SECRET", "OSS_REGION", "OSS_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    import alibabacloud_oss_v2 as oss

    oss_server.client().put_object(
        oss.PutObjectRequest(
            bucket="test-bucket",
            key="runs/r1/metrics.jsonl",
            body=b'{"step": 1, "data": {"critic/score/mean": 0.5}}\n{"step": 2, "data": {"critic/score/mean": 0.75}}\n',
        )
    )
    uri = "oss://test-bucket/runs/r1/metrics.jsonl"
    log = logging.getLogger("test-progress")
    without = ProgressTracker(uri)  # no connection: nothing read, one warning, the wait goes on
    asyncio.run(without.poll(log))
    assert without.last_step == 0 and without.warned
    conn = {
        "conn_type": "alibaba_cloud",
        "login": "LTAItestkeyid0000",
        "password": OSS_SECRET,
        "extra": {"region": "cn-test", "endpoint": oss_server.endpoint, "path_style": "true"},
    }
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps(conn))
    tracker = ProgressTracker(uri, store_conn_id=CONN)
    asyncio.run(tracker.poll(log))
    assert tracker.last_step == 2 and tracker.last_row["data"]["critic/score/mean"] == 0.75
    assert "OSS_ACCESS_KEY_SECRET" not in os.environ  # the credentials were set only while reading
