"""The store connection: a store client built with its credentials (the worker), or its credentials as environment
variables (a step subprocess, a local Ray job).

One connection id per store (default ``pipeline_store``). Shapes follow Airflow's own providers, so an existing
connection can be reused:

- OSS (conn type ``alibaba_cloud`` or ``oss``): login/password = AccessKey id/secret (or extra
  ``access_key_id``/``access_key_secret`` as the Alibaba provider's ``auth_type: AK`` connections hold them);
  extra ``region`` (required), ``endpoint``, ``security_token``, ``path_style``.
- GCS (conn type ``google_cloud_platform`` or ``gcs``): extra ``key_path`` or ``keyfile_dict`` (dict or JSON
  string), ``project``; the ``extra__google_cloud_platform__*`` spelling of older connections is read too;
  extra ``emulator_host`` points at a local emulator. Without a key the client uses the worker's ambient
  credentials (workload identity).

As the providers' hooks build their clients: :class:`StoreHook` opens the store with the connection's credentials
handed to the client (``StoreHook(conn_id).open(uri)``); the worker's ``os.environ`` is never written. For a child
process, :func:`store_env`'s dict goes into the child's environment only (never XCom, logs or templates); the
child names the connection id in its errors (``PIPELINE_STORE_CONN_ID``) and never the secret.
"""

from __future__ import annotations

import json
import logging

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowFailException

log = logging.getLogger(__name__)

OSS_TYPES = ("alibaba_cloud", "oss", "aliyun_oss")
GCS_TYPES = ("google_cloud_platform", "gcs", "google_cloud_storage")


def _extra(extra: dict, name: str, provider: str):
    """An extra field, accepting the provider-prefixed spelling older connections use."""
    value = extra.get(name)
    if value in (None, ""):
        value = extra.get(f"extra__{provider}__{name}")
    return value if value not in (None, "") else None


