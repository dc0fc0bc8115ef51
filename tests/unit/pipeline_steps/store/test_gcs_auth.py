"""GCS authentication as Google does it, which the emulator alone cannot show (fake-gcs-server accepts anyone).

The ``upload`` step runs with a service-account key file (what the store connection's ``keyfile_dict`` becomes) and
the client library's own ``API_ENDPOINT_OVERRIDE`` pointing at a proxy in front of the emulator. The key's
``token_uri`` is a stand-in of Google's token endpoint that verifies the signed JWT with google-auth's own code, and
the proxy refuses, as GCS does, any request without a token that endpoint issued (tests/helpers/google_auth.py).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.google_auth import GoogleAuthStandIn
from tests.helpers.storage_servers import run_step


@pytest.fixture
def authed(gcs_server):
    auth = GoogleAuthStandIn()
    proxy = FaultProxy(gcs_server.url, authorize=auth.authorized)
    try:
        yield auth, proxy
    finally:
        proxy.close()
        auth.close()


def _env(proxy, key_file: dict) -> dict:
    return {
        "API_ENDPOINT_OVERRIDE": proxy.url,
        "GOOGLE_CLOUD_PROJECT": "test-project",
        "GCS_KEYFILE_JSON": json.dumps(key_file),
    }


def _tree(root):
    root.mkdir()
    for i in range(3):
        (root / f"part-{i}.bin").write_bytes(bytes([i]) * (50_000 + i))
    return root


def test_the_store_authenticates_with_the_key_and_a_request_without_a_token_is_refused(gcs_server, authed, tmp_path):
    auth, proxy = authed
    src = _tree(tmp_path / "src")
    r = run_step(["upload", "--src", str(src), "--dest", "gs://test-bucket/auth/v1"], _env(proxy, auth.key_file()))
    assert r.returncode == 0, r.stderr[-3000:]
    assert auth.issued and proxy.refused == 0  # the step got a token for its key and every request carried it
    assert json.loads(r.stdout.strip().splitlines()[-1])["uploaded"] == 3
    # the check is real: the same proxy refuses a request without a token, with GCS's 401
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{proxy.url}/storage/v1/b/test-bucket/o", timeout=10)
    assert err.value.code == 401 and proxy.refused == 1


def test_a_key_google_does_not_know_is_one_line_exit_2_and_nothing_is_written(gcs_server, authed, tmp_path):
    """A deleted or rotated key: Google's token endpoint answers invalid_grant. That is bad input (exit 2, the
    connection named, not retried), not a transient failure, and the private key never reaches the output."""
    auth, proxy = authed
    src = _tree(tmp_path / "src")
    wrong = auth.key_file(wrong=True)
    r = run_step(["upload", "--src", str(src), "--dest", "gs://test-bucket/auth/v2"], _env(proxy, wrong))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "invalid_grant" in lines[0] and "pipeline_store" in lines[0], lines[0]
    assert auth.refused >= 1 and not auth.issued
    assert wrong["private_key"].splitlines()[1] not in r.stderr + r.stdout
    listing = json.load(
        urllib.request.urlopen(f"{gcs_server.url}/storage/v1/b/test-bucket/o?prefix=auth/v2", timeout=10)
    )
    assert not listing.get("items"), listing


def test_a_key_file_and_endpoint_handed_to_the_client_authenticate_with_nothing_in_the_environment(
    gcs_server, authed, tmp_path, monkeypatch
):
    """What the worker does (``StoreHook(conn_id).open(uri)``): the connection's ``key_path`` and the endpoint are
    handed to the client, not set in ``os.environ``; the library, which looks for both in the environment itself,
    is given them."""
    import os

    from pipeline_steps.store import open_store

    auth, proxy = authed
    for k in ("GOOGLE_APPLICATION_CREDENTIALS", "GCS_KEYFILE_JSON", "API_ENDPOINT_OVERRIDE", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(k, raising=False)
    key_path = tmp_path / "key.json"
    key_path.write_text(json.dumps(auth.key_file()))
    handed = {
        "GOOGLE_APPLICATION_CREDENTIALS": str(key_path),
        "API_ENDPOINT_OVERRIDE": proxy.url,
        "GOOGLE_CLOUD_PROJECT": "test-project",
    }
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    store = open_store("gs://test-bucket/handed", credentials=handed)
    store.write_bytes("gs://test-bucket/handed/a.txt", b"with a token")
    assert store.read_bytes("gs://test-bucket/handed/a.txt") == b"with a token"
    assert auth.issued and proxy.refused == 0  # every request carried a token issued for the handed key
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == before
