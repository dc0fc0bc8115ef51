"""The store connection's credentials are handed to the store's client (``StoreHook(conn_id).open(uri)``,
``open_store(uri, credentials=...)``), as the providers' hooks build their clients: the worker's ``os.environ`` is
never written, so two tasks (or the triggerer's coroutines) reading two stores at once need no process-wide lock.

The call sites the worker runs itself are driven with a recording ``oss://`` client: it records, at every call, the
credentials it was handed and the store variables it saw in ``os.environ``. Then the real clients: the OSS test
server and the GCS emulator reached with credentials that are nowhere in the environment.
"""

from __future__ import annotations

import json
import os

import pytest
from airflow.sdk import DAG

from tests.helpers.storage_servers import OSS_KEY_ID, OSS_REGION, OSS_SECRET

CONN = "handed_store"
NAMES = (
    "OSS_ACCESS_KEY_ID",
    "OSS_ACCESS_KEY_SECRET",
    "OSS_REGION",
    "OSS_ENDPOINT",
    "PIPELINE_STORE_CONN_ID",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_CLOUD_PROJECT",
    "GCS_KEYFILE_JSON",
)


def _store_environ() -> dict:
    return {k: os.environ.get(k) for k in NAMES}


def _environ() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class RecordingStore:
    """An ``oss://`` client that keeps objects in memory and records what it was handed and what it saw."""

    objects: dict[str, bytes] = {}
    calls: list[tuple[str, str | None, dict]] = []

    def __init__(self, root, credentials=None):
        self.root, self.handed = root, dict(credentials or {})
        self._record("open")

    def _record(self, op: str) -> None:
        RecordingStore.calls.append((op, self.handed.get("OSS_ACCESS_KEY_ID"), _store_environ()))

    def read_bytes(self, uri: str) -> bytes | None:
        self._record("read")
        return RecordingStore.objects.get(uri)

    def write_bytes(self, uri: str, data: bytes) -> None:
        self._record("write")
        RecordingStore.objects[uri] = bytes(data)

    def _parse(self, uri: str):
        from pipeline_steps.store import parse_uri

        return parse_uri(uri)

    def _list(self, prefix: str, token):  # no object below a prefix: an output not written yet
        self._record("list")
        return [], None

    def upload_dir(self, src, uri: str, replace: bool = False) -> dict:
        self._record("upload")
        RecordingStore.objects[f"{uri}/_manifest.json"] = b"{}"
        return {"uri": uri, "uploaded": 1}


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    from pipeline_steps import settings
    from pipeline_steps.store import oss

    for k in NAMES:
        monkeypatch.delenv(k, raising=False)
    conn = {"conn_type": "alibaba_cloud", "login": OSS_KEY_ID, "password": OSS_SECRET, "extra": {"region": "cn-x"}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps(conn))
    monkeypatch.setenv(settings.MIRROR_DIR, str(tmp_path / "mirror"))
    monkeypatch.setattr(oss, "OssStore", RecordingStore)
    RecordingStore.objects, RecordingStore.calls = {}, []
    before = _environ()
    yield RecordingStore
    assert _environ() == before


def _check(recorded, ops: set[str]) -> None:
    assert ops <= {op for op, _, _ in recorded.calls}, recorded.calls
    empty = dict.fromkeys(NAMES)
    for op, key_id, seen in recorded.calls:
        assert key_id == OSS_KEY_ID, (op, "the connection's key was not handed to the client")
        assert seen == empty, (op, "the store's variables were in os.environ during the call", seen)


def test_progress_checkpoint_and_tracking_reads_hand_the_credentials(recorded):
    import asyncio
    import logging

    from operators import progress
    from operators.backends import training_result

    run = "oss://test-bucket/runs/r1"
    recorded.objects[f"{run}/metrics.jsonl"] = b'{"step": 1, "data": {"critic/score/mean": 0.5}}\n'
    recorded.objects[f"{run}/checkpoints/latest_checkpointed_iteration.txt"] = b"1\n"
    tracker = progress.ProgressTracker(f"{run}/metrics.jsonl", store_conn_id=CONN)
    asyncio.run(tracker.poll(logging.getLogger("test")))
    assert tracker.last_step == 1
    result = training_result({"backend": "kuberay"}, f"{run}/checkpoints", f"{run}/metrics.jsonl", CONN)
    assert result["checkpoint_step"] == 1
    assert progress.read_text(f"{run}/checkpoints/mlflow_run.json", CONN) is None
    _check(recorded, {"open", "read"})