def store_env(conn_id: str | None, uri: str) -> dict[str, str]:
    """Environment variables the step subprocess needs to reach the store holding ``uri``.

    :param conn_id: Airflow connection id for the store; None means use the worker's environment as is.
    :param uri: a store URI (``file://``, ``oss://`` or ``gs://``); decides which backend's variables are set.
    :return: e.g. ``{"OSS_ACCESS_KEY_ID": ..., "OSS_ACCESS_KEY_SECRET": ..., "OSS_REGION": ...,
        "PIPELINE_STORE_CONN_ID": ...}``.
    :raises AirflowFailException: the connection is of the wrong type or lacks a required field (one line, no secret).
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme == "file" or not conn_id:
        return {"PIPELINE_STORE_CONN_ID": conn_id} if conn_id else {}
    from airflow.sdk.exceptions import AirflowNotFoundException

    env = {"PIPELINE_STORE_CONN_ID": conn_id}
    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        # no connection: the step falls back to the worker's own environment and names conn_id if that fails
        log.warning("store connection %r not defined; the step uses the worker's environment", conn_id)
        return env
    extra = conn.extra_dejson or {}
    ctype = (conn.conn_type or "").lower()
    if scheme == "oss":
        if ctype and ctype not in OSS_TYPES:
            raise AirflowFailException(
                f"store connection {conn_id!r} has type {ctype!r} but {uri} needs an OSS connection (alibaba_cloud)"
            )
        key_id = conn.login or _extra(extra, "access_key_id", "alibaba_cloud")
        secret = conn.password or _extra(extra, "access_key_secret", "alibaba_cloud")
        region = _extra(extra, "region", "alibaba_cloud")
        if not key_id or not secret:
            raise AirflowFailException(
                f"store connection {conn_id!r}: set login/password to the OSS AccessKey id/secret"
            )
        if not region:
            raise AirflowFailException(f"store connection {conn_id!r}: set extra 'region' (e.g. cn-hangzhou)")
        env.update({"OSS_ACCESS_KEY_ID": key_id, "OSS_ACCESS_KEY_SECRET": secret, "OSS_REGION": region})
        endpoint = _extra(extra, "endpoint", "alibaba_cloud") or (conn.host or None)
        if endpoint:
            env["OSS_ENDPOINT"] = f"{endpoint}:{conn.port}" if conn.port and endpoint == conn.host else endpoint
        token = _extra(extra, "security_token", "alibaba_cloud")
        if token:
            env["OSS_SESSION_TOKEN"] = token
        if str(_extra(extra, "path_style", "alibaba_cloud") or "").lower() in ("1", "true", "yes"):
            env["OSS_PATH_STYLE"] = "true"
        return env
    if scheme == "gs":
        if ctype and ctype not in GCS_TYPES:
            raise AirflowFailException(
                f"store connection {conn_id!r} has type {ctype!r} but {uri} needs a Google Cloud connection"
            )
        p = "google_cloud_platform"
        key_path, keyfile = _extra(extra, "key_path", p), _extra(extra, "keyfile_dict", p)
        if key_path and keyfile:
            raise AirflowFailException(
                f"store connection {conn_id!r}: set only one of extra 'key_path' and 'keyfile_dict'"
            )
        if key_path:
            env["GOOGLE_APPLICATION_CREDENTIALS"] = str(key_path)
        if keyfile:
            if isinstance(keyfile, str):
                try:
                    keyfile = json.loads(keyfile)
                except ValueError:
                    raise AirflowFailException(
                        f"store connection {conn_id!r}: extra 'keyfile_dict' is not valid JSON"
                    ) from None
            env["GCS_KEYFILE_JSON"] = json.dumps(keyfile)
        project = _extra(extra, "project", p) or _extra(extra, "project_id", p)
        if project:
            env["GOOGLE_CLOUD_PROJECT"] = str(project)
        emulator = _extra(extra, "emulator_host", p)
        if emulator:
            env["STORAGE_EMULATOR_HOST"] = str(emulator)
        return env
    raise AirflowFailException(f"store URI {uri!r}: scheme not supported; use file://, oss:// or gs://")


class StoreHook(BaseHook):
    """The store (``file://``, ``oss://``, ``gs://``) opened with the connection's credentials.

    :param store_conn_id: the store connection (shapes: this module's docstring); None: the worker's environment.
    """

    conn_name_attr = "store_conn_id"
    default_conn_name = "pipeline_store"
    hook_name = "Pipeline store"

    def __init__(self, store_conn_id: str | None = default_conn_name, **kwargs):
        super().__init__(**kwargs)
        self.store_conn_id = store_conn_id

    def credentials(self, uri: str) -> dict[str, str]:
        """The variables the store client of ``uri`` is handed (none for ``file://``)."""
        if "://" not in uri or uri.startswith("file://"):
            return {}
        return store_env(self.store_conn_id, uri)

    def open(self, uri: str):
        """:func:`pipeline_steps.store.open_store` for ``uri``, its client built with the connection's credentials.

        :raises AirflowFailException: the connection is of the wrong type or lacks a field (one line, no secret)
        """
        from pipeline_steps.store import open_store

        return open_store(uri, credentials=self.credentials(uri))

    def read_text(self, uri: str) -> str | None:
        """The text at a store URI or local path (None when it does not exist yet): a metrics file, a marker."""
        if "://" not in uri:
            try:
                with open(uri, encoding="utf-8", errors="replace") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        data = self.open(uri).read_bytes(uri)
        return None if data is None else data.decode("utf-8", errors="replace")


def store_credentials_file(conn_id: str | None, uri: str, name: str) -> str | None:
    """The store connection's environment in a file only the worker's user reads (:mod:`operators.hooks.
    job_credentials`), for a local Ray job that reads and writes the store itself; the job loads it with
    :func:`pipeline_steps.store.load_credentials_file`. None for a ``file://`` store or when the connection holds
    nothing."""
    from operators.hooks import job_credentials

    env = {k: v for k, v in store_env(conn_id, uri).items() if k != "PIPELINE_STORE_CONN_ID"}
    return str(job_credentials.write("store", name, env)) if env else None


def remove_store_credentials_file(name: str) -> None:
    """Remove the file :func:`store_credentials_file` wrote for ``name`` (if any): the job is over."""
    from operators.hooks import job_credentials

    job_credentials.remove("store", name)
