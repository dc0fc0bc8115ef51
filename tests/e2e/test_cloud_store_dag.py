"""The whole DAG on a cloud store: ``verl_grpo_pipeline`` then ``verl_evaluate_model``, both through real Airflow
(``airflow dags test``) on the local backend, with the store on the OSS test server and on fake-gcs-server.

The worker gets the store's credentials only from the Airflow connection (``AIRFLOW_CONN_PIPELINE_STORE``, the
Helm values' shape): no ``OSS_*``/``STORAGE_EMULATOR_HOST`` variable is in Airflow's environment, so every place
the worker itself opens the store (collect_inputs, pre-flight, progress, report, the evaluation DAG's plan) must go
through the store hook. Stand-ins: the OSS test server (an OSS-dialect layer over moto) and fake-gcs-server stand for
Alibaba OSS and Google Cloud Storage, which cannot be reached from here; the Hugging Face Hub is the offline cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.airflow_cli import dags_test
from tests.helpers.storage_servers import OSS_KEY_ID, OSS_REGION, OSS_SECRET

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _connection(kind: str, server) -> dict:
    if kind == "oss":
        return {
            "conn_type": "alibaba_cloud",
            "login": OSS_KEY_ID,
            "password": OSS_SECRET,
            "extra": {"region": OSS_REGION, "endpoint": server.endpoint, "path_style": "true"},
        }
    return {"conn_type": "google_cloud_platform", "extra": {"project": "test-project", "emulator_host": server.url}}


def _listing(kind: str, server, prefix: str) -> list[str]:
    if kind == "oss":
        import alibabacloud_oss_v2 as oss

        keys, token = [], None
        while True:
            r = server.client().list_objects_v2(
                oss.ListObjectsV2Request(bucket="test-bucket", prefix=prefix, continuation_token=token)
            )
            keys += [o.key for o in r.contents or []]
            if not r.is_truncated:
                return keys
            token = r.next_continuation_token
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="test-project", credentials=AnonymousCredentials(), client_options={"api_endpoint": server.url}
    )
    return [b.name for b in client.list_blobs("test-bucket", prefix=prefix)]


@pytest.mark.budget(900)  # 460 s (oss) and 424 s (gcs) in make test at a load average of 10
@pytest.mark.parametrize("kind", ["oss", "gcs"])
def test_pipeline_and_evaluation_dags_run_on_a_cloud_store(kind, request, tmp_path):
    from scripts.local_profile import newest_run, prepare, stop_services, task_states, xcom

    server = request.getfixturevalue("oss_server" if kind == "oss" else "gcs_server")
    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow"
    env = prepare(home, airflow_home)
    for k in list(env):  # credentials reach the worker through the connection only
        if k.startswith(("OSS_", "GOOGLE_", "GCS_", "STORAGE_EMULATOR")):
            del env[k]
    prefix = f"verl-{kind}-{tmp_path.name}"
    scheme = "oss" if kind == "oss" else "gs"
    env["PIPELINE_STORE_URI"] = f"{scheme}://test-bucket/{prefix}"
    env["AIRFLOW_CONN_PIPELINE_STORE"] = json.dumps(_connection(kind, server))
    airflow = str(Path(sys.executable).with_name("airflow"))
    try:
        conf = {"experiment": "local_tiny", "backend": "local", "datasets": ["gsm8k"], "smoke": True}
        rc = dags_test(airflow, "verl_grpo_pipeline", conf, env, tmp_path / "pipeline.log")
        log = (tmp_path / "pipeline.log").read_text()
        assert rc == 0, log[-6000:]
        db = airflow_home / "airflow.db"
        run_id = newest_run(db, "verl_grpo_pipeline")
        states = task_states(db, run_id)
        # export is skipped when the gate does not promote (the tiny model rarely beats its base); all else succeeds
        assert states and all(s == "success" for t, s in states.items() if t != "export[-1]"), states
        exported = xcom(db, run_id, "export")[0]["export"]  # pushed before a skip too
        assert states["export[-1]"] == ("success" if exported["promoted"] else "skipped"), (states, exported)

        upload = xcom(db, run_id, "upload_dataset")[0]["upload"]
        assert upload["uri"].startswith(f"{scheme}://test-bucket/{prefix}/datasets/gsm8k/")
        report = xcom(db, run_id, "report")[0]["report"]
        assert report["report"].startswith(f"{scheme}://test-bucket/{prefix}/runs/"), report
        trained = xcom(db, run_id, "train")[0]
        assert trained["checkpoint_uri"].startswith(f"{scheme}://test-bucket/{prefix}/runs/"), trained
        assert trained["checkpoint_step"] == 1, trained  # smoke: one step, saved
        evaluated = xcom(db, run_id, "evaluate")[0]["evaluate"]
        assert evaluated["results"].startswith(f"{scheme}://test-bucket/{prefix}/runs/"), evaluated
        model = xcom(db, run_id, "stage_model")[0]["stage_model"]["uri"]
        if states["export[-1]"] == "success":
            model = xcom(db, run_id, "export")[0]["export"]["uri"]
            assert model.startswith(f"{scheme}://test-bucket/{prefix}/models/exported/"), model

        keys = _listing(kind, server, prefix + "/")
        for needle in (
            "/datasets/gsm8k/",
            "/models/local/tiny/",
            "/models/exported/local_tiny/step",  # export ran: the merged model is stored (promoted or a candidate)
            "/checkpoints/latest_checkpointed_iteration.txt",
            "/eval/results.json",
            "/report/report.html",
            "/metrics.jsonl",
            "/lineage.json",
        ):
            assert any(needle in k for k in keys), (needle, keys[:50])
        # nothing secret in what Airflow keeps or prints
        assert OSS_SECRET not in log

        # the on-demand evaluation DAG on a model in the store, reading it and the evaluation set from the store
        conf = {"model_uri": model, "eval_dataset": "gsm8k", "k": 1, "max_new_tokens": 8}
        rc = dags_test(airflow, "verl_evaluate_model", conf, env, tmp_path / "evaluate.log")
        assert rc == 0, (tmp_path / "evaluate.log").read_text()[-6000:]
        run_id = newest_run(db, "verl_evaluate_model")
        states = task_states(db, run_id)
        assert states and all(s == "success" for s in states.values()), states
    finally:
        stop_services(home)  # the local Ray cluster and MLflow server the run started
