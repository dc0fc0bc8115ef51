"""The MLflow connection: a team's tracking server, for training runs on both backends and the export's logging.

Connection ``mlflow_default`` (the HTTP provider's shape; conn type ``http``, ``https`` or ``mlflow``):

- host: a name (``mlflow.example.com``) or a URL (``https://mlflow.example.com``); port optional;
- schema: ``http`` or ``https`` (the HTTP provider's use of the field); any other value is a path prefix, which is
  what ``AIRFLOW_CONN_MLFLOW_DEFAULT=https://user:pass@mlflow.example.com/mlflow`` puts there; extra ``path`` also
  sets one. Without a scheme from host or schema, ``https`` for conn type https, else ``http``;
- login/password -> ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``; extra ``token`` (or a password
  without login) -> ``MLFLOW_TRACKING_TOKEN``: MLflow's client reads these itself.

Where the values go: the tracking URI is no secret (XCom, the model card, manifests carry it; a URI with credentials
in it is refused). The credentials go only into a child process's environment (steps on the worker), a file readable
by the worker's user alone for the local Ray job (whose environment the Ray dashboard shows), and, for RayJobs, a
``secretKeyRef`` to the Kubernetes Secret the deployment keeps them in (:meth:`MlflowHook.cluster_settings`): never
a value in a manifest.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from urllib.parse import urlsplit

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowFailException, AirflowNotFoundException

from operators.hooks import job_credentials
from pipeline_steps import library_env, settings

USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"
CREDENTIAL_ENVS = (USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV)
# the Kubernetes Secret's data keys (the same as gsm8k_qwen2_5_3b's Secret mlflow-tracking)
SECRET_KEYS = {USERNAME_ENV: "username", PASSWORD_ENV: "password", TOKEN_ENV: "token"}
SECRET_ENV = settings.MLFLOW_SECRET  # the deployment's Secret name; else the preset's cluster.mlflow_secret
CONN_TYPES = ("http", "https", "mlflow")


class MlflowHook(BaseHook):
    """A team's MLflow tracking server from an Airflow connection.

    :param mlflow_conn_id: the connection; when it does not exist, :meth:`tracking_uri` is None and nothing
        changes (the local profile's embedded server, or the preset's own settings, stay in use).
    """

    conn_name_attr = "mlflow_conn_id"
    default_conn_name = "mlflow_default"
    conn_type = "http"
    hook_name = "MLflow tracking server"

    def __init__(self, mlflow_conn_id: str | None = default_conn_name, **kwargs):
        super().__init__(**kwargs)
        self.mlflow_conn_id = mlflow_conn_id

    @cached_property
    def connection(self):
        """The connection, or None when no id is given or it does not exist."""
        if not self.mlflow_conn_id:
            return None
        try:
            return self.get_connection(self.mlflow_conn_id)
        except AirflowNotFoundException:
            return None

    def _fail(self, what: str):
        raise AirflowFailException(f"connection {self.mlflow_conn_id!r}: {what}")

    @cached_property
    def tracking_uri(self) -> str | None:
        """``scheme://host[:port][/path]``, or None without a connection.

        :raises AirflowFailException: one line naming the connection and the bad field (never its password)
        """
        conn = self.connection
        if conn is None:
            return None
        conn_type = (conn.conn_type or "http").lower()
        if conn_type not in CONN_TYPES:
            self._fail(f"conn type {conn_type!r}: expected one of {', '.join(CONN_TYPES)} (an MLflow server's URL)")
        host = (conn.host or "").strip()
        if not host:
            self._fail("no host; set the MLflow server's host name or URL")
        schema = (conn.schema or "").strip().strip("/")
        path = str((conn.extra_dejson or {}).get("path") or "").strip("/")
        if "://" in host:
            parts = urlsplit(host)
            scheme, netloc, path = parts.scheme, parts.netloc, "/".join(p for p in (parts.path.strip("/"), path) if p)
        else:
            scheme = schema if schema in ("http", "https") else ("https" if conn_type == "https" else "http")
            netloc = host
        if schema and schema not in ("http", "https"):
            path = "/".join(p for p in (schema, path) if p)
        if scheme not in ("http", "https"):
            self._fail(f"scheme {scheme!r}: the MLflow server must be an http(s) URL")
        if "@" in netloc or any(c.isspace() for c in netloc + path) or not netloc.strip(":"):
            self._fail("host: a server name or URL without credentials (put them in login/password)")
        if conn.port and ":" not in netloc.rsplit("]", 1)[-1]:
            netloc = f"{netloc}:{int(conn.port)}"
        return f"{scheme}://{netloc}" + (f"/{path}" if path else "")

    @cached_property
    def credentials(self) -> dict[str, str]:
        """The credential variables MLflow's client reads (secret values: for a child process's environment only)."""
        conn = self.connection
        if conn is None:
            return {}
        token = (conn.extra_dejson or {}).get("token")
        out = {}
        if conn.login and conn.password:
            out = {USERNAME_ENV: conn.login, PASSWORD_ENV: conn.password}
        elif conn.password:
            token = token or conn.password
        elif conn.login:
            self._fail("login without password; give both, or a token (extra 'token')")
        if token:
            out[TOKEN_ENV] = str(token)
        return out

    def env(self) -> dict[str, str]:
        """``MLFLOW_TRACKING_URI`` and the credentials, for a child process's environment; {} without a connection."""
        uri = self.tracking_uri
        return {library_env.MLFLOW_TRACKING_URI: uri, **self.credentials} if uri else {}

    def credentials_file(self, name: str) -> Path | None:
        """The credentials in a file only the worker's user can read, for a local Ray job (the Ray dashboard shows a
        job's environment, so they cannot travel there); the job reads it with
        :func:`pipeline_steps.tracking_run.load_credentials`. None when there are no credentials."""
        if not self.credentials:
            return None
        return job_credentials.write("mlflow", name, self.credentials)

    def cluster_settings(self, cluster: dict) -> dict:
        """The preset's ``cluster`` with the connection's server in it: ``MLFLOW_TRACKING_URI`` in ``cluster.env``
        (a plain value) and each credential the connection holds as a ``cluster.secrets`` reference to the
        deployment's Secret (``$PIPELINE_MLFLOW_SECRET``, else ``cluster.mlflow_secret``; keys ``username``,
        ``password``, ``token``; optional, as a missing Secret would hold the pods in ``CreateContainerConfigError``
        until the job's deadline). The connection replaces the preset's own ``MLFLOW_*`` entries. Unchanged without
        a connection.

        :raises AirflowFailException: the connection has credentials but no Secret is named for the pods
        """
        uri = self.tracking_uri
        if not uri or not isinstance(cluster, dict):  # a malformed cluster section: the render refuses it
            return cluster
        if not isinstance(cluster.get("env") or {}, dict) or not isinstance(cluster.get("secrets") or [], list):
            return cluster
        cluster = dict(cluster)
        names = (library_env.MLFLOW_TRACKING_URI, *CREDENTIAL_ENVS)
        env = {k: v for k, v in (cluster.get("env") or {}).items() if k not in names}
        secrets = [s for s in cluster.get("secrets") or [] if not (isinstance(s, dict) and s.get("env") in names)]
        env[library_env.MLFLOW_TRACKING_URI] = uri
        secret = settings.get(SECRET_ENV) or cluster.get("mlflow_secret")
        if self.credentials and not secret:
            self._fail(
                f"has credentials, but no Kubernetes Secret is named to give them to the pods: create one with keys "
                f"{', '.join(SECRET_KEYS[k] for k in self.credentials)} and name it in ${SECRET_ENV} or the "
                "preset's cluster.mlflow_secret"
            )
        for name in self.credentials:
            secrets.append({"env": name, "secret": str(secret), "key": SECRET_KEYS[name], "optional": True})
        cluster["env"], cluster["secrets"] = env, secrets
        return cluster


def _credentials_dir() -> Path:
    """The worker user's directory for a local job's MLflow credentials files (one per Airflow deployment)."""
    return job_credentials.directory("mlflow")


def remove_credentials_file(name: str) -> None:
    """Remove the file :meth:`MlflowHook.credentials_file` wrote for ``name`` (if any): the job is over."""
    job_credentials.remove("mlflow", name)
