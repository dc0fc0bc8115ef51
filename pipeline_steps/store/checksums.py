"""Checksums of local files: sha256 and the backend's native checksum in one read, cached by file stat.

Checksums are cached by file stat (SQLite under ``$PIPELINE_CACHE_DIR``), so an unchanged directory is not read
again; the cache is best effort.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
from pathlib import Path

from pipeline_steps import settings

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


class _ChecksumCache:
    """Checksums of local files keyed by (path, size, mtime_ns, inode), so an unchanged
    directory is not re-read on re-upload (the rsync heuristic). Stored in SQLite under
    ``$PIPELINE_CACHE_DIR`` (default ``~/.cache/pipeline_steps``); losing it only costs time, so it is best effort:
    any failure to open, read or write it (an unwritable directory, a full disk, a corrupt file) turns the cache off
    for the rest of the run, with one warning."""

    def __init__(self):
        root = settings.cache_dir()
        self.db = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            # shared with upload_dir's hashing thread; sqlite3 serialises access to one connection
            self.db = sqlite3.connect(
                str(root / "checksums.sqlite"), timeout=30, isolation_level=None, check_same_thread=False
            )
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS sums (path TEXT, size INT, mtime INT, ino INT, algo TEXT, value TEXT,"
                " PRIMARY KEY (path, algo))"
            )
        except (OSError, sqlite3.Error) as exc:
            self._off(exc, root)

    warned = False  # one warning per process, however many caches (source files, a local store's objects) fail

    def _off(self, exc: BaseException, where=None) -> None:
        if _ChecksumCache.warned:
            log.debug("checksum cache %s off: %s", where or "", exc)
        else:
            _ChecksumCache.warned = True
            log.warning(
                "checksum cache %s unusable (%s: %s); continuing without it (files are re-read: only costs time)",
                where or settings.get(settings.CACHE_DIR) or "",
                exc.__class__.__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
        db, self.db = self.db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

    def _run(self, sql: str, args: tuple):
        db = self.db
        if db is None:
            return None
        try:
            return db.execute(sql, args).fetchone()
        except (OSError, sqlite3.Error) as exc:
            if self.db is db:  # the first failure warns; the hashing thread may meet the same one
                self._off(exc)
            return None

    def get(self, path: Path, st: os.stat_result, algo: str) -> str | None:
        row = self._run("SELECT size, mtime, ino, value FROM sums WHERE path=? AND algo=?", (str(path), algo))
        if row and tuple(row[:3]) == (st.st_size, st.st_mtime_ns, st.st_ino):
            return row[3]
        return None

    def forget(self, path: Path) -> None:
        self._run("DELETE FROM sums WHERE path=?", (str(path),))

    def put(self, path: Path, st: os.stat_result, algo: str, value: str) -> None:
        self._run(
            "INSERT OR REPLACE INTO sums VALUES (?,?,?,?,?,?)",
            (str(path), st.st_size, st.st_mtime_ns, st.st_ino, algo, value),
        )


def _native_hasher(algo: str | None):
    if algo == "crc64ecma":  # OSS's CRC64-ECMA is CRC-64/XZ; fastcrc runs it ~50x faster than the SDK's crcmod
        import fastcrc

        crc = fastcrc.crc64.xz(b"")

        def update(chunk: bytes) -> None:
            nonlocal crc
            crc = fastcrc.crc64.xz(chunk, initial=crc)

        return update, lambda: str(crc)
    if algo == "crc32c":
        import base64

        import google_crc32c

        c = google_crc32c.Checksum()
        return c.update, lambda: base64.b64encode(c.digest()).decode()
    return None


def file_checksums(path: Path, native: str | None, cache: _ChecksumCache | None = None) -> dict[str, str]:
    """sha256 (and the backend's native checksum, unless ``native`` is None) of a local file, in one read."""
    st = path.stat()
    algos = ["sha256"] + ([native] if native and native != "sha256" else [])
    if cache:
        got = {a: cache.get(path, st, a) for a in algos}
        if all(got.values()):
            return got
    sha = hashlib.sha256()
    nat = _native_hasher(native) if native != "sha256" else None
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            if nat:
                nat[0](chunk)
    out = {"sha256": sha.hexdigest()}
    if nat:
        out[native] = nat[1]()
    if cache and _same_file(path.stat(), st):  # not modified while we read it
        for a, v in out.items():
            cache.put(path, st, a, v)
    return out


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_size, a.st_mtime_ns, a.st_ino) == (b.st_size, b.st_mtime_ns, b.st_ino)
