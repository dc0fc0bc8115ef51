"""Object storage for dataset versions, staged models and checkpoints, chosen by URI.

``open_store(uri)`` returns the backend for ``file:///abs/path`` (local disk, the
embedded default), ``oss://bucket/prefix`` (Alibaba Cloud OSS) or ``gs://bucket/prefix``
(Google Cloud Storage). Credentials are handed to the client (the Airflow worker's, from a connection:
``StoreHook(conn_id).open(uri)`` in ``operators/hooks/store_connection.py``), or else come from the environment (a
step in a pod or a child process)::

    store = open_store(uri)                 # or open_store(uri, credentials={"OSS_ACCESS_KEY_ID": ..., ...})
    store.upload_dir(src_dir, dest_uri)     # -> {"uri","uploaded","skipped","bytes_uploaded","files","manifest_sha256"}
                                            # one content per version; replace=True for a republished output
    store.download_dir(src_uri, dest_dir)   # verifies every file against the manifest
    store.read_manifest(uri)                # None when the version is incomplete
    store.list_versions(prefix_uri); store.delete_prefix(uri); store.read_bytes(uri); store.write_bytes(uri, data)
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline_steps.store.base import Store
from pipeline_steps.store.manifest import MANIFEST
from pipeline_steps.store.store_uri import StoreURI, conn_id, parse_uri, validate_key

__all__ = [
    "MANIFEST",
    "Store",
    "StoreURI",
    "conn_id",
    "load_credentials_file",
    "open_store",
    "parse_uri",
    "validate_key",
]


def load_credentials_file() -> list[str]:
    """The store's credentials from the file named by ``$PIPELINE_STORE_CREDENTIALS_FILE`` (the train task's, for a
    local Ray job) into this process's environment, where the store clients read them; variables already set win.
    A file that is not on this machine (a job on another host) leaves the job's own environment in charge.

    :returns: the names set (never the values)
    """
    import json
    import os
    from pathlib import Path

    from pipeline_steps import settings

    path = settings.get(settings.STORE_CREDENTIALS_FILE)
    if not path:
        return []
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict):
        return []
    names = [k for k, v in data.items() if isinstance(v, str) and not os.environ.get(k)]
    for k in names:
        os.environ[k] = data[k]
    return names


def open_store(uri: str, credentials: Mapping[str, str] | None = None) -> Store:
    """The store that holds ``uri`` (backend imported lazily: only the one in use is loaded).

    :param credentials: the store's credentials as variables (the keys
        :func:`operators.hooks.store_connection.store_env` makes of a connection), given to the client; a variable
        not given is read from the environment. Never written to the environment.
    """
    u = parse_uri(uri)
    if u.scheme == "file":
        from pipeline_steps.store.local_disk import LocalStore

        return LocalStore(u)
    if u.scheme == "oss":
        from pipeline_steps.store.oss import OssStore

        return OssStore(u, credentials)
    from pipeline_steps.store.gcs import GcsStore

    return GcsStore(u, credentials)
