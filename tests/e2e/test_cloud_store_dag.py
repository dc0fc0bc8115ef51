"""The whole DAG on a cloud store: ``verl_grpo_pipeline`` then ``verl_evaluate_model``, both through real Airflow
(``airflow dags test``) on the local backend, with the store on the OSS test server and on fake-gcs-server.

The worker gets the store's credentials only from the Airflow connection (``AIRFLOW_CONN_PIPELINE_STORE``, the
Helm values' shape): no ``OSS_*``/``STORAGE_EMULATOR_HOST`` variable is in Airflow's environment, so every place
the worker itself opens the store (collect_inputs, pre-flight, progress, report, the evaluation DAG's plan) must go
through the store hook. Stand-ins: the OSS test server (an OSS-dialect layer over moto) and fake-gcs-server stand for
Alibaba OSS and Google Cloud Storage, which cannot be reached from here; the Hugging Face Hub is the offline cache.

The GCS run also trains on a user's own JSONL files chosen in the trigger form, read from the bucket (``gs://``):
``{"train_jsonl": ..., "validation_jsonl": ...}`` instead of the preset's gsm8k. They go through download (versioned
by their content), preprocess (train and validation splits, ``rollout_extra`` a struct) and upload (a dataset version
in the store, emitted as an Asset named like the registry datasets'); the run trains on the train split and validates
on the validation split. (tests/unit/pipeline_steps/data/test_user_jsonl.py runs Hub files, pinned and unpinned,
through the same download and preprocess steps.) The same run shows the plan made once (issue 25): run under
:mod:`tests.helpers.count_plan_calls`, it reads its preset, resolves its backend and turns its form (the files and a
learning rate) into verl overrides once each, in the ``plan`` task; every later task reads the plan (XCom, and
``plan.json`` in the run directory, which the lineage matches).

The OSS run trains the local tool-agent preset (``local_tiny_tool_agent``), which proves its plumbing, not learning:
the dataset step writes ``tool_agent`` rows (system prompt naming the tool, ``agent_name``, ``tools_kwargs``), the
trainer starts the local sandbox server itself (no ``E2B_*`` endpoint set) and rolls out through verl's
``ToolAgentLoop``, the step's trajectories land in ``rollouts/<step>.jsonl`` of the run directory, the report has its
Trajectories section, and the sandbox server ends with the step. The randomly initialised tiny model practically
never writes a well-formed ``<tool_call>``, so whether the tool is called is not asserted here;
tests/e2e/test_agent_grpo_cpu.py scripts a call, and tests/e2e/test_tool_learning.py shows a policy learning to call.
One whole-DAG run serves each set of claims: each costs minutes of make test's two cores.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.airflow_cli import dags_test
from tests.helpers.count_plan_calls import assert_launched_as_planned
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


def _gcs_bucket(server):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="test-project", credentials=AnonymousCredentials(), client_options={"api_endpoint": server.url}
    )
    return client.bucket("test-bucket")


def _jsonl(items) -> bytes:
    return b"".join(
        json.dumps(
            {
                "messages": [{"role": "user", "content": f"What is the largest of {a}, {b} and {c}? Answer: N"}],
                "rollout_extra": {"solution": str(max(a, b, c)), "digits": [a, b, c]},
            }
        ).encode()
        + b"\n"
        for a, b, c in items
    )


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
    return [b.name for b in _gcs_bucket(server).list_blobs(prefix=prefix)]


@pytest.mark.budget(900)  # 460 s (oss) and 424 s (gcs) in make test at a load average of 10
@pytest.mark.parametrize(
    "kind",
    [
        # the tool-agent preset's sandbox server jails each sandbox (uids, namespaces)
        pytest.param("oss", marks=pytest.mark.needs_root(reason="the local sandbox server needs root")),
        "gcs",
    ],
)
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
    experiment = "local_tiny_tool_agent" if kind == "oss" else "local_tiny"
    conf = {"experiment": experiment, "backend": "local", "datasets": ["gsm8k"], "smoke": True}
    dataset = "gsm8k"
    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL"):
        env.pop(k, None)  # no sandbox service configured: the tool-agent trainer must start the local one
    if kind == "gcs":  # the form's JSONL files, in the bucket
        train, val = (
            _jsonl([(i % 10, (3 * i) % 10, (7 * i) % 10) for i in range(20)]),
            _jsonl([(i, 9 - i, 4) for i in range(6)]),
        )
        bucket = _gcs_bucket(server)
        for name, data in (("my_arith.jsonl", train), ("my_arith_val.jsonl", val)):
            bucket.blob(f"{prefix}-user/{name}").upload_from_string(data)
        user = f"gs://test-bucket/{prefix}-user"
        conf = {
            "experiment": "local_tiny",
            "smoke": True,
            "learning_rate": 1e-5,
            "train_jsonl": f"{user}/my_arith.jsonl",
            "validation_jsonl": f"{user}/my_arith_val.jsonl",
        }
        dataset = "my_arith"
        # the version is the files' content: sha256 over split name and each file's sha256
        h = hashlib.sha256()
        for split, data in (("train", train), ("validation", val)):
            h.update(f"{split}\0{hashlib.sha256(data).hexdigest()}\0".encode())
        revision = h.hexdigest()[:16]
    counts_file = tmp_path / "counts.json"
    env["PIPELINE_CALL_COUNTS"] = str(counts_file)
    try:
        counted = [sys.executable, "-m", "tests.helpers.count_plan_calls"]
        rc = dags_test(counted, "verl_grpo_pipeline", conf, env, tmp_path / "pipeline.log")
        log = (tmp_path / "pipeline.log").read_text()
        assert rc == 0, log[-6000:]
        db = airflow_home / "airflow.db"
        run_id = newest_run(db, "verl_grpo_pipeline")
        states = task_states(db, run_id)
        # export is skipped when the gate does not promote (the tiny model rarely beats its base); all else succeeds
        assert states and all(s == "success" for t, s in states.items() if t != "export[-1]"), states
        exported = xcom(db, run_id, "export")[0]["export"]  # pushed before a skip too
        assert states["export[-1]"] == ("success" if exported["promoted"] else "skipped"), (states, exported)

        uploads = {u["dataset"]: u for u in xcom(db, run_id, "upload_dataset")}
        assert set(uploads) == {dataset, "aime2024"}, uploads.keys()  # the form's file instead of gsm8k, for gcs
        upload = uploads[dataset]["upload"]
        assert upload["uri"].startswith(f"{scheme}://test-bucket/{prefix}/datasets/{dataset}/")
        if kind == "gcs":
            _check_jsonl_run(uploads[dataset], revision, prefix, db, run_id, server)
        else:
            _check_tool_agent_run(upload, prefix, db, run_id, server, home)
        # planned once: the preset read, the backend resolved and the overrides computed in the plan task only
        recorded = json.loads(counts_file.read_text())
        assert recorded["counts"] == {"preset_loads": 1, "backend_resolutions": 1, "overrides_computations": 1}, (
            recorded
        )
        plan = xcom(db, run_id, "plan", "run")[0]
        # every step ran the argv the plan recorded (placeholders filled in from upstream results only)
        with sqlite3.connect(db) as c:  # two suites on one machine once made the train task retry (a second launch)
            (attempts,) = c.execute(
                "SELECT try_number FROM task_instance WHERE run_id=? AND task_id='train'", (run_id,)
            ).fetchone()
        assert_launched_as_planned(plan, recorded, train_attempts=attempts)
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
            f"/datasets/{dataset}/",
            "/models/local/tiny/",
            f"/models/exported/{experiment}/step",  # export ran: the merged model is stored (promoted or a candidate)
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
        if kind == "gcs":  # no gsm8k in this store: the form's own evaluation file, the user's validation split
            conf = {
                "model_uri": model,
                "eval_data_uri": f"{upload['uri']}/validation.parquet",
                "k": 1,
                "max_new_tokens": 8,
            }
        env.pop("PIPELINE_CALL_COUNTS")
        rc = dags_test(airflow, "verl_evaluate_model", conf, env, tmp_path / "evaluate.log")
        assert rc == 0, (tmp_path / "evaluate.log").read_text()[-6000:]
        run_id = newest_run(db, "verl_evaluate_model")
        states = task_states(db, run_id)
        assert states and all(s == "success" for s in states.values()), states
    finally:
        stop_services(home)  # the local Ray cluster and MLflow server the run started


def _check_jsonl_run(mine: dict, revision: str, prefix: str, db: Path, run_id: str, server) -> None:
    """The GCS run's JSONL dataset: versioned by its content, uploaded, registered, trained and validated on."""
    import io

    import pyarrow.parquet as pq

    from scripts.local_profile import xcom

    bucket = _gcs_bucket(server)

    def read(uri: str) -> bytes:
        return bucket.blob(uri.removeprefix("gs://test-bucket/")).download_as_bytes()

    assert mine["role"] == "train" and mine["download"]["commit"] == revision
    content = mine["preprocess"]["content_hash"]
    base = mine["upload"]["uri"]
    assert base == f"gs://test-bucket/{prefix}/datasets/my_arith/{revision}/{content[:16]}"
    with sqlite3.connect(db) as c:
        assets = {a for (a,) in c.execute("SELECT name FROM asset")}
    assert f"my_arith@{revision[:7]} ({content[:7]})" in assets, assets

    # trained on its train split, validated on its validation split
    inputs = {k: xcom(db, run_id, "collect_inputs", k)[0] for k in ("train_files", "val_files")}
    assert inputs == {"train_files": [f"{base}/train.parquet"], "val_files": [f"{base}/validation.parquet"]}
    rows = pq.read_table(io.BytesIO(read(f"{base}/validation.parquet"))).to_pylist()
    assert len(rows) == 6  # smoke: at most 8 rows per split
    assert rows[0]["extra_info"]["rollout_extra"] == {"digits": [0, 9, 4], "solution": "9"}
    plan = xcom(db, run_id, "plan", "run")[0]
    metrics = [json.loads(x) for x in read(f"{plan['run_dir']}/metrics.jsonl").decode().splitlines()]
    val_keys = {k for m in metrics for k in m["data"] if k.startswith("val-core/math_dapo/")}
    assert val_keys, [sorted(m["data"]) for m in metrics][:1]
    assert any("critic/score/mean" in m["data"] for m in metrics)  # and a training step ran

    # the plan in the run directory is the plan every task read; the lineage records it
    assert json.loads(read(f"{plan['run_dir']}/plan.json")) == plan
    assert plan["backend"] == "local" and plan["overrides"][0] == "actor_rollout_ref.actor.optim.lr=1e-05"
    lineage = json.loads(read(f"{plan['run_dir']}/lineage.json"))
    assert lineage["experiment"]["preset_sha256"] == plan["preset_sha256"]
    assert lineage["experiment"]["overrides"] == plan["overrides"]


