"""The services a run talks to, asked once each with the credentials the run would use: the E2B-compatible sandbox
(tool-agent presets), the MLflow tracking server (presets logging to mlflow) and the store."""

from __future__ import annotations

import base64
import os

from pipeline_steps import library_env
from pipeline_steps.diagnostics import Check, http_status, no_answer, safe_url

SANDBOX_LIST = "/v2/sandboxes?limit=1"  # E2B's list route, served by sandbox-manager and AGS too (needs the key)
MLFLOW_SEARCH = "/api/2.0/mlflow/experiments/search?max_results=1"


def secret_value(core, ns: str, ref: dict) -> tuple[str | None, str]:
    """The value of a preset's ``cluster.secrets`` entry, for a request header only; (None, why) when unreadable."""
    from kubernetes.client.exceptions import ApiException

    what = f"Secret {ref['secret']} key {ref['key']}"
    try:
        data = core.read_namespaced_secret(ref["secret"], ns).data or {}
    except ApiException as exc:
        if exc.status in (403, 404):
            return (
                None,
                f"this identity may not read {what}" if exc.status == 403 else f"Secret {ref['secret']} is absent",
            )
        return None, f"{what}: HTTP {exc.status}"
    if ref["key"] not in data:
        return None, f"{what} is missing"
    return base64.b64decode(data[ref["key"]]).decode(), what


def _ref(cluster: dict, env: str) -> dict | None:
    return next((s for s in cluster.get("secrets") or [] if isinstance(s, dict) and s.get("env") == env), None)


def check_sandbox(core, ns: str, exp) -> list[Check]:
    from pipeline_steps.errors import UserError
    from pipeline_steps.tools import uses_code_sandbox
    from pipeline_steps.training.sandbox_services import SANDBOX_DOMAIN_ENV, SANDBOX_SERVICES_ENV, with_sandbox_service

    mt = "actor_rollout_ref.rollout.multi_turn."
    if str(exp.verl.get(mt + "enable", False)).lower() not in ("true", "1"):
        return []
    if not uses_code_sandbox(exp.verl.get(mt + "tool_config_path") or ""):
        return []
    cluster = exp.spec.get("cluster") or {}
    name = f"sandbox service for {exp.name}"
    try:  # the service the RayJob's pods get, resolved as the renderer resolves it
        cluster = with_sandbox_service(exp, cluster)
    except UserError as exc:
        return [Check(name, False, "no sandbox service configured", str(exc))]
    if service := cluster.get("sandbox_service"):
        name += f" ({service})"
    # the E2B SDK's own rule: $E2B_API_URL (a self-hosted or stand-in API) before https://api.<domain>
    api = (os.environ.get("E2B_API_URL") or f"https://api.{cluster['env']['E2B_DOMAIN']}").rstrip("/")
    ref = _ref(cluster, "E2B_API_KEY")
    key, source = secret_value(core, ns, ref)
    if key is None and os.environ.get("E2B_API_KEY"):  # a user without Secret access may give the key this way
        key, source = os.environ["E2B_API_KEY"], "$E2B_API_KEY"
    where = f"${SANDBOX_SERVICES_ENV}[{service!r}] (Helm values)" if service else f"${SANDBOX_DOMAIN_ENV} (Helm values)"
    try:
        status = http_status(api + (SANDBOX_LIST if key else "/health"), {"X-API-KEY": key} if key else {})
    except OSError as exc:
        fix = f"check {where} and that the service is up (curl {api}/health)"
        return [Check(name, False, f"{api} does not answer ({no_answer(exc)})", fix)]
    if not key:
        return [Check(name, status == 200, f"{api}/health: HTTP {status}; API key not checked ({source})", where)]
    if status in (401, 403):
        fix = (
            f"put the sandbox service's API key into Secret {ref['secret']} key {ref['key']} "
            f"(k8s/secrets/README.md: kubectl -n {ns} create secret generic {ref['secret']} ...)"
        )
        return [Check(name, False, f"{api} refused the API key from {source} (HTTP {status})", fix)]
    detail = f"{api} answers GET /v2/sandboxes with the API key from {source} (HTTP {status})"
    return [Check(name, status == 200, detail, f"check {where}: is {api} an E2B-compatible API?")]


