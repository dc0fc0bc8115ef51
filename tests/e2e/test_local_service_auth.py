"""The local services want a key (issue 46, item 4), proved with real clients against the real servers, each refusal
beside an acceptance (so the refusal is the key's doing, not a broken server):

* Airflow's API server as `make airflow` starts it (scripts/airflow_local.py ``start``): no write without a login
  (``PATCH`` of a DAG: 401), no token minted without the password (``GET /auth/token``, the all-admins mint: 403), a
  foreign ``Host`` refused before Airflow sees it (DNS rebinding: ``Host: attacker.example`` -> 403 even with the
  password), the login link sets a session the UI works with, and the password file is private and in no log;
* the embedded MLflow server (pipeline_steps/local/mlflow_server.py): an unauthenticated experiment delete is refused
  and the experiment survives; a foreign ``Host`` is refused; MLflow's own client with the generated credentials works;
* the MCP code server (pipeline_steps/tools/mcp_code_server.py), through the ``mcp`` SDK's client: without the token
  nothing, and the sandbox service (a recording stand-in of the E2B API) never sees the deployment's key; with it the
  tool call reaches the sandbox service with the key; a foreign ``Host`` is refused; no token, no server;
* the local sandbox server: a foreign ``Host`` is refused on its loopback port (root: it runs sandboxes).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.helpers.ports import free_port

pytestmark = pytest.mark.slow
FOREIGN = "attacker.example"


# --- Airflow ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    from scripts.airflow_local import start, stop

    tmp = tmp_path_factory.mktemp("airflow-auth")
    saved = dict(os.environ)
    os.environ.update({"PIPELINE_SCHEDULE": "none", "PIPELINE_END_DATE": ""})
    home, airflow_home, log = tmp / "pipeline", tmp / "airflow-home", tmp / "standalone.log"
    port = free_port()
    proc = None
    try:
        proc, url = start(home, airflow_home, port, log)
        yield {"url": url, "port": port, "airflow_home": airflow_home, "log": log}
    finally:
        if proc is not None:
            stop(proc, home)
        os.environ.clear()
        os.environ.update(saved)


def _password(airflow) -> str:
    from scripts.airflow_local import ensure_password

    return ensure_password(airflow["airflow_home"])


def _token(airflow) -> str:
    r = httpx.post(f"{airflow['url']}/auth/token", json={"username": "admin", "password": _password(airflow)})
    assert r.status_code == 201, r.text
    return r.json()["access_token"]


def _wait_for_dag(airflow, token: str, dag: str = "verl_grpo_pipeline") -> None:
    deadline = time.time() + 300  # the DAG processor's first parse
    while time.time() < deadline:
        r = httpx.get(f"{airflow['url']}/api/v2/dags/{dag}", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        if r.status_code == 200:
            return
        time.sleep(3)
    pytest.fail(f"the DAG processor did not register {dag} within 5 minutes")


@pytest.mark.budget(900)  # with the module's Airflow start and the DAG's first parse, on a loaded machine
def test_airflow_refuses_a_write_without_a_login_and_takes_one_with_it(airflow):
    url, token = airflow["url"], _token(airflow)
    _wait_for_dag(airflow, token)
    patch = f"{url}/api/v2/dags/verl_grpo_pipeline"
    # before issue 46: 200 (every caller was an admin)
    r = httpx.patch(patch, json={"is_paused": True})
    assert r.status_code == 401, (r.status_code, r.text)
    r = httpx.patch(patch, json={"is_paused": True}, headers={"Authorization": "Bearer not-a-token"})
    assert r.status_code in (401, 403), (r.status_code, r.text)
    # the all-admins mint (GET /auth/token) and a wrong password mint nothing
    assert httpx.get(f"{url}/auth/token").status_code == 403
    r = httpx.post(f"{url}/auth/token", json={"username": "admin", "password": "wrong"})
    assert r.status_code == 401 and "access_token" not in r.text
    # with the login: the same write works
    r = httpx.patch(patch, json={"is_paused": True}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["is_paused"] is True, r.text
    # reads want the login too (the UI's data)
    assert httpx.get(f"{url}/api/v2/dags").status_code == 401


def test_airflow_refuses_a_foreign_host_even_with_the_password(airflow):
    url, port, password = airflow["url"], airflow["port"], _password(airflow)
    body = {"username": "admin", "password": password}
    for host in (FOREIGN, f"{FOREIGN}:{port}", f"192.168.1.10:{port}"):
        # before issue 46: GET /auth/token with Host: attacker.example -> 201 and an admin token
        r = httpx.get(f"{url}/auth/token", headers={"Host": host})
        assert r.status_code == 403 and "not a loopback name" in r.text, (host, r.status_code, r.text)
        r = httpx.post(f"{url}/auth/token", json=body, headers={"Host": host})
        assert r.status_code == 403 and "access_token" not in r.text, (host, r.status_code, r.text)
        assert httpx.get(f"{url}/api/v2/monitor/health", headers={"Host": host}).status_code == 403
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        r = httpx.post(f"{url}/auth/token", json=body, headers={"Host": host})
        assert r.status_code == 201 and r.json()["access_token"], (host, r.status_code, r.text)


def test_the_login_link_opens_a_session_and_a_wrong_key_does_not(airflow):
    from scripts.airflow_local import login_url

    url, password = airflow["url"], _password(airflow)
    link = login_url(url, password)
    assert password in link.split("#", 1)[1] and password not in link.split("#", 1)[0]  # never sent to the server
    with httpx.Client() as anonymous:
        r = anonymous.post(f"{url}/pipeline/login", json={"key": "wrong"})
        assert r.status_code == 401 and "_token" not in r.headers.get("set-cookie", "")
        assert anonymous.post(f"{url}/pipeline/login", content=f'{{"key": "{password}"}}').status_code in (415, 422)
        assert anonymous.get(f"{url}/api/v2/dags").status_code == 401
        r = anonymous.post(f"{url}/pipeline/login", json={"key": password}, headers={"Host": FOREIGN})
        assert r.status_code == 403 and "_token" not in r.headers.get("set-cookie", "")
    with httpx.Client() as browser:
        assert browser.get(link).status_code == 200  # the page that posts the fragment's key
        r = browser.post(f"{url}/pipeline/login", json={"key": password})  # what it posts
        assert r.status_code == 200 and "_token=" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
        assert browser.get(f"{url}/api/v2/dags").status_code == 200  # the session cookie, as the UI sends it
        assert browser.get(f"{url}/api/v2/dags", headers={"Host": FOREIGN}).status_code == 403


@pytest.mark.browser
def test_the_login_link_opens_the_ui_in_chromium(airflow, tmp_path):
    import shutil

    chromium = shutil.which("chromium")
    if not chromium:
        pytest.skip("Debian's chromium is not installed")
    from playwright.sync_api import sync_playwright

    from scripts.airflow_local import login_url
    from tests.helpers.chromium import CHROMIUM_ARGS

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(login_url(airflow["url"], _password(airflow)))  # the one click
            page.wait_for_url(f"{airflow['url']}/", timeout=60_000)  # the page logged in and opened the UI
            assert "key=" not in page.url
            page.goto(f"{airflow['url']}/dags/verl_grpo_pipeline", wait_until="networkidle")
            page.get_by_role("button", name="Trigger").first.wait_for(timeout=60_000)
            page.screenshot(path=str(tmp_path / "logged-in.png"))
        finally:
            browser.close()


def test_the_password_is_private_and_in_no_log(airflow):
    from scripts.airflow_local import passwords_file

    path = passwords_file(airflow["airflow_home"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    password = _password(airflow)
    assert len(password) >= 20 and password not in airflow["log"].read_text(errors="replace")


# --- MLflow ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    from pipeline_steps.local import mlflow_server

    d = tmp_path_factory.mktemp("mlflow-auth")
    uri = mlflow_server.ensure_server(d)
    yield uri, d
    mlflow_server.shutdown_server(d)


def test_mlflow_refuses_an_unauthenticated_delete(mlflow):
    from pipeline_steps.local import mlflow_server

    uri, d = mlflow
    creds = mlflow_server.client_env(d)
    auth = (creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"])
    r = httpx.post(f"{uri}/api/2.0/mlflow/experiments/create", json={"name": "keep-me"}, auth=auth)
    assert r.status_code == 200, r.text
    exp_id = r.json()["experiment_id"]
    delete = f"{uri}/api/2.0/mlflow/experiments/delete"
    # before issue 46: 200, and the experiment was gone
    assert httpx.post(delete, json={"experiment_id": exp_id}).status_code == 401
    assert httpx.post(delete, json={"experiment_id": exp_id}, auth=("admin", "wrong")).status_code == 401
    assert httpx.get(f"{uri}/api/2.0/mlflow/experiments/search?max_results=10").status_code == 401  # reads too
    got = httpx.get(f"{uri}/api/2.0/mlflow/experiments/get?experiment_id={exp_id}", auth=auth).json()
    assert got["experiment"]["lifecycle_stage"] == "active"  # still there
    assert httpx.post(delete, json={"experiment_id": exp_id}, auth=auth).status_code == 200


def test_mlflow_refuses_a_foreign_host(mlflow):
    from pipeline_steps.local import mlflow_server

    uri, d = mlflow
    creds = mlflow_server.client_env(d)
    auth = (creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"])
    port = uri.rsplit(":", 1)[1]
    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=10"
    for host in (FOREIGN, f"{FOREIGN}:{port}", f"192.168.1.10:{port}", f"10.0.0.1:{port}"):
        r = httpx.get(search, auth=auth, headers={"Host": host})
        assert r.status_code == 403 and "DNS rebinding" in r.text, (host, r.status_code, r.text)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert httpx.get(search, auth=auth, headers={"Host": host}).status_code == 200, host


def test_mlflows_own_client_works_with_the_generated_credentials_only(mlflow, monkeypatch, tmp_path):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipeline_steps.local import mlflow_server

    uri, d = mlflow
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(MlflowException, match="401|not authenticated|Unauthorized"):
        MlflowClient(tracking_uri=uri).create_experiment(f"anon-{tmp_path.name}")
    for k, v in mlflow_server.client_env(d).items():
        monkeypatch.setenv(k, v)
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(f"authed-{tmp_path.name}")
    run = client.create_run(exp).info.run_id
    client.log_metric(run, "m", 1.0, step=1)
    assert client.get_run(run).data.metrics == {"m": 1.0}
    creds = d / mlflow_server.CREDENTIALS_FILE
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600 and stat.S_IMODE(d.stat().st_mode) == 0o700
    password = mlflow_server.client_env(d)["MLFLOW_TRACKING_PASSWORD"]
    assert password not in (d / "server.log").read_text(errors="replace")
    assert password not in (d / mlflow_server.STATE_FILE).read_text()


# --- the MCP code server ---------------------------------------------------------------------------------------------


class _E2BRecorder(ThreadingHTTPServer):
    """A stand-in for the sandbox service's control plane that records who called it (and creates nothing)."""

    daemon_threads = True

    def __init__(self):
        self.calls: list[dict] = []
        super().__init__(("127.0.0.1", 0), _RecordingHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RecordingHandler(BaseHTTPRequestHandler):
    def _any(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.calls.append({"path": self.path, "key": self.headers.get("X-API-KEY")})
        body = json.dumps({"code": 503, "message": "recording stand-in: no sandboxes here"}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _any

    def log_message(self, *args):
        pass


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # a cold import of the MCP server takes over 30 s on a loaded machine
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the MCP server did not start"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def mcp_server():
    e2b = _E2BRecorder()
    threading.Thread(target=e2b.serve_forever, daemon=True).start()
    key, token, port = "deployment-key-" + secrets.token_hex(8), secrets.token_hex(16), free_port()
    env = dict(os.environ, E2B_API_KEY=key, E2B_API_URL=e2b.url, E2B_SANDBOX_URL=e2b.url, MCP_SERVER_TOKEN=token)
    env.pop("E2B_DOMAIN", None)
    cmd = [sys.executable, "-m", "pipeline_steps.tools.mcp_code_server", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc)
        yield {"url": f"http://127.0.0.1:{port}/mcp", "port": port, "token": token, "key": key, "e2b": e2b}
    finally:
        proc.terminate()
        proc.wait(10)
        e2b.shutdown()


async def _call(url: str, headers: dict, code: str = "print(1)"):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(url, headers=headers, timeout=30) as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = await session.list_tools()
            return [t.name for t in tools.tools], await session.call_tool("run_code_once", {"code": code})


def _tools_call(token: str | None = None, host: str | None = None) -> dict:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if host:
        headers["Host"] = host
    return headers


TOOLS_CALL = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "tools/call",
    "params": {"name": "run_code_once", "arguments": {"code": "print(1)"}},
}


def test_mcp_refuses_an_unauthenticated_tools_call_and_spends_no_key(mcp_server):
    e2b = mcp_server["e2b"]
    before = len(e2b.calls)
    # before issue 46: the call reached the sandbox service with the deployment's key
    with pytest.raises(BaseException) as refused:  # the SDK's client fails its session on the 401
        asyncio.run(asyncio.wait_for(_call(mcp_server["url"], {}), 60))
    assert "401" in repr(refused.value) or "Unauthorized" in repr(refused.value), repr(refused.value)
    with pytest.raises(BaseException):
        asyncio.run(asyncio.wait_for(_call(mcp_server["url"], {"Authorization": "Bearer wrong"}), 60))
    r = httpx.post(mcp_server["url"], json=TOOLS_CALL, headers=_tools_call())
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
    r = httpx.post(mcp_server["url"], json=TOOLS_CALL, headers=_tools_call("wrong-token"))
    assert r.status_code == 401
    assert len(e2b.calls) == before  # the sandbox service never heard of these callers


def test_mcp_with_the_token_reaches_the_sandbox_service_with_the_key(mcp_server):
    e2b = mcp_server["e2b"]
    before = len(e2b.calls)
    names, result = asyncio.run(
        asyncio.wait_for(_call(mcp_server["url"], {"Authorization": f"Bearer {mcp_server['token']}"}), 120)
    )
    assert names == ["run_code_once"]
    assert result.isError  # the stand-in creates no sandbox; what matters is who called it, with which key
    assert e2b.calls[before:] and all(c["key"] == mcp_server["key"] for c in e2b.calls[before:]), e2b.calls


def test_mcp_refuses_a_foreign_host_even_with_the_token(mcp_server):
    port, token = mcp_server["port"], mcp_server["token"]
    before = len(mcp_server["e2b"].calls)
    for host in (FOREIGN, f"{FOREIGN}:{port}"):
        r = httpx.post(mcp_server["url"], json=TOOLS_CALL, headers=_tools_call(token, host))
        assert r.status_code in (403, 421), (host, r.status_code, r.text)
    assert len(mcp_server["e2b"].calls) == before


def test_mcp_server_does_not_start_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "MCP_SERVER_TOKEN"}
    cmd = [sys.executable, "-m", "pipeline_steps.tools.mcp_code_server", "--port", str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a token" in lines[0], proc.stderr


# --- the local sandbox server ----------------------------------------------------------------------------------------


@pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")
def test_the_sandbox_server_refuses_a_foreign_host(tmp_path):
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    with LocalSandboxServer(tmp_path / "state", args=["--warm", "0"]) as server:
        key = {"X-API-KEY": server.api_key}
        port = server.url.rsplit(":", 1)[1]
        for host in (FOREIGN, f"{FOREIGN}:{port}"):
            r = httpx.get(f"{server.url}/v2/sandboxes", headers={**key, "Host": host})
            assert r.status_code == 403 and "not a loopback name" in r.text, (host, r.status_code, r.text)
        assert httpx.get(f"{server.url}/v2/sandboxes", headers=key).status_code == 200
        assert httpx.get(f"{server.url}/v2/sandboxes", headers={**key, "Host": f"localhost:{port}"}).status_code == 200
