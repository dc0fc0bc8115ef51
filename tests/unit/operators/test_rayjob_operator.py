"""The train task on the kuberay backend (``GRPOTrainOperator``) and its ``RayJobTrigger`` against a stand-in
Kubernetes API server: submit, defer, progress, failure, resume, re-attach, cancellation, validation.

No Kubernetes API server can run here, so the operator's real client code (the
cncf-kubernetes ``KubernetesHook`` on the ``kubernetes`` package, and ``kubernetes_asyncio``
in the trigger) talks HTTP to ``tests/helpers/k8s_api_stand_in.py`` through an Airflow connection
(``AIRFLOW_CONN_K8S_STANDIN``) whose kube config points at ``http://127.0.0.1:PORT``. A
scripted controller in the stand-in moves status the way KubeRay does; see its docstring
for what it does not cover (admission webhooks, the real controller, schema defaulting). The RayJob is the one the
product renders from a shipped preset, after the real pre-flight (``tests/helpers/rayjob_operators.py``); the worker
reads the run directory through the bucket mount (no bucket here).

The operator is driven for real, the way Airflow runs a deferrable task:
``execute`` -> ``TaskDeferred`` -> the trigger's async generator (``run()``) -> ``execute_complete``.
The context holds only ``run_id`` (no task instance), so the dashboard-link XCom push is not exercised here.
"""

from __future__ import annotations

import asyncio
import shlex

import pytest
from airflow.sdk.exceptions import AirflowFailException

from operators.backends import GROUP_LABEL
from operators.failures import JobFailed
from operators.train import GRPOTrainOperator
from operators.triggers.kuberay_job import RayJobTrigger
from tests.helpers.deferral import deferred, run_trigger
from tests.helpers.k8s_api_stand_in import SUCCESS
from tests.helpers.k8s_connection import K8S_CONN_ID, K8S_NAMESPACE, RAYJOB_CRD
from tests.helpers.rayjob_operators import (
    CONTEXT,
    RUN_DIR,
    job_name,
    kuberay_deployment,
    make_op,
    preflight_once,
    rayjob_body,
)

CRD = RAYJOB_CRD
CONN, NS = K8S_CONN_ID, K8S_NAMESPACE


@pytest.fixture
def api(k8s_api):
    return k8s_api


@pytest.fixture
def run_dir(monkeypatch, tmp_path):
    """The run directory at its mount path (where the stand-in writes metrics and a test writes checkpoints)."""
    preflight_once(monkeypatch)
    return kuberay_deployment(monkeypatch, tmp_path)


def defer(op: GRPOTrainOperator) -> RayJobTrigger:
    trigger = deferred(op, CONTEXT)
    assert isinstance(trigger, RayJobTrigger)
    return trigger


def render_then(monkeypatch, change) -> None:
    """The real render, then ``change`` applied to its body (a body the API server or KubeRay refuses)."""
    from pipeline_steps.training import rayjob_manifest

    real = rayjob_manifest.build_rayjob

    def build_rayjob(*args, **kwargs):
        body = real(*args, **kwargs)
        change(body)
        return body

    monkeypatch.setattr(rayjob_manifest, "build_rayjob", build_rayjob)


def metrics_row(step: int, score: float) -> dict:
    return {
        "step": step,
        "data": {
            "critic/score/mean": score,
            "actor/entropy": 1.5 - step / 10,
            "response_length/mean": 12.0,
            "perf/throughput": 100.0 + step,
            "timing_s/step": 2.5,
            "training/global_step": step,
        },
    }


def test_success_reports_progress_and_returns_xcom(api, run_dir, capsys):
    name = job_name("grpo_ok")
    api.script(
        name,
        [
            {"jobDeploymentStatus": "Initializing"},
            {"jobDeploymentStatus": "Running", "jobStatus": "PENDING"},
            {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "log": ["loading model", "step:1 - score:0.25"],
                "metrics": [metrics_row(1, 0.25)],
            },
            {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "log": ["step:2 - score:0.5"],
                "metrics": [metrics_row(2, 0.5)],
            },
            {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "log": ["training done"]},
        ],
        metrics_file=run_dir / "metrics.jsonl",
    )
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    op = make_op("grpo_ok")
    event = run_trigger(defer(op))
    assert api.count_creates(name) == 1
    assert event["status"] == "success" and event["job_status"] == "SUCCEEDED"
    assert event["log_tail"][-1] == "training done"
    text = capsys.readouterr().out  # Airflow's structlog writes task and trigger logs to stdout here
    assert "progress step 1: critic/score/mean=0.25" in text and "progress step 2: critic/score/mean=0.5" in text
    assert "job log | loading model" in text and text.count("job log | step:1 - score:0.25") == 1  # no repeats
    out = op.execute_complete(CONTEXT, event)
    assert "job log |" not in capsys.readouterr().out  # the resumed task does not print the job's log a second time
    assert out["last_step"] == 2 and out["checkpoint_step"] == 2
    assert out["metrics"]["critic/score/mean"] == 0.5 and out["metrics"]["perf/throughput"] == 102.0
    assert out["checkpoint_uri"] == f"{RUN_DIR}/checkpoints" and out["backend"] == "kuberay"
    # the created object carries the attempt labels and went through the CRD schema check
    created = api.creates[0]
    assert created["metadata"]["labels"][GROUP_LABEL] == name and created["metadata"]["namespace"] == NS


