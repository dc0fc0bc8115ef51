"""A model built once per cache (``PIPELINE_CACHE_DIR``) and shared by every run and test that stages it.

One builder per entry: the others wait on a lock file and take its result. Without the lock, a backfill of four runs
on a fresh machine (or four test workers) built the same model four times at once on the same cores, each taking
minutes. The entry appears in one rename, complete. A cache that cannot be written costs time only: the model is
then built under the caller's fallback directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def complete(entry: Path) -> bool:
    """A built model directory: its config and tokenizer are written (the build writes them, the weights, then
    renames the whole directory into place)."""
    return (entry / "config.json").exists() and (entry / "tokenizer.json").exists()


def cached_build(
    entry: Path, build: Callable[[Path], object], fallback: Path, what: str, complete: Callable[[Path], bool] = complete
) -> Path:
    """``entry`` (a directory named by a digest of the build's inputs) once ``build(path)`` has written the model
    there (``complete``: how a finished entry looks); ``build(fallback)``'s directory when the cache cannot be
    written."""
    if complete(entry):
        log.info("%s from the build cache %s", what, entry)
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.parent / f".{entry.name}.lock", "w")  # noqa: SIM115 - held for the whole build
    except OSError as exc:
        log.warning("%s build cache %s not writable (%s): building without it", what, entry.parent, exc)
        build(fallback)
        return fallback
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if complete(entry):  # built by the holder we waited for
            log.info("%s from the build cache %s (built by another run)", what, entry)
            return entry
        try:
            work = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}.", dir=entry.parent))
        except OSError as exc:
            log.warning("%s build cache %s not writable (%s): building without it", what, entry.parent, exc)
            build(fallback)
            return fallback
        try:
            build(work / "model")
            try:
                os.rename(work / "model", entry)
            except OSError:  # an entry made by a builder that took no lock (same inputs, same files)
                if not complete(entry):
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return entry
