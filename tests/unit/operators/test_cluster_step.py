"""PipelineStepJobOperator: one pipeline step, in the worker (local) or as a KubeRay RayJob (kuberay).

Local backend: nothing is mocked; the real ``evaluate`` step runs as a child process on the tiny model.

KubeRay backend: no Kubernetes API server, KubeRay or GPU can run here, so
- the Kubernetes API is the in-process stand-in of ``tests/helpers/k8s_api_stand_in.py`` (see its docstring for what it
  does not cover); the operator's real clients (cncf-kubernetes ``KubernetesHook``, ``kubernetes_asyncio`` in the
  trigger) talk HTTP to it, and it validates every created RayJob against the KubeRay v1.7.0 CRD schema;
- its scripted controller only plays the RayJob's status. The job itself is played by the test: it runs the
  rendered ``spec.entrypoint`` through ``/bin/sh -c`` (what Ray's job supervisor does with it), with the bucket
  mount played by a symlink from the "pod path" to the ``file://`` store directory. Where running it is not
  possible (an export that succeeds needs a trained checkpoint), the test writes the summary file the job would
  have written, and says so at that point;
- the task context is the real ``OutletEventAccessors`` for assets plus a minimal task-instance stand-in that
  records ``xcom_push`` calls.
The vLLM generator (GPU) is not exercised: the cluster evaluate here generates with ``--generator hf``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from operators.cluster_step import PipelineStepJobOperator, map_uri_args, pod_paths_to_uris
from operators.failures import JobFailed
from pipeline_steps.errors import UserError
from pipeline_steps.training.mounts import MountMap
from pipeline_steps.training.rayjob_manifest import rayjob_name
from tests.helpers.deferral import deferred, run_trigger
from tests.helpers.eval_rows import aime_rows
from tests.helpers.k8s_connection import K8S_CONN_ID, K8S_NAMESPACE
from tests.helpers.rayjob_operators import train_plan

ROOT = Path(__file__).resolve().parents[3]
RUN_ID = "manual__2026-01-01T00:00:00+00:00"
PRESET = "gsm8k_qwen2_5_3b"  # cluster preset: 1 node x 8 GPUs, head 8 CPU / 32Gi
CONN, NS = K8S_CONN_ID, K8S_NAMESPACE
EVAL_URI_ARGS = ("--model", "--data", "--output", "--base-model", "--baseline-cache")


class TaskInstance:
    """The one TaskInstance call the operator makes on the skip path: ``xcom_push``."""

    def __init__(self):
        self.pushed: dict = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


def context():
    from airflow.sdk.execution_time.context import OutletEventAccessors

    return {"run_id": RUN_ID, "ti": TaskInstance(), "outlet_events": OutletEventAccessors()}


def run_entrypoint(entrypoint: str) -> subprocess.CompletedProcess:
    """What Ray's job supervisor does with ``spec.entrypoint``: one /bin/sh parses it (HTTPMode)."""
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        TOKENIZERS_PARALLELISM="false",
    )
    return subprocess.run(["/bin/sh", "-c", entrypoint], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def aime_parquet(path: Path, n: int = 2) -> Path:
    rows = aime_rows(n)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def cluster(k8s_api, tmp_path, monkeypatch):
    """Stand-in API server, a ``file://`` store and its "bucket mount" (a symlink at the pod path)."""
    store, mnt = tmp_path / "store", tmp_path / "mnt" / "store"
    store.mkdir()
    mnt.parent.mkdir()
    mnt.symlink_to(store, target_is_directory=True)
    monkeypatch.setenv(
        "PIPELINE_MOUNTS", json.dumps([{"uri": f"file://{store}", "claim": "verl-store", "path": str(mnt)}])
    )
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    return {"api": k8s_api, "store": store, "mnt": mnt}


def kuberay_plan(store: Path) -> dict:
    """A kuberay run's plan of ``PRESET`` (its ``cluster:`` section: shape, image, mounts) on the mounted store."""
    return train_plan(PRESET, "kuberay", f"file://{store}")


def local_plan(tmp_path: Path) -> dict:
    """A local run's plan (``local_tiny``): the step runs in the worker."""
    return train_plan("local_tiny", "local", f"file://{tmp_path / 'store'}")


def make_op(dag_id: str, task_id: str, **kw) -> PipelineStepJobOperator:
    """The step task of DAG ``dag_id``, polling fast; ``plan=`` (required) says the backend."""
    kw.setdefault("namespace", NS)
    with DAG(dag_id, schedule=None):
        return PipelineStepJobOperator(task_id=task_id, kubernetes_conn_id=CONN, poll_interval=0.01, **kw)


# -- pure helpers ------------------------------------------------------------------------------------------
def test_map_uri_args_maps_only_named_flags_in_every_form():
    mounts = MountMap.from_config(
        [
            {"uri": "gs://bkt", "claim": "c", "path": "/mnt/gs"},
            {"uri": "file:///data/store", "claim": "nfs", "path": "/mnt/nfs"},
        ]
    )
    args = [
        "--model",
        "gs://bkt/models/m",
        "--data=gs://bkt/d/test.parquet",
        "--files",
        "gs://bkt/a",
        "file:///data/store/b",
        "--store-root",
        "gs://bkt",
        "--output",
        "/data/store/runs/r/eval",
        "--k",
        "4",
        "--note",
        "gs://bkt/x",
    ]
    out = map_uri_args(args, ("--model", "--data", "--files", "--output"), mounts)
    assert out == [
        "--model",
        "/mnt/gs/models/m",
        "--data=/mnt/gs/d/test.parquet",
        "--files",
        "/mnt/gs/a",
        "/mnt/nfs/b",
        "--store-root",
        "gs://bkt",
        "--output",
        "/mnt/nfs/runs/r/eval",
        "--k",
        "4",
        "--note",
        "gs://bkt/x",
    ]
    with pytest.raises(AirflowFailException, match=r"^--model 'oss://other/m': .*outside every mounted bucket"):
        map_uri_args(["--model", "oss://other/m"], ("--model",), mounts)
    with pytest.raises(AirflowFailException, match=r"^--output '/home/u/work/x': .*not a store URI on a mount"):
        map_uri_args(["--output", "/home/u/work/x"], ("--output",), mounts)
    with pytest.raises(AirflowFailException, match="climbs out of its mount"):
        map_uri_args(["--data", "gs://bkt/../etc/passwd"], ("--data",), mounts)


def test_pod_paths_in_a_summary_become_store_uris():
    mounts = MountMap.from_config(
        [
            {"uri": "gs://bkt", "claim": "c", "path": "/mnt/gs"},
            {"uri": "gs://bkt2/pre", "claim": "d", "path": "/mnt/gs/inner"},
        ]
    )
    summary = {
        "results": "/mnt/gs/runs/r/eval/results.json",
        "nested": ["/mnt/gs/inner/x", {"p": "/mnt/gs"}],
        "local": "/tmp/work/x",
        "other": "/mnt/gsx/y",
        "n": 3,
        "none": None,
    }
    assert pod_paths_to_uris(summary, mounts) == {
        "results": "gs://bkt/runs/r/eval/results.json",
        "nested": ["gs://bkt2/pre/x", {"p": "gs://bkt"}],
        "local": "/tmp/work/x",
        "other": "/mnt/gsx/y",
        "n": 3,
        "none": None,
    }


def test_cluster_entry_writes_summary_and_keeps_exit_code(tmp_path):
    out = tmp_path / "s" / "summary.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline_steps.cluster_entry",
            "--summary-file",
            str(out),
            "--",
            "evaluate",
            "--model",
            "m",
            "--data",
            "d",
            "--output",
            str(tmp_path / "o"),
            "--k",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
        timeout=120,
    )
    assert (
        p.returncode == 2
        and p.stderr.strip().splitlines()[-1] == "error: --k 0: must be at least 1 (samples per problem)"
    )
    assert json.loads(p.stdout.strip().splitlines()[-1])["ok"] is False  # the job log still shows the summary
    assert json.loads(out.read_text()) == {
        "exit_code": 2,
        "summary": {"ok": False, "step": "evaluate", "error": "--k 0: must be at least 1 (samples per problem)"},
    }
    assert [f.name for f in out.parent.iterdir()] == ["summary.json"]  # no temporary sibling left
    p = subprocess.run(
        [sys.executable, "-m", "pipeline_steps.cluster_entry", "evaluate", "--k", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
        timeout=60,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: cluster_entry: missing '--'")


def test_operator_needs_a_plan_and_rejects_bad_backend_and_missing_summary_location(cluster):
    with pytest.raises(TypeError, match=r"^missing keyword argument 'plan'$"), DAG("t_bad", schedule=None):
        PipelineStepJobOperator(task_id="evaluate", step="evaluate")
    with pytest.raises(TypeError, match=r"^PipelineStepJobOperator 'evaluate': plan= is required \(the plan task's"):
        make_op("t_bad", "evaluate", step="evaluate", plan=None)
    # A bad backend: the plan task refuses the form's value where it makes the plan (tested here at the plan), and the
    # typed plan refuses one in a plan dict (edited by hand), so the task fails in one line and no RayJob is made.
    with pytest.raises(UserError, match=r"^backend 'slurm': choose 'local' or 'kuberay'"):
        train_plan(PRESET, "slurm", f"file://{cluster['store']}")
    edited = {**kuberay_plan(cluster["store"]), "backend": "slurm"}
    op = make_op("t_bad", "evaluate", step="evaluate", plan=edited, request={"args": ["--k", "1"]})
    with pytest.raises(AirflowFailException, match=r"^plan: backend 'slurm': choose 'local' or 'kuberay'"):
        op.execute(context())
    op = make_op(
        "t_bad", "evaluate", step="evaluate", plan=kuberay_plan(cluster["store"]), request={"args": ["--k", "1"]}
    )
    with pytest.raises(AirflowFailException, match="needs summary_dir= or store_uri="):
        op.execute(context())
    assert cluster["api"].creates == []


# -- local backend -----------------------------------------------------------------------------------------
@pytest.mark.slow  # about 7 s of CPU: the real step
def test_local_backend_runs_the_real_step_and_fails_bad_input_without_retry(tiny_model, tmp_path):
    data = aime_parquet(tmp_path / "aime.parquet")
    args = [
        "--model",
        str(tiny_model),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "eval"),
        "--k",
        "2",
        "--max-new-tokens",
        "4",
        "--max-problems",
        "1",
        "--seed",
        "3",
    ]
    op = make_op(
        "t_local",
        "evaluate",
        step="evaluate",
        plan=local_plan(tmp_path),
        request={"args": args, "carry": {"dataset": "aime2024"}},
    )
    out = op.execute(context())
    assert set(out) == {"dataset", "evaluate"} and out["dataset"] == "aime2024"
    ev = out["evaluate"]
    assert ev["results"] == str(tmp_path / "eval" / "results.json") and ev["samples_scored"] == 2 and ev["k"] == 2
    assert json.loads(Path(ev["results"]).read_text())["overall"]["avg@k"] == ev["avg@k"]
    bad = make_op(
        "t_local", "evaluate", step="evaluate", plan=local_plan(tmp_path), request={"args": [*args, "--k", "0"]}
    )
    with pytest.raises(AirflowFailException, match=r"--k 0: must be at least 1.*\(bad input: not retried\)"):
        bad.execute(context())


# -- kuberay backend ---------------------------------------------------------------------------------------
@pytest.mark.slow  # about 15 s of CPU: the evaluate step run as the pod runs it
def test_kuberay_evaluate_runs_as_gpu_rayjob_and_returns_the_local_xcom_shape(cluster, tiny_model, tmp_path):
    api, store, mnt = cluster["api"], cluster["store"], cluster["mnt"]
    shutil.copytree(tiny_model, store / "models" / "tiny")
    aime_parquet(store / "datasets" / "aime2024" / "test.parquet")
    run_dir = "runs/gsm8k/it's $(touch pwned) `id`"  # a run folder with shell metacharacters stays one argument
    args = [
        "--model",
        f"file://{store}/models/tiny",
        "--data",
        f"{store}/datasets/aime2024/test.parquet",  # plain path: planning.local_path
        "--output",
        f"file://{store}/{run_dir}/eval",
        "--k",
        "2",
        "--max-new-tokens",
        "4",
        "--max-problems",
        "1",
        "--seed",
        "3",
        "--generator",
        "hf",
    ]
    op = make_op(
        "t_eval",
        "evaluate",
        step="evaluate",
        plan=kuberay_plan(store),
        store_uri=f"file://{store}",
        uri_args=EVAL_URI_ARGS,
        request={"args": args, "carry": {"dataset": "aime2024"}},
    )
    trigger = deferred(op, context())
    name = rayjob_name("t_eval", RUN_ID, "evaluate", "evaluate")
    assert trigger.name == name and len(api.creates) == 1
    body = api.creates[0]
    argv = shlex.split(body["spec"]["entrypoint"])
    assert argv == [
        "python3",
        "-m",
        "pipeline_steps.cluster_entry",
        "--summary-file",
        f"{mnt}/tmp/step-summaries/{name}.json",
        "--",
        "evaluate",
        "--model",
        f"{mnt}/models/tiny",
        "--data",
        f"{mnt}/datasets/aime2024/test.parquet",
        "--output",
        f"{mnt}/{run_dir}/eval",
        "--k",
        "2",
        "--max-new-tokens",
        "4",
        "--max-problems",
        "1",
        "--seed",
        "3",
        "--generator",
        "hf",
    ]
    workers = body["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert len(workers) == 1 and workers[0]["replicas"] == 1
    assert workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert body["spec"]["entrypointNumGpus"] == 8  # the step runs on the GPU worker, not the CPU head
    assert body["metadata"]["labels"]["app.kubernetes.io/component"] == "evaluate"

    job = run_entrypoint(body["spec"]["entrypoint"])  # the job, as Ray's supervisor runs it (see module docstring)
    assert job.returncode == 0, job.stderr[-3000:]
    assert not (ROOT / "pwned").exists() and not (tmp_path / "pwned").exists()
    assert (store / run_dir / "eval" / "results.json").is_file()  # the folder name arrived literally
    event = run_trigger(trigger)
    assert event["status"] == "success", event
    out = op.execute_complete(context(), event)

    # the same step run by the local backend gives the same XCom, with local paths where the cluster gives URIs
    local_args = [
        "--model",
        str(store / "models" / "tiny"),
        "--data",
        str(store / "datasets/aime2024/test.parquet"),
        "--output",
        str(tmp_path / "local-eval"),
        *args[6:],
    ]
    local = make_op(
        "t_eval",
        "evaluate",
        step="evaluate",
        plan=local_plan(tmp_path),
        request={"args": local_args, "carry": {"dataset": "aime2024"}},
    ).execute(context())
    assert set(out) == set(local) == {"dataset", "evaluate"} and set(out["evaluate"]) == set(local["evaluate"])
    assert out["evaluate"]["results"] == f"file://{store}/{run_dir}/eval/results.json"
    assert out["evaluate"]["output"] == f"file://{store}/{run_dir}/eval"
    assert local["evaluate"]["results"] == str(tmp_path / "local-eval" / "results.json")
    same = {k for k in local["evaluate"] if k not in ("output", "results", "base_results")}
    assert {k: out["evaluate"][k] for k in same} == {k: local["evaluate"][k] for k in same}
    assert out["evaluate"]["samples_scored"] == 2


def test_kuberay_export_is_cpu_only_retries_with_own_summary_and_skips_when_not_promoted(cluster):
    from tests.helpers.k8s_api_stand_in import SUCCESS

    api, store, mnt = cluster["api"], cluster["store"], cluster["mnt"]
    name = rayjob_name("t_export", RUN_ID, "export", "export")
    api.script(
        name,
        [
            {"jobDeploymentStatus": "Initializing"},
            {
                "jobDeploymentStatus": "Failed",
                "reason": "DeadlineExceeded",
                "message": "The RayJob has passed the activeDeadlineSeconds",
            },
        ],
    )
    api.script(name[:44].rstrip("-") + "-r1", SUCCESS)
    args = [
        "--checkpoint-dir",
        f"file://{store}/runs/r/checkpoints",
        "--output",
        "/tmp/export-work",
        "--store-root",
        f"file://{store}",
        "--experiment",
        PRESET,
        "--lineage",
        f"file://{store}/runs/r/lineage.json",
        "--eval-results",
        f"file://{store}/runs/r/eval/results.json",
        "--base-results",
        f"file://{store}/runs/r/eval/base_results.json",
    ]

    def op():
        return make_op(
            "t_export",
            "export",
            step="export",
            plan=kuberay_plan(store),
            store_uri=f"file://{store}",
            uri_args=("--checkpoint-dir", "--lineage", "--eval-results", "--base-results"),
            skip_unless="promoted",
            request={"args": args, "carry": {}},
        )

    first = op()
    event = run_trigger(deferred(first, context()))
    with pytest.raises(JobFailed, match="reason=DeadlineExceeded"):  # retryable: Airflow's retries apply
        first.execute_complete(context(), event)
    body = api.creates[0]
    assert "workerGroupSpecs" not in body["spec"]["rayClusterSpec"] and "entrypointNumGpus" not in body["spec"]
    head = body["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    from pipeline_steps.training import experiment

    cluster = experiment.load(PRESET).spec["cluster"]  # the merge's size: cluster.export, not the idle head's
    want = {k: str(v) for k, v in cluster["export"].items()}
    assert want != {k: str(v) for k, v in cluster["head"].items()}
    assert head["resources"] == {"requests": want, "limits": want}
    argv = shlex.split(body["spec"]["entrypoint"])
    assert argv[argv.index("--checkpoint-dir") + 1] == f"{mnt}/runs/r/checkpoints"
    assert (
        argv[argv.index("--store-root") + 1] == f"file://{store}"
    )  # not a uri_arg: the step uploads through the store
    # a stale summary of the failed attempt must not be read for the retry
    (store / "tmp" / "step-summaries").mkdir(parents=True)
    (store / "tmp" / "step-summaries" / f"{name}.json").write_text(
        json.dumps({"exit_code": 0, "summary": {"promoted": True}})
    )

    retry = op()
    trigger = deferred(retry, context())
    assert trigger.name.endswith("-r1") and api.deletes == [name]
    argv = shlex.split(api.creates[1]["spec"]["entrypoint"])
    assert argv[argv.index("--summary-file") + 1] == f"{mnt}/tmp/step-summaries/{trigger.name}.json"
    event = run_trigger(trigger)
    assert event["status"] == "success"
    with pytest.raises(Exception, match="left no summary"):
        retry.execute_complete(context(), event)
    # A real successful export needs a trained FSDP checkpoint; the test writes the summary file that the job's
    # cluster_entry would have written at its pod path (pod paths inside, as the step reports them).
    (mnt / "tmp" / "step-summaries" / f"{trigger.name}.json").write_text(
        json.dumps(
            {
                "exit_code": 0,
                "summary": {
                    "ok": True,
                    "step": "export",
                    "promoted": False,
                    "reason": "avg@k 0.1 does not beat the base's 0.2 by more than 0.0",
                    "uri": f"{mnt}/models/exported/{PRESET}/v1",
                    "output": "/tmp/export-work",
                },
            }
        )
    )
    ctx = context()
    with pytest.raises(AirflowSkipException, match="step export: avg@k 0.1 does not beat"):
        retry.execute_complete(ctx, event)
    assert ctx["ti"].pushed["return_value"] == {
        "export": {
            "promoted": False,
            "reason": "avg@k 0.1 does not beat the base's 0.2 by more than 0.0",
            "uri": f"file://{store}/models/exported/{PRESET}/v1",
            "output": "/tmp/export-work",
        }
    }


def test_kuberay_step_bad_input_fails_with_kuberay_reason_and_step_error_without_retry(cluster):
    api, store = cluster["api"], cluster["store"]
    name = rayjob_name("t_badexport", RUN_ID, "export", "export")
    api.script(
        name,
        [
            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
            {  # KubeRay v1.7.0 ends a failed application Failed with reason AppFailed
                "jobDeploymentStatus": "Failed",
                "jobStatus": "FAILED",
                "reason": "AppFailed",
                "message": "Job entrypoint command failed with exit code 2",
            },
        ],
    )
    args = [
        "--checkpoint-dir",
        f"file://{store}/runs/r/checkpoints",
        "--output",
        "/tmp/export-work",
        "--store-root",
        f"file://{store}",
        "--experiment",
        PRESET,
        "--lineage",
        f"file://{store}/runs/r/lineage.json",
        "--eval-results",
        f"file://{store}/runs/r/eval/results.json",
        "--base-results",
        f"file://{store}/runs/r/eval/base_results.json",
    ]
    op = make_op(
        "t_badexport",
        "export",
        step="export",
        plan=kuberay_plan(store),
        store_uri=f"file://{store}",
        namespace=None,
        uri_args=("--checkpoint-dir", "--lineage", "--eval-results", "--base-results"),
        request={"args": args},
    )
    trigger = deferred(op, context())
    assert api.creates[0]["metadata"]["namespace"] == NS  # no namespace= given: the connection's
    job = run_entrypoint(api.creates[0]["spec"]["entrypoint"])  # the real export step: its lineage file is missing
    assert job.returncode == 2, job.stderr[-2000:]
    event = run_trigger(trigger)
    with pytest.raises(AirflowFailException) as exc:
        op.execute_complete(context(), event)
    message = str(exc.value)
    assert message.startswith(f"RayJob {name} failed: jobDeploymentStatus=Failed, jobStatus=FAILED, reason=AppFailed")
    assert (
        "step export: --lineage" in message
        and "file not found" in message
        and message.endswith("(bad input: not retried)")
    )
