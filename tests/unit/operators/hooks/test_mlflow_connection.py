"""A team's MLflow server from the Airflow connection ``mlflow_default`` (issue 15 item 4), with the real hook
(``AIRFLOW_CONN_MLFLOW_DEFAULT``), the real RayJob render and, for the local backend, a real MLflow server behind a
proxy that refuses requests without the connection's credentials.

The password must never appear in a rendered manifest, the XCom result, the task's log or the local Ray job's
environment (the Ray dashboard shows it): on a cluster the pods read it from a Kubernetes Secret by reference, a
local job from a file only the worker's user can read.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowFailException

from operators.hooks.mlflow import MlflowHook
from operators.train import GRPOTrainOperator
from tests.helpers.deferral import deferred, run_trigger
from tests.helpers.operator_runs import RUN_ID, write_parquet
from tests.helpers.rayjob_operators import read_through_mounts, train_plan

PASSWORD = "pw-Must-Not-Leak-7f3a9c"  # found nowhere but in the connection and the credentials file
CONN = "AIRFLOW_CONN_MLFLOW_DEFAULT"
IMAGE = "registry.example.com/verl-grpo-train@sha256:" + "0" * 64


@pytest.fixture(autouse=True)
def _no_ambient_tracking(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("PIPELINE_MLFLOW_SECRET", raising=False)


# -- the hook -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conn, uri",
    [
        # URI form: Airflow puts the path into the schema field; %40 is an '@' in the password
        ("https://alice:pw%40x@mlflow.example.com:8443/mlflow", "https://mlflow.example.com:8443/mlflow"),
        ({"conn_type": "http", "host": "https://ml.example.com", "port": 5000}, "https://ml.example.com:5000"),
        ({"conn_type": "http", "host": "ml.internal", "schema": "https"}, "https://ml.internal"),
        ({"conn_type": "https", "host": "ml.internal", "extra": {"path": "/team-a/"}}, "https://ml.internal/team-a"),
        ({"conn_type": "http", "host": "10.0.0.7", "port": 5000}, "http://10.0.0.7:5000"),
    ],
)
def test_the_hook_turns_the_connection_into_a_tracking_uri(monkeypatch, conn, uri):
    monkeypatch.setenv(CONN, conn if isinstance(conn, str) else json.dumps(conn))
    assert MlflowHook().tracking_uri == uri


def test_credentials_and_their_absence(monkeypatch):
    monkeypatch.setenv(CONN, f"https://alice:{PASSWORD}@mlflow.example.com")
    hook = MlflowHook()
    assert hook.credentials == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    assert hook.env() == {"MLFLOW_TRACKING_URI": "https://mlflow.example.com", **hook.credentials}
    monkeypatch.setenv(CONN, json.dumps({"conn_type": "https", "host": "ml.example.com", "extra": {"token": "t0k"}}))
    assert MlflowHook().credentials == {"MLFLOW_TRACKING_TOKEN": "t0k"}
    monkeypatch.delenv(CONN)
    assert MlflowHook().tracking_uri is None and MlflowHook().env() == {}  # no connection: nothing changes
    assert MlflowHook(None).cluster_settings({"env": {"A": "1"}}) == {"env": {"A": "1"}}


@pytest.mark.parametrize(
    "conn, message",
    [
        ({"conn_type": "postgres", "host": "db"}, "conn type 'postgres'"),
        ({"conn_type": "http", "host": ""}, "no host"),
        ({"conn_type": "http", "host": f"https://bob:{PASSWORD}@ml.example.com"}, "without credentials"),
        ({"conn_type": "http", "host": "ftp://ml.example.com"}, "scheme 'ftp'"),
        ({"conn_type": "http", "host": "ml.example.com", "login": "bob"}, "login without password"),
    ],
)
def test_a_bad_connection_is_one_line_naming_the_field_never_the_password(monkeypatch, conn, message):
    monkeypatch.setenv(CONN, json.dumps(conn))
    with pytest.raises(AirflowFailException) as exc:
        MlflowHook().env()
    text = str(exc.value)
    assert message in text and "mlflow_default" in text and "\n" not in text and PASSWORD not in text


def test_two_airflow_deployments_on_one_machine_keep_their_credentials_files_apart(monkeypatch, tmp_path):
    """A local job's credentials file is named by its submission name, which two deployments running the same DAG
    run id share (two clones' suites did, and one's clean-up check saw the other's file): each Airflow home has its
    own directory, so neither overwrites nor removes the other's."""
    from operators.hooks import mlflow as mlflow_hook

    written = {}
    for team in ("a", "b"):
        monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / f"airflow-{team}"))
        monkeypatch.setenv(CONN, f"https://{team}:{PASSWORD}-{team}@mlflow.example.com")
        written[team] = mlflow_hook.MlflowHook().credentials_file("verl-grpo-pipeline-train-0123456789ab")
    try:
        assert written["a"] != written["b"]
        for team, path in written.items():
            assert json.loads(path.read_text())[mlflow_hook.PASSWORD_ENV] == f"{PASSWORD}-{team}"
        mlflow_hook.remove_credentials_file("verl-grpo-pipeline-train-0123456789ab")  # b's home is the current one
        assert written["a"].exists() and not written["b"].exists()
    finally:
        for path in written.values():  # and the directories of these two throwaway homes
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()


