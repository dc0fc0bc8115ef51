"""A training run's tracking: its MLflow run (the record kept beside its checkpoints, logging to it after training)
and how to view its TensorBoard event files (where they are: the run's ``RunLayout.tensorboard``).

The CPU trainer and the cluster's training entrypoint (:mod:`pipeline_steps.training.verl_main`) write
``mlflow_run.json`` (:data:`FILE`) into the checkpoints directory when they log to MLflow, so a resumed attempt
continues the same run, the train task's XCom, the report and the model card name it, and the export step logs the
evaluation and the model card to it. The
record holds no secret: a team server's credentials stay in the environment (``MLFLOW_TRACKING_USERNAME``/
``MLFLOW_TRACKING_PASSWORD`` or ``MLFLOW_TRACKING_TOKEN``), read by MLflow's client itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipeline_steps import library_env, settings

log = logging.getLogger(__name__)

FILE = "mlflow_run.json"


def loggers(value) -> list[str]:
    """``trainer.logger`` as a list of backend names (verl takes a name or a list)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def tensorboard_info(uri: str, local: str | os.PathLike | None = None) -> dict:
    """Where the event files are and the command that shows them: ``{"uri", "command"}``.

    ``local``: the directory on this machine (a local run's); otherwise a ``file://`` URI or a plain path gives the
    command, and an object-store URI gives none (TensorBoard reads it only with that store's fsspec driver installed;
    download the directory, or point TensorBoard at a mount of the bucket).
    """
    path = local
    if path is None and (uri.startswith("file://") or "://" not in uri):
        path = uri[len("file://") :] if uri.startswith("file://") else uri
    return {"uri": uri, "command": f"tensorboard --logdir {shlex.quote(str(path))}" if path else None}


def url(tracking_uri: str, run_id: str, experiment_id: str | None) -> str | None:
    """A browser link to the run on an ``http(s)`` server (``None`` for a file or database store)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    base = tracking_uri.rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"{base}/#/runs/{run_id}"


def without_credentials(uri: str) -> str:
    """``uri`` without a ``user:password@`` part (a record is shown in XCom, the model card and the report)."""
    parts = urllib.parse.urlsplit(uri)
    if not (parts.username or parts.password):
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def record(tracking_uri: str, run_id: str, experiment_id: str | None) -> dict:
    tracking_uri = without_credentials(tracking_uri)
    return {
        "run_id": run_id,
        "tracking_uri": tracking_uri,
        "experiment_id": experiment_id,
        "url": url(tracking_uri, run_id, experiment_id),
    }


def start_run(tracking_uri: str, experiment: str, run_name: str, run_id: str | None = None) -> dict:
    """The record of the MLflow run a training logs to, named as verl's mlflow logger names its own: experiment
    ``trainer.project_name`` (created if missing), run name ``trainer.experiment_name``. ``run_id``: continue that
    run (a resumed attempt) when the server still has it. The caller hands the id to verl as ``$MLFLOW_RUN_ID``,
    which verl's ``Tracking`` attaches to instead of starting a run of its own.

    :raises Exception: MLflow's client errors (server away, refused credentials)
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    if run_id:
        try:
            info = client.get_run(run_id).info
        except MlflowException as exc:  # another server's id, or purged: start a new run
            log.warning("MLflow run %s not found at %s (%s): starting a new one", run_id, tracking_uri, exc.error_code)
        else:
            if info.lifecycle_stage == "active":
                return record(tracking_uri, info.run_id, info.experiment_id)
            log.warning("MLflow run %s was deleted: starting a new one", run_id)  # verl could not attach to it
    found = client.get_experiment_by_name(experiment)
    if found is None:
        try:
            experiment_id = client.create_experiment(experiment)
        except MlflowException:  # created meanwhile by another run
            experiment_id = client.get_experiment_by_name(experiment).experiment_id
    else:
        experiment_id = found.experiment_id
    info = client.create_run(experiment_id, run_name=run_name).info
    return record(tracking_uri, info.run_id, experiment_id)


def parse(text: str | None) -> dict | None:
    """The record in ``text`` (a :data:`FILE`'s content); None if absent or torn."""
    try:
        data = json.loads(text) if text else None
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("run_id"), str) else None


def read(path: str | os.PathLike) -> dict | None:
    """The record at ``path`` (a file, or a checkpoints directory holding :data:`FILE`); None if absent or torn."""
    p = Path(path)
    if p.is_dir():
        p = p / FILE
    try:
        return parse(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def numeric(flat: dict, prefix: str) -> dict[str, float]:
    """The finite numbers of ``flat`` under MLflow-safe keys (``@`` is not allowed in a metric name)."""
    out = {}
    for k, v in flat.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[f"{prefix}{k}".replace("@", "_at_")] = float(v)
    return out


CREDENTIALS_FILE_ENV = settings.MLFLOW_CREDENTIALS_FILE
CREDENTIAL_ENVS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def load_credentials() -> list[str]:
    """MLflow credentials from the file named by ``$PIPELINE_MLFLOW_CREDENTIALS_FILE`` into this process's
    environment, where MLflow's client reads them (a local Ray job's environment is shown by the Ray dashboard, so
    the train task hands them over in a file only its user can read). Variables already set win.

    :returns: the names set (never the values)
    :raises UserError: the file is named but unreadable
    """
    from pipeline_steps.errors import UserError

    path = settings.get(CREDENTIALS_FILE_ENV)
    if not path:
        return []
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"${CREDENTIALS_FILE_ENV}={path}: unreadable ({exc.__class__.__name__})") from None
    names = []
    for k in CREDENTIAL_ENVS:
        if isinstance(data, dict) and isinstance(data.get(k), str) and not os.environ.get(k):
            os.environ[k] = data[k]
            names.append(k)
    return names


def responds(uri: str, timeout: float = 2.0) -> bool:
    """True when an MLflow server answers its health check at ``uri``."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_to_run(run: dict, metrics: dict[str, float], artifacts: list[Path], step: int | None = None) -> bool:
    """Log ``metrics`` and ``artifacts`` (files) to the recorded run; False (with a warning) if the server is away.

    Tracking is a record of the run, not part of the model: an unreachable server must not fail an export.
    ``$MLFLOW_TRACKING_URI`` wins over the recorded URI (the same server seen from another host).
    """
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = os.environ.get(library_env.MLFLOW_TRACKING_URI) or run["tracking_uri"]
    if uri.startswith(("http://", "https://")) and not responds(uri):  # the client would retry for minutes
        log.warning("MLflow server %s does not answer: the run %s gets no evaluation/model card", uri, run["run_id"])
        return False
    client = MlflowClient(tracking_uri=uri)
    try:
        client.get_run(run["run_id"])
        if metrics:
            ts = int(time.time() * 1000)
            client.log_batch(run["run_id"], metrics=[Metric(k, v, ts, step or 0) for k, v in metrics.items()])
        for f in artifacts:
            client.log_artifact(run["run_id"], str(f))
    except Exception as exc:  # any client error: connection refused, unknown run, server error
        log.warning("could not log to MLflow run %s at %s: %s", run["run_id"], uri, str(exc).splitlines()[0][:300])
        return False
    return True