def test_step_operator_mirror_upload_and_summary_hand_the_credentials(recorded, tmp_path):
    from operators.cluster_step import PipelineStepJobOperator
    from pipeline_steps.store import mirror
    from tests.helpers.rayjob_operators import train_plan

    recorded.objects["oss://test-bucket/in/data.txt"] = b"rows"
    recorded.objects["oss://test-bucket/tmp/step-summaries/job-1.json"] = json.dumps(
        {"exit_code": 0, "summary": {"ok": True}}
    ).encode()
    with DAG("t_handed", schedule=None):
        op = PipelineStepJobOperator(
            task_id="evaluate",
            step="evaluate",
            plan=train_plan("local_tiny", "local", f"file://{tmp_path}/store"),  # the local backend: in the worker
            request={"args": ["--data", "oss://test-bucket/in/data.txt", "--output", "oss://test-bucket/out"]},
            uri_args=("--data", "--output"),
            output_args=("--output",),
            store_uri="oss://test-bucket",
            store_conn_id=CONN,
        )
    op._mirror_inputs()
    args = op.request["args"]
    assert open(args[1]).read() == "rows" and args[3] == str(mirror.local_for("oss://test-bucket/out"))
    (mirror.local_for("oss://test-bucket/out") / "results.json").parent.mkdir(parents=True, exist_ok=True)
    (mirror.local_for("oss://test-bucket/out") / "results.json").write_text("{}")
    op.finish({}, {})
    assert "oss://test-bucket/out/_manifest.json" in recorded.objects
    assert op.read_summary("job-1") == {"exit_code": 0, "summary": {"ok": True}}
    _check(recorded, {"open", "read", "upload"})


def test_train_preflight_is_handed_the_credentials(recorded, monkeypatch, tmp_path):
    from operators.train import GRPOTrainOperator
    from pipeline_steps.training import preflight_checks
    from tests.helpers.rayjob_operators import train_plan

    seen = {}

    def preflight(exp, *, check_store=True, store_credentials=None):
        seen.update(handed=dict(store_credentials or {}), environ=_store_environ())
        raise RuntimeError("stop after pre-flight")

    monkeypatch.setattr(preflight_checks, "preflight", preflight)
    run = train_plan("local_tiny", "local", f"file://{tmp_path}/store")
    with DAG("t_handed_train", schedule=None):
        op = GRPOTrainOperator(
            task_id="train",
            plan=run,
            train_files=["oss://test-bucket/datasets/d/train.parquet"],
            model_path="oss://test-bucket/models/m",
            run_dir="oss://test-bucket/runs/r1",
            store_conn_id=CONN,
        )
    with pytest.raises(RuntimeError, match="stop after pre-flight"):
        op.execute({"run_id": "r"})
    assert seen["handed"]["OSS_ACCESS_KEY_ID"] == OSS_KEY_ID and seen["handed"]["PIPELINE_STORE_CONN_ID"] == CONN
    assert seen["environ"] == dict.fromkeys(NAMES)


def test_the_plan_tasks_hand_the_credentials(recorded):
    """The two DAGs' plan tasks: the pipeline's saves plan.json, the evaluation DAG's reads a dataset's pointer."""
    from operators.hooks.store_connection import StoreHook
    from pipeline_steps.planning import evaluation_run, plan, plan_io

    store = "oss://test-bucket/store"
    creds = StoreHook(CONN).credentials(store)
    run = plan.plan({"experiment": "local_tiny", "backend": "local", "store_uri": store}, None, "r1", "d")
    uri = plan_io.save(run, creds)
    assert json.loads(recorded.objects[uri])["run_dir"] == run["run_dir"]
    pointer = f"{store}/datasets/gsm8k/last_processed.json"
    recorded.objects[pointer] = json.dumps({"uri": f"{store}/datasets/gsm8k/c/h"}).encode()
    params = {"store_uri": store, "model_uri": f"{store}/models/m", "eval_dataset": "gsm8k"}
    params.update(k=1, temperature=1.0, top_p=1.0, max_new_tokens=8)
    ev = evaluation_run.evaluation_plan(params, None, "r2", "e", creds)
    assert ev["data"] == f"{store}/datasets/gsm8k/c/h/test.parquet"
    _check(recorded, {"open", "read", "write"})


def test_the_gcs_client_reaches_the_emulator_only_handed(gcs_server, monkeypatch):
    """The library reads ``STORAGE_EMULATOR_HOST`` from the environment itself: handed, it is passed as the endpoint."""
    from pipeline_steps.store import open_store

    for k in NAMES:
        monkeypatch.delenv(k, raising=False)
    before = _environ()
    gcs = open_store("gs://test-bucket/handed", credentials=gcs_server.env())
    gcs.write_bytes("gs://test-bucket/handed/b.txt", b"handed too")
    assert gcs.read_bytes("gs://test-bucket/handed/b.txt") == b"handed too"
    assert _environ() == before


def test_the_oss_client_reaches_the_store_with_the_connections_credentials_only_handed(oss_server, monkeypatch):
    from operators.hooks.store_connection import StoreHook

    for k in NAMES:
        monkeypatch.delenv(k, raising=False)
    conn = {
        "conn_type": "alibaba_cloud",
        "login": OSS_KEY_ID,
        "password": OSS_SECRET,
        "extra": {"region": OSS_REGION, "endpoint": oss_server.endpoint},
    }
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps(conn))
    before = _environ()
    store = StoreHook(CONN).open("oss://test-bucket/handed")
    store.write_bytes("oss://test-bucket/handed/a.txt", b"handed")
    assert store.read_bytes("oss://test-bucket/handed/a.txt") == b"handed"
    assert _environ() == before
    from pipeline_steps.errors import UserError
    from pipeline_steps.store.oss import OssStore

    wrong = {**StoreHook(CONN).credentials("oss://test-bucket"), "OSS_ACCESS_KEY_SECRET": "wrong"}
    with pytest.raises(UserError, match=CONN):  # errors name the connection handed (no variable in the environment)
        OssStore(store.root, wrong).read_bytes("oss://test-bucket/handed/a.txt")
