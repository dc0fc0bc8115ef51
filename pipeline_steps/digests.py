"""The sha256 of a local file: the one way the project hashes a file's bytes (standard library only).

Uploads compute theirs with the backend's native checksum in the same read (:mod:`pipeline_steps.store.checksums`).
"""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike) -> str:
    """A local file's sha256, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
