"""The store interface, the version manifest and object-key validation.

A *version* is a prefix holding files plus ``_manifest.json`` (path, size,
sha256 and the backend's native checksum per file). The manifest is written last
and is the commit marker: a prefix without it is incomplete and is never read.

Backends implement a handful of object primitives (``_head``, ``_put_file``,
``_get_file``, ``_get_bytes``, ``_put_bytes``, ``_list``, ``_delete``); the version
logic (skip what is already there and verifies, repair what does not, write the
manifest last, verify downloads) lives here once. Concurrent uploads to one version are made safe by a claim
object created with the store's conditional create (store/claim.py): one content per version.

A file that must be sent is read twice, at the same time: by the SDK sending it and by a
thread computing its sha256 and native checksum (hashlib, fastcrc and google-crc32c release
the GIL), so hashing does not delay the upload. ``_put_file`` returns the server's checksum
of the stored object, which must equal the file's (end to end). Checksums are cached by
file stat, so an unchanged directory is not read again. A file whose stat changes between
the start of its hashing and the end of its upload is refused.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pipeline_steps.store.claim as claim  # not "from pipeline_steps.store import": that package imports this module
from pipeline_steps import atomic, outputs, settings
from pipeline_steps.errors import TransientError, UserError

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
MIRROR_MARKER = ".mirrored-from.json"  # a local copy's record of the version it mirrors (store/mirror.py)
MANIFEST_FORMAT = 1
SCHEMES = ("file", "oss", "gs")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_CHUNK = 8 << 20


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


# -- local checksums ----------------------------------------------------------------------------


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


@dataclasses.dataclass
class ObjectInfo:
    size: int
    checksum: str | None  # the backend's native checksum, when it reports one


class Store(abc.ABC):
    """One backend. All public methods take full URIs of this store's scheme (and bucket)."""

    scheme: str = ""
    native: str | None = None  # name of the server-side checksum in the manifest ("crc64ecma", "crc32c", "sha256")

    def __init__(self, root: StoreURI):
        self.root = root

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

    def upload_dir(self, src_dir: str | os.PathLike, dest_uri: str, replace: bool = False) -> dict:
        """Upload ``src_dir`` as the version ``dest_uri``; idempotent and resumable.

        Files already stored with the right size and checksum are skipped (nothing
        sent); missing or different ones (an interrupted run, a corrupted object) are
        uploaded; the manifest is written last. Returns
        ``{"uri","uploaded","skipped","bytes_uploaded","files","manifest_sha256"}``.

        A version holds one content (store/claim.py): of concurrent uploads, one owns it; the same content succeeds
        too, other content is refused (UserError) before any object is written, as is other content once committed.
        ``replace=True`` is for locations with a single writer that republishes them (a run directory, a report):
        the last upload's content replaces the version's.
        """
        src = Path(src_dir)
        u = self._parse(dest_uri)
        if not u.key.strip("/"):
            raise UserError(
                f"--dest {dest_uri!r} is a store root; upload into a version prefix such as .../datasets/<name>/<rev>"
            )
        files = _source_files(src)
        cache = _ChecksumCache()
        manifest_key = self._join(u.key, MANIFEST)
        old_raw = self._get_bytes(manifest_key)
        entries, found = [], []
        for rel, path in files:
            st = path.stat()  # the file as found: any change until its upload ends is caught
            entry = {"path": rel, "size": st.st_size}
            found.append((st, path))
            for algo in {"sha256", self.native} - {None}:
                if value := cache.get(path, st, algo):
                    entry[algo] = value
            if not replace:  # the claim names the content, so it is hashed before any byte is sent
                entry.update(file_checksums(path, self.native, cache))
            entries.append(entry)
        token = None
        if replace:
            self._delete([self._join(u.key, claim.CLAIM)])  # the location is taken over
        else:
            manifest_bytes = render_manifest(entries, self.native)
            if old_raw is not None and old_raw != manifest_bytes:
                raise claim.other_content(dest_uri, "already holds a committed upload of different content")
            token = claim.take(self, u.key, hashlib.sha256(manifest_bytes).hexdigest(), dest_uri)
        try:
            uploaded, skipped, sent, manifest_bytes = self._send(src, u, entries, found, cache, old_raw, replace)
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the upload's own error is the one to report
                claim.withdraw(self, u.key, token)
            raise
        aborted = self._cleanup_incomplete(self._join(u.key, ""))
        if aborted:
            log.info("aborted %d stale multipart upload(s) under %s", aborted, dest_uri)
        summary = {
            "uri": str(u),
            "uploaded": uploaded,
            "skipped": skipped,
            "bytes_uploaded": sent,
            "files": len(entries),
            "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
        }
        log.info("upload %s -> %s: %d uploaded, %d skipped, %d bytes sent", src, u, uploaded, skipped, sent)
        return summary

    def _send(self, src: Path, u: StoreURI, entries: list[dict], found: list, cache, old_raw, replace: bool):
        """Upload what is missing or differs, then commit the manifest: (uploaded, skipped, bytes sent, manifest)."""
        manifest_key = self._join(u.key, MANIFEST)
        todo, skipped = [], 0
        for entry, (st, path) in zip(entries, found):
            key = self._join(u.key, entry["path"])
            info = self._head(key)
            if info is not None and info.size == st.st_size and self.native:
                if self.native not in entry or "sha256" not in entry:
                    entry.update(file_checksums(path, self.native, cache))
                if info.checksum == entry[self.native]:
                    skipped += 1
                    continue
            if info is not None:
                log.warning(
                    "%s: stored object differs (size %s, checksum %s); re-uploading", key, info.size, info.checksum
                )
            todo.append((entry, st, path, key))
        if todo and old_raw is not None:
            # Objects of a committed version are about to change: withdraw its commit marker first so
            # no reader trusts a manifest that does not match the objects; it is rewritten at the end.
            self._delete([manifest_key])
            old_raw = None
        uploaded, sent = 0, 0
        with ThreadPoolExecutor(1, thread_name_prefix="checksums") as hasher:
            for entry, st, path, key in todo:
                sums = (
                    None
                    if {"sha256", self.native} <= entry.keys()
                    else hasher.submit(file_checksums, path, self.native, cache)
                )
                stored = self._put_file(path, key, entry["size"])
                if sums is not None:
                    entry.update(sums.result())
                if not _same_file(path.stat(), st):
                    raise UserError(
                        f"--src {src}: {entry['path']} changed while it was uploaded; re-run when the source is stable"
                    )
                if stored is not None and stored != entry[self.native]:
                    # end to end: the server's checksum of the stored object against the file's; a retry re-uploads it
                    raise TransientError(
                        f"{key}: the stored object's {self.native} ({stored}) is not the file's "
                        f"({entry[self.native]}): corrupted in transfer; retried"
                    )
                self._stored(key, entry)
                uploaded += 1
                sent += entry["size"]
        manifest_bytes = render_manifest(entries, self.native)
        if old_raw != manifest_bytes:
            if replace:
                self._put_bytes(manifest_key, manifest_bytes)
            else:
                self._commit(u, entries, manifest_key, manifest_bytes)
            sent += len(manifest_bytes)
        return uploaded, skipped, sent, manifest_bytes

    def _commit(self, u: StoreURI, entries: list[dict], manifest_key: str, manifest_bytes: bytes) -> None:
        """Create the manifest (conditionally: it never replaces another) once every object is the one it names."""
        for e in entries:  # a writer outside the claim (a replace, a tamper) may have changed an object since
            info = self._head(self._join(u.key, e["path"]))
            if info is None or info.size != e["size"] or (self.native and info.checksum != e[self.native]):
                raise TransientError(f"{u}/{e['path']}: changed by another writer during the upload; retried")
        if not self._create_bytes(manifest_key, manifest_bytes) and self._get_bytes(manifest_key) != manifest_bytes:
            raise claim.other_content(str(u), "another upload committed different content first")

    def verify(self, uri: str) -> tuple[dict | None, list[str]]:
        """(manifest, problems): compare every stored object's size and native checksum with the manifest."""
        manifest = self.read_manifest(uri)
        if manifest is None:
            return None, ["no manifest"]
        u = self._parse(uri)
        problems = []
        for e in manifest["files"]:
            info = self._head(self._join(u.key, validate_key(e["path"], f"manifest path in {uri}")))
            if info is None:
                problems.append(f"{e['path']}: missing")
            elif info.size != e["size"] or (self.native and info.checksum != e.get(self.native)):
                problems.append(f"{e['path']}: size/checksum differs from the manifest")
        return manifest, problems

    def download_file(self, uri: str, dest: str | os.PathLike, what: str = "file") -> dict:
        """One object (a user's file, not a version) into ``dest``; a one-line UserError naming ``what`` when it does
        not exist. Returns ``{"uri", "bytes"}``."""
        u = self._parse(uri)
        info = self._head(u.key)
        if info is None:
            raise UserError(f"{what} {uri}: no such object in the store; check the path and the bucket")
        out = Path(dest)
        out.parent.mkdir(parents=True, exist_ok=True)
        if info.size == 0:  # nothing to fetch (a ranged GET of an empty object is a 416 on GCS)
            out.touch()
        else:
            self._get_file(u.key, out)
        if out.stat().st_size != info.size:
            raise TransientError(f"{uri}: downloaded {out.stat().st_size} bytes of {info.size}; retried")
        return {"uri": str(u), "bytes": info.size}

    def download_dir(self, src_uri: str, dest_dir: str | os.PathLike) -> dict:
        """Download a complete version into ``dest_dir`` (atomically), verifying every file's
        size and sha256 against the manifest; UserError on an incomplete version or a mismatch."""
        u = self._parse(src_uri)
        manifest = self.read_manifest(src_uri)
        if manifest is None:
            raise UserError(f"{src_uri} has no {MANIFEST}: the version is incomplete or absent; upload it first")
        dest = Path(dest_dir)
        total = 0
        with atomic.atomic_dir(dest) as tmp:
            for e in manifest["files"]:
                rel = validate_key(e["path"], f"manifest path in {src_uri}")
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                if e["size"] == 0:  # nothing to fetch (a ranged GET of an empty object is a 416 on GCS)
                    out.touch()
                else:
                    self._get_file(self._join(u.key, rel), out)
                got = file_checksums(out, None)
                if out.stat().st_size != e["size"] or got["sha256"] != e["sha256"]:
                    self._forget(self._join(u.key, rel))  # so that the re-upload below re-reads it and repairs it
                    # transient: a transfer corrupted on the way fails the same check; a retry downloads it again,
                    # and a version corrupted in the store keeps failing with this line
                    raise TransientError(
                        f"{src_uri}/{rel}: downloaded object does not match the manifest (sha256 {got['sha256'][:12]} "
                        f"!= {e['sha256'][:12]}); retried; if it persists the stored version is corrupted, re-upload it"
                    )
                total += e["size"]
        return {"uri": str(u), "path": str(dest), "files": len(manifest["files"]), "bytes": total}


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
