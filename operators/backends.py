"""Where a job runs, as strategies the operators delegate to: KubeRay (a ``RayJob`` per attempt) or the local Ray
cluster (a Ray job per attempt). Each returns the trigger that waits for the job; :func:`complete` turns the
trigger's event into the task's outcome the same way for both. An operator gives a strategy the values it needs
(its logger, connection, namespace, :class:`Polling`), not itself.

Attempts: a job's name is deterministic per DAG run and task, so a retried or restarted worker finds its job
instead of submitting a second one. KubeRay: every attempt carries the label :data:`GROUP_LABEL` (= the attempt-0
name); a failed attempt is deleted (its Ray cluster goes with it) and the next is ``<base>-r<N>``, the same body
under its own name (a rendered training entrypoint resumes from the run's checkpoints by itself). Local: attempts
are ``<base>-a<N>``; a live or finished attempt is re-attached.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import re
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING

from airflow.sdk.exceptions import AirflowFailException

from operators.failures import JobFailed
from operators.links import DASHBOARD_XCOM_KEY
from operators.progress import checkpoint_step, describe_failure, rayjob_outcome
from operators.triggers.kuberay_job import RayJobTrigger
from operators.triggers.local_ray import LocalRayJobTrigger
from pipeline_steps.constants import RAYJOB_NAME_MAX

if TYPE_CHECKING:  # the hook module loads the Kubernetes clients: imported where a job is reached, not at DAG parse
    from operators.hooks.rayjob_api import RayJobHook

GROUP_LABEL = "verl-pipeline/rayjob-group"  # value: the attempt-0 name; selects every attempt of one task
ATTEMPT_LABEL = "verl-pipeline/attempt"


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


def submission_base(dag_id: str, run_id: str, task_id: str) -> str:
    """Deterministic Ray submission id prefix for one task of one DAG run (readable part + hash)."""
    digest = hashlib.sha256(f"{dag_id}\0{run_id}\0{task_id}".encode()).hexdigest()[:12]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{dag_id}-{task_id}".lower()).strip("-")[:40]
    return f"{readable}-{digest}"


@dataclasses.dataclass(frozen=True)
class Polling:
    """What a job's trigger is given (see :class:`operators.triggers.job_poll.JobPollTrigger`).

    :param interval: seconds between polls of the job.
    :param log_tail_lines: lines of the job's log to show.
    :param metrics_uri: verl's file-logger output, read for progress (None: the job reports no training progress).
    :param store_conn_id: the store connection ``metrics_uri`` is read with.
    """

    interval: float = 30.0
    log_tail_lines: int = 20
    metrics_uri: str | None = None
    store_conn_id: str | None = None

    def trigger_kwargs(self) -> dict:
        return {
            "poll_interval": self.interval,
            "metrics_uri": self.metrics_uri,
            "store_conn_id": self.store_conn_id,
            "log_tail_lines": self.log_tail_lines,
        }


class KubeRayJobs:
    """Create or re-attach this task's current RayJob attempt through :class:`RayJobHook`.

    :param log: the operator's logger.
    :param conn_id: the Kubernetes connection.
    :param cluster_context: kube config context.
    :param namespace: namespace (default: the body's, then the connection's, then ``default``).
    :param dashboard_url_template: Ray dashboard link; ``{dashboard_url}``, ``{namespace}``, ``{name}`` and
        ``{ray_cluster}`` are filled from the RayJob status (for an ingress, give its URL pattern).
    :param polling: what the trigger is given.
    """

    def __init__(
        self,
        log,
        *,
        conn_id: str | None,
        cluster_context: str | None = None,
        namespace: str | None = None,
        dashboard_url_template: str = "http://{dashboard_url}",
        polling: Polling = Polling(),
    ):
        self.log, self.conn_id, self.cluster_context, self.namespace = log, conn_id, cluster_context, namespace
        self.dashboard_url_template, self.polling = dashboard_url_template, polling

    @cached_property
    def hook(self) -> RayJobHook:
        from operators.hooks.rayjob_api import RayJobHook

        return RayJobHook(conn_id=self.conn_id, cluster_context=self.cluster_context)

    def namespace_for(self, body: dict | None = None) -> str:
        """The operator's namespace, else the body's, the connection's, then ``default``."""
        body_ns = ((body or {}).get("metadata") or {}).get("namespace")
        return self.namespace or body_ns or self.hook.get_namespace() or "default"

    def submit(self, context, body: dict, prepare: Callable[[dict], dict] | None = None) -> RayJobTrigger:
        """The trigger waiting for this task's current attempt (created when there is none alive). Every attempt
        runs ``body`` under its own name: a training entrypoint resumes from the run's checkpoints by itself, a step
        re-runs.

        :param prepare: applied to each new attempt's body just before it is created (e.g. a per-attempt path).
        """
        base, namespace = body["metadata"]["name"], self.namespace_for(body)
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
            new = attempt_body(body, base, attempt)
            obj = self._create(prepare(new) if prepare else new, namespace)
        push_job(context, obj["metadata"]["name"], self._dashboard_url(obj))
        mode = (
            (obj.get("spec") or {}).get("submissionMode")
            or (body.get("spec") or {}).get("submissionMode")
            or "K8sJobMode"
        )
        return RayJobTrigger(
            name=obj["metadata"]["name"],
            namespace=namespace,
            submission_mode=mode,
            kubernetes_conn_id=self.conn_id,
            cluster_context=self.cluster_context,
            **self.polling.trigger_kwargs(),
        )

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

    def _dashboard_url(self, obj: dict) -> str | None:
        dashboard = (obj.get("status") or {}).get("dashboardURL")
        if not dashboard:
            return None
        if dashboard.startswith(("http://", "https://")):
            return dashboard
        return self.dashboard_url_template.format(
            dashboard_url=dashboard,
            namespace=obj["metadata"].get("namespace", ""),
            name=obj["metadata"]["name"],
            ray_cluster=(obj.get("status") or {}).get("rayClusterName", ""),
        )

    def dashboard_from_event(self, event: dict) -> str | None:
        obj = {
            "metadata": {"name": event.get("name"), "namespace": event.get("namespace") or ""},
            "status": {"dashboardURL": event.get("dashboard_url")},
        }
        return self._dashboard_url(obj)

    def kill(self, body: dict | None) -> None:
        """The task was killed while running on the worker: delete every attempt (their clusters go with them)."""
        if not body:
            return
        base, namespace = body["metadata"]["name"], self.namespace_for(body)
        for obj in self.hook.list_rayjobs(namespace, f"{GROUP_LABEL}={base}"):
            if self.hook.delete_rayjob(obj["metadata"]["name"], namespace):
                self.log.info("deleted RayJob %s/%s", namespace, obj["metadata"]["name"])