def _mlflow_settings(core, ns: str, cluster: dict) -> tuple[str, dict[str, str], str]:
    """(tracking URI, credential variables, where they come from): the MLflow connection (the operator puts it in
    the environment, as it does for the RayJob), else the preset's Secret; ("", {}, why) with neither."""
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    if os.environ.get(library_env.MLFLOW_TRACKING_URI):
        creds = {n: os.environ[n] for n in names if os.environ.get(n)}
        return os.environ[library_env.MLFLOW_TRACKING_URI], creds, "$MLFLOW_TRACKING_URI"
    ref = _ref(cluster, library_env.MLFLOW_TRACKING_URI)
    if ref is None:
        return "", {}, "no MLflow connection and the preset reads no URI from a Secret"
    uri, source = secret_value(core, ns, ref)
    if uri is None:
        return "", {}, source
    creds = {n: v for n in names if (r := _ref(cluster, n)) and (v := secret_value(core, ns, r)[0])}
    return uri, creds, f"Secret {ref['secret']}"


def check_mlflow(core, ns: str, exp) -> list[Check]:
    from pipeline_steps import tracking_run

    if "mlflow" not in tracking_run.loggers(exp.verl.get("trainer.logger")):
        return []
    name = f"MLflow tracking server for {exp.name}"
    uri, creds, source = _mlflow_settings(core, ns, exp.spec.get("cluster") or {})
    if not uri:
        return [Check(name, True, f"not checked: {source} (verl logs to an SQLite file in the pod, lost with it)")]
    if not uri.startswith(("http://", "https://")):
        return [Check(name, True, f"not checked: {safe_url(uri)} is not an HTTP server")]
    headers = {}
    if creds.get("MLFLOW_TRACKING_USERNAME") and creds.get("MLFLOW_TRACKING_PASSWORD"):
        pair = f"{creds['MLFLOW_TRACKING_USERNAME']}:{creds['MLFLOW_TRACKING_PASSWORD']}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    elif creds.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = "Bearer " + creds["MLFLOW_TRACKING_TOKEN"]
    url = uri.rstrip("/") + MLFLOW_SEARCH
    shown = safe_url(uri.rstrip("/"))
    fix = (
        "check the Airflow connection mlflow_default (host, login/password or extra token) or the Secret "
        f"mlflow-tracking (k8s/secrets/README.md), and that the server is up (curl {shown}/health)"
    )
    try:
        status = http_status(url, headers)
    except OSError as exc:
        return [Check(name, False, f"{shown} (from {source}) does not answer ({no_answer(exc)})", fix)]
    if status in (401, 403):
        return [Check(name, False, f"{shown} refused the credentials from {source} (HTTP {status})", fix)]
    return [Check(name, status == 200, f"{shown} (from {source}) answers experiments/search: HTTP {status}", fix)]


def check_store(uri: str) -> list[Check]:
    """One listing of the store root through the pipeline's own backend, with the connection's credentials."""
    if not uri:
        return []
    from pipeline_steps.errors import TransientError, UserError
    from pipeline_steps.store import conn_id, open_store

    name = f"store {safe_url(uri)}"
    fix = (
        f"fix the Airflow connection {conn_id()!r} (operators/hooks/store_connection.py lists its fields) or the "
        "store URI, then run doctor again"
    )
    try:
        store = open_store(uri)
        names = store.list_names(uri)
    except (UserError, TransientError) as exc:  # the backends' one-line messages: connection id, never a secret
        return [Check(name, False, str(exc).splitlines()[0], fix)]
    return [Check(name, True, f"listed with connection {conn_id()!r} ({len(names)} objects at its root)")]
