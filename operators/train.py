"""``GRPOTrainOperator``: the ``train`` task, on a local Ray cluster or as a KubeRay RayJob.

Both backends run the same CPU pre-flight first (verl's own config composition and
checks, :func:`pipeline_steps.training.preflight.preflight`), so a bad config fails in seconds,
before a cluster is requested. Then:

* ``kuberay``: the RayJob is rendered by :func:`pipeline_steps.training.rayjob.build_rayjob`
  (and once more with ``trainer.resume_mode=auto`` for attempts after a failed one) and
  handed to :class:`operators.rayjob.RayJobOperator`'s create-or-re-attach logic;
* ``local``: :func:`pipeline_steps.local.ray_cluster.ensure_cluster` gives a local Ray cluster, the
  ``train-local`` step is submitted under a submission id derived from dag/run/task (a
  restarted worker re-attaches to it; after a failed attempt the next id resumes from the
  checkpoint directory), and :class:`operators.local_ray.LocalRayJobTrigger` waits for it.

XCom (both backends): ``checkpoint_uri``, ``checkpoint_step``, ``metrics_uri``, ``last_step``,
``metrics`` (the last step's numeric metrics), ``backend``, ``job``.

verl, torch and Ray are imported inside ``execute`` only: DAG files must parse fast.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from airflow.sdk.exceptions import AirflowFailException

from operators.rayjob import RayJobOperator


def normalize_overrides(value) -> list[str]:
    """Overrides as typed in the trigger form: a list, a JSON list, or one ``KEY=VALUE`` per line."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError:
                raise AirflowFailException(
                    f"overrides {text[:80]!r}: not a JSON list; pass one KEY=VALUE per line or a JSON list"
                ) from None
        else:
            value = [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AirflowFailException("overrides: expected a list of KEY=VALUE strings")
    return list(value)


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


def local_path(uri: str, what: str) -> str:
    """A ``file://`` store URI or plain path as a local path (the local backend reads files directly)."""
    from pipeline_steps.errors import UserError
    from pipeline_steps.uris import local_path as to_path

    try:
        return str(to_path(uri, what))
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None


def submission_base(dag_id: str, run_id: str, task_id: str) -> str:
    """Deterministic Ray submission id prefix for one task of one DAG run (readable part + hash)."""
    digest = hashlib.sha256(f"{dag_id}\0{run_id}\0{task_id}".encode()).hexdigest()[:12]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{dag_id}-{task_id}".lower()).strip("-")[:40]
    return f"{readable}-{digest}"


class GRPOTrainOperator(RayJobOperator):
    """Pre-flight, then GRPO training with verl on the local Ray backend or as a KubeRay RayJob.

    :param experiment: preset name (``dags/experiments/NAME.yaml``) or a preset file.
    :param overrides: verl Hydra overrides (``KEY=VALUE``): a list, a JSON list, or one per line.
        Untrusted: they only ever travel as single argv items (local) or shell-quoted arguments (RayJob).
    :param backend: ``"local"`` or ``"kuberay"``; default: ``local`` when the preset says so, else ``kuberay``.
    :param train_files: verl-schema parquet files (store URIs or, for the local backend, paths).
    :param val_files: validation parquet files.
    :param model_path: the staged model (store URI or local directory).
    :param run_dir: the run's directory in the store: ``checkpoints/`` and ``metrics.jsonl`` go below it.
    :param ray_address: local backend: the Ray dashboard address (default ``$RAY_ADDRESS`` or a local cluster).
    :param check_store: pre-flight also checks that data and model are staged (manifests present).
    :param kwargs: passed to :class:`operators.rayjob.RayJobOperator` (namespace, kubernetes_conn_id,
        poll_interval, metrics_reader, ...) and ``BaseOperator``.
    """

    template_fields: Sequence[str] = (
        "experiment",
        "overrides",
        "backend",
        "train_files",
        "val_files",
        "model_path",
        "run_dir",
        "namespace",
        "ray_address",
    )

    def __init__(
        self,
        *,
        experiment: str,
        overrides=(),
        backend: str | None = None,
        train_files=(),
        val_files=(),
        model_path: str,
        run_dir: str,
        ray_address: str | None = None,
        check_store: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.experiment, self.overrides, self.backend = experiment, overrides, backend
        self.train_files, self.val_files, self.model_path = train_files, val_files, model_path
        self.run_dir, self.ray_address, self.check_store = run_dir, ray_address, check_store
        self._local_job: tuple[str, str] | None = None

    # -- shared ---------------------------------------------------------------------------------------
    def _derive_paths(self) -> None:
        """Checkpoint dir and metrics file below ``run_dir`` (recomputed on resume: a deferred task
        comes back as a fresh operator object)."""
        run_dir = str(self.run_dir).rstrip("/")
        self.checkpoint_uri = f"{run_dir}/checkpoints"
        self.metrics_uri = f"{run_dir}/metrics.jsonl"

    def _load(self, backend: str):
        """The experiment with the pipeline's derived keys and the user's overrides (user wins)."""
        from pipeline_steps.errors import UserError
        from pipeline_steps.training import experiment

        derived = {
            "data.train_files": as_list(self.train_files),
            "data.val_files": as_list(self.val_files),
            "actor_rollout_ref.model.path": str(self.model_path),
            "trainer.default_local_dir": self.checkpoint_uri,
        }
        try:
            exp = experiment.load(self.experiment, normalize_overrides(self.overrides), derived=derived)
        except UserError as exc:
            raise AirflowFailException(str(exc)) from None
        exp.spec["backend"] = "local" if backend == "local" else "cluster"
        return exp

    def _backend(self) -> str:
        from pipeline_steps.constants import resolve_backend
        from pipeline_steps.training import experiment

        try:
            preset = experiment.load(self.experiment).spec.get("backend")
            return resolve_backend(self.backend, preset)
        except Exception as exc:
            raise AirflowFailException(str(exc).splitlines()[0]) from None

    def _preflight(self, exp) -> dict:
        from pipeline_steps.errors import UserError
        from pipeline_steps.training.preflight import preflight

        try:
            summary = preflight(exp, check_store=self.check_store)
        except UserError as exc:  # a bad config does not get better on retry
            raise AirflowFailException(f"pre-flight: {exc}") from None
        self.log.info("pre-flight passed: %s", json.dumps(summary, default=str, sort_keys=True)[:2000])
        return summary

    def _ids(self, context) -> dict:
        """dag id, run id and task id: what makes the job's name and Ray submission id deterministic."""
        dag_id = self.dag_id if self.has_dag() else "adhoc"
        return {"dag_id": dag_id, "run_id": str(context.get("run_id") or "adhoc"), "task_id": self.task_id}

    def execute(self, context):
        self._derive_paths()
        backend = self._backend()
        exp = self._load(backend)
        self._preflight(exp)
        if backend == "local":
            return self._execute_local(context, exp)
        return self._execute_kuberay(context, exp)

    def execute_complete(self, context, event: dict) -> dict:
        self._derive_paths()
        return super().execute_complete(context, event)

    # -- kuberay --------------------------------------------------------------------------------------
    def _execute_kuberay(self, context, exp):
        from pipeline_steps.errors import UserError
        from pipeline_steps.training.mounts import MountMap
        from pipeline_steps.training.rayjob import build_rayjob

        ids = self._ids(context)
        try:
            mounts = MountMap.from_env()
            namespace = (
                self.namespace or self.hook.get_namespace() or "default"
            )  # the DAG may leave it to the connection
            body = build_rayjob(exp, namespace=namespace, mounts=mounts, **ids)
            resume = body  # the entrypoint always resumes (trainer.resume_mode=auto): a retry re-submits it
        except UserError as exc:
            raise AirflowFailException(f"render RayJob: {exc}") from None
        self.rayjob = body
        return self.submit_rayjob(context, body, resume)

    # -- local ----------------------------------------------------------------------------------------
    def _job_argv(self, exp_ref: str) -> list[str]:
        from pipeline_steps.local import ray_cluster as local_ray

        train = [local_path(u, "train_files") for u in as_list(self.train_files)]
        val = [local_path(u, "val_files") for u in as_list(self.val_files)]
        argv = ["train-local", "--experiment", exp_ref]
        # "--override=K=V" keeps a value that starts with '-' from being read as an option
        argv += [f"--override={o}" for o in normalize_overrides(self.overrides)]
        argv += ["--train-files", *train]
        if val:
            argv += ["--val-files", *val]
        argv += [
            "--model-path",
            local_path(str(self.model_path), "model_path"),
            "--output-dir",
            local_path(str(self.run_dir).rstrip("/"), "run_dir"),
        ]
        return local_ray.job_argv(None, *argv)

    def _execute_local(self, context, exp):
        from operators.local_ray import LocalRayJobTrigger
        from pipeline_steps.local import ray_cluster as local_ray

        address = local_ray.ensure_cluster(self.ray_address)
        ti = context.get("ti")
        base = submission_base(**self._ids(context))
        attempt, status = 0, None
        while True:  # find the latest attempt of this task
            try:
                status = local_ray.status(address, f"{base}-a{attempt}")
            except local_ray.JobNotFoundError:
                break
            attempt += 1
        if attempt and status in local_ray.LIVE | {"SUCCEEDED"}:
            attempt -= 1  # re-attach to the live or finished attempt
        elif attempt:
            self.log.warning(
                "previous attempt %s-a%d ended %s; attempt %d resumes from %s",
                base,
                attempt - 1,
                status,
                attempt,
                self.checkpoint_uri,
            )
        sid = f"{base}-a{attempt}"
        argv = self._job_argv(self.experiment)  # train-local resumes from the run's checkpoints by itself
        env = {"VERL_FILE_LOGGER_PATH": local_path(self.metrics_uri, "run_dir"), "TOKENIZERS_PARALLELISM": "false"}
        try:
            local_ray.submit_or_attach(address, sid, argv, env=env)
        except local_ray.JobAlreadyFinishedError as exc:  # raced with a failure between status and submit
            raise RuntimeError(str(exc)) from None
        self._local_job = (address, sid)
        if ti is not None:
            from operators.rayjob import DASHBOARD_XCOM_KEY

            ti.xcom_push(key=DASHBOARD_XCOM_KEY, value=address)
            ti.xcom_push(key="job", value=sid)  # the failure notice names the job even when the task fails
        self.defer(
            trigger=LocalRayJobTrigger(
                address=address,
                submission_id=sid,
                poll_interval=self.poll_interval,
                metrics_uri=self.metrics_uri,
                metrics_reader=self.metrics_reader,
                log_tail_lines=self.log_tail_lines,
            ),
            method_name="execute_complete",
        )

    def on_kill(self) -> None:
        if self._local_job:
            from pipeline_steps.local import ray_cluster as local_ray

            address, sid = self._local_job
            try:
                local_ray.stop(address, sid)
                self.log.info("stopped Ray job %s", sid)
            except local_ray.JobNotFoundError:
                pass
            return
        super().on_kill()
