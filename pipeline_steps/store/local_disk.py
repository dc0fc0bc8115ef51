"""``file:///abs/path``: the embedded default store, a directory tree on local disk.

Objects are files written atomically (temp sibling + rename); the native checksum
is sha256 of the stored file (cached by path, size, mtime and inode, so any write to
it is seen), so a modified file is detected and repaired by the next upload;
downloads always re-read and verify every byte.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.store.base import ObjectInfo, Store
from pipeline_steps.store.checksums import _ChecksumCache, file_checksums
from pipeline_steps.store.local_files import copy_file


class LocalStore(Store):
    scheme = "file"
    native = "sha256"
    _cache = None

    @property
    def _stored_sums(self) -> _ChecksumCache:
        """sha256 of stored files keyed by their stat: unchanged stored files are not re-read.

        Any write changes the key."""
        if self._cache is None:
            self._cache = _ChecksumCache()
        return self._cache

    def _head(self, key: str) -> ObjectInfo | None:
        p = Path(key)
        if not p.is_file():
            return None
        return ObjectInfo(size=p.stat().st_size, checksum=file_checksums(p, None, self._stored_sums)["sha256"])

    def _cleanup_incomplete(self, prefix: str) -> int:
        """Remove temp files a killed writer left under ``prefix`` (a committed version must hold only its files):
        those whose writer process (pid in the name, this host) is gone, or older than STALE_TEMP_SECONDS."""
        removed = 0
        base = Path(prefix)
        if not base.is_dir():
            return 0
        for p in base.rglob(".tmp-*"):
            if p.is_file() and _abandoned(p):
                p.unlink(missing_ok=True)
                removed += 1
        return removed

    def _put_file(self, path: Path, key: str, size: int) -> str | None:
        copy_file(path, Path(key))
        return None  # sha256 is the native checksum: upload_dir hashes the source while the kernel copies it

    def _forget(self, key: str) -> None:
        self._stored_sums.forget(Path(key))

    def _stored(self, key: str, entry: dict) -> None:
        # the copy holds the bytes that were hashed (the source did not change meanwhile)
        self._stored_sums.put(Path(key), Path(key).stat(), "sha256", entry["sha256"])

    def _get_file(self, key: str, path: Path) -> None:
        copy_file(Path(key), path)

    def _get_bytes(self, key: str) -> bytes | None:
        try:
            return Path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def _put_bytes(self, key: str, data: bytes) -> None:
        atomic.write_bytes(key, data)

    def _create_bytes(self, key: str, data: bytes) -> bool:
        """A complete temporary file, then ``link`` to the name: the kernel lets exactly one link win."""
        final = Path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".tmp-{final.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_bytes(data)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)
                return True
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)

    def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        base = Path(prefix)
        if not base.is_dir():
            return [], []
        if delimiter:
            keys, dirs = [], []
            for p in sorted(base.iterdir()):
                if p.name.startswith(".tmp-"):
                    continue
                (dirs if p.is_dir() else keys).append(str(p) + ("/" if p.is_dir() else ""))
            return keys, dirs
        keys = [str(p) for p in sorted(base.rglob("*")) if p.is_file() and not p.name.startswith(".tmp-")]
        return keys, []

    def _delete(self, keys: list[str]) -> int:
        n = 0
        for k in keys:
            try:
                os.unlink(k)
                n += 1
            except FileNotFoundError:
                pass
        # drop directories the deletion emptied, deepest first
        for d in sorted({str(Path(k).parent) for k in keys}, key=len, reverse=True):
            p = Path(d)
            while p != Path(self.root.key) and p != p.parent:
                try:
                    p.rmdir()
                except OSError:
                    break
                p = p.parent
        return n


def _abandoned(p: Path) -> bool:
    """A temp file whose writer cannot still be writing it (copy_file and create_bytes: ``.tmp-<name>.<pid>.<thread>``;
    an older copy_file: ``.tmp-<name>.<pid>``), by :func:`pipeline_steps.atomic.abandoned`'s rules."""
    parts = p.name.split(".")
    for tail in (1, 2):  # where the pid stands: last, or before the thread id
        if len(parts) > tail + 1 and parts[-tail].isdigit() and 0 < int(parts[-tail]) < 1 << 22:
            return atomic.abandoned(p, ".".join(parts[:-tail]) + ".")
    return atomic.abandoned(p, p.name + ".")
