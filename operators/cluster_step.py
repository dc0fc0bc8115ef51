"""``PipelineStepJobOperator``: a pipeline step in the worker (local backend) or as a KubeRay RayJob.

* ``local``: exactly :class:`operators.step.PipelineStepOperator` (child process, same ``request``, XCom and
  exit-code semantics). On a cloud store the store URIs in ``uri_args`` are given to the step as their local
  mirror (:mod:`pipeline_steps.store.mirror`: fetched first), the ``output_args`` among them are uploaded after it,
  and mirror paths in its summary are turned back into store URIs.
* ``kuberay``: the step runs in a RayJob rendered by :func:`pipeline_steps.training.rayjob_manifest.build_rayjob` whose
  entrypoint is ``python3 -m pipeline_steps.cluster_entry --summary-file P -- <step> <args>`` (every argv item
  shell-quoted by the renderer). Store URIs in the flags named by ``uri_args`` become paths on the pods'
  bucket mounts. Creation, re-attach after a worker restart and retries are the KubeRay backend strategy's
  (:class:`operators.backends.KubeRayJobs`). The step's JSON summary comes back through the store: the job
  writes it to ``<summary_dir>/<RayJob attempt name>.json`` on the shared mount (one file per attempt, so a
  stale summary of an earlier attempt is never read), ``execute_complete`` reads it with
  :func:`pipeline_steps.store.open_store`, turns pod paths in it back into store URIs, and returns the same
  XCom as the local path. A step exit code 2 (bad input) fails the task without retries on both backends.

GPU: an ``evaluate`` job gets one worker with the preset's ``cluster.gpus_per_node`` GPUs and reserves them for
the entrypoint (``spec.entrypointNumGpus``), so Ray runs the step on that GPU worker; an ``export`` job is
CPU-only: a head-only Ray cluster (no worker group) whose head runs the step.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from operators.backends import complete
from operators.failures import JobFailed, user_errors
from operators.hooks.store_connection import StoreHook
from operators.ray_job import RayJobBaseOperator
from operators.step import PipelineStepOperator

ENTRY = ["python3", "-m", "pipeline_steps.cluster_entry"]
GPU_KINDS = ("evaluate",)


# -- pure helpers (unit-tested) ----------------------------------------------------------------------------
def to_pod_arg(value: str, flag: str, mounts) -> str:
    """A store URI (or a ``file://`` store path given as a plain absolute path) -> its path in the pods.

    :raises AirflowFailException: the value is not on any bucket mount (one line: which flag, what to do).
    """
    with user_errors(f"{flag} {value!r}"):
        if "://" not in value and value.startswith("/") and mounts.find(f"file://{value}"):
            value = f"file://{value}"  # the plan strips file:// for the local backend
        return mounts.to_pod_path(value)


def map_flag_values(args: Sequence[str], flags: Sequence[str], convert) -> list[str]:
    """``args`` with each value of a flag in ``flags`` (``--flag V [V ...]``, ``--flag=V``) as ``convert(V, flag)``."""
    flags = set(flags)
    out, current = [], None
    for a in map(str, args):
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            if eq and flag in flags:
                out.append(f"{flag}={convert(value, flag)}")
                current = None
            else:
                out.append(a)
                current = flag if flag in flags and not eq else None
        elif current:
            out.append(convert(a, current))  # nargs="+" flags: every value up to the next flag
        else:
            out.append(a)
    return out


def map_uri_args(args: Sequence[str], uri_flags: Sequence[str], mounts) -> list[str]:
    """``args`` with each value of a flag in ``uri_flags`` as its path on the pods' bucket mounts."""
    return map_flag_values(args, uri_flags, lambda value, flag: to_pod_arg(value, flag, mounts))


def pod_paths_to_uris(value, mounts):
    """Pod paths in a step summary (strings, nested) -> the store URIs they are mounted from; others unchanged."""
    if isinstance(value, dict):
        return {k: pod_paths_to_uris(v, mounts) for k, v in value.items()}
    if isinstance(value, list):
        return [pod_paths_to_uris(v, mounts) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        norm = posixpath.normpath(value)
        for m in sorted(mounts.mounts, key=lambda m: len(m.path), reverse=True):
            if norm == m.path or norm.startswith(m.path + "/"):
                return m.uri + norm[len(m.path) :]
    return value


def cpu_only(body: dict, head: dict | None = None) -> dict:
    """The RayJob as a head-only Ray cluster (no GPU worker group); the entrypoint runs on the head.

    :param head: optional ``{"cpu": ..., "memory": ...}`` for the head container (it does the work).
    """
    spec = body["spec"]
    spec["rayClusterSpec"].pop("workerGroupSpecs", None)
    spec.pop("entrypointNumGpus", None)
    if head:
        res = {k: str(head[k]) for k in ("cpu", "memory") if head.get(k)}
        container = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        container["resources"] = {"requests": dict(res), "limits": dict(res)}
    return body


def single_gpu_worker(body: dict) -> dict:
    """One GPU worker whose GPUs are reserved for the entrypoint, so Ray runs the step on it (the head has none)."""
    group = body["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replicas"] = group["minReplicas"] = group["maxReplicas"] = 1
    gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
    body["spec"]["entrypointNumGpus"] = gpus
    return body


# -- operator ----------------------------------------------------------------------------------------------
class PipelineStepJobOperator(RayJobBaseOperator, PipelineStepOperator):
    """Run one pipeline step in the worker (``local``) or as a KubeRay RayJob (``kuberay``).

    :param step: step name, as in ``python -m pipeline_steps --help``.
    :param request: ``{"args": [...], "carry": {...}}`` as for :class:`operators.step.PipelineStepOperator`;
        without it, the argv the plan holds for the step (``plan["steps"][step]``, no placeholders).
    :param plan: the run's plan, required (:func:`pipeline_steps.planning.plan.plan`, the ``plan`` task's XCom, or
        :func:`pipeline_steps.planning.evaluation_run.evaluation_plan`): the backend, and for a RayJob the preset as
        read (cluster shape, image, secrets, mounts) with the run's overrides, come from it; no preset is read again.
    :param uri_args: flags whose values are store URIs to turn into pod paths (kuberay), e.g.
        ``("--model", "--data", "--output")``; every other argument is passed as is (shell-quoted).
    :param output_args: those of ``uri_args`` the step writes (local backend on a cloud store: uploaded after it).
    :param job_kind: RayJob kind (name and label); default: the step name.
    :param gpu: run on a GPU worker (default: ``job_kind == "evaluate"``); otherwise a head-only CPU cluster.
    :param cpu_head_resources: ``{"cpu", "memory"}`` for the head of a CPU-only job (default: the preset's
        ``cluster.export``, sized for merging its checkpoint, else ``cluster.head``).
    :param summary_dir: store URI (on a bucket mount) where the job writes its summary; default
        ``<store_uri>/tmp/step-summaries``.
    :param store_uri: store root (as for PipelineStepOperator); also the default ``summary_dir``'s root.
    :param kwargs: :class:`operators.ray_job.RayJobBaseOperator`'s (``namespace``, ``kubernetes_conn_id``,
        ``cluster_context``, ``poll_interval``, ``log_tail_lines``, ``dashboard_url_template``),
        :class:`operators.step.PipelineStepOperator`'s (``store_conn_id``, ``hf_conn_id``, ``mlflow_conn_id``,
        ``summary_key``, ``skip_unless``) and ``BaseOperator``'s.
    """

    template_fields: Sequence[str] = (
        "request",
        "store_uri",
        "plan",
        "namespace",
        "summary_dir",
    )
    template_fields_renderers = {"request": "json"}
    ui_color = "#e3f2e8"

    def __init__(
        self,
        *,
        step: str,
        plan: dict,
        uri_args: Sequence[str] = (),
        output_args: Sequence[str] = (),
        job_kind: str | None = None,
        gpu: bool | None = None,
        cpu_head_resources: dict | None = None,
        summary_dir: str | None = None,
        **kwargs,
    ):
        super().__init__(step=step, plan=plan, **kwargs)
        self.uri_args, self.output_args, self.job_kind = tuple(uri_args), tuple(output_args), job_kind or step
        self._published: list[str] = []  # local backend on a cloud store: the output URIs to upload at the end
        self.gpu = self.job_kind in GPU_KINDS if gpu is None else gpu
        self.cpu_head_resources, self.summary_dir = cpu_head_resources, summary_dir
        self._entry: dict | None = None

    # -- dispatch ---------------------------------------------------------------------------------------
    def execute(self, context):
        if not self.request.get("args"):  # the argv the plan holds whole for this step
            from pipeline_steps.planning.run_requests import step_request

            with user_errors(f"step {self.step}"):
                self.request = step_request(self._run_plan(), self.step)
        if self._backend() == "local":
            self._mirror_inputs()
            return super().execute(context)  # the step in a child process of the worker
        self.defer(trigger=self._submit_kuberay(context), method_name="execute_complete")

    # -- local ------------------------------------------------------------------------------------------
    def _mirror_inputs(self) -> None:
        """On a cloud store: the store URIs among the step's arguments -> their local mirror, fetched."""
        from pipeline_steps.store import mirror

        if not (self.store_uri and mirror.is_remote(self.store_uri)):
            return

        def to_local(value: str, flag: str) -> str:
            if not mirror.is_remote(value):
                return value
            if flag in self.output_args:
                self._published.append(value)
            return str(mirror.fetch(value, credentials))

        credentials = StoreHook(self.store_conn_id).credentials(self.store_uri)  # handed to the store's client
        with user_errors(f"step {self.step}: fetch inputs"):
            args = map_flag_values([str(a) for a in self.request.get("args", [])], self.uri_args, to_local)
        self.request = {**self.request, "args": args}

    def finish(self, context, summary: dict) -> dict:
        if self._published:
            from pipeline_steps.store import mirror

            credentials = StoreHook(self.store_conn_id).credentials(self.store_uri)
            with user_errors(f"step {self.step}: upload"):
                for uri in self._published:
                    self.log.info("uploading %s: %s", uri, mirror.publish(uri, credentials))
            summary = mirror.to_uris(summary)
        return super().finish(context, summary)

    # -- kuberay ----------------------------------------------------------------------------------------
    def _summary_dir(self) -> str:
        root = self.summary_dir or (f"{str(self.store_uri).rstrip('/')}/tmp/step-summaries" if self.store_uri else "")
        if "://" not in root:
            raise AirflowFailException(
                f"step {self.step}: the kuberay backend needs summary_dir= or store_uri= "
                "(a store URI on a bucket mount, where the job leaves its summary)"
            )
        return root.rstrip("/")

    def summary_uri(self, attempt_name: str) -> str:
        """Where the RayJob attempt ``attempt_name`` writes the step's summary."""
        return f"{self._summary_dir()}/{attempt_name}.json"

    def _entrypoint(self, attempt_name: str) -> list[str]:
        pod_summary = to_pod_arg(self.summary_uri(attempt_name), "summary_dir", self._entry["mounts"])
        return [*ENTRY, "--summary-file", pod_summary, "--", self.step, *self._entry["args"]]

    def _submit_kuberay(self, context):
        from pipeline_steps.training.rayjob_manifest import build_rayjob, join_argv, rayjob_name

        exp = self._experiment()
        ids = self._ids(context)
        mounts = self._mounts(exp)
        jobs = self._kuberay()
        with user_errors(f"step {self.step}: render RayJob"):
            args = map_uri_args([str(a) for a in self.request.get("args", [])], self.uri_args, mounts)
            self._entry = {"mounts": mounts, "args": args}
            base = rayjob_name(ids["dag_id"], ids["run_id"], ids["task_id"], self.job_kind)
            body = build_rayjob(
                exp,
                namespace=jobs.namespace_for(),
                mounts=mounts,
                entrypoint=self._entrypoint(base),
                job_kind=self.job_kind,
                cluster=self._cluster(exp),
                **ids,
            )
        head = self.cpu_head_resources or (exp.spec.get("cluster") or {}).get("export")
        body = single_gpu_worker(body) if self.gpu else cpu_only(body, head)
        self.rayjob = body
        self.log.info("step %s as RayJob %s: %s", self.step, base, body["spec"]["entrypoint"])

        def per_attempt(attempt: dict) -> dict:  # each attempt writes its own summary file
            attempt["spec"]["entrypoint"] = join_argv(self._entrypoint(attempt["metadata"]["name"]))
            return attempt

        return jobs.submit(context, body, prepare=per_attempt)  # a retry re-runs the same step

    def read_summary(self, attempt_name: str) -> dict | None:
        """``{"exit_code": N, "summary": {...}}`` written by the attempt, or None when it wrote none."""
        uri = self.summary_uri(attempt_name)
        data = StoreHook(self.store_conn_id).open(uri).read_bytes(uri)
        if data is None:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            raise AirflowException(
                f"step {self.step}: summary {uri} is not JSON; the job's write was interrupted"
            ) from None
        return record if isinstance(record, dict) else None

    def execute_complete(self, context, event: dict) -> dict:
        """Resumed from the trigger: fail with KubeRay's reason (and the step's error), or return the step's XCom."""
        name = event.get("name") or ""
        try:
            complete(self.log, context, event, self._kuberay().dashboard_from_event(event))
        except (JobFailed, AirflowFailException) as exc:
            record = self._try_read(name)
            summary = (record or {}).get("summary") or {}
            error = f"; step {self.step}: {summary['error']}" if summary.get("error") else ""
            if (record or {}).get("exit_code") == 2:  # bad input: retrying the same input cannot help
                raise AirflowFailException(f"{exc}{error} (bad input: not retried)") from None
            raise type(exc)(f"{exc}{error}") from None
        record = self.read_summary(name)
        if record is None:
            raise AirflowException(
                f"step {self.step}: RayJob {name} succeeded but left no summary at "
                f"{self.summary_uri(name)}; check that summary_dir is on a writable bucket mount"
            )
        if record.get("exit_code") != 0:
            raise AirflowException(
                f"step {self.step}: RayJob {name} succeeded but the step exited {record.get('exit_code')}"
            )
        return self._finish(context, dict(record.get("summary") or {}))

    def _try_read(self, name: str) -> dict | None:
        try:
            return self.read_summary(name) if name else None
        except Exception as exc:  # the failure itself is what the user needs; the summary only adds detail
            self.log.warning("cannot read the step summary of %s: %s", name, exc)
            return None

    def _finish(self, context, summary: dict) -> dict:
        """PipelineStepOperator.finish on the summary with pod paths turned back into store URIs."""
        summary.pop("ok", None)
        summary.pop("step", None)
        return self.finish(context, pod_paths_to_uris(summary, self._mounts()))

    def _mounts(self, exp=None):
        """Bucket mounts of the pods: ``$PIPELINE_MOUNTS``, else the preset's ``cluster.mounts`` (as render-rayjob)."""
        from pipeline_steps.training.mounts import MountMap

        with user_errors(f"step {self.step}"):
            return MountMap.for_experiment((exp or self._experiment()).spec)

    def on_kill(self) -> None:
        if self.rayjob:
            RayJobBaseOperator.on_kill(self)
        else:
            PipelineStepOperator.on_kill(self)
