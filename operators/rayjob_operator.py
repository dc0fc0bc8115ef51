"""``RayJobOperator``: run a rendered KubeRay ``RayJob`` to completion from Airflow.

The operator only orchestrates: :class:`operators.backends.KubeRayJobs` creates or re-attaches this task's attempt
through :class:`operators.hooks.rayjob_api.RayJobHook`, the task defers to
:class:`operators.triggers.kuberay_job.RayJobTrigger`, and :func:`operators.backends.complete` turns the
trigger's event into success or a (retryable) failure.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow.sdk import BaseOperator

from operators.backends import KubeRayJobs, complete, training_result
from operators.links import RayDashboardLink


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

    def execute(self, context):
        if not self.rayjob:
            raise ValueError("RayJobOperator needs a rendered RayJob body (rayjob=)")
        trigger = KubeRayJobs(self).submit(context, self.rayjob, self.resume_rayjob)
        self.defer(trigger=trigger, method_name="execute_complete")

    def execute_complete(self, context, event: dict) -> dict:
        complete(self, context, event, KubeRayJobs(self).dashboard_from_event(event))
        return training_result(event, self.checkpoint_uri, self.metrics_uri, self.metrics_reader)

    def on_kill(self) -> None:
        KubeRayJobs(self).kill(self.rayjob)