@pytest.mark.parametrize(
    "final, expect",
    [
        (  # KubeRay v1.7.0 (rayjob_controller.go): a failed application ends Failed with reason AppFailed
            {
                "jobDeploymentStatus": "Failed",
                "jobStatus": "FAILED",
                "reason": "AppFailed",
                "message": "Job entrypoint command failed with exit code 1",
            },
            ["jobDeploymentStatus=Failed", "jobStatus=FAILED", "reason=AppFailed", "exit code 1"],
        ),
        (
            {"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED", "message": "Job was stopped"},
            ["jobStatus=STOPPED"],
        ),
        (
            {
                "jobDeploymentStatus": "Failed",
                "jobStatus": "RUNNING",
                "reason": "DeadlineExceeded",
                "message": "The RayJob has passed the activeDeadlineSeconds. DeadlineExceeded",
            },
            ["reason=DeadlineExceeded", "activeDeadlineSeconds"],
        ),
    ],
)
def test_terminal_failures_fail_with_reason_and_message(api, run_dir, final, expect):
    name = job_name("grpo_bad")
    api.script(
        name,
        [{"jobDeploymentStatus": "Initializing"}, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, final],
    )
    op = make_op("grpo_bad")
    event = run_trigger(defer(op))
    assert event["status"] == "error"
    with pytest.raises(JobFailed) as exc:
        op.execute_complete(CONTEXT, event)
    for fragment in [f"RayJob {name} failed", *expect]:
        assert fragment in str(exc.value)


def test_validation_failed_fails_without_retry(api, run_dir):
    api.script(
        job_name("grpo_invalid"),
        [
            {
                "jobDeploymentStatus": "ValidationFailed",
                "reason": "ValidationFailed",
                "message": "The RayJob spec is invalid: entrypoint must be set in K8sJobMode",
            }
        ],
    )
    op = make_op("grpo_invalid")
    event = run_trigger(defer(op))
    with pytest.raises(AirflowFailException, match="reason=ValidationFailed.*entrypoint must be set"):
        op.execute_complete(CONTEXT, event)


def test_worker_dies_mid_wait_and_retry_reattaches_without_second_create(api, run_dir):
    name = job_name("grpo_crash")
    api.script(
        name,
        [
            {"jobDeploymentStatus": "Initializing"},
            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
            {"wait_for": "worker-restarted"},
            *SUCCESS[-1:],
        ],
    )

    async def wait_until_running_then_die(trigger):
        task = asyncio.ensure_future(trigger.run().__anext__())
        for _ in range(2000):
            if (api.status(name, NS) or {}).get("jobStatus") == "RUNNING":
                break
            await asyncio.sleep(0.01)
        task.cancel()  # the worker/triggerer process dies here
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(wait_until_running_then_die(defer(make_op("grpo_crash"))))
    assert api.status(name, NS)["jobStatus"] == "RUNNING"
    api.open_gates.add("worker-restarted")
    retry = make_op("grpo_crash")  # a fresh operator object, as on a new worker
    event = run_trigger(defer(retry))
    assert event["status"] == "success" and event["name"] == name
    assert api.count_creates() == 1 and api.deletes == []
    assert retry.execute_complete(CONTEXT, event)["job"] == name


def test_retry_after_success_reattaches_and_succeeds_again(api, run_dir):
    op = make_op("grpo_done")
    assert run_trigger(defer(op))["status"] == "success"
    event = run_trigger(defer(make_op("grpo_done")))
    assert event["status"] == "success" and api.count_creates() == 1


