"""Store URIs (``file://``, ``oss://``, ``gs://``), object-key validation and what every backend shares about
errors: the connection id named in them, which HTTP answers are transient."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from urllib.parse import urlsplit

from pipeline_steps import settings
from pipeline_steps.errors import UserError

SCHEMES = ("file", "oss", "gs")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def conn_id() -> str:
    """The Airflow connection id named in store errors (the credentials' origin)."""
    return settings.get(settings.STORE_CONN_ID)


def validate_key(rel: str, what: str = "object key") -> str:
    """A relative object key built from validated names, or UserError.

    Rejects absolute paths, ``..``/``.`` and empty segments, backslashes and control
    characters: keys end up as paths inside mounted buckets, so they must not escape.
    """
    if not isinstance(rel, str) or not rel:
        raise UserError(f"{what} is empty; pass a relative path such as datasets/gsm8k/v1")
    shown = rel.encode("unicode_escape").decode()[:200]
    if _CONTROL_RE.search(rel):
        raise UserError(f"{what} {shown!r} contains control characters; rename it")
    if rel.startswith("/"):
        raise UserError(f"{what} {shown!r} is absolute; pass a path relative to the store root")
    if "\\" in rel:
        raise UserError(f"{what} {shown!r} contains a backslash; use '/' between names")
    for seg in rel.split("/"):
        if seg in ("", ".", ".."):
            raise UserError(f"{what} {shown!r} has an empty, '.' or '..' segment; pass a normalised relative path")
    if len(rel.encode("utf-8")) > 1000:
        raise UserError(f"{what} {shown[:60]!r}... is longer than 1000 bytes; shorten it")
    return rel


@dataclasses.dataclass(frozen=True)
class StoreURI:
    scheme: str
    bucket: str  # "" for file://
    key: str  # prefix without leading/trailing slash ("" = root); for file:// the absolute path

    def child(self, rel: str) -> "StoreURI":
        rel = validate_key(rel)
        if self.scheme == "file":
            return StoreURI("file", "", str(Path(self.key) / rel))
        return StoreURI(self.scheme, self.bucket, f"{self.key}/{rel}" if self.key else rel)

    def __str__(self) -> str:
        if self.scheme == "file":
            return "file://" + self.key
        return f"{self.scheme}://{self.bucket}/{self.key}"


def parse_uri(uri: str) -> StoreURI:
    """``file:///abs/path``, ``oss://bucket/prefix`` or ``gs://bucket/prefix`` -> StoreURI (validated)."""
    if not isinstance(uri, str) or "://" not in uri:
        raise UserError(f"store URI {uri!r}: expected file:///abs/path, oss://bucket/prefix or gs://bucket/prefix")
    if _CONTROL_RE.search(uri):
        raise UserError(f"store URI {uri.encode('unicode_escape').decode()!r} contains control characters")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise UserError(f"store URI {uri!r}: scheme {scheme!r} not supported; use file://, oss:// or gs://")
    if parts.query or parts.fragment:
        raise UserError(f"store URI {uri!r}: must not contain '?' or '#'")
    path = parts.path.strip("/")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UserError(f"store URI {uri!r}: file URIs need an absolute path, as in file:///data/store")
        if path:
            validate_key(path, f"path in store URI {uri!r}")
        return StoreURI("file", "", "/" + path)
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise UserError(
            f"store URI {uri!r}: bucket {bucket!r} is not a valid bucket name (lower-case letters, digits, '-', 3-63 "
            "chars)"
        )
    if path:
        validate_key(path, f"prefix in store URI {uri!r}")
    return StoreURI(scheme, bucket, path)


def transient_status(status: int | None, code: str | None = None) -> bool:
    """An HTTP answer that a later attempt may not get: 5xx, 408 (timeout), 429 (throttling) and the stores'
    throttling/busy codes."""
    return bool(status and (status >= 500 or status in (408, 429))) or code in (
        "RequestTimeout",
        "SlowDown",
        "Throttling",
        "ServerBusy",
        "InternalError",
        "ServiceUnavailable",
    )
