"""Local files on their way into or out of a store: which files of a source directory upload, and the atomic
copy the ``file://`` store writes objects with."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path

import pipeline_steps.store.claim as claim  # not "from pipeline_steps.store import": that package imports this module
from pipeline_steps import outputs
from pipeline_steps.errors import UserError
from pipeline_steps.store.manifest import MANIFEST, MIRROR_MARKER
from pipeline_steps.store.store_uri import validate_key


def _source_files(src: Path) -> list[tuple[str, Path]]:
    """The files to upload: regular files only, checked before any byte is sent.

    The one rule for symlinks: a symlink is uploaded (as the file it points to) only when it resolves to a
    regular file inside ``src``. A symlink that leaves ``src``, points to a directory or a non-regular file, or
    dangles is refused, as are FIFOs, sockets and devices: one line naming the path.
    """
    if not src.is_dir():
        raise UserError(f"--src {src}: not a directory; pass the directory to upload")
    root = src.resolve()
    files = []
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            rel = p.relative_to(src).as_posix()
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode):
                continue  # walked into (never through a symlink)
            if rel.startswith(".tmp-") or "/.tmp-" in rel:  # atomic.py leftovers of a crashed writer
                continue
            if rel == outputs.MARKER or name == MIRROR_MARKER:  # local bookkeeping, not data
                continue
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = p.resolve(strict=True)
                except (OSError, RuntimeError):
                    raise UserError(f"--src {src}: {rel} is a broken symlink; fix or remove it") from None
                if root != target and root not in target.parents:
                    raise UserError(
                        f"--src {src}: {rel} is a symlink to {target}, outside the source; copy the file in instead"
                    )
                if not stat.S_ISREG(target.stat().st_mode):
                    raise UserError(
                        f"--src {src}: {rel} is a symlink to a directory or special file; only regular files upload"
                    )
            elif not stat.S_ISREG(st.st_mode):
                raise UserError(
                    f"--src {src}: {rel} is not a regular file (FIFO, socket or device); remove it from the source"
                )
            validate_key(rel, f"file name {rel!r} in --src {src}")
            if rel in (MANIFEST, claim.CLAIM):
                raise UserError(f"--src {src} contains {rel}, a name the store reserves for itself; rename that file")
            files.append((rel, p))
    if not files:
        raise UserError(f"--src {src}: directory is empty; nothing to upload")
    return sorted(files)


def copy_file(src: Path, dest: Path) -> None:
    """Copy a file into place atomically (temp sibling + fsync + rename); the copy runs in the
    kernel (``shutil.copyfile`` uses sendfile/copy_file_range), no bytes through Python."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # pid and thread: two uploads of one version in one process (threads) must not share a temp file (one's
    # rename took the other's, which then failed with FileNotFoundError)
    tmp = dest.with_name(f".tmp-{dest.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        shutil.copyfile(src, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