def _oss_read(server, uri: str) -> bytes:
    import alibabacloud_oss_v2 as oss

    key = uri.removeprefix("oss://test-bucket/")
    return server.client().get_object(oss.GetObjectRequest(bucket="test-bucket", key=key)).body.read()


def _check_tool_agent_run(upload: dict, prefix: str, db: Path, run_id: str, server, home: Path) -> None:
    """The OSS run's tool-agent plumbing: tool agent rows, the local sandbox server started and stopped by the
    training step, one step's trajectories in the run directory, the report's Trajectories section."""
    import pyarrow.parquet as pq

    from scripts.local_profile import ray_temp_dir, xcom

    # the uploaded training rows are tool agent rows
    rows = pq.read_table(io.BytesIO(_oss_read(server, f"{upload['uri']}/train.parquet"))).to_pylist()
    assert rows and all(r["agent_name"] == "tool_agent" for r in rows), rows[:1]
    assert rows[0]["prompt"][0]["role"] == "system" and "code_interpreter" in rows[0]["prompt"][0]["content"]
    assert "code_interpreter" in rows[0]["extra_info"]["tools_kwargs"], rows[0]["extra_info"]

    # the trainer started the local sandbox server, and it ended with the step (the training job's own log: Ray keeps
    # the driver's output in the local cluster's directory)
    drivers = sorted((ray_temp_dir(home) / "session_latest" / "logs").glob("job-driver-*train*.log"))
    job_log = "".join(p.read_text(errors="replace") for p in drivers)
    started = re.search(r"started the local sandbox server for the code tool: http://[\w.]+:(\d+)", job_log)
    assert started, (drivers, job_log[-3000:])
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"sandbox-server --port {started.group(1)}" not in ps, "the local sandbox server outlived the training step"

    # the step's trajectories, in the run directory in the store
    plan = xcom(db, run_id, "plan", "run")[0]
    assert plan["run_dir"].startswith(f"oss://test-bucket/{prefix}/runs/"), plan["run_dir"]
    dumps = _listing("oss", server, plan["run_dir"].removeprefix("oss://test-bucket/") + "/rollouts/")
    assert [k.rsplit("/", 1)[-1] for k in dumps] == ["1.jsonl"], dumps  # smoke: one training step
    samples = [json.loads(line) for line in _oss_read(server, dumps[0]).decode().splitlines()]
    assert len(samples) == 2 * 4, len(samples)  # data.train_batch_size 2, rollout.n 4
    assert all("num_turns" in s and "turns" in s and s["turns"][0]["role"] == "assistant" for s in samples)

    report = xcom(db, run_id, "report")[0]["report"]
    md = _oss_read(server, report["report"]).decode()
    assert "## Trajectories" in md, md[:2000]
