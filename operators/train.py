"""``GRPOTrainOperator``: the ``train`` task, on a local Ray cluster or as a KubeRay RayJob.

Both backends run the same CPU pre-flight first (verl's own config composition and
checks, :func:`pipeline_steps.training.preflight_checks.preflight`), so a bad config fails in seconds,
before a cluster is requested. Then the operator delegates to a backend strategy
(:mod:`operators.backends`):

* ``kuberay``: the RayJob rendered by :func:`pipeline_steps.training.rayjob_manifest.build_rayjob` (its entrypoint
  always resumes from the run's checkpoints) goes to :class:`operators.backends.KubeRayJobs` (create or re-attach);
* ``local``: the ``train-local`` step goes to :class:`operators.backends.LocalRayJobs` under a submission id
  derived from dag/run/task (a restarted worker re-attaches to it; after a failed attempt the next one resumes
  from the checkpoint directory).

XCom (both backends): ``checkpoint_uri``, ``checkpoint_step``, ``metrics_uri``, ``last_step``,
``metrics`` (the last step's numeric metrics), ``backend``, ``job``, ``mlflow`` (the run's MLflow record, or None)
and ``tensorboard`` (``{uri, command}`` of its event files, or None).

verl, torch and Ray are imported inside ``execute`` only: DAG files must parse fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from airflow.sdk.exceptions import AirflowFailException

from operators.backends import KubeRayJobs, LocalRayJobs, complete, submission_base, training_result
from operators.failures import user_errors
from operators.hooks.store_connection import StoreHook
from operators.ray_job import RayJobBaseOperator
from pipeline_steps import library_env

__all__ = ["GRPOTrainOperator", "as_list", "local_tracking_env"]


def as_list(value) -> list[str]:
    """A list of URIs from a list, or from a rendered template (JSON or a Python list literal)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("["):
            return [text]
        try:
            value = json.loads(text)
        except ValueError:
            import ast

            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise AirflowFailException(
                    f"file list {text[:80]!r}: not a list literal; pass a list of URIs"
                ) from None
    return [str(v) for v in value]