def test_create_conflict_reattaches(api, run_dir):
    """Another worker created the RayJob between our list and our create (409): attach, do not fail."""
    from operators.hooks.rayjob_api import RayJobHook

    name = job_name("grpo_race")
    body = rayjob_body(name, "/mnt/ckpt/run1")  # created without our labels, so the list misses it
    RayJobHook(conn_id=CONN).create_rayjob(body, NS)
    trigger = defer(make_op("grpo_race"))
    assert trigger.name == name and api.count_creates() == 1
    assert run_trigger(trigger)["status"] == "success"


def test_killed_task_deletes_rayjob(api, run_dir):
    name = job_name("grpo_kill")
    api.script(name, [{"jobDeploymentStatus": "Initializing"}, {"wait_for": "never"}])
    op = make_op("grpo_kill")
    defer(op)
    assert ("training", name) in api.objects
    op.on_kill()
    assert api.deletes == [name]
    assert api.objects[("training", name)]["metadata"].get("deletionTimestamp")  # being deleted


def test_killed_deferred_task_trigger_deletes_rayjob_and_waiter_reports_it(api, run_dir):
    name = job_name("grpo_kill2")
    api.script(name, [{"jobDeploymentStatus": "Initializing"}, {"wait_for": "never"}])
    trigger = defer(make_op("grpo_kill2"))
    asyncio.run(trigger.on_kill())
    assert api.deletes == [name]
    event = run_trigger(trigger)  # a waiter that outlives the object fails with a clear message
    assert event["status"] == "error" and "was deleted while the task waited" in event["message"]


def test_retry_after_failed_attempt_resumes_from_checkpoint(api, run_dir):
    name, retry_name = job_name("grpo_resume"), job_name("grpo_resume", 1)
    api.script(
        name,
        [
            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
            {"jobDeploymentStatus": "Complete", "jobStatus": "FAILED", "message": "worker OOM"},
        ],
    )
    api.script(retry_name, SUCCESS)
    first = make_op("grpo_resume")
    event = run_trigger(defer(first))
    with pytest.raises(JobFailed, match="worker OOM"):
        first.execute_complete(CONTEXT, event)
    retry = make_op("grpo_resume")
    trigger = defer(retry)
    assert trigger.name == retry_name
    assert api.deletes == [name]  # the failed attempt and its cluster are gone
    assert api.count_creates() == 2
    old, new = api.creates
    old_args, new_args = shlex.split(old["spec"]["entrypoint"]), shlex.split(new["spec"]["entrypoint"])
    assert new_args == old_args  # the same job again: the rendered entrypoint resumes by itself
    resume = [a.split("=", 1)[1].strip("'\"") for a in new_args if a.startswith("trainer.resume_mode=")]
    assert resume == ["auto"]  # from the checkpoints in default_local_dir
    ckpt = [a for a in old_args if a.startswith("trainer.default_local_dir=")]
    assert ckpt and [a for a in new_args if a.startswith("trainer.default_local_dir=")] == ckpt
    assert new["spec"]["jobId"] == old["spec"]["jobId"] + "-r1" and new["metadata"]["labels"][GROUP_LABEL] == name
    assert run_trigger(trigger)["status"] == "success"
    # a third run (say, cleared after success) re-attaches to attempt 1: no new create
    assert defer(make_op("grpo_resume")).name == retry_name and api.count_creates() == 2


def test_invalid_body_is_rejected_by_schema(api, run_dir, monkeypatch):
    if not CRD.is_file():
        pytest.skip(f"KubeRay CRD not found at {CRD} (../shared is absent): schema check not available")
    render_then(monkeypatch, lambda body: body["spec"].update(activeDeadlineSeconds="one hour"))
    op = make_op("grpo_schema")
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as exc:
        op.execute(CONTEXT)
    assert exc.value.status == 422 and "activeDeadlineSeconds" in exc.value.body
    assert api.count_creates() == 0


