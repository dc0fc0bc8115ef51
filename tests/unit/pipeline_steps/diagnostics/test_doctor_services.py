"""``doctor``'s questions to the services a run talks to, each with the credentials the run would use: the sandbox
service (a tiny E2B-API stand-in answering as OpenKruise's sandbox-manager does: ``GET /health`` open, ``GET
/v2/sandboxes`` behind ``X-API-KEY``, a refused key echoed in the 401 body), a real local MLflow server
(pipeline_steps/local/mlflow_server.py) and the OSS test server (tests/helpers/storage_servers.py). The cluster is
tests/unit/pipeline_steps/diagnostics/test_doctor.py's ready one; the preset is the tool-agent preset with mlflow added
to its loggers and the stand-in as its sandbox endpoint."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.helpers.doctor_cluster import NS, b64
from tests.helpers.ports import free_port
from tests.helpers.step_cli import ROOT, run_step
from tests.helpers.storage_servers import OSS_SECRET

PRESET = "doctor_tool_agent"
API_KEY = "e2b_k3y-never-printed"


class SandboxApi:
    """The two routes of an E2B-compatible API that doctor calls, as sandbox-manager serves them."""

    def __init__(self, key: str):
        self.key, self.requests = key, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                api.requests.append(self.path)
                if self.path == "/health":
                    code, body = 200, "OK"
                elif self.path.startswith("/v2/sandboxes"):
                    sent = self.headers.get("X-API-KEY", "")
                    ok = sent == api.key
                    code = 200 if ok else 401
                    body = "[]" if ok else json.dumps({"code": 401, "message": f"Invalid API Key: {sent}"})
                else:
                    code, body = 404, "404 page not found"
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def mlflow_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def mlflow_uri(mlflow_dir):
    from pipeline_steps.local import mlflow_server

    uri = mlflow_server.ensure_server(mlflow_dir)
    try:
        yield uri
    finally:
        mlflow_server.shutdown_server(mlflow_dir)


@pytest.fixture
def services(cluster, tmp_path, mlflow_dir, mlflow_uri, oss_server):  # noqa: F811 - the imported fixture
    from pipeline_steps.local import mlflow_server

    api, config = cluster
    sandbox = SandboxApi(API_KEY)
    api.secrets[(NS, "sandbox-api-key")] = {"apiKey": b64(API_KEY)}
    presets = tmp_path / "presets"
    presets.mkdir()
    src = ROOT / "pipeline_steps" / "training" / "presets" / "gsm8k_tool_agent_qwen2_5_3b.yaml"

    def write_preset(service: str | None = None) -> None:
        spec = yaml.safe_load(src.read_text())
        spec["name"] = PRESET
        if service:
            spec["cluster"]["sandbox_service"] = service
        spec["verl"]["trainer.logger"] = ["console", "file", "mlflow"]
        (presets / f"{PRESET}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

    write_preset()
    env = {
        "PIPELINE_MOUNTS": (ROOT / "k8s" / "overlays" / "ack" / "mounts.json").read_text(),
        "KUBERNETES_SERVICE_HOST": "",
        "PIPELINE_PRESETS_DIR": str(presets),
        "PIPELINE_E2B_DOMAIN": "sandbox.example.com",  # the deployment's default service (Helm values)
        "E2B_API_URL": sandbox.url,  # ...which the stand-in serves (the E2B SDK's own override of api.<domain>)
        "E2B_API_KEY": "",
        "MLFLOW_TRACKING_URI": mlflow_uri,
        **mlflow_server.client_env(mlflow_dir),  # the embedded server's generated login (issue 46)
        "PIPELINE_STORE_CONN_ID": "pipeline_store",
        **oss_server.env(),
    }
    try:
        yield api, config, env, sandbox, write_preset
    finally:
        sandbox.stop()


def doctor(config, env):
    return run_step(
        "doctor",
        "--kube-config",
        config,
        "--namespace",
        NS,
        "--experiment",
        PRESET,
        "--store-uri",
        "oss://test-bucket/doctor",
        env=env,
    )


def _fails(config, env, lines: str) -> str:
    rc, summary, err = doctor(config, env)
    assert rc == 2 and not summary["ok"], err
    assert lines in err, err
    assert err.count("[FAIL]") == 1, err
    return err


def test_a_ready_cluster_and_its_services_pass(services, mlflow_uri):
    api, config, env, sandbox, _ = services
    rc, summary, err = doctor(config, env)
    assert rc == 0, err
    lines = err.splitlines()
    assert (
        f"[ok] sandbox service for {PRESET}: {sandbox.url} answers GET /v2/sandboxes with the API key from Secret "
        "sandbox-api-key key apiKey (HTTP 200)" in lines
    ), err
    assert f"[ok] MLflow tracking server for {PRESET}: {mlflow_uri} (from $MLFLOW_TRACKING_URI) answers " in err
    assert (
        "[ok] store oss://test-bucket/doctor: listed with connection 'pipeline_store' (0 objects at its root)" in lines
    )
    assert sandbox.requests == ["/v2/sandboxes?limit=1"]
    assert API_KEY not in err and OSS_SECRET not in err and env["MLFLOW_TRACKING_PASSWORD"] not in err


def test_the_sandbox_service_refuses_the_key(services):
    api, config, env, sandbox, _ = services
    api.secrets[(NS, "sandbox-api-key")] = {"apiKey": b64("an-old-key-never-printed")}
    err = _fails(
        config,
        env,
        f"[FAIL] sandbox service for {PRESET}: {sandbox.url} refused the API key from Secret sandbox-api-key key "
        "apiKey (HTTP 401)\n"
        "       fix: put the sandbox service's API key into Secret sandbox-api-key key apiKey (k8s/secrets/README.md: "
        f"kubectl -n {NS} create secret generic sandbox-api-key ...)\n",
    )
    assert "an-old-key-never-printed" not in err  # sandbox-manager's 401 body echoes it: bodies are never shown


def test_the_sandbox_service_does_not_answer(services):
    api, config, env, sandbox, _ = services
    gone = f"http://127.0.0.1:{free_port()}"
    _fails(
        config,
        {**env, "E2B_API_URL": gone},
        f"[FAIL] sandbox service for {PRESET}: {gone} does not answer (ConnectionRefusedError: [Errno 111] "
        "Connection refused)\n"
        f"       fix: check $PIPELINE_E2B_DOMAIN (Helm values) and that the service is up (curl {gone}/health)\n",
    )


def test_a_named_sandbox_service_is_checked_with_its_own_secret(services):
    """A preset naming a service of $PIPELINE_SANDBOX_SERVICES is checked with that service's Secret, and a name the
    deployment does not map is a failure naming the fix."""
    api, config, env, sandbox, write_preset = services
    api.secrets[(NS, "ags-api-key")] = {"apiKey": b64("not-the-ags-key")}  # the stand-in accepts API_KEY only
    services_env = {"ags-shanghai": {"domain": "ap-shanghai.tencentags.com", "secret": "ags-api-key"}}
    write_preset("ags-shanghai")
    _fails(
        config,
        {**env, "PIPELINE_SANDBOX_SERVICES": json.dumps(services_env)},
        f"[FAIL] sandbox service for {PRESET} (ags-shanghai): {sandbox.url} refused the API key from Secret "
        "ags-api-key key apiKey (HTTP 401)\n",
    )
    err = _fails(
        config,
        env,
        f"[FAIL] sandbox service for {PRESET}: no sandbox service configured\n"
        "       fix: cluster.sandbox_service='ags-shanghai': not a sandbox service of this deployment (known: none); "
        "add it to $PIPELINE_SANDBOX_SERVICES in the Helm values or name one of those\n",
    )
    assert "not-the-ags-key" not in err


def test_the_mlflow_server_does_not_answer(services):
    api, config, env, sandbox, _ = services
    gone = f"http://127.0.0.1:{free_port()}"
    _fails(
        config,
        {**env, "MLFLOW_TRACKING_URI": gone},
        f"[FAIL] MLflow tracking server for {PRESET}: {gone} (from $MLFLOW_TRACKING_URI) does not answer "
        "(ConnectionRefusedError: [Errno 111] Connection refused)\n"
        "       fix: check the Airflow connection mlflow_default (host, login/password or extra token) or the Secret "
        f"mlflow-tracking (k8s/secrets/README.md), and that the server is up (curl {gone}/health)\n",
    )


def test_the_store_refuses_the_connections_credentials(services):
    api, config, env, sandbox, _ = services
    err = _fails(
        config,
        {**env, "OSS_ACCESS_KEY_SECRET": "a-wrong-secret-never-printed"},
        "[FAIL] store oss://test-bucket/doctor: store connection 'pipeline_store': OSS refused the credentials for "
        "oss://test-bucket/doctor (SignatureDoesNotMatch); check the connection's key id and secret\n"
        "       fix: fix the Airflow connection 'pipeline_store' (operators/hooks/store_connection.py lists its "
        "fields) or the store URI, then run doctor again\n",
    )
    assert "a-wrong-secret-never-printed" not in err