class LocalRayJobs:
    """Submit or re-attach this task's current attempt on the local Ray cluster.

    :param log: the operator's logger.
    :param ray_address: the Ray dashboard address (None: ``$RAY_ADDRESS`` or a local cluster).
    :param polling: what the trigger is given.
    """

    def __init__(self, log, *, ray_address: str | None = None, polling: Polling = Polling()):
        self.log, self.ray_address, self.polling = log, ray_address, polling
        self.job: tuple[str, str] | None = None

    def submit(self, context, base: str, argv: list[str], env: dict[str, str]) -> LocalRayJobTrigger:
        from pipeline_steps.local import ray_cluster

        address = ray_cluster.ensure_cluster(self.ray_address)
        attempt, status = 0, None
        while True:  # find the latest attempt of this task
            try:
                status = ray_cluster.status(address, f"{base}-a{attempt}")
            except ray_cluster.JobNotFoundError:
                break
            attempt += 1
        if attempt and status in ray_cluster.LIVE | {"SUCCEEDED"}:
            attempt -= 1  # re-attach to the live or finished attempt
        elif attempt:
            self.log.warning(
                "previous attempt %s-a%d ended %s; attempt %d resumes from its checkpoints",
                base,
                attempt - 1,
                status,
                attempt,
            )
        sid = f"{base}-a{attempt}"
        try:
            ray_cluster.submit_or_attach(address, sid, argv, env=env)
        except ray_cluster.JobAlreadyFinishedError as exc:  # raced with a failure between status and submit
            raise RuntimeError(str(exc)) from None
        self.job = (address, sid)
        push_job(context, sid, address)
        return LocalRayJobTrigger(
            address=address,
            submission_id=sid,
            **self.polling.trigger_kwargs(),
        )

    def kill(self) -> None:
        if not self.job:
            return
        from pipeline_steps.local import ray_cluster

        address, sid = self.job
        try:
            ray_cluster.stop(address, sid)
            self.log.info("stopped Ray job %s", sid)
        except ray_cluster.JobNotFoundError:
            pass


def push_job(context, name: str, dashboard_url: str | None) -> None:
    """The job's name (the failure notice names it even when the task fails) and its dashboard link."""
    ti = context.get("ti") if context else None
    if ti is None:
        return
    ti.xcom_push(key="job", value=name)
    if dashboard_url:
        ti.xcom_push(key=DASHBOARD_XCOM_KEY, value=dashboard_url)


def complete(log, context, event: dict, dashboard_url: str | None = None) -> None:
    """Resumed from a trigger: log the last progress; fail with the job's reason on failure.

    A spec the API rejected (``ValidationFailed``) and a local job whose step exited 2 (bad input: an allocation
    the settings cannot fit, a refused input) fail without retry; any other failure raises :class:`JobFailed` so the
    task's retries apply (the next attempt resumes).
    """
    if event.get("last_progress"):
        log.info("last progress %s", event["last_progress"])
    # the job's log is not logged again here: the trigger logged each line as it came, into this task's log
    if dashboard_url and context and context.get("ti") is not None:
        context["ti"].xcom_push(key=DASHBOARD_XCOM_KEY, value=dashboard_url)
    if event.get("status") != "success":
        message = event.get("message") or f"job {event.get('name')} failed"
        if event.get("reason") == "ValidationFailed":  # the spec itself is wrong: a retry cannot help
            raise AirflowFailException(message)
        if event.get("exit_code") == 2:  # the step's bad input: the same input fails the same way
            raise AirflowFailException(f"{message} (bad input: not retried)")
        raise JobFailed(message)


def training_result(
    event: dict, checkpoint_uri: str | None, metrics_uri: str | None, store_conn_id: str | None = None
) -> dict:
    """The training XCom: where the checkpoints are, how far training got, and the final metrics (the checkpoint
    marker read with the store connection ``store_conn_id``)."""
    return {
        "backend": event.get("backend"),
        "job": event.get("name"),
        "checkpoint_uri": checkpoint_uri,
        "checkpoint_step": checkpoint_step(checkpoint_uri, store_conn_id),
        "metrics_uri": metrics_uri,
        "last_step": event.get("last_step"),
        "metrics": event.get("metrics") or {},
    }