@pytest.mark.parametrize(
    "middle",
    [
        [{"jobDeploymentStatus": "Suspending"}, {"jobDeploymentStatus": "Suspended"}, {"jobDeploymentStatus": "New"}],
        [
            {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed", "failed": 1},
            {"jobDeploymentStatus": "Retrying", "jobStatus": "FAILED"},
            {"jobDeploymentStatus": "Initializing"},
        ][1:],  # backoffLimit > 0: KubeRay retries with a new cluster; only Retrying is seen between polls
    ],
    ids=["suspended-by-kueue", "retrying-backoff"],
)
def test_suspended_and_retrying_are_waited_out_not_failures(api, run_dir, middle):
    api.script(
        job_name("grpo_wait"),
        [
            {"jobDeploymentStatus": "Initializing"},
            *middle,
            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
            {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"},
        ],
    )
    op = make_op("grpo_wait")
    event = run_trigger(defer(op))
    assert event["status"] == "success", event


def test_the_api_server_prunes_unknown_fields_and_refuses_a_foreign_namespace(api, tmp_path):
    from operators.hooks.rayjob_api import RayJobHook

    hook = RayJobHook(conn_id=CONN)
    body = rayjob_body("grpo-prune", "/mnt/ckpt/run1")
    body["spec"]["notAKubeRayField"] = {"x": 1}
    created = hook.create_rayjob(body, NS)
    assert "notAKubeRayField" not in created["spec"]  # a structural schema drops what it does not declare
    assert created["spec"]["entrypoint"] == body["spec"]["entrypoint"]
    other = rayjob_body("grpo-ns", "/mnt/ckpt/run1")
    other["metadata"]["namespace"] = "somewhere-else"
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as exc:
        hook.create_rayjob(other, NS)
    assert exc.value.status == 400
    assert hook.delete_rayjob("grpo-prune", NS)
    lingering = hook.get_rayjob("grpo-prune", NS)  # deletion takes a moment: a deletion timestamp, then gone
    assert lingering is not None and lingering["metadata"].get("deletionTimestamp")
    for _ in range(5):
        if hook.get_rayjob("grpo-prune", NS) is None:
            break
    assert hook.get_rayjob("grpo-prune", NS) is None


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda b: b["metadata"].update(name="grpo-" + "x" * 50), "no more than 47 characters"),
        (lambda b: b["spec"].update(suspend=True, shutdownAfterJobFinishes=False), "not allowed to be suspended"),
        (lambda b: b["spec"].update(activeDeadlineSeconds=0), "activeDeadlineSeconds must be a positive integer"),
        (
            lambda b: b["spec"]["rayClusterSpec"]["headGroupSpec"].update(
                rayStartParams={"num-gpus": "0"}, resources={"cpu": "4"}
            ),
            "both rayStartParams and Resources for Head group",
        ),
        (lambda b: b["spec"].update(runtimeEnvYAML="env_vars: [unclosed"), "RuntimeEnvYAML"),
    ],
    ids=["name-too-long", "suspend-without-shutdown", "deadline-zero", "resources-twice", "runtime-env-yaml"],
)
def test_kuberay_validation_failures_fail_the_task_with_kuberays_message(api, run_dir, monkeypatch, change, message):
    """Bodies the CRD schema accepts but KubeRay's controller refuses (validation.go): the stand-in's controller
    sets ValidationFailed with KubeRay's message, whatever was scripted, and the task fails without retry."""
    render_then(monkeypatch, change)
    op = make_op("grpo_kuberay_invalid")
    event = run_trigger(defer(op))
    with pytest.raises(AirflowFailException, match=f"reason=ValidationFailed.*{message}"):
        op.execute_complete(CONTEXT, event)


def test_the_trigger_waits_for_a_job_that_moves_with_time_not_with_reads(api, run_dir):
    """The stand-in's controller moves on a clock here (1 s per state, as a cluster would), and the trigger polls
    every 0.05 s: the event comes only when the job is done (after its 4 s), after many reads of unchanged state."""
    import time

    api.step_seconds = 1.0
    name = job_name("grpo_slow")
    trigger = defer(make_op("grpo_slow", poll_interval=0.05))
    reads_before = sum(1 for m, p in api.requests if m == "GET" and p.endswith(f"/{name}"))
    t0 = time.monotonic()
    event = run_trigger(trigger)
    elapsed = time.monotonic() - t0
    reads = sum(1 for m, p in api.requests if m == "GET" and p.endswith(f"/{name}")) - reads_before
    assert event["status"] == "success", event
    assert elapsed >= len(SUCCESS) * 1.0 - 0.5, elapsed  # not before the controller got there
    assert reads > 2 * len(SUCCESS), reads  # read far more often than the job changed


def test_a_trigger_an_earlier_release_serialized_still_loads():
    """Triggers serialized before ``metrics_reader`` was removed carry it (always None): the triggerer still loads
    them after an upgrade, so a deferred train task keeps waiting instead of failing."""
    kwargs = {"name": "grpo-old", "namespace": NS, "metrics_uri": "gs://b/run/metrics.jsonl", "metrics_reader": None}
    path, again = RayJobTrigger(**kwargs).serialize()
    assert "metrics_reader" not in again and again["metrics_uri"] == kwargs["metrics_uri"]
