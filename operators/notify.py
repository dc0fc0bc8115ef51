"""Failure notice: one paragraph saying which step failed, on what, why, and what to do; optionally sent to a webhook.

Use it as a task or DAG ``on_failure_callback``::

    default_args={"on_failure_callback": notify_failure}          # the "pipeline_webhook" connection, if any
    on_failure_callback=FailureNotifier(conn_id="team_webhook")   # another connection id

The paragraph is logged as one record (in the task log for a task callback, in the DAG processor's log for a
DAG callback). When the webhook connection exists, the paragraph is POSTed as ``{"text": ...}`` (the shape
Slack, Mattermost and most chat webhooks accept) with a short timeout. The target URL is the connection's
extra ``url``; else it is built from the connection: ``conn_type`` http/https (or ``schema`` http/https, the
HTTP provider's convention) as the scheme, ``host`` (which may carry its own scheme) and ``port``, ``schema``
as the path when it is not a scheme, and the remaining extras as the query string (that is where Airflow puts
the query of an ``AIRFLOW_CONN_*`` URI); login/password go as basic auth; extra ``timeout`` overrides the
timeout. A webhook that fails is logged (scheme and host only: paths and query strings of webhooks often
carry their secret) and never fails the callback.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from airflow.sdk.bases.notifier import BaseNotifier

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "pipeline_webhook"
DEFAULT_TIMEOUT = 5.0
MAX_ERROR_CHARS = 400

# task id -> what to do; matched exactly, then by the first key the task id starts with
HINTS: dict[str, str] = {
    "plan": "check the trigger-form values and the dataset revision pins; a revision must exist at the run's logical "
    "date",
    "download": "check the revision pin (dataset_revisions in the trigger form) and the Hugging Face connection "
    "(huggingface_default): the Hub must be reachable, the revision must exist and gated repositories need a token",
    "preprocess": "open rejected.jsonl and stats.json in the preprocess output to see which rows were rejected and "
    "why, "
    "then fix the data or raise --max-rejected-fraction (default 0.05) on purpose",
    "upload_dataset": "check the store connection (pipeline_store: credentials, bucket, endpoint) and the store URI; "
    "a retry resumes the upload",
    "stage_model": "check the store connection (pipeline_store) and the model revision pin; a retry skips what is "
    "staged",
    "collect_inputs": "check that the upstream datasets produced a train split and that the evaluation set was "
    "processed",
    "train": "check the RayJob (kubectl describe rayjob; its status message) or the Ray dashboard job logs, and the "
    "pre-flight lines in this log (a bad override fails there); clearing the task resumes from the last checkpoint",
    "evaluate": "check the checkpoint the train task reported and the evaluation set (eval_dataset); evaluate runs on "
    "the gpu pool, so a queued run may only need a free slot",
    "export": "check the checkpoint, the store connection (pipeline_store) and the evaluation results it reads; "
    "a retry re-exports the same version",
    "report": "check that the run directory is readable; the report shows missing inputs as not produced",
    "register_datasets": "the data is uploaded; if the task failed with no error in its log, the API server refused "
    "the Asset registration (its log names why): clear this task to register again, nothing is re-uploaded",
    "register_model": "the model is exported; if the task failed with no error in its log, the API server refused "
    "the Asset registration (its log names why): clear this task to register again, nothing is re-exported",
}
DEFAULT_HINT = "read this task's log above the error, fix the cause, then clear the task to retry"


def hint_for(task_id: str | None) -> str:
    if not task_id:
        return DEFAULT_HINT
    if task_id in HINTS:
        return HINTS[task_id]
    for key, text in HINTS.items():
        if task_id.startswith(key):
            return text
    return DEFAULT_HINT


def first_line(text) -> str:
    for line in str(text).splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."
    return ""


def error_line(context) -> str:
    exc = context.get("exception")
    if exc is None:  # a DAG-level callback: the scheduler gives a reason, not an exception
        reason = context.get("reason")
        return f"the DAG run failed ({reason})" if reason else "no error message was recorded"
    if isinstance(exc, BaseException):
        msg = first_line(exc)
        return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return first_line(exc) or "no error message was recorded"


def mapped_item(context) -> str | None:
    """What a mapped (or single) task was working on: the rendered map index, else the request's carry."""
    ti, task = context.get("ti"), context.get("task")
    label = getattr(ti, "rendered_map_index", None)
    if label:
        return f"dataset {label}"
    request = getattr(task, "request", None) if task is not None else None
    carry = request.get("carry") if isinstance(request, dict) else None
    if isinstance(carry, dict):
        if carry.get("dataset"):
            return f"dataset {carry['dataset']}"
        if carry.get("model"):
            return f"model {carry['model']}"
    map_index = getattr(ti, "map_index", None)
    if isinstance(map_index, int) and map_index >= 0:
        return f"map index {map_index}"
    return None


def _pull(ti, task_id: str, key: str = "return_value"):
    try:
        return ti.xcom_pull(task_ids=task_id, key=key)
    except Exception:  # no XCom backend reachable (a crafted context, or the processor lost its connection)
        return None


def job_name(context) -> str | None:
    """The job's name from XCom: the failed task's ``job`` (pushed or returned), else the training job's."""
    ti = context.get("ti")
    task_id = getattr(ti, "task_id", None)
    if ti is None or not task_id or not hasattr(ti, "xcom_pull"):
        return None
    for value in (_pull(ti, task_id, "job"), _pull(ti, task_id)):
        if isinstance(value, dict):
            value = value.get("job")
        if isinstance(value, str) and value:
            return f"job {value}"
    if task_id != "train":
        trained = _pull(ti, "train")
        if isinstance(trained, dict) and isinstance(trained.get("job"), str) and trained["job"]:
            return f"training job {trained['job']}"
    return None


