"""Store URIs as local paths, for the code that reads files directly (the local backend, the report)."""

from __future__ import annotations

from pathlib import Path

from pipeline_steps.errors import UserError


def local_path(uri: str, what: str) -> Path:
    """A plain path or ``file://`` URI as a local Path; any other scheme is a one-line UserError naming ``what``."""
    if "://" not in uri:
        return Path(uri).expanduser()
    from pipeline_steps.store import parse_uri

    u = parse_uri(uri)
    if u.scheme != "file":
        raise UserError(
            f"{what}={uri!r}: read locally, which needs a local path or file:// URI, not {u.scheme}://; "
            "use the local store, or run this on the cluster backend"
        )
    return Path(u.key)


def strip_file_scheme(uri: str) -> str:
    """``file:///x`` -> ``/x``; other URIs unchanged (a cluster step maps them onto its bucket mounts)."""
    return uri[len("file://") :] if uri.startswith("file://") else uri
