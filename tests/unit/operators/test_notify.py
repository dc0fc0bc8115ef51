"""The failure notice: one paragraph (step, dataset or job, error line, what to do), posted to a webhook when
configured.

Real parts: a real HTTP server on 127.0.0.1 receives the POSTs; the webhook connection is read by Airflow's own
environment-variable secrets backend (``AIRFLOW_CONN_PIPELINE_WEBHOOK``); the unit-level contexts are built from a
real ``PipelineStepOperator`` and Airflow's ``RuntimeTaskInstance`` (crafted: no task runner behind them, so XCom is
unreachable there, which the notice must survive). The last test runs ``airflow dags test`` on a small probe DAG
(written to a temporary dags folder, SQLite metadata DB) so the real task runner calls the callback with its real
context and real XCom.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pendulum
import pytest

from operators import notify

ROOT = Path(__file__).resolve().parents[3]
DAG_FILE = ROOT / "dags" / "verl_grpo_pipeline.py"
SECRET = "s3cr3t-path-token"


class Hook:
    """A webhook receiver: records each request; ``status`` and ``delay`` set how it answers."""

    def __init__(self):
        self.requests: list[dict] = []
        self.status, self.delay = 200, 0.0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hook.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                time.sleep(hook.delay)
                self.send_response(hook.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):  # keep the test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def texts(self) -> list[str]:
        return [json.loads(r["body"])["text"] for r in self.requests]

    def close(self):
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


@pytest.fixture
def no_webhook(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_PIPELINE_WEBHOOK", raising=False)


def step_context(task_id="preprocess", dataset="gsm8k", error=None, try_number=3, retries=2, rendered=None):
    """A task-failure context as the task runner builds it, from a real operator and task instance."""
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    from operators.step import PipelineStepOperator

    op = PipelineStepOperator(
        task_id=task_id,
        step=task_id.replace("_", "-"),
        request={"args": ["--dataset", dataset], "carry": {"dataset": dataset, "role": "train"}},
    )
    ti = RuntimeTaskInstance.model_construct(
        id=uuid.uuid4(),
        task=op,
        dag_id="verl_grpo_pipeline",
        run_id="manual__2026-03-01",
        task_id=task_id,
        try_number=try_number,
        map_index=1,
        max_tries=retries,
        rendered_map_index=rendered,
        start_date=pendulum.now("UTC"),
    )
    if error is None:
        error = AirflowFailException(
            f'step {task_id}: 12% of rows rejected (threshold 5%)\n  File "x.py", line 3\nsecond line'
        )
    return {"ti": ti, "task_instance": ti, "task": op, "run_id": ti.run_id, "exception": error}


def test_paragraph_names_step_dataset_first_error_line_and_hint(no_webhook):
    text = notify.paragraph(step_context())
    assert "\n" not in text
    assert "verl_grpo_pipeline" in text and "manual__2026-03-01" in text
    assert "step preprocess failed (dataset gsm8k, try 3 of 3)" in text
    assert "Error: AirflowFailException: step preprocess: 12% of rows rejected (threshold 5%)." in text
    assert "second line" not in text and "x.py" not in text
    assert text.endswith(f"What to do: {notify.HINTS['preprocess']}.")
    assert "rejected.jsonl" in text and "stats.json" in text


def test_rendered_map_index_wins_and_dag_level_context_works(no_webhook):
    ctx = step_context(task_id="upload_dataset", rendered="dapo_math@a1b2c3")
    assert "(dataset dapo_math@a1b2c3, try 3 of 3)" in notify.paragraph(ctx)

    from airflow.sdk import DAG

    text = notify.paragraph(
        {"dag": DAG("verl_grpo_pipeline", schedule=None), "run_id": "scheduled__x", "reason": "task_failure"}
    )
    assert text.startswith("Airflow DAG verl_grpo_pipeline, run scheduled__x failed.")
    assert "Error: the DAG run failed (task_failure)." in text


def test_every_task_of_the_pipeline_has_its_own_hint():
    import runpy

    dag = runpy.run_path(str(DAG_FILE))["dag"]
    generic = [t for t in dag.task_ids if notify.hint_for(t) == notify.DEFAULT_HINT]
    assert not generic, f"tasks without a specific hint: {generic}"
    assert "revision" in notify.hint_for("download") and "store connection" in notify.hint_for("upload_dataset")
    assert "store connection" in notify.hint_for("stage_model") and "Ray dashboard" in notify.hint_for("train")


def test_webhook_from_env_connection_receives_the_paragraph(hook, monkeypatch, caplog):
    monkeypatch.setenv(
        "AIRFLOW_CONN_PIPELINE_WEBHOOK", f"http://bot:{SECRET}@127.0.0.1:{hook.port}/hooks/T0/{SECRET}?token={SECRET}"
    )
    ctx = step_context(
        task_id="download",
        dataset="aime2024",
        error=RuntimeError("Repository Not Found for url: https://huggingface.co/api/datasets/x"),
    )
    with caplog.at_level(logging.INFO, logger="operators.notify"):
        notify.notify_failure(ctx)
    assert len(hook.requests) == 1
    req = hook.requests[0]
    assert req["path"] == f"/hooks/T0/{SECRET}?token={SECRET}"
    assert req["headers"]["Content-Type"] == "application/json"
    assert req["headers"]["Authorization"] == "Basic " + base64.b64encode(f"bot:{SECRET}".encode()).decode()
    (text,) = hook.texts()
    assert text == notify.paragraph(ctx)
    assert "step download failed (dataset aime2024" in text and notify.HINTS["download"] in text
    logged = [r.getMessage() for r in caplog.records]
    assert text in logged  # the same paragraph, as one log record
    assert f"failure notice posted to http://127.0.0.1:{hook.port} (connection 'pipeline_webhook')" in logged
    assert SECRET not in caplog.text and "/hooks" not in caplog.text


def test_registered_secrets_are_masked_in_log_and_webhook(hook, monkeypatch, caplog):
    from airflow.sdk.log import mask_secret

    monkeypatch.setenv("AIRFLOW_CONN_PIPELINE_WEBHOOK", f"http://127.0.0.1:{hook.port}/x")
    mask_secret("oss-key-ABCDEF123456")  # as Airflow does for every connection password it hands out
    ctx = step_context(
        task_id="upload_dataset", error=RuntimeError("403 for access key oss-key-ABCDEF123456 on bucket b")
    )
    with caplog.at_level(logging.INFO, logger="operators.notify"):
        notify.notify_failure(ctx)
    (text,) = hook.texts()
    assert "403 for access key *** on bucket b" in text and "ABCDEF123456" not in caplog.text


def test_webhook_url_in_extra_and_another_conn_id(hook, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_TEAM_HOOK",
        json.dumps({"conn_type": "http", "extra": {"url": f"http://127.0.0.1:{hook.port}/in"}}),
    )
    notify.FailureNotifier(conn_id="team_hook")(step_context(task_id="train", error=RuntimeError("RayJob r-1 failed")))
    assert [r["path"] for r in hook.requests] == ["/in"]
    assert "Ray dashboard" in hook.texts()[0]


def test_no_webhook_configured_logs_only(hook, no_webhook, caplog):
    with caplog.at_level(logging.INFO, logger="operators.notify"):
        notify.notify_failure(step_context())
    assert hook.requests == []
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == notify.paragraph(step_context()) and caplog.records[0].levelno == logging.ERROR
    assert "no connection 'pipeline_webhook': failure notice logged only" in messages


@pytest.mark.parametrize("mode", ["http_500", "timeout", "refused"])
def test_failing_webhook_is_logged_never_raised(hook, monkeypatch, caplog, mode):
    port = hook.port
    if mode == "http_500":
        hook.status = 500
    elif mode == "timeout":
        hook.delay = 30.0  # far beyond the 0.5 s timeout: an answer in under 10 s proves the client gave up
    else:
        hook.close()  # nothing listens on the port any more
    monkeypatch.setenv(
        "AIRFLOW_CONN_PIPELINE_WEBHOOK",
        json.dumps(
            {
                "conn_type": "http",
                "host": "127.0.0.1",
                "port": port,
                "schema": f"x/{SECRET}",
                "extra": {"timeout": 0.5, "token": SECRET},
            }
        ),
    )
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="operators.notify"):
        notify.notify_failure(step_context())  # must not raise
    assert time.monotonic() - t0 < 10  # bounded by the connection's timeout, not by the receiver (30 s)
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = {"http_500": "answered HTTP 500", "timeout": "(ReadTimeout)", "refused": "(ConnectionError)"}[mode]
    assert len(warning) == 1 and expected in warning[0] and f"http://127.0.0.1:{port}" in warning[0]
    assert SECRET not in caplog.text


@pytest.mark.slow
def test_real_task_runner_calls_it_with_xcom_and_posts(hook, tmp_path):
    """``airflow dags test`` of a probe DAG: a mapped step that fails on bad input and a train task that pushed
    its job."""
    dags, home = tmp_path / "dags", tmp_path / "home"
    dags.mkdir()
    (dags / "notify_probe.py").write_text(
        textwrap.dedent(f"""
        import pendulum
        from airflow.sdk import dag, task
        from operators.notify import notify_failure
        from operators.step import PipelineStepOperator

        @dag(dag_id="notify_probe", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False,
             on_failure_callback=notify_failure, default_args={{"on_failure_callback": notify_failure, "retries": 0}})
        def notify_probe():
            step = dict(task_id="download", step="download", hf_conn_id=None, store_conn_id=None)
            args = ["--dataset", "nosuch", "--dest", {str(tmp_path / "snap")!r}]
            PipelineStepOperator.partial(**step).expand(request=[{{"args": args, "carry": {{"dataset": "nosuch"}}}}])

            @task(task_id="train")
            def train(ti=None):
                ti.xcom_push(key="job", value="verl-grpo-abc123")
                raise RuntimeError(
                    "RayJob verl-grpo-abc123 ended FAILED: worker OOM\\nTraceback line that must not appear"
                )

            train()

        dag = notify_probe()
    """)
    )
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_CONN_PIPELINE_WEBHOOK": f"http://127.0.0.1:{hook.port}/hooks/{SECRET}?token={SECRET}",
    }
    airflow = str(Path(sys.executable).with_name("airflow"))
    p = subprocess.run([airflow, "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([airflow, "dags", "test", "notify_probe"], env=env, capture_output=True, text=True, timeout=400)
    output = p.stdout + p.stderr
    assert "DagRun Finished" in output and "state=failed" in output, output[-3000:]

    texts = hook.texts()
    assert all(r["path"] == f"/hooks/{SECRET}?token={SECRET}" for r in hook.requests)
    download = [t for t in texts if "step download failed" in t]
    train = [t for t in texts if "step train failed" in t]
    assert len(download) == 1 and len(train) == 1, texts
    assert "(dataset nosuch, try 1 of 1)" in download[0]
    assert "--dataset 'nosuch' is not a known dataset" in download[0] and notify.HINTS["download"] in download[0]
    assert "(job verl-grpo-abc123, try 1 of 1)" in train[0]
    assert "Error: RuntimeError: RayJob verl-grpo-abc123 ended FAILED: worker OOM." in train[0]
    assert "Traceback line" not in train[0]
    assert len(texts) == 2, texts  # `dags test` ran the two task callbacks here, not the DAG-level one
    assert download[0] in output and train[0] in output  # logged too
    assert SECRET not in output
