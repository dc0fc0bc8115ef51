"""A local working copy of cloud-store locations, for the local backend on an ``oss://`` or ``gs://`` store.

The local backend's processes (CPU training in the local Ray job, evaluate and export in the worker) read and write
local files. On a cloud store each store URI they are given is mirrored at
``$PIPELINE_HOME/work/mirror/<scheme>/<bucket>/<key>``: an input is fetched first (:func:`fetch`), an output is
written there and uploaded afterwards (:func:`publish`). ``file://`` URIs and plain paths are used in place.

Fetching a URI inside a committed version (a dataset version, a staged model, a published run directory) downloads
that whole version, verified against its manifest, once: a local copy whose recorded manifest digest matches the
store's is reused. A location without a manifest above it (a run directory before its first publish) is copied
object by object. Credentials come from the environment, as for every store access.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.store.manifest import MANIFEST
from pipeline_steps.store.manifest import MIRROR_MARKER as MARKER  # {"uri", "manifest_sha256"} it was fetched from
from pipeline_steps.store.store_uri import parse_uri

SEARCH_UP = 4  # how many parents to look at for the version that holds a file (datasets/<name>/<rev>/<fp>/x)


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


def root() -> Path:
    from pipeline_steps import settings

    return settings.get_path(settings.MIRROR_DIR, settings.home() / "work" / "mirror")


def local_for(uri: str) -> Path:
    """Where ``uri`` lives locally: its mirror path (cloud), its path (``file://``), or itself (a plain path)."""
    uri = str(uri)
    if not is_remote(uri):
        return Path(uri[len("file://") :] if uri.startswith("file://") else uri)
    u = parse_uri(uri)
    return root() / u.scheme / u.bucket / u.key.strip("/")


def _manifest_digest(store, uri: str) -> str | None:
    raw = store.read_bytes(f"{uri.rstrip('/')}/{MANIFEST}")
    return None if raw is None else hashlib.sha256(raw).hexdigest()


def _fetch_version(store, uri: str, digest: str) -> Path:
    dest = local_for(uri)
    try:
        if json.loads((dest / MARKER).read_text()).get("manifest_sha256") == digest:
            return dest  # already here, unchanged in the store
    except (OSError, ValueError):
        pass
    store.download_dir(uri, dest)
    atomic.write_json(dest / MARKER, {"uri": uri, "manifest_sha256": digest})
    return dest


def _fetch_objects(store, uri: str) -> Path:
    """A location without a manifest: the object itself, or every object below the prefix."""
    dest = local_for(uri)
    data = store.read_bytes(uri)
    if data is not None:
        atomic.write_bytes(dest, data)
        return dest
    u = store._parse(uri)
    base = u.key.rstrip("/") + "/"
    keys, _ = store._list(base, None)
    for key in keys:
        out = dest / key[len(base) :]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".tmp-{out.name}")
        store._get_file(key, tmp)
        os.replace(tmp, out)
    return dest


def fetch(uri: str, credentials: Mapping[str, str] | None = None) -> Path:
    """The local copy of an input ``uri`` (fetched when needed); a missing input yields its would-be path.

    :param credentials: the store's, handed to its client (:func:`pipeline_steps.store.open_store`)"""
    if not is_remote(uri):
        return local_for(uri)
    from pipeline_steps.store import open_store

    uri = str(uri).rstrip("/")
    store = open_store(uri, credentials)
    candidate = uri
    for _ in range(SEARCH_UP + 1):  # the version holding uri (itself, or a parent)
        digest = _manifest_digest(store, candidate)
        if digest:
            version = _fetch_version(store, candidate, digest)
            return version / uri[len(candidate) :].lstrip("/")
        parent = candidate.rsplit("/", 1)[0]
        if "/" not in parent.split("://", 1)[1]:  # reached the bucket
            break
        candidate = parent
    return _fetch_objects(store, uri)


def publish(uri: str, credentials: Mapping[str, str] | None = None) -> dict | None:
    """Upload the local copy of an output ``uri`` as a version (manifest last); None for local URIs or no output.

    :param credentials: the store's, handed to its client (:func:`pipeline_steps.store.open_store`)"""
    if not is_remote(uri):
        return None
    src = local_for(uri)
    if not src.is_dir():
        return None
    from pipeline_steps.store import open_store

    store = open_store(uri, credentials)
    summary = store.upload_dir(src, uri, replace=True)  # an output republished by its one writer (a retry)
    digest = _manifest_digest(store, uri)
    atomic.write_json(src / MARKER, {"uri": uri, "manifest_sha256": digest})
    return summary


def to_uris(value):
    """Mirror paths in a step summary (strings, nested) -> the store URIs they mirror; others unchanged."""
    if isinstance(value, dict):
        return {k: to_uris(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_uris(v) for v in value]
    base = str(root()) + "/"
    if isinstance(value, str) and value.startswith(base):
        scheme, _, rest = value[len(base) :].partition("/")
        return f"{scheme}://{rest}"
    return value


# -- a step's handoffs: what an upstream task left in the store, and what this step leaves there ----------------
def step_input(value: str, flag: str) -> Path:
    """A step's input as a local path: a plain path as given; a store URI (``file://``, ``oss://``, ``gs://``: an
    upstream task's output, as the plan hands it over) fetched into the local mirror first.

    Tasks share nothing but the store: a store URI with nothing behind it is an upstream output that is not there
    (yet, or any more), so it raises :class:`~pipeline_steps.errors.TransientError` (retried), never bad input.
    """
    from pipeline_steps.errors import TransientError

    value = str(value)
    if "://" not in value:
        return Path(value)
    path = fetch(value)
    if not path.exists():
        raise TransientError(
            f"{flag} {value}: the upstream task's output is not in the store; it is retried (if it persists, re-run "
            "the upstream task)"
        )
    return path


def step_output(value: str) -> Path:
    """Where a step writes an output named by ``value`` (a plain path, or a store URI: its local mirror, published
    by :func:`publish_output` when the step is done; a ``file://`` URI is written in place)."""
    return local_for(str(value))


def publish_output(value: str) -> str:
    """Commit the local copy of a step's output to the store (nothing to do for a path or a ``file://`` URI);
    returns what the next task is handed: the store URI as given (a plain path stays a path)."""
    publish(str(value))
    return str(value)
