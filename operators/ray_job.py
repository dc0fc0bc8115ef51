"""``RayJobBaseOperator``: what the operators that run a job on the local Ray cluster or as a KubeRay RayJob share.

The shape of the cncf.kubernetes provider's ``KubernetesJobOperator`` (which derives from the pod operator): the
operator holds the task's parameters and turns them into a job; the Kubernetes API is reached through a hook
(:class:`operators.hooks.rayjob_api.RayJobHook`, behind the backend strategy :class:`operators.backends.KubeRayJobs`)
and the wait happens in a trigger (:mod:`operators.triggers`), where the task resumes in ``execute_complete``.

Shared here: the run's plan, rebuilt once as a typed object (:mod:`pipeline_steps.planning.run_plan`: the backend,
the preset as read and the overrides come from it, no preset is read again), the KubeRay parameters (namespace,
connection, context, dashboard link), the polling parameters, the ids that make a job's name deterministic, the
backend strategy, the MLflow cluster settings and the kill.

Derived operators: :class:`operators.train.GRPOTrainOperator` (the ``train`` task) and
:class:`operators.cluster_step.PipelineStepJobOperator` (a pipeline step in the worker or as a RayJob). Each sets
``store_conn_id`` and ``mlflow_conn_id`` with its own defaults (a step operator's come from
:class:`operators.step.PipelineStepOperator`).
"""

from __future__ import annotations

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from operators.backends import KubeRayJobs, Polling
from operators.failures import user_errors
from operators.links import RayDashboardLink


class RayJobBaseOperator(BaseOperator):
    """Base of the operators that run a job on the local Ray backend or as a KubeRay RayJob.

    :param plan: the run's plan (the ``plan`` task's XCom: :meth:`pipeline_steps.planning.run_plan.RunPlan.to_dict`,
        or the evaluation DAG's :class:`~pipeline_steps.planning.run_plan.EvaluationPlan`): the backend, the preset as
        read and the overrides come from it. Required: an operator without one fails at construction.
    :param namespace: kuberay backend: namespace (default: the Kubernetes connection's, then ``default``).
    :param kubernetes_conn_id: kuberay backend: the Kubernetes connection.
    :param cluster_context: kuberay backend: kube config context.
    :param poll_interval: seconds between polls of the job.
    :param log_tail_lines: lines of the job's log to show.
    :param dashboard_url_template: Ray dashboard link for KubeRay (see :class:`operators.backends.KubeRayJobs`).
    """

    operator_extra_links = (RayDashboardLink(),)

    store_conn_id: str | None
    mlflow_conn_id: str | None

    def __init__(
        self,
        *,
        plan: dict,
        namespace: str | None = None,
        kubernetes_conn_id: str | None = "kubernetes_default",
        cluster_context: str | None = None,
        poll_interval: float = 30.0,
        log_tail_lines: int = 20,
        dashboard_url_template: str = "http://{dashboard_url}",
        **kwargs,
    ):
        if plan is None or plan == {}:
            raise TypeError(
                f"{type(self).__name__} {kwargs.get('task_id')!r}: plan= is required (the plan task's XCom: the "
                "run's backend, preset and overrides)"
            )
        super().__init__(**kwargs)
        self.plan = plan
        self.namespace, self.kubernetes_conn_id, self.cluster_context = namespace, kubernetes_conn_id, cluster_context
        self.poll_interval, self.log_tail_lines = poll_interval, log_tail_lines
        self.dashboard_url_template = dashboard_url_template
        self.rayjob: dict | None = None  # the RayJob body submitted (kuberay), for on_kill
        self._typed_plan: tuple | None = None  # (the plan dict, its typed object): rebuilt once per rendered plan

    # -- the run's plan ------------------------------------------------------------------------------------
    def _run_plan(self):
        """The plan as a typed object (:func:`pipeline_steps.planning.run_plan.from_dict`: a pipeline run's
        ``RunPlan`` or the evaluation DAG's ``EvaluationPlan``), rebuilt from the rendered dict once."""
        if not self.plan:
            raise AirflowFailException(f"task {self.task_id}: no plan= given (the plan task's XCom)")
        if self._typed_plan is None or self._typed_plan[0] is not self.plan:
            from pipeline_steps.planning import run_plan

            with user_errors():
                self._typed_plan = (self.plan, run_plan.from_dict(self.plan))
        return self._typed_plan[1]

    def _backend(self) -> str:
        """``local`` or ``kuberay``: the plan's."""
        return self._run_plan().backend

    def _experiment(self, derived: dict | None = None):
        """The preset the plan read, the derived keys, then its overrides (no preset file read)."""
        plan = self._run_plan()
        if not hasattr(plan, "experiment_with"):
            raise AirflowFailException(
                f"task {self.task_id}: the evaluation plan holds no preset; the kuberay backend needs a run's plan"
            )
        with user_errors():
            return plan.experiment_with(derived)

    def _overrides(self) -> list[str]:
        return list(getattr(self._run_plan(), "overrides", None) or [])

    def _ids(self, context) -> dict:
        """dag id, run id and task id: what makes the job's name and Ray submission id deterministic."""
        dag_id = self.dag_id if self.has_dag() else "adhoc"
        return {"dag_id": dag_id, "run_id": str(context.get("run_id") or "adhoc"), "task_id": self.task_id}

    # -- the backend strategy ------------------------------------------------------------------------------
    def _polling(self, metrics_uri: str | None = None) -> Polling:
        """What the trigger is given; ``metrics_uri``: verl's file-logger output (None: no training progress)."""
        conn_id = self.store_conn_id if metrics_uri else None
        return Polling(self.poll_interval, self.log_tail_lines, metrics_uri, conn_id)

    def _kuberay(self, metrics_uri: str | None = None) -> KubeRayJobs:
        return KubeRayJobs(
            self.log,
            conn_id=self.kubernetes_conn_id,
            cluster_context=self.cluster_context,
            namespace=self.namespace,
            dashboard_url_template=self.dashboard_url_template,
            polling=self._polling(metrics_uri),
        )

    def _cluster(self, exp) -> dict:
        """The preset's ``cluster`` section; when ``trainer.logger`` has mlflow, a team server's from the MLflow
        connection (URI plain, credentials by Secret reference)."""
        from pipeline_steps import tracking_run

        cluster = exp.spec.get("cluster") or {}
        if self.mlflow_conn_id and "mlflow" in tracking_run.loggers(exp.verl.get("trainer.logger")):
            from operators.hooks.mlflow import MlflowHook

            cluster = MlflowHook(self.mlflow_conn_id).cluster_settings(cluster)
        return cluster

    def on_kill(self) -> None:
        if self.rayjob:
            self._kuberay().kill(self.rayjob)
