"""Streamed staging of a Hub model: one file at a time, Hub -> local disk -> store, so the worker's disk holds at most
the largest file (a 32B model is ~65 GB, its largest shard ~4 GB), never the whole snapshot.

Per file: ``hf_hub_download`` at the resolved commit into a scratch dir, check its sha256 (LFS files: the Hub's
``lfs.sha256``; others: the git blob id), upload it (``Store._put_file``, server checksum compared), record it in
``<version>/_staging.json``, delete the local copy. The record lets a killed run resume without downloading what is
already stored. The version is claimed (store/claim.py) for a digest of the Hub's file list at that commit before any
object is written, and ``_manifest.json`` is committed last; ``_staging.json`` goes after the commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pipeline_steps.data.hub import hub_errors
from pipeline_steps.errors import TransientError, UserError
from pipeline_steps.store import claim
from pipeline_steps.store.checksums import file_checksums
from pipeline_steps.store.manifest import MANIFEST, render_manifest
from pipeline_steps.store.store_uri import validate_key

log = logging.getLogger(__name__)

PROGRESS = "_staging.json"
MARGIN = 256 << 20  # scratch headroom beyond the largest file (hub metadata, filesystem slack)


def hub_files(model: str, revision: str):
    """(commit, [{path, size, sha256|None, blob}]) of the model at ``revision``, from one Hub API call."""
    from huggingface_hub import HfApi

    with hub_errors(model, revision, "model"):
        info = HfApi().model_info(model, revision=revision, files_metadata=True)
    files = []
    for s in info.siblings or []:
        rel = validate_key(s.rfilename, f"file name {s.rfilename!r} in {model}")
        if rel in (MANIFEST, claim.CLAIM, PROGRESS):
            raise UserError(f"{model}: file {rel} has a name the store reserves for itself; it cannot be staged")
        lfs = s.lfs
        files.append({"path": rel, "size": s.size or 0, "sha256": lfs.sha256 if lfs else None, "blob": s.blob_id})
    if not files:
        raise UserError(f"model {model}@{revision} has no files; check the name and revision")
    return info.sha, sorted(files, key=lambda f: f["path"])


def check_disk(where: Path, files: list[dict], model: str) -> None:
    """Streaming needs the largest file plus a margin, not the model."""
    largest = max(f["size"] for f in files)
    free = shutil.disk_usage(where).free
    if largest + MARGIN > free:
        raise UserError(
            f"{model}: its largest file is {largest / 1e9:.1f} GB (streamed staging holds one file at a time) and "
            f"{where} has {free / 1e9:.1f} GB free: give the stage_model task more disk (ephemeral-storage, "
            "k8s/airflow/values.yaml) or point TMPDIR at a larger volume"
        )


def _check_content(path: Path, f: dict, sha256: str, model: str) -> None:
    if f["sha256"] and sha256 != f["sha256"]:
        bad = f"sha256 {sha256[:12]} != {f['sha256'][:12]}"
    elif not f["sha256"] and f["blob"]:
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's blob id, not security
        with open(path, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        bad = None if h.hexdigest() == f["blob"] else f"git blob {h.hexdigest()[:12]} != {f['blob'][:12]}"
    else:
        bad = None
    if bad is None and path.stat().st_size != f["size"]:
        bad = f"{path.stat().st_size} bytes != {f['size']}"
    if bad:
        raise TransientError(f"{model}/{f['path']}: downloaded file does not match the Hub's ({bad}); retried")


def _sweep(root: Path, prefix: str) -> None:
    """Remove the scratch dirs a killed run of this version left (its pid is gone): a worker that outlives its
    tasks would otherwise keep up to one file per kill."""
    for d in root.glob(f"{prefix}*"):
        try:
            os.kill(int(d.name[len(prefix) :].split("-")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, OSError):
            pass  # not ours to judge (a live process of another user, an odd name)


def stage(store, model: str, commit: str, files: list[dict], uri: str, scratch_root: str | None = None) -> dict:
    """Stream ``files`` of ``model@commit`` into the version ``uri``; resumable, committed last."""
    from huggingface_hub import hf_hub_download

    u = store._parse(uri)
    plan = json.dumps({"model": model, "commit": commit, "files": files}, sort_keys=True).encode()
    token = claim.take(store, u.key, hashlib.sha256(plan).hexdigest(), uri)
    progress_key = store._join(u.key, PROGRESS)
    manifest_key = store._join(u.key, MANIFEST)
    try:
        if store._get_bytes(manifest_key) is not None:  # committed but no longer verifies: withdraw it before repairs
            store._delete([manifest_key])
        raw = store._get_bytes(progress_key)
        done = json.loads(raw) if raw else {}
        entries, uploaded, sent = [], 0, 0
        prefix = f"hub-stream-{hashlib.sha256(uri.encode()).hexdigest()[:12]}-"
        _sweep(Path(scratch_root or tempfile.gettempdir()), prefix)
        with tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-", dir=scratch_root) as scratch:
            for f in files:
                key = store._join(u.key, f["path"])
                entry = done.get(f["path"])
                info = store._head(key) if entry else None
                if entry and info and info.size == entry["size"] and info.checksum == entry.get(store.native):
                    entries.append(entry)  # stored by an earlier run and unchanged since
                    continue
                with hub_errors(model, commit, "model", f["path"]):
                    local = Path(hf_hub_download(model, f["path"], revision=commit, local_dir=scratch))
                try:
                    sums = file_checksums(local, store.native)
                    _check_content(local, f, sums["sha256"], model)
                    entry = {"path": f["path"], "size": f["size"], **sums}
                    stored = store._put_file(local, key, f["size"])
                    if stored is not None and stored != entry[store.native]:
                        raise TransientError(f"{key}: stored object's checksum differs from the file's; retried")
                    store._stored(key, entry)
                finally:
                    local.unlink(missing_ok=True)  # the point of streaming: never more than one file on disk
                entries.append(entry)
                done[f["path"]] = entry
                store._put_bytes(progress_key, json.dumps(done, sort_keys=True).encode())
                uploaded += 1
                sent += f["size"]
        manifest_bytes = render_manifest(entries, store.native)
        store._commit(u, entries, manifest_key, manifest_bytes)
    except BaseException:
        try:
            claim.withdraw(store, u.key, token)
        except Exception:  # noqa: BLE001 - best effort: the staging's own error is the one to report
            pass
        raise
    store._delete([progress_key])
    log.info("streamed %s@%s -> %s: %d files uploaded, %d bytes", model, commit, uri, uploaded, sent)
    return {
        "uri": str(u),
        "uploaded": uploaded,
        "skipped": len(files) - uploaded,
        "bytes_uploaded": sent,
        "files": len(files),
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
    }
