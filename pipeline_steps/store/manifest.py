"""The version manifest: ``_manifest.json`` (path, size, sha256 and the backend's native checksum per file), written
last as a version's commit marker, and the local copy's record of the version it mirrors."""

from __future__ import annotations

import json

MANIFEST = "_manifest.json"
MIRROR_MARKER = ".mirrored-from.json"  # a local copy's record of the version it mirrors (store/mirror.py)
MANIFEST_FORMAT = 1


def render_manifest(entries: list[dict], native: str | None) -> bytes:
    """Deterministic manifest bytes: the same files give the same manifest (no timestamps)."""
    files = sorted(entries, key=lambda e: e["path"])
    doc = {
        "format": MANIFEST_FORMAT,
        "native": native,
        "files": files,
        "file_count": len(files),
        "total_bytes": sum(e["size"] for e in files),
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