def test_credentials_without_a_secret_for_the_pods_are_refused(monkeypatch):
    monkeypatch.setenv(CONN, f"https://alice:{PASSWORD}@mlflow.example.com")
    with pytest.raises(AirflowFailException, match=r"PIPELINE_MLFLOW_SECRET or the preset's cluster.mlflow_secret"):
        MlflowHook().cluster_settings({"env": {}})
    monkeypatch.setenv("PIPELINE_MLFLOW_SECRET", "team-mlflow")  # the deployment's name wins over the preset's
    secrets = MlflowHook().cluster_settings({"mlflow_secret": "other"})["secrets"]
    assert {s["secret"] for s in secrets} == {"team-mlflow"}


# -- kuberay: the rendered RayJob -----------------------------------------------------------------------


def _container_env(body: dict) -> list[list[dict]]:
    cluster = body["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]] + list(cluster.get("workerGroupSpecs") or [])
    return [p["template"]["spec"]["containers"][0]["env"] for p in pods]


@pytest.mark.parametrize("step", [False, True], ids=["train", "export"])
def test_the_rayjob_gets_the_uri_plain_and_the_credentials_by_secret_reference(
    k8s_api, tmp_path, monkeypatch, caplog, capsys, step
):
    """The train task's RayJob and the export step's RayJob (which logs the evaluation and the card to the run)."""
    from operators.cluster_step import PipelineStepJobOperator
    from pipeline_steps.training.rayjob_manifest import rayjob_name
    from tests.helpers.k8s_api_stand_in import SUCCESS

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(CONN, f"https://alice:{PASSWORD}@mlflow.team.example:8443")
    mnt = tmp_path / "mnt"
    monkeypatch.setenv("PIPELINE_MOUNTS", json.dumps([{"uri": "gs://verl-bucket", "claim": "store", "path": str(mnt)}]))
    read_through_mounts(monkeypatch)  # the worker reads the run directory at its mount path (no bucket here)
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", IMAGE)
    run_dir = "gs://verl-bucket/runs/gsm8k/run1"
    kind = "export" if step else "train"
    k8s_api.script(rayjob_name("t_conn", RUN_ID, kind, kind), SUCCESS)
    with DAG("t_conn", schedule=None):
        if step:
            op = PipelineStepJobOperator(
                task_id="export",
                step="export",
                # the preset logs to mlflow; its cluster.mlflow_secret is mlflow-tracking
                plan=train_plan("gsm8k_qwen2_5_3b", "kuberay", "gs://verl-bucket", run_dir=run_dir),
                request={"args": ["--checkpoint-dir", f"{run_dir}/checkpoints"]},
                uri_args=("--checkpoint-dir",),
                store_uri="gs://verl-bucket",
                mlflow_conn_id="mlflow_default",
                namespace="training",
                kubernetes_conn_id="k8s_standin",
                poll_interval=0.01,
            )
        else:
            op = GRPOTrainOperator(
                task_id="train",
                plan=train_plan("gsm8k_qwen2_5_3b", "kuberay", "gs://verl-bucket", run_dir=run_dir),
                namespace="training",
                train_files=["gs://verl-bucket/datasets/gsm8k/train.parquet"],
                model_path="gs://verl-bucket/models/Qwen/Qwen2.5-3B-Instruct/main",
                run_dir=run_dir,
                check_store=False,
                kubernetes_conn_id="k8s_standin",
                poll_interval=0.01,
            )
    trigger = deferred(op, {"run_id": RUN_ID})
    (body,) = k8s_api.creates
    for env in _container_env(body):
        by_name = {e["name"]: e for e in env}
        assert by_name["MLFLOW_TRACKING_URI"] == {
            "name": "MLFLOW_TRACKING_URI",
            "value": "https://mlflow.team.example:8443",
        }
        for name, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
            ref = {"name": "mlflow-tracking", "key": key, "optional": True}
            assert by_name[name] == {"name": name, "valueFrom": {"secretKeyRef": ref}}
        assert "MLFLOW_TRACKING_TOKEN" not in by_name  # the connection holds no token: the preset's ref is gone too
        assert [e["name"] for e in env].count("MLFLOW_TRACKING_URI") == 1  # replaced the preset's Secret reference
    runtime_env = yaml.safe_load(body["spec"]["runtimeEnvYAML"])["env_vars"]
    assert runtime_env["MLFLOW_TRACKING_URI"] == "https://mlflow.team.example:8443"
    if not step:
        (mnt / "runs/gsm8k/run1/checkpoints").mkdir(parents=True)
        out = op.execute_complete({"run_id": RUN_ID}, run_trigger(trigger, timeout=60))
        assert PASSWORD not in json.dumps(out, default=str)
    manifest = json.dumps(k8s_api.creates) + yaml.safe_dump(body)
    assert "alice" not in manifest and PASSWORD not in manifest
    logged = caplog.text + "".join(capsys.readouterr())
    assert "mlflow.team.example" in json.dumps(k8s_api.creates) and PASSWORD not in logged


# -- local backend: the connection wins over the embedded server ---------------------------------------


class _BasicAuthProxy(ThreadingHTTPServer):
    """A tracking server that wants the connection's credentials: MLflow's REST API behind HTTP basic auth."""

    daemon_threads = True

    def __init__(self, upstream: str, user: str, password: str, upstream_auth: str = ""):
        self.upstream = upstream.split("://", 1)[1]
        self.upstream_auth = upstream_auth  # the embedded server behind it wants its own login (issue 46)
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.refused = 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(BaseHTTPRequestHandler):
    def _forward(self):
        if self.path != "/health" and self.headers.get("Authorization") != self.server.expected:
            self.server.refused += 1
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection(self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization", "connection")}
        headers["Authorization"] = self.server.upstream_auth
        conn.request(self.command, self.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    def log_message(self, *args):
        pass


@pytest.fixture
def team_server(tmp_path):
    from pipeline_steps.local import mlflow_server

    d = tmp_path / "team-mlflow"
    upstream = mlflow_server.ensure_server(d)
    own = mlflow_server.client_env(d)
    pair = f"{own['MLFLOW_TRACKING_USERNAME']}:{own['MLFLOW_TRACKING_PASSWORD']}".encode()
    proxy = _BasicAuthProxy(upstream, "alice", PASSWORD, "Basic " + base64.b64encode(pair).decode())
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        mlflow_server.shutdown_server(d)


@pytest.mark.slow
def test_local_backend_logs_to_the_connections_server_with_its_credentials(
    tmp_path,
    tiny_model,
    ray_cluster,  # noqa: F811
    team_server,
    monkeypatch,
    caplog,
    capsys,  # noqa: F811
):
    from mlflow.tracking import MlflowClient

    from operators.hooks import mlflow as mlflow_hook
    from pipeline_steps.local import mlflow_server
    from pipeline_steps.local import ray_cluster as local_ray

    caplog.set_level(logging.DEBUG)
    host, port = team_server.uri.split("//")[1].split(":")
    monkeypatch.setenv(
        CONN, json.dumps({"conn_type": "http", "host": host, "port": int(port), "login": "alice", "password": PASSWORD})
    )
    embedded = tmp_path / "embedded-mlflow"
    monkeypatch.setenv("PIPELINE_MLFLOW_DIR", str(embedded))  # where the operator would start its own server
    run_dir = tmp_path / "run"
    with DAG("t_conn_local", schedule=None):
        op = GRPOTrainOperator(
            task_id="train",
            plan=train_plan(  # local_tiny: trainer.logger has mlflow
                "local_tiny",
                "local",
                f"file://{tmp_path}/store",
                ["trainer.total_training_steps=1", "actor_rollout_ref.rollout.n=2"],
                f"file://{run_dir}",
                save=True,
            ),
            train_files=[str(write_parquet(tmp_path / "train.parquet"))],
            model_path=str(tiny_model),
            run_dir=f"file://{run_dir}",
            ray_address=ray_cluster,
            poll_interval=1.0,
        )
    trigger = deferred(op, {"run_id": RUN_ID})
    info = local_ray.info(ray_cluster, trigger.submission_id)
    job_env = (info.get("runtime_env") or {}).get("env_vars") or {}
    assert job_env["MLFLOW_TRACKING_URI"] == team_server.uri  # the connection's server, not an embedded one
    cred_file = Path(job_env["PIPELINE_MLFLOW_CREDENTIALS_FILE"])
    assert oct(cred_file.stat().st_mode & 0o777) == "0o600" and oct(cred_file.parent.stat().st_mode & 0o777) == "0o700"
    assert PASSWORD not in json.dumps(info, default=str)  # the Ray dashboard's view of the job
    event = run_trigger(trigger, timeout=420)
    assert event["status"] == "success", event
    out = op.execute_complete({"run_id": RUN_ID}, event)
    assert not cred_file.exists()  # handed over, then removed with the job

    assert not (embedded / mlflow_server.STATE_FILE).exists()  # no embedded server was started
    run = out["mlflow"]
    assert run and run["tracking_uri"] == team_server.uri
    # through the proxy, with the credentials (MLflow's client reads them from the environment)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    history = MlflowClient(tracking_uri=team_server.uri).get_metric_history(run["run_id"], "critic/score/mean")
    assert [m.step for m in history] == [1]
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    refused = team_server.refused
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", f"/api/2.0/mlflow/runs/get?run_id={run['run_id']}")
    assert conn.getresponse().status == 401 and team_server.refused == refused + 1  # the proxy does check

    assert PASSWORD not in json.dumps(out, default=str)
    assert PASSWORD not in caplog.text + "".join(capsys.readouterr())
    assert PASSWORD not in (run_dir / "train_summary.json").read_text()
    assert PASSWORD not in "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.json*"))
    assert not any("t-conn-local" in p.name for p in mlflow_hook._credentials_dir().glob("*.json"))
    assert os.environ.get("MLFLOW_TRACKING_URI") is None  # the worker's own environment is untouched