class GRPOTrainOperator(RayJobBaseOperator):
    """Pre-flight, then GRPO training with verl on the local Ray backend or as a KubeRay RayJob.

    :param plan: the run's plan (:func:`pipeline_steps.planning.plan.plan`, the ``plan`` task's XCom): the preset as
        read, the backend and the overrides come from it (no preset is read again). Overrides are untrusted:
        checked by :mod:`pipeline_steps.training.overrides`, and they only ever travel as single argv items (local)
        or shell-quoted arguments (RayJob).
    :param train_files: verl-schema parquet files (store URIs or, for the local backend, paths).
    :param val_files: validation parquet files.
    :param model_path: the staged model (store URI or local directory).
    :param run_dir: the run's directory in the store: ``checkpoints/`` and ``metrics.jsonl`` go below it.
    :param ray_address: local backend: the Ray dashboard address (default ``$RAY_ADDRESS`` or a local cluster).
    :param check_store: pre-flight also checks that data and model are staged (manifests present).
    :param store_conn_id: the store connection: the worker reads the store with it (pre-flight, progress,
        the local backend's mirror of a cloud store; see :mod:`pipeline_steps.store.mirror`).
    :param mlflow_conn_id: a team's MLflow server (:class:`operators.hooks.mlflow.MlflowHook`), used when the
        preset's ``trainer.logger`` has mlflow and the connection exists: the local job logs there instead of the
        embedded server; the RayJob gets its URI and its credentials by Secret reference.
    :param kwargs: :class:`operators.ray_job.RayJobBaseOperator`'s (``namespace``, ``kubernetes_conn_id``,
        ``cluster_context``, ``poll_interval``, ``log_tail_lines``, ``dashboard_url_template``) and
        ``BaseOperator``'s.
    """

    template_fields: Sequence[str] = (
        "plan",
        "train_files",
        "val_files",
        "model_path",
        "run_dir",
        "namespace",
        "ray_address",
    )
    ui_color = "#e8f4fd"

    def __init__(
        self,
        *,
        plan: dict,
        train_files=(),
        val_files=(),
        model_path: str,
        run_dir: str,
        ray_address: str | None = None,
        check_store: bool = True,
        store_conn_id: str | None = None,
        mlflow_conn_id: str | None = "mlflow_default",
        **kwargs,
    ):
        super().__init__(plan=plan, **kwargs)
        self.store_conn_id, self.mlflow_conn_id = store_conn_id, mlflow_conn_id
        self.train_files, self.val_files, self.model_path = train_files, val_files, model_path
        self.run_dir, self.ray_address, self.check_store = run_dir, ray_address, check_store
        self._local: LocalRayJobs | None = None

    @property
    def layout(self):
        """Every location of the run (:class:`pipeline_steps.planning.layout.RunLayout`), from its directory."""
        from pipeline_steps.planning.layout import RunLayout

        return RunLayout.for_run_dir(str(self.run_dir))

    @property
    def checkpoint_uri(self) -> str:
        return self.layout.checkpoints

    @property
    def metrics_uri(self) -> str:
        return self.layout.metrics

    def _kuberay(self, metrics_uri: str | None = None) -> KubeRayJobs:
        return super()._kuberay(metrics_uri or self.metrics_uri)

    def _load(self, backend: str):
        """The experiment with the pipeline's derived keys (:func:`pipeline_steps.training.derived_keys.derived_keys`:
        the store URIs as they are) and the run's overrides."""
        from pipeline_steps.training.derived_keys import derived_keys

        derived = derived_keys(
            self.layout,
            train_files=as_list(self.train_files),
            val_files=as_list(self.val_files),
            model_path=str(self.model_path),
        )
        exp = self._experiment(derived)  # the preset the plan read, and its overrides
        exp.spec["backend"] = "local" if backend == "local" else "cluster"
        return exp

    def execute(self, context):
        from pipeline_steps.training.preflight_checks import preflight

        backend = self._backend()
        exp = self._load(backend)
        credentials = StoreHook(self.store_conn_id).credentials(str(self.run_dir))  # handed to the store's client
        with user_errors("pre-flight"):  # a bad config does not get better on retry
            summary = preflight(exp, check_store=self.check_store, store_credentials=credentials)
        self.log.info("pre-flight passed: %s", json.dumps(summary, default=str, sort_keys=True)[:2000])
        trigger = self._submit_local(context, exp) if backend == "local" else self._submit_kuberay(context, exp)
        self.defer(trigger=trigger, method_name="execute_complete")

    def execute_complete(self, context, event: dict) -> dict:
        url = self._kuberay().dashboard_from_event(event) if event.get("backend") == "kuberay" else None
        if event.get("backend") != "kuberay":  # the job has read its MLflow credentials (if it got any) long ago
            from operators.hooks.mlflow import remove_credentials_file
            from operators.hooks.store_connection import remove_store_credentials_file

            remove_credentials_file(submission_base(**self._ids(context)))
            remove_store_credentials_file(submission_base(**self._ids(context)))
        complete(self.log, context, event, url)
        # the job committed the run directory to the store
        result = training_result(event, self.checkpoint_uri, self.metrics_uri, self.store_conn_id)
        result.update(self._tracking(event.get("backend")))
        if result["mlflow"]:
            self.log.info("MLflow run: %s", result["mlflow"].get("url") or result["mlflow"]["run_id"])
        if result["tensorboard"]:
            tb = result["tensorboard"]
            self.log.info("TensorBoard logs: %s (%s)", tb["uri"], tb["command"] or "download them to view")
        return result

    def _tracking(self, backend: str | None) -> dict:
        """``mlflow``: the run's record beside the checkpoints (written by the CPU trainer or the cluster entrypoint),
        read from the store as every task reads what another left; ``tensorboard``: where the event files are and
        the command to view them."""
        from operators import progress
        from pipeline_steps import tracking_run

        text = progress.read_text(self.layout.mlflow_record, self.store_conn_id)
        logger = self._load("local" if backend != "kuberay" else "kuberay").verl.get("trainer.logger")
        return {
            "mlflow": tracking_run.parse(text),
            "tensorboard": tracking_run.tensorboard_info(self.layout.tensorboard)
            if "tensorboard" in tracking_run.loggers(logger)
            else None,
        }

    def _submit_kuberay(self, context, exp):
        from pipeline_steps.training.mounts import MountMap
        from pipeline_steps.training.rayjob_manifest import build_rayjob

        jobs = self._kuberay()
        with user_errors("render RayJob"):
            body = build_rayjob(
                exp,
                namespace=jobs.namespace_for(),
                mounts=MountMap.for_experiment(exp.spec),
                cluster=self._cluster(exp),
                **self._ids(context),
            )
        self.rayjob = body
        return jobs.submit(context, body)  # the entrypoint resumes by itself: a retry re-submits it

    def _submit_local(self, context, exp):
        """The train-local step as a local Ray job. It is handed store URIs, never this worker's files: tasks share
        nothing but the store, and the job fetches its inputs, resumes from the run directory in the store and
        commits the run directory there itself (on a cloud store, with the store connection's credentials in a
        file only this user reads; a job on another machine uses its own environment)."""
        from operators.hooks.store_connection import store_credentials_file
        from pipeline_steps.local import ray_cluster
        from pipeline_steps.planning.layout import RunLayout
        from pipeline_steps.planning.run_requests import train_local_argv
        from pipeline_steps.store import mirror

        run_dir = str(self.run_dir).rstrip("/")
        facts = {
            "train_files": as_list(self.train_files),
            "val_files": as_list(self.val_files),
            "model_path": str(self.model_path),
            "output_dir": run_dir,
        }
        with user_errors():  # the argv the plan recorded, with the store URIs filled in
            argv = train_local_argv(self.plan, {**facts, "plan_file": self.layout.plan_file})
        # progress is read where a job on this machine writes it (a job elsewhere: its final result still counts)
        progress_uri = RunLayout.for_run_dir(str(mirror.local_for(run_dir))).metrics
        env = {"TOKENIZERS_PARALLELISM": "false"}
        base = submission_base(**self._ids(context))
        with user_errors("store connection"):
            cred_file = store_credentials_file(self.store_conn_id, run_dir, base)
        if cred_file:
            from pipeline_steps import settings

            env[settings.STORE_CREDENTIALS_FILE] = cred_file
        env.update(local_tracking_env(exp, self.mlflow_conn_id, base))
        self._local = LocalRayJobs(self.log, ray_address=self.ray_address, polling=self._polling(progress_uri))
        return self._local.submit(context, base, ray_cluster.job_argv(None, *argv), env)

    def on_kill(self) -> None:
        if self._local is not None:
            self._local.kill()
        else:
            super().on_kill()


