"""Wait for a KubeRay ``RayJob``: status through :class:`operators.hooks.rayjob_api.RayJobHook`'s async calls.

Success is only ``jobDeploymentStatus == Complete`` with ``jobStatus == SUCCEEDED`` (KubeRay reports ``Complete`` for
FAILED and STOPPED jobs too). The log tail comes from the submitter pod in ``K8sJobMode``; in ``HTTPMode`` (no
submitter pod) from the Ray dashboard's Jobs API when the triggerer can reach it. Every rendered RayJob turns Ray token
authentication on (``spec.rayClusterSpec.authOptions.mode: token``), so the dashboard refuses a request without the
cluster's token: the trigger reads it from the Secret KubeRay gives the cluster's pods (``authOptions.secretName``, else
the one KubeRay generates under the RayCluster's name; key ``auth_token``) and sends it as Ray's clients do
(``Authorization: Bearer <token>``). The token is kept in memory only, never logged or put in an event.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from operators.progress import describe_failure, rayjob_outcome
from operators.triggers.job_poll import JobPollTrigger, Poll

if TYPE_CHECKING:  # the hook module loads the Kubernetes clients: imported where a job is reached, not at DAG parse
    from operators.hooks.rayjob_api import RayJobHook


class RayJobTrigger(JobPollTrigger):
    """Polls one RayJob until it is terminal and yields a single event.

    :param name: the RayJob's name.
    :param namespace: its namespace.
    :param kubernetes_conn_id: the Kubernetes connection.
    :param cluster_context: kube config context, if not the connection's default.
    :param submission_mode: the RayJob's ``spec.submissionMode``: where its log tail is read from.
    :param kwargs: :class:`operators.triggers.job_poll.JobPollTrigger`'s (poll interval, metrics, log tail, ...).
    """

    backend = "kuberay"

    def __init__(
        self,
        name: str,
        namespace: str,
        kubernetes_conn_id: str | None = "kubernetes_default",
        cluster_context: str | None = None,
        submission_mode: str = "K8sJobMode",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.name, self.namespace, self.submission_mode = name, namespace, submission_mode
        self.kubernetes_conn_id, self.cluster_context = kubernetes_conn_id, cluster_context
        self._dashboard_misses = 0
        self._ray_token: str | None = None  # read once per trigger run; never serialized, logged or evented

    @property
    def job_name(self) -> str:
        return self.name

    def job_fields(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "kubernetes_conn_id": self.kubernetes_conn_id,
            "cluster_context": self.cluster_context,
            "submission_mode": self.submission_mode,
        }

    @cached_property
    def hook(self) -> RayJobHook:
        from operators.hooks.rayjob_api import RayJobHook

        return RayJobHook(conn_id=self.kubernetes_conn_id, cluster_context=self.cluster_context)

    def static_fields(self) -> dict:
        return {"namespace": self.namespace}

    async def poll(self) -> Poll:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            obj = await self.hook.async_get_rayjob(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return Poll(
                    "gone", {}, "deleted", f"RayJob {self.namespace}/{self.name} was deleted while the task waited"
                )
            raise
        status = obj.get("status") or {}
        fields = {
            "job_deployment_status": status.get("jobDeploymentStatus"),
            "job_status": status.get("jobStatus"),
            "reason": status.get("reason"),
            "dashboard_url": status.get("dashboardURL"),
            "_status": status,
            "_auth": ((obj.get("spec") or {}).get("rayClusterSpec") or {}).get("authOptions") or {},
        }
        label = (
            f"jobDeploymentStatus={status.get('jobDeploymentStatus') or '-'} jobStatus={status.get('jobStatus') or '-'}"
        )
        return Poll(rayjob_outcome(status), fields, label)

    def failure_message(self, poll: Poll, tail: list[str]) -> str:
        return describe_failure(self.name, poll.fields.get("_status") or {})

    def api_failure(self, exc: Exception) -> str:
        status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
        detail = f"HTTP {status} {reason}" if status else str(exc)
        return f"Kubernetes API kept failing for RayJob {self.name}: {detail}"

    async def log_tail(self, poll: Poll) -> list[str]:
        """The job's log tail; empty while the job has not started, and when the log is unreachable."""
        status = poll.fields.get("_status") or {}
        if not status.get("jobStatus"):
            return []
        try:
            if self.submission_mode == "K8sJobMode":
                return await self.hook.async_submitter_log(self.name, self.namespace, self.log_tail_lines)
            if status.get("dashboardURL") and status.get("jobId") and self._dashboard_misses < 3:
                headers = await self._ray_auth_header(poll.fields.get("_auth") or {}, status)
                return await self._dashboard_log(status["dashboardURL"], status["jobId"], headers)
        except Exception as exc:  # logs are best effort
            self._dashboard_misses += self.submission_mode != "K8sJobMode"
            self.log.debug("no log tail for RayJob %s: %s", self.name, exc)
        return []

    async def _ray_auth_header(self, auth: dict, status: dict) -> dict[str, str]:
        """The dashboard request's ``Authorization`` header when the cluster has token authentication on."""
        if str(auth.get("mode") or "").lower() != "token":
            return {}
        if self._ray_token is None:
            secret = auth.get("secretName") or status.get("rayClusterName")  # KubeRay's generated Secret: the cluster's
            if not secret:
                return {}
            self._ray_token = await self.hook.async_ray_token(secret, self.namespace)
        return {"Authorization": f"Bearer {self._ray_token}"} if self._ray_token else {}

    async def _dashboard_log(self, dashboard: str, job_id: str, headers: dict[str, str] | None = None) -> list[str]:
        import aiohttp

        base = dashboard if dashboard.startswith(("http://", "https://")) else f"http://{dashboard}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"{base}/api/jobs/{job_id}/logs", headers=headers or {}) as resp:
                resp.raise_for_status()
                logs = (await resp.json()).get("logs") or ""
        return logs.splitlines()[-self.log_tail_lines :]

    def _event(self, kind, fields, progress, tail, message) -> dict:
        event = super()._event(kind, fields, progress, tail, message)
        event.pop("_status", None)
        event.pop("_auth", None)
        for key in ("job_deployment_status", "job_status", "reason", "dashboard_url"):
            event.setdefault(key, None)
        return event

    async def on_kill(self) -> None:
        """A user killed the deferred task: delete the RayJob (its cluster goes with it)."""
        if await self.hook.async_delete_rayjob(self.name, self.namespace):
            self.log.info("deleted RayJob %s/%s", self.namespace, self.name)
