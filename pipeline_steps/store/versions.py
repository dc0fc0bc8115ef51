"""A version's transfers: upload a directory as a version (skip what is stored and verifies, repair what does not,
commit the manifest last, one content per version through the claim), verify it, download it verified.

A file that must be sent is read twice, at the same time: by the SDK sending it and by a thread computing its sha256
and native checksum (hashlib, fastcrc and google-crc32c release the GIL), so hashing does not delay the upload.
``_put_file`` returns the server's checksum of the stored object, which must equal the file's (end to end). A file
whose stat changes between the start of its hashing and the end of its upload is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pipeline_steps.store.claim as claim  # not "from pipeline_steps.store import": that package imports this module
from pipeline_steps import atomic
from pipeline_steps.errors import TransientError, UserError
from pipeline_steps.store.checksums import _ChecksumCache, _same_file, file_checksums
from pipeline_steps.store.local_files import _source_files
from pipeline_steps.store.manifest import MANIFEST, render_manifest
from pipeline_steps.store.store_uri import StoreURI, validate_key

log = logging.getLogger(__name__)


class VersionTransfers:
    """The version logic of :class:`pipeline_steps.store.base.Store`, written once over the backend's primitives."""

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