def local_tracking_env(exp, mlflow_conn_id: str | None = None, job: str = "job") -> dict[str, str]:
    """The environment of a local job whose ``trainer.logger`` has mlflow: the MLflow connection's server when the
    connection exists (its credentials in a file only this user reads, named by ``$PIPELINE_MLFLOW_CREDENTIALS_FILE``:
    the Ray dashboard shows a job's environment), else ``$MLFLOW_TRACKING_URI``, else the local profile's embedded
    server (started on demand, reused while it runs, like the local Ray cluster). The embedded server's credentials
    reach the job the same way: its own credentials file (pipeline_steps/local/mlflow_server.py), by name.

    :param job: the Ray submission's base name (names the credentials file)
    """
    from operators.hooks.mlflow import MlflowHook
    from pipeline_steps import tracking_run
    from pipeline_steps.local import mlflow_server

    if "mlflow" not in tracking_run.loggers(exp.verl.get("trainer.logger")):
        return {}
    hook = MlflowHook(mlflow_conn_id)
    if hook.tracking_uri:
        env = {library_env.MLFLOW_TRACKING_URI: hook.tracking_uri}
        secret_file = hook.credentials_file(job)
        if secret_file:
            env[tracking_run.CREDENTIALS_FILE_ENV] = str(secret_file)
        return env
    env = {library_env.MLFLOW_TRACKING_URI: mlflow_server.ensure_server()}  # a failed start is retryable, not bad input
    if mlflow_server.is_local_server(
        env[library_env.MLFLOW_TRACKING_URI]
    ):  # the embedded server wants its login (issue 46)
        env[tracking_run.CREDENTIALS_FILE_ENV] = str(mlflow_server.credentials_file())  # 0600, in its own directory
    return env
