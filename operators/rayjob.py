"""KubeRay ``RayJob`` from Airflow: a hook, a deferrable operator, its trigger and a Ray dashboard link.

The operator only orchestrates: it finds this task's RayJob (re-attach) or creates it
through the cncf-kubernetes provider's :class:`KubernetesHook`, then defers to
:class:`RayJobTrigger`, which polls the RayJob's status asynchronously with
``kubernetes_asyncio`` (the provider's async hook has no custom-object calls) and
reports training progress from verl's file logger and the submitter pod's log.

Attempts: the rendered RayJob's name is deterministic per DAG run and task, so a
retried or restarted worker finds it instead of submitting a second job. Every
attempt carries the label :data:`GROUP_LABEL` = that base name; a failed attempt is
deleted (its Ray cluster goes with it) and the next one is ``<base>-r<N>`` with a
resume body (by default the same entrypoint plus ``trainer.resume_mode=auto``), so a
retry continues from the last checkpoint in the same checkpoint directory.

Success is only ``jobDeploymentStatus == Complete`` with ``jobStatus == SUCCEEDED``
(KubeRay reports ``Complete`` for FAILED and STOPPED jobs too).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import shlex
from collections.abc import AsyncIterator, Callable, Sequence
from functools import cached_property
from typing import Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook
from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowFailException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from pipeline_steps import metrics_log
from pipeline_steps.constants import CHECKPOINT_TRACKER, RAYJOB_NAME_MAX

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
GROUP_LABEL = "verl-pipeline/rayjob-group"  # value: the attempt-0 name; selects every attempt of one task
ATTEMPT_LABEL = "verl-pipeline/attempt"
TERMINAL_DEPLOYMENT = ("Complete", "Failed", "ValidationFailed")
PROGRESS_KEYS = ("critic/score/mean", "actor/entropy", "response_length/mean", "perf/throughput", "timing_s/step")
DASHBOARD_XCOM_KEY = "ray_dashboard_url"


class JobFailed(RuntimeError):
    """The training job ended without success (Airflow retries it: the next attempt resumes)."""


# -- status and progress helpers (pure, shared by both backends) ------------------------------------------
def rayjob_outcome(status: dict | None) -> str:
    """``"running"``, ``"succeeded"`` or ``"failed"`` for a RayJob ``status``.

    :param status: the RayJob's ``.status`` (may be empty right after creation).
    """
    status = status or {}
    deployment, job = status.get("jobDeploymentStatus") or "", status.get("jobStatus") or ""
    if deployment == "Complete" and job == "SUCCEEDED":
        return "succeeded"
    if deployment in TERMINAL_DEPLOYMENT or status.get("reason") in ("DeadlineExceeded", "ValidationFailed"):
        return "failed"
    return "running"


def describe_failure(name: str, status: dict) -> str:
    """One line saying which RayJob failed, how, and why (KubeRay's reason and message)."""
    parts = [
        f"RayJob {name} failed: jobDeploymentStatus={status.get('jobDeploymentStatus') or '-'}",
        f"jobStatus={status.get('jobStatus') or '-'}",
    ]
    if status.get("reason"):
        parts.append(f"reason={status['reason']}")
    if status.get("message"):
        parts.append(f"message={' '.join(str(status['message']).split())[:500]}")
    return ", ".join(parts)


def read_text(uri: str) -> str | None:
    """Default reader for the metrics file and checkpoint marker: a local path, or a store URI
    (``file://``, ``oss://``, ``gs://``) read through :mod:`pipeline_steps.store` with the
    credentials in the environment. ``None`` when it does not exist (yet)."""
    if "://" not in uri:
        try:
            with open(uri, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return None
    from pipeline_steps.store import open_store

    data = open_store(uri).read_bytes(uri)
    return None if data is None else data.decode("utf-8", errors="replace")


def read_mounted(uri: str) -> str | None:
    """Reader for workers that mount the buckets like the Ray pods do (``$PIPELINE_MOUNTS``):
    a store URI is read at its mount path."""
    from pipeline_steps.training.mounts import MountMap

    return read_text(MountMap.from_env().to_pod_path(uri) if "://" in uri else uri)


def resolve_reader(dotted: str | None) -> Callable[[str], str | None]:
    """The reader named by ``module.function`` (kept as a string so triggers serialize)."""
    if not dotted:
        return read_text
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def parse_metrics(text: str | None) -> list[dict]:
    """verl file-logger JSON lines (``{"step": N, "data": {...}}``) -> rows; a torn last line is skipped."""
    return metrics_log.parse(text).rows


def format_progress(row: dict) -> str:
    data = row.get("data") or {}
    shown = " ".join(
        f"{k}={data[k]:.4g}" if isinstance(data[k], float) else f"{k}={data[k]}" for k in PROGRESS_KEYS if k in data
    )
    return f"step {row['step']}: {shown}".rstrip()


def scalar_metrics(row: dict | None) -> dict:
    """The numeric metrics of one step (what goes to XCom)."""
    data = (row or {}).get("data") or {}
    return {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def new_log_lines(previous: Sequence[str], tail: Sequence[str]) -> list[str]:
    """Lines of ``tail`` not shown yet, given the previously shown tail (overlap on its last line)."""
    if previous and previous[-1] in tail:
        idx = len(tail) - 1 - list(reversed(tail)).index(previous[-1])
        return list(tail[idx + 1 :])
    return list(tail)


class ProgressTracker:
    """Reads the metrics file and yields the rows not reported yet (state kept in ``last_step``)."""

    def __init__(self, metrics_uri: str | None, reader: str | None, last_step: int = 0):
        self.metrics_uri, self.reader, self.last_step = metrics_uri, reader, last_step
        self.last_row: dict | None = None
        self.warned = False

    async def poll(self, log) -> None:
        if not self.metrics_uri:
            return
        try:
            text = await asyncio.to_thread(resolve_reader(self.reader), self.metrics_uri)
        except Exception as exc:  # progress is best effort: never fail the wait on it
            if not self.warned:
                log.warning("cannot read metrics %s (%s); progress not shown", self.metrics_uri, exc)
                self.warned = True
            return
        rows = parse_metrics(text)
        if rows:
            self.last_row = rows[-1]
        for row in rows:
            if row["step"] > self.last_step:
                log.info("progress %s", format_progress(row))
                self.last_step = row["step"]


def checkpoint_step(checkpoint_uri: str | None, reader: str | None) -> int | None:
    """verl's ``latest_checkpointed_iteration.txt`` under the checkpoint dir, if readable."""
    if not checkpoint_uri:
        return None
    try:
        text = resolve_reader(reader)(checkpoint_uri.rstrip("/") + "/" + CHECKPOINT_TRACKER)
        return int(text.strip()) if text and text.strip().isdigit() else None
    except Exception:
        return None


# -- hook -------------------------------------------------------------------------------------------------
class RayJobHook(KubernetesHook):
    """The cncf-kubernetes hook with the RayJob (``ray.io/v1``) custom-object calls.

    :param conn_id: the Kubernetes connection (kube config path, in-cluster, or kube config JSON).
    """

    def get_rayjob(self, name: str, namespace: str) -> dict | None:
        """The RayJob, or ``None`` when it does not exist."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.get_custom_object(GROUP, VERSION, PLURAL, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_rayjob(self, body: dict, namespace: str) -> dict:
        return self.create_custom_object(GROUP, VERSION, PLURAL, body, namespace)

    def delete_rayjob(self, name: str, namespace: str) -> bool:
        """Delete with foreground propagation (its RayCluster first); ``False`` if it was already gone."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.delete_custom_object(GROUP, VERSION, PLURAL, name, namespace, propagation_policy="Foreground")
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def list_rayjobs(self, namespace: str, label_selector: str) -> list[dict]:
        out = self.custom_object_client.list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, label_selector=label_selector
        )
        return list(out.get("items") or [])


def attempt_of(obj: dict) -> int:
    try:
        return int(((obj.get("metadata") or {}).get("labels") or {}).get(ATTEMPT_LABEL, 0))
    except ValueError:
        return 0


def attempt_body(body: dict, base: str, attempt: int) -> dict:
    """``body`` as attempt ``attempt``: its own name and Ray job id, group and attempt labels."""
    out = copy.deepcopy(body)
    meta = out.setdefault("metadata", {})
    labels = meta.setdefault("labels", {})
    labels[GROUP_LABEL], labels[ATTEMPT_LABEL] = base, str(attempt)
    if attempt:
        suffix = f"-r{attempt}"
        meta["name"] = base[: RAYJOB_NAME_MAX - len(suffix)].rstrip("-") + suffix
        if out.get("spec", {}).get("jobId"):
            out["spec"]["jobId"] = f"{out['spec']['jobId']}{suffix}"
    return out


def with_resume_args(body: dict, args: Sequence[str]) -> dict:
    """``body`` whose entrypoint ends with ``args``, each shell-quoted (Hydra: the last value wins)."""
    out = copy.deepcopy(body)
    if args:
        out["spec"]["entrypoint"] = out["spec"]["entrypoint"].rstrip() + " " + " ".join(shlex.quote(a) for a in args)
    return out


# -- extra link -------------------------------------------------------------------------------------------
class RayDashboardLink(BaseOperatorLink):
    """Opens the Ray dashboard of the job's cluster (URL pushed to XCom by the operator)."""

    name = "Ray dashboard"

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return XCom.get_value(key=DASHBOARD_XCOM_KEY, ti_key=ti_key) or ""


# -- trigger ----------------------------------------------------------------------------------------------
class RayJobTrigger(BaseTrigger):
    """Polls one RayJob until it is terminal and yields a single :class:`TriggerEvent`.

    :param name: the RayJob's name.
    :param namespace: its namespace.
    :param kubernetes_conn_id: the Kubernetes connection.
    :param cluster_context: kube config context, if not the connection's default.
    :param poll_interval: seconds between status polls.
    :param metrics_uri: verl's file-logger JSON lines (a local path, or a store URI its reader can read).
    :param metrics_reader: ``module.function`` reading a URI to text (default :func:`read_text`).
    :param log_tail_lines: how many lines of the submitter pod's log to show.
    :param last_step: metric steps up to this one were already reported.
    :param max_api_errors: consecutive API errors (other than 404) tolerated before failing.
    :param submission_mode: the RayJob's ``spec.submissionMode``: where its log tail is read from.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        kubernetes_conn_id: str | None = "kubernetes_default",
        cluster_context: str | None = None,
        poll_interval: float = 30.0,
        metrics_uri: str | None = None,
        metrics_reader: str | None = None,
        log_tail_lines: int = 20,
        last_step: int = 0,
        max_api_errors: int = 10,
        submission_mode: str = "K8sJobMode",
    ):
        super().__init__()
        self.name, self.namespace, self.submission_mode = name, namespace, submission_mode
        self._dashboard_misses = 0
        self.kubernetes_conn_id, self.cluster_context = kubernetes_conn_id, cluster_context
        self.poll_interval, self.metrics_uri, self.metrics_reader = poll_interval, metrics_uri, metrics_reader
        self.log_tail_lines, self.last_step, self.max_api_errors = log_tail_lines, last_step, max_api_errors

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "name": self.name,
                "namespace": self.namespace,
                "kubernetes_conn_id": self.kubernetes_conn_id,
                "cluster_context": self.cluster_context,
                "poll_interval": self.poll_interval,
                "metrics_uri": self.metrics_uri,
                "metrics_reader": self.metrics_reader,
                "log_tail_lines": self.log_tail_lines,
                "last_step": self.last_step,
                "max_api_errors": self.max_api_errors,
                "submission_mode": self.submission_mode,
            },
        )

    @cached_property
    def hook(self) -> AsyncKubernetesHook:
        return AsyncKubernetesHook(conn_id=self.kubernetes_conn_id, cluster_context=self.cluster_context)

    async def _get(self) -> dict:
        from kubernetes_asyncio.client import CustomObjectsApi

        async with self.hook.get_conn() as api_client:
            return await CustomObjectsApi(api_client).get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name
            )

    async def _log_tail(self, status: dict) -> list[str]:
        """The job's log tail: the submitter pod's log in K8sJobMode (it follows the Ray job), else the
        Ray dashboard's Jobs API (reachable when Airflow runs inside the cluster). Empty when unavailable."""
        try:
            if self.submission_mode == "K8sJobMode":
                return await self._submitter_log()
            if status.get("dashboardURL") and status.get("jobId") and self._dashboard_misses < 3:
                return await self._dashboard_log(status["dashboardURL"], status["jobId"])
        except Exception as exc:  # logs are best effort
            self._dashboard_misses += self.submission_mode != "K8sJobMode"
            self.log.debug("no log tail for RayJob %s: %s", self.name, exc)
        return []

    async def _submitter_log(self) -> list[str]:
        from kubernetes_asyncio.client import CoreV1Api

        async with self.hook.get_conn() as api_client:
            core = CoreV1Api(api_client)
            pods = await core.list_namespaced_pod(
                self.namespace, label_selector=f"batch.kubernetes.io/job-name={self.name}"
            )
            if not pods.items:
                return []
            pod = max(pods.items, key=lambda p: str(p.metadata.creation_timestamp or ""))
            text = await core.read_namespaced_pod_log(pod.metadata.name, self.namespace, tail_lines=self.log_tail_lines)
            return str(text).splitlines()

    async def _dashboard_log(self, dashboard: str, job_id: str) -> list[str]:
        import aiohttp

        base = dashboard if dashboard.startswith(("http://", "https://")) else f"http://{dashboard}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"{base}/api/jobs/{job_id}/logs") as resp:
                resp.raise_for_status()
                logs = (await resp.json()).get("logs") or ""
        return logs.splitlines()[-self.log_tail_lines :]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio.client.exceptions import ApiException

        progress = ProgressTracker(self.metrics_uri, self.metrics_reader, self.last_step)
        shown: list[str] = []
        seen, errors = None, 0
        while True:
            try:
                obj = await self._get()
                errors = 0
            except ApiException as exc:
                if exc.status == 404:
                    yield TriggerEvent(
                        self._event(
                            "error",
                            {},
                            progress,
                            shown,
                            f"RayJob {self.namespace}/{self.name} was deleted while the task waited",
                        )
                    )
                    return
                errors += 1
                if errors > self.max_api_errors:
                    yield TriggerEvent(
                        self._event(
                            "error",
                            {},
                            progress,
                            shown,
                            f"Kubernetes API kept failing for RayJob {self.name}: HTTP {exc.status} {exc.reason}",
                        )
                    )
                    return
                self.log.warning(
                    "RayJob %s: API error %s (%d/%d), retrying", self.name, exc.status, errors, self.max_api_errors
                )
                await asyncio.sleep(self.poll_interval)
                continue
            status = obj.get("status") or {}
            now = (status.get("jobDeploymentStatus"), status.get("jobStatus"))
            if now != seen:
                self.log.info("RayJob %s: jobDeploymentStatus=%s jobStatus=%s", self.name, now[0] or "-", now[1] or "-")
                seen = now
            await progress.poll(self.log)
            tail = await self._log_tail(status) if status.get("jobStatus") else []
            for line in new_log_lines(shown, tail):
                self.log.info("job log | %s", line)
            shown = tail or shown
            outcome = rayjob_outcome(status)
            if outcome != "running":
                message = None if outcome == "succeeded" else describe_failure(self.name, status)
                yield TriggerEvent(
                    self._event("success" if outcome == "succeeded" else "error", status, progress, shown, message)
                )
                return
            await asyncio.sleep(self.poll_interval)

    def _event(self, kind: str, status: dict, progress: ProgressTracker, tail: list[str], message: str | None) -> dict:
        return {
            "status": kind,
            "backend": "kuberay",
            "name": self.name,
            "namespace": self.namespace,
            "message": message,
            "job_deployment_status": status.get("jobDeploymentStatus"),
            "job_status": status.get("jobStatus"),
            "reason": status.get("reason"),
            "dashboard_url": status.get("dashboardURL"),
            "last_step": progress.last_row["step"] if progress.last_row else None,
            "last_progress": format_progress(progress.last_row) if progress.last_row else None,
            "metrics": scalar_metrics(progress.last_row),
            "log_tail": list(tail),
        }

    async def on_kill(self) -> None:
        """A user killed the deferred task: delete the RayJob (its cluster goes with it)."""
        from kubernetes_asyncio.client import CustomObjectsApi, V1DeleteOptions
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            async with self.hook.get_conn() as api_client:
                await CustomObjectsApi(api_client).delete_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    self.name,
                    body=V1DeleteOptions(propagation_policy="Foreground"),
                )
            self.log.info("deleted RayJob %s/%s", self.namespace, self.name)
        except ApiException as exc:
            if exc.status != 404:
                raise


# -- operator ---------------------------------------------------------------------------------------------
class RayJobOperator(BaseOperator):
    """Run a KubeRay ``RayJob`` to completion: create or re-attach, defer, report, clean up.

    :param rayjob: the RayJob body (``ray.io/v1``); its ``metadata.name`` must be deterministic per
        DAG run and task so that a retry finds it.
    :param namespace: namespace (default: the body's, then the connection's, then ``default``).
    :param kubernetes_conn_id: the Kubernetes connection.
    :param cluster_context: kube config context.
    :param poll_interval: seconds between status polls in the trigger.
    :param metrics_uri: where verl's file logger writes (read for progress and final metrics).
    :param metrics_reader: ``module.function`` that reads ``metrics_uri`` (default: local path or store URI).
    :param checkpoint_uri: the run's checkpoint directory (``trainer.default_local_dir`` as seen from here).
    :param resume_rayjob: body for attempts after a failed one; default: ``rayjob`` with ``resume_args``.
    :param resume_args: Hydra overrides appended to the entrypoint of later attempts when no
        ``resume_rayjob`` is given (default: resume from the latest checkpoint).
    :param log_tail_lines: lines of the job's log to show.
    :param dashboard_url_template: Ray dashboard link; ``{dashboard_url}``, ``{namespace}``, ``{name}``
        and ``{ray_cluster}`` are filled from the RayJob status (for an ingress, give its URL pattern).
    """

    template_fields: Sequence[str] = ("rayjob", "namespace", "metrics_uri", "checkpoint_uri")
    template_fields_renderers = {"rayjob": "json"}
    operator_extra_links = (RayDashboardLink(),)
    ui_color = "#e8f4fd"

    def __init__(
        self,
        *,
        rayjob: dict | None = None,
        namespace: str | None = None,
        kubernetes_conn_id: str | None = "kubernetes_default",
        cluster_context: str | None = None,
        poll_interval: float = 30.0,
        metrics_uri: str | None = None,
        metrics_reader: str | None = None,
        checkpoint_uri: str | None = None,
        resume_rayjob: dict | None = None,
        resume_args: Sequence[str] = ("trainer.resume_mode=auto",),
        log_tail_lines: int = 20,
        dashboard_url_template: str = "http://{dashboard_url}",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.rayjob, self.namespace, self.resume_rayjob = rayjob, namespace, resume_rayjob
        self.kubernetes_conn_id, self.cluster_context = kubernetes_conn_id, cluster_context
        self.poll_interval, self.metrics_uri, self.metrics_reader = poll_interval, metrics_uri, metrics_reader
        self.checkpoint_uri, self.resume_args, self.log_tail_lines = checkpoint_uri, tuple(resume_args), log_tail_lines
        self.dashboard_url_template = dashboard_url_template

    @cached_property
    def hook(self) -> RayJobHook:
        return RayJobHook(conn_id=self.kubernetes_conn_id, cluster_context=self.cluster_context)

    def _namespace(self, body: dict) -> str:
        return self.namespace or body.get("metadata", {}).get("namespace") or self.hook.get_namespace() or "default"

    def execute(self, context):
        if not self.rayjob:
            raise ValueError("RayJobOperator needs a rendered RayJob body (rayjob=)")
        return self.submit_rayjob(context, self.rayjob, self.resume_rayjob)

    def submit_rayjob(self, context, body: dict, resume_body: dict | None):
        """Create or re-attach to this task's current attempt, then defer to the trigger."""
        base, namespace = body["metadata"]["name"], self._namespace(body)
        attempts = sorted(self.hook.list_rayjobs(namespace, f"{GROUP_LABEL}={base}"), key=attempt_of)
        latest = attempts[-1] if attempts else None
        if latest is not None and rayjob_outcome(latest.get("status")) != "failed":
            obj = latest
            self.log.info(
                "re-attaching to RayJob %s (attempt %d, %s)",
                obj["metadata"]["name"],
                attempt_of(obj),
                (obj.get("status") or {}).get("jobDeploymentStatus") or "new",
            )
        else:
            attempt = 0
            if latest is not None:
                attempt = attempt_of(latest) + 1
                self.log.warning(
                    "previous attempt %s", describe_failure(latest["metadata"]["name"], latest.get("status") or {})
                )
                self.log.info(
                    "deleting failed RayJob %s (and its Ray cluster); attempt %d resumes from the checkpoint",
                    latest["metadata"]["name"],
                    attempt,
                )
                self.hook.delete_rayjob(latest["metadata"]["name"], namespace)
                body = resume_body or with_resume_args(body, self.resume_args)
            obj = self._create(attempt_body(body, base, attempt), namespace)
        self._push_dashboard(context, obj)
        mode = (
            (obj.get("spec") or {}).get("submissionMode")
            or (body.get("spec") or {}).get("submissionMode")
            or "K8sJobMode"
        )
        self.defer(trigger=self._trigger(obj["metadata"]["name"], namespace, mode), method_name="execute_complete")

    def _create(self, body: dict, namespace: str) -> dict:
        from kubernetes.client.exceptions import ApiException

        name = body["metadata"]["name"]
        try:
            obj = self.hook.create_rayjob(body, namespace)
            self.log.info("created RayJob %s/%s", namespace, name)
            return obj
        except ApiException as exc:
            if exc.status != 409:
                raise
        # another worker created it between our list and create: attach to that one
        self.log.info("RayJob %s/%s already exists: re-attaching", namespace, name)
        return self.hook.get_rayjob(name, namespace) or body

    def _trigger(self, name: str, namespace: str, submission_mode: str) -> RayJobTrigger:
        return RayJobTrigger(
            name=name,
            namespace=namespace,
            submission_mode=submission_mode,
            kubernetes_conn_id=self.kubernetes_conn_id,
            cluster_context=self.cluster_context,
            poll_interval=self.poll_interval,
            metrics_uri=self.metrics_uri,
            metrics_reader=self.metrics_reader,
            log_tail_lines=self.log_tail_lines,
        )

    def _push_dashboard(self, context, obj: dict) -> None:
        status = obj.get("status") or {}
        if context.get("ti") is not None:  # the failure notice names the job even when the task fails
            context["ti"].xcom_push(key="job", value=obj["metadata"]["name"])
        if status.get("dashboardURL") and context.get("ti") is not None:
            if status["dashboardURL"].startswith(("http://", "https://")):  # the local backend gives a full URL
                context["ti"].xcom_push(key=DASHBOARD_XCOM_KEY, value=status["dashboardURL"])
                return
            url = self.dashboard_url_template.format(
                dashboard_url=status["dashboardURL"],
                namespace=obj["metadata"].get("namespace", ""),
                name=obj["metadata"]["name"],
                ray_cluster=status.get("rayClusterName", ""),
            )
            context["ti"].xcom_push(key=DASHBOARD_XCOM_KEY, value=url)

    def execute_complete(self, context, event: dict) -> dict:
        """Resumed from the trigger: log the last progress and log tail, fail with KubeRay's reason, or return XCom."""
        if event.get("last_progress"):
            self.log.info("last progress %s", event["last_progress"])
        for line in event.get("log_tail") or []:
            self.log.info("job log | %s", line)
        if event.get("dashboard_url"):
            self._push_dashboard(
                context,
                {
                    "metadata": {"name": event.get("name"), "namespace": event.get("namespace") or ""},
                    "status": {"dashboardURL": event["dashboard_url"]},
                },
            )
        if event.get("status") != "success":
            message = event.get("message") or f"job {event.get('name')} failed"
            if event.get("reason") == "ValidationFailed":  # the spec itself is wrong: a retry cannot help
                raise AirflowFailException(message)
            raise JobFailed(message)
        return self.result(event)

    def result(self, event: dict) -> dict:
        """The XCom: where the checkpoints are, how far training got, and the final metrics."""
        return {
            "backend": event.get("backend"),
            "job": event.get("name"),
            "checkpoint_uri": self.checkpoint_uri,
            "checkpoint_step": checkpoint_step(self.checkpoint_uri, self.metrics_reader),
            "metrics_uri": self.metrics_uri,
            "last_step": event.get("last_step"),
            "metrics": event.get("metrics") or {},
        }

    def on_kill(self) -> None:
        """The task was killed while running on the worker: delete every attempt (their clusters go with them)."""
        if not self.rayjob:
            return
        base, namespace = self.rayjob["metadata"]["name"], self._namespace(self.rayjob)
        for obj in self.hook.list_rayjobs(namespace, f"{GROUP_LABEL}={base}"):
            if self.hook.delete_rayjob(obj["metadata"]["name"], namespace):
                self.log.info("deleted RayJob %s/%s", namespace, obj["metadata"]["name"])
