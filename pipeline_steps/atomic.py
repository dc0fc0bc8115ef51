"""Atomic writes: a reader sees the old state or the complete new one, never a partial file.

Files are written to a temporary sibling and renamed into place; directories are
built in a temporary sibling and swapped in with one rename, so a crash leaves
either nothing or a complete output (plus a ``.tmp-*`` sibling that the next
run removes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from pipeline_steps import outputs

_UMASK = os.umask(0o022)  # read once (os.umask is the only way, and it sets it): files get 0666 & ~umask
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() would give; mkstemp's 0600 made store files inconsistent


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


STALE_SECONDS = 6 * 3600  # a temp entry this old has no live writer, whatever its name says


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's, alive
    return True


def abandoned(path: Path, prefix: str) -> bool:
    """A temp entry ``<prefix><pid>.<random>`` whose writer cannot still be writing it: that pid is gone, or it is
    older than STALE_SECONDS (also the rule for names without a pid, from older versions)."""
    try:
        age = time.time() - path.lstat().st_mtime
    except FileNotFoundError:
        return False
    pid = path.name[len(prefix) :].split(".", 1)[0]
    if pid.isdigit() and 0 < int(pid) < 1 << 22:
        return not pid_alive(int(pid)) or age > STALE_SECONDS
    return age > STALE_SECONDS


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, owner: str | None = None, what: str = "--output"):
    """Yield a temporary directory; on success it replaces ``final`` in one rename.

    :param owner: the step writing it: an existing non-empty ``final`` must be that step's earlier output
        (:mod:`pipeline_steps.outputs`), and the new one is marked as the step's.
    :param what: the input that named ``final`` (for the one-line error when it cannot be written).
    """
    final = Path(final)
    if owner:
        outputs.check_reusable(final, owner)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}.", dir=final.parent))
        probe.rmdir()
    except OSError as exc:  # read-only, permission denied, a file in the way: bad input, not a crash
        from pipeline_steps.errors import UserError

        raise UserError(f"{what} {final}: cannot write there ({exc.strerror}); choose a writable directory") from None
    prefix = f".tmp-{final.name}."
    for stale in final.parent.glob(f"{prefix}*"):  # left by a crashed run, not another writer's work in progress
        if abandoned(stale, prefix):
            shutil.rmtree(stale, ignore_errors=True)
    # the writer's pid in the name: a concurrent run writing the same output (two backfill runs of one dataset
    # version) must not take this directory for a crashed run's leftovers
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", dir=final.parent))
    try:
        yield tmp
        if owner:
            outputs.mark(tmp, owner)
        if final.exists():
            old = tmp.with_name(tmp.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