def paragraph(context) -> str:
    """The one-paragraph notice for a failure ``context`` (task or DAG callback)."""
    ti = context.get("ti")
    dag = context.get("dag")
    dag_id = getattr(ti, "dag_id", None) or getattr(dag, "dag_id", None) or "unknown DAG"
    run_id = context.get("run_id") or getattr(ti, "run_id", None) or "unknown run"
    task_id = getattr(ti, "task_id", None)
    is_task = context.get("exception") is not None or "reason" not in context
    where = f"step {task_id}" if task_id else "an unknown step"
    about = [x for x in (mapped_item(context), job_name(context)) if x]
    try_number, max_tries = getattr(ti, "try_number", None), getattr(ti, "max_tries", None)
    tries = f"try {try_number} of {max_tries + 1}" if isinstance(try_number, int) and isinstance(max_tries, int) else ""
    if is_task:
        detail = ", ".join(x for x in ("; ".join(about), tries) if x)
        head = f"Airflow DAG {dag_id}, run {run_id}: {where} failed" + (f" ({detail})" if detail else "")
    else:
        head = (
            f"Airflow DAG {dag_id}, run {run_id} failed"
            + (f"; last step {task_id}" if task_id else "")
            + (f" ({'; '.join(about)})" if about else "")
        )
    return f"{head}. Error: {error_line(context)}. What to do: {hint_for(task_id)}."


# ---------------------------------------------------------------------------------------------------------
# webhook


def webhook_request(conn, timeout: float = DEFAULT_TIMEOUT) -> dict | None:
    """``{"url", "params", "auth", "timeout"}`` for a connection, or None when it names no target."""
    extra = conn.extra_dejson or {}
    timeout = extra.get("timeout", timeout)
    auth = (conn.login, conn.password or "") if conn.login else None
    if extra.get("url"):
        return {"url": str(extra["url"]), "params": None, "auth": auth, "timeout": float(timeout)}
    host = (conn.host or "").strip()
    if not host:
        return None
    schemes = ("http", "https")
    if "://" in host:
        base = host.rstrip("/")
    else:
        scheme = conn.conn_type if conn.conn_type in schemes else conn.schema if conn.schema in schemes else "https"
        base = f"{scheme}://{host}" + (f":{conn.port}" if conn.port else "")
    path = conn.schema if conn.schema and conn.schema not in schemes else ""
    url = base + ("/" + path.lstrip("/") if path else "")
    params = {k: v for k, v in extra.items() if k not in ("url", "timeout") and isinstance(v, (str, int, float))}
    return {"url": url, "params": params or None, "auth": auth, "timeout": float(timeout)}


def shown(url: str) -> str:
    """Scheme and host of a URL: what may appear in a log."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def _redact(text: str) -> str:
    """Airflow's secrets masker over the text (connection passwords, masked variables, ``mask_secret`` values)."""
    try:
        from airflow.sdk.log import redact
    except ImportError:  # the masker moved: the task log still masks, the webhook text goes as built
        return text
    out = redact(text)
    return out if isinstance(out, str) else text


class FailureNotifier(BaseNotifier):
    """Log one paragraph about a failed task or DAG run and post it to a webhook connection when one exists.

    :param conn_id: Airflow connection holding the webhook (see the module docstring); absent means log only.
    :param timeout: seconds to wait for the webhook (the connection's extra ``timeout`` wins).
    """

    def __init__(self, conn_id: str | None = DEFAULT_CONN_ID, timeout: float = DEFAULT_TIMEOUT):
        super().__init__()
        self.conn_id = conn_id
        self.timeout = timeout

    def notify(self, context) -> None:
        try:
            text = paragraph(context)
        except Exception as exc:  # a callback must not fail the run's bookkeeping
            text = f"A pipeline task failed; the failure notice could not be built ({type(exc).__name__})."
        text = _redact(text)  # the log masks registered secrets; the webhook body must too
        log.error("%s", text)
        self.post(text)

    def post(self, text: str) -> bool:
        """POST ``{"text": text}`` to the webhook; True when it answered 2xx. Never raises."""
        if not self.conn_id:
            return False
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = BaseHook.get_connection(self.conn_id)
        except AirflowNotFoundException:
            log.info("no connection %r: failure notice logged only", self.conn_id)
            return False
        except Exception as exc:
            log.warning(
                "connection %r could not be read (%s): failure notice logged only", self.conn_id, type(exc).__name__
            )
            return False
        try:
            req = webhook_request(conn, self.timeout)
        except (TypeError, ValueError):
            req = None
        if req is None:
            log.warning("connection %r has no host and no extra 'url': failure notice not posted", self.conn_id)
            return False
        import requests

        try:
            resp = requests.post(
                req["url"],
                json={"text": text},
                params=req["params"],
                auth=req["auth"],
                timeout=req["timeout"],
                allow_redirects=False,
            )
        except requests.RequestException as exc:  # its message repeats the full URL: log the class only
            log.warning(
                "failure notice not delivered to %s (%s); the run is unaffected", shown(req["url"]), type(exc).__name__
            )
            return False
        if not 200 <= resp.status_code < 300:
            log.warning(
                "failure notice: %s answered HTTP %d; the run is unaffected", shown(req["url"]), resp.status_code
            )
            return False
        log.info("failure notice posted to %s (connection %r)", shown(req["url"]), self.conn_id)
        return True


def notify_failure(context) -> None:
    """``on_failure_callback`` for tasks and DAGs: log the failure notice and post it to ``pipeline_webhook``."""
    FailureNotifier()(context)
