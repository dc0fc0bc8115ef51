"""The store interface: the object primitives a backend implements and the small-object and version API over them.

A *version* is a prefix holding files plus ``_manifest.json`` (store/manifest.py). The manifest is written last
and is the commit marker: a prefix without it is incomplete and is never read.

Backends implement a handful of object primitives (``_head``, ``_put_file``, ``_get_file``, ``_get_bytes``,
``_put_bytes``, ``_list``, ``_delete``); the version logic (skip what is already there and verifies, repair what
does not, write the manifest last, verify downloads) lives once in store/versions.py. Concurrent uploads to one
version are made safe by a claim object created with the store's conditional create (store/claim.py): one content
per version. URIs and key validation are in store/store_uri.py, local checksums in store/checksums.py.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import pipeline_steps.store.claim as claim  # not "from pipeline_steps.store import": that package imports this module
from pipeline_steps import settings
from pipeline_steps.errors import UserError
from pipeline_steps.store.manifest import MANIFEST, MANIFEST_FORMAT
from pipeline_steps.store.store_uri import StoreURI, conn_id, parse_uri, validate_key
from pipeline_steps.store.versions import VersionTransfers


@dataclasses.dataclass
class ObjectInfo:
    size: int
    checksum: str | None  # the backend's native checksum, when it reports one


class Store(VersionTransfers, abc.ABC):
    """One backend. All public methods take full URIs of this store's scheme (and bucket)."""

    scheme: str = ""
    native: str | None = None  # name of the server-side checksum in the manifest ("crc64ecma", "crc32c", "sha256")

    def __init__(self, root: StoreURI, credentials: Mapping[str, str] | None = None):
        """:param credentials: the store connection's variables (``OSS_ACCESS_KEY_ID``, ``GCS_KEYFILE_JSON``, ...,
        ``PIPELINE_STORE_CONN_ID``: what :func:`operators.hooks.store_connection.store_env` makes of a connection),
        handed to the client; each one not given is read from the environment (a step in a pod or process)."""
        self.root = root
        self._credentials = {k: str(v) for k, v in (credentials or {}).items() if v not in (None, "")}

    def setting(self, name: str, default: str = "") -> str:
        """A credential or client setting: the one handed to the store, else the environment's."""
        return self._credentials.get(name) or os.environ.get(name) or default

    def handed(self, name: str) -> bool:
        """``name`` was handed to the store (not only in the environment, where the client library looks itself)."""
        return bool(self._credentials.get(name)) and self._credentials[name] != os.environ.get(name)

    @property
    def conn_id(self) -> str:
        """The Airflow connection id named in this store's errors (the credentials' origin)."""
        handed = settings.is_set(settings.STORE_CONN_ID, self._credentials)
        return settings.get(settings.STORE_CONN_ID, self._credentials) if handed else conn_id()

    # -- primitives (keys are full object keys in the bucket, or absolute paths for file://) ----------
    @abc.abstractmethod
    def _head(self, key: str) -> ObjectInfo | None: ...

    @abc.abstractmethod
    def _put_file(self, path: Path, key: str, size: int) -> str | None:
        """Upload ``path`` to ``key``; return the server's native checksum of the stored object (None if the
        backend has none to give), which upload_dir compares with the file's."""

    def _stored(self, key: str, entry: dict) -> None:
        """Called once ``key`` holds exactly the bytes ``entry`` describes (the source did not change)."""

    @abc.abstractmethod
    def _get_file(self, key: str, path: Path) -> None: ...

    @abc.abstractmethod
    def _get_bytes(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _put_bytes(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        """(object keys, common prefixes) under ``prefix`` (prefix ends with '/' or is '')."""

    @abc.abstractmethod
    def _delete(self, keys: list[str]) -> int: ...

    @abc.abstractmethod
    def _create_bytes(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist (atomically, against concurrent writers); False if it did."""

    def _forget(self, key: str) -> None:
        """Drop what is remembered about a stored object's checksum (backends that cache it)."""

    def _cleanup_incomplete(self, prefix: str) -> int:
        """Abort multipart uploads left open under ``prefix`` (backends that have them)."""
        return 0

    # -- URI helpers ------------------------------------------------------------------------------
    def _parse(self, uri: str) -> StoreURI:
        u = parse_uri(uri)
        if u.scheme != self.scheme or u.bucket != self.root.bucket:
            raise UserError(f"store URI {uri!r} belongs to another store than {self.root}; open a store for it")
        return u

    @staticmethod
    def _join(prefix: str, rel: str) -> str:
        return f"{prefix}/{rel}" if prefix else rel

    # -- public API -------------------------------------------------------------------------------
    def read_bytes(self, uri: str) -> bytes | None:
        """A small object's bytes, or None when it does not exist."""
        return self._get_bytes(self._parse(uri).key)

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write a small object in one request (replaces it atomically)."""
        u = self._parse(uri)
        validate_key(u.key.lstrip("/"), f"object {uri!r}")
        self._put_bytes(u.key, data)

    def create_bytes(self, uri: str, data: bytes) -> bool:
        """Create a small object only if it does not exist yet: exactly one of concurrent creators wins (True).

        The store's own conditional write: exclusive link on file://, ``if_generation_match=0`` on GCS,
        ``x-oss-forbid-overwrite`` on OSS.
        """
        u = self._parse(uri)
        validate_key(u.key.lstrip("/"), f"object {uri!r}")
        return self._create_bytes(u.key, data)

    def delete(self, uri: str) -> None:
        """Delete one object (absent is fine)."""
        self._delete([self._parse(uri).key])

    def list_names(self, prefix_uri: str) -> list[str]:
        """Names of the objects directly under ``prefix_uri`` (not the sub-prefixes)."""
        u = self._parse(prefix_uri)
        base = f"{u.key.rstrip('/')}/" if u.key else ""
        keys, _ = self._list(base, "/")
        return sorted(k[len(base) :] for k in keys if "/" not in k[len(base) :])

    def read_manifest(self, uri: str) -> dict | None:
        """The version's manifest, or None when the version is incomplete (no manifest yet)."""
        u = self._parse(uri)
        raw = self._get_bytes(self._join(u.key, MANIFEST))
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
            if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), list):
                raise ValueError("unknown format")
        except (ValueError, AttributeError):
            raise UserError(
                f"{uri}/{MANIFEST} is not a manifest this version understands; re-upload the version"
            ) from None
        return manifest

    def list_versions(self, prefix_uri: str) -> list[str]:
        """URIs of the child prefixes of ``prefix_uri`` that hold a manifest (complete versions)."""
        u = self._parse(prefix_uri)
        base = f"{u.key}/" if u.key else ""
        _, children = self._list(base, "/")
        out = []
        for child in sorted(children):
            name = child[len(base) :].strip("/")
            if name and self._head(self._join(child.rstrip("/"), MANIFEST)) is not None:
                out.append(str(u.child(name)))
        return out

    def delete_prefix(self, uri: str) -> int:
        """Delete every object under ``uri`` (manifest first, so readers never see a half-deleted version)."""
        u = self._parse(uri)
        if not u.key.strip("/"):
            raise UserError(f"refusing to delete the whole store {uri!r}; pass a version prefix")
        base = u.key.rstrip("/") + "/"
        keys, _ = self._list(base, None)
        manifest = self._join(u.key, MANIFEST)
        held = self._join(u.key, claim.CLAIM)  # removed last: no new upload starts before the old objects are gone
        n = 0
        if manifest in keys:
            n += self._delete([manifest])
        n += self._delete([k for k in keys if k not in (manifest, held)])
        self._cleanup_incomplete(base)
        if held in keys:
            n += self._delete([held])
        return n
