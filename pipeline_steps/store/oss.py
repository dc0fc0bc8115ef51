"""``oss://bucket/prefix``: Alibaba Cloud OSS through ``alibabacloud-oss-v2``.

Files go through the SDK's upload manager (parallel multipart above one part, one
PutObject below it) with its checkpoint files, so a killed upload resumes from its
last complete part on the next run; downloads use its download manager. Uploads are
checked end to end: the server's ``x-oss-hash-crc64ecma`` of the completed object must
equal the file's CRC64 (computed with fastcrc while the upload runs; the SDK's own,
slower per-part check is off for uploads and stays on for downloads). That CRC64 is also
the native checksum the manifest records and re-runs compare against (HeadObject, no
data read).

Credentials, handed to the client (``open_store(uri, credentials=...)``: the worker, from a connection, see
operators/hooks/store_connection.py) or else from the environment (a step in a pod or process):
``OSS_ACCESS_KEY_ID``, ``OSS_ACCESS_KEY_SECRET`` (``OSS_SESSION_TOKEN``), ``OSS_REGION``,
``OSS_ENDPOINT``; ``OSS_PATH_STYLE=true`` forces path-style addressing (automatic for
IP/localhost endpoints). Tuning: ``PIPELINE_STORE_PART_MB`` (16), ``PIPELINE_STORE_PARALLEL`` (4):
peak memory is bounded by parts in flight x part size.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from pipeline_steps import settings
from pipeline_steps.errors import TransientError, UserError, disk_full
from pipeline_steps.store.base import ObjectInfo, Store
from pipeline_steps.store.store_uri import StoreURI, transient_status

log = logging.getLogger(__name__)


def _tuning(default_part_mb: float) -> tuple[int, int]:
    """(part size in bytes, parts in flight) from ``PIPELINE_STORE_PART_MB`` / ``PIPELINE_STORE_PARALLEL``."""
    try:
        part = int(float(settings.get(settings.STORE_PART_MB) or default_part_mb) * (1 << 20))
        par = settings.get_int(settings.STORE_PARALLEL)
    except ValueError:
        raise UserError("PIPELINE_STORE_PART_MB / PIPELINE_STORE_PARALLEL must be numbers") from None
    return max(part, 100 << 10), max(par, 1)


def checkpoint_dir() -> str | None:
    """Where the SDK keeps resume checkpoints of uploads; None (no resume, still correct) when it cannot be made."""
    root = settings.cache_dir() / "oss-checkpoints"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.debug("OSS upload checkpoints off (%s): %s", root, exc)  # the checksum cache warns once for the dir
        return None
    return str(root) + os.sep  # the SDK takes dirname() of this value


class OssStore(Store):
    scheme = "oss"
    native = "crc64ecma"

    def __init__(self, root: StoreURI, credentials=None):
        super().__init__(root, credentials)
        import alibabacloud_oss_v2 as oss

        self._oss = oss
        self.bucket = root.bucket
        self.part_size, self.parallel = _tuning(16)
        region = self.setting("OSS_REGION")
        endpoint = self.setting("OSS_ENDPOINT")
        if not region:
            raise UserError(
                f"store connection {self.conn_id!r}: no OSS region; set the connection's extra 'region' "
                "(or OSS_REGION), e.g. cn-hangzhou"
            )
        key_id, secret = self.setting("OSS_ACCESS_KEY_ID"), self.setting("OSS_ACCESS_KEY_SECRET")
        if not key_id or not secret:
            raise UserError(
                f"store connection {self.conn_id!r}: no OSS credentials; set its login/password (or "
                "OSS_ACCESS_KEY_ID/OSS_ACCESS_KEY_SECRET)"
            )
        cfg = oss.config.load_default()
        cfg.credentials_provider = oss.credentials.StaticCredentialsProvider(
            key_id, secret, self.setting("OSS_SESSION_TOKEN") or None
        )
        cfg.region = region
        if endpoint:
            cfg.endpoint = endpoint
        cfg.use_path_style = _path_style(endpoint, self.setting("OSS_PATH_STYLE"))
        cfg.connect_timeout = settings.get_float(settings.STORE_CONNECT_TIMEOUT)
        cfg.retry_max_attempts = settings.get_int(settings.STORE_RETRIES)
        # The SDK's upload CRC64 (crcmod, ~0.4 GB/s, holding the GIL) would cap an upload at that rate on any
        # network; upload_dir computes the file's CRC64 with fastcrc instead and compares it with the server's
        # CRC64 of the completed object (end to end, which also covers resumed uploads).
        cfg.disable_upload_crc64_check = True
        self.endpoint = endpoint or f"oss-{region}.aliyuncs.com"
        self.client = oss.Client(cfg)
        self._bucket_checked = False

    # -- errors -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _errors(self, op: str, key: str = ""):
        """SDK errors -> one-line UserError naming the connection id; never a secret."""
        oss = self._oss
        try:
            yield
        except UserError:
            raise
        except Exception as exc:
            where = f"oss://{self.bucket}/{key}" if key else f"oss://{self.bucket}"
            chain = [exc]  # UploadError -> OperationError -> ServiceError/RequestError -> transport error
            while hasattr(chain[-1], "unwrap") and chain[-1].unwrap() is not None and len(chain) < 8:
                chain.append(chain[-1].unwrap())
            service = [e for e in chain if isinstance(e, oss.exceptions.ServiceError)]
            request = [e for e in chain if isinstance(e, oss.exceptions.RequestError)]
            err = service[0] if service else request[0] if request else chain[-1]
            cid = self.conn_id
            if isinstance(err, oss.exceptions.ServiceError):
                code = err.code or f"HTTP {err.status_code}"
                if code in (
                    "InvalidAccessKeyId",
                    "SignatureDoesNotMatch",
                    "AccessDenied",
                    "SecurityTokenExpired",
                    "InvalidSecurityToken",
                ):
                    raise UserError(
                        f"store connection {cid!r}: OSS refused the credentials for {where} ({code}); check the "
                        "connection's key id and secret"
                    ) from None
                if code == "NoSuchBucket":
                    raise UserError(
                        f"store connection {cid!r}: bucket {self.bucket!r} does not exist at {self.endpoint} "
                        "(NoSuchBucket); create it or fix the URI/region"
                    ) from None
                if transient_status(err.status_code, code):
                    raise TransientError(
                        f"store connection {cid!r}: OSS {op} {where} failed ({code}, HTTP {err.status_code}) after "
                        "the client's retries; the store is failing or throttling, Airflow retries the task"
                    ) from None
                raise UserError(
                    f"store connection {cid!r}: OSS {op} {where} failed ({code}, HTTP {err.status_code})"
                ) from None
            if isinstance(err, oss.exceptions.InconsistentError):
                raise TransientError(
                    f"OSS {op} {where}: CRC64 mismatch between client and server; the transfer was corrupted, retried"
                ) from None
            if disk_full(exc):
                raise disk_full(exc) from None  # the CLI reports a full disk as transient
            if isinstance(err, (oss.exceptions.RequestError, ConnectionError, TimeoutError)):
                raise TransientError(
                    f"store connection {cid!r}: cannot reach OSS endpoint {self.endpoint} for {op} {where} "
                    f"({err.__class__.__name__}); check the endpoint/region and the network (retried)"
                ) from None
            raise

    def _ensure_bucket(self):
        """One cheap request up front so bad credentials/bucket/endpoint fail with a clear line."""
        if self._bucket_checked:
            return
        with self._errors("list", self.root.key):
            self.client.list_objects_v2(
                self._oss.ListObjectsV2Request(bucket=self.bucket, prefix=self.root.key, max_keys=1)
            )
        self._bucket_checked = True

    # -- primitives -------------------------------------------------------------------------------
    def _unless_missing(self, op: str, key: str, call):
        """``call()``, or None when the object does not exist (NoSuchKey)."""
        self._ensure_bucket()
        oss = self._oss
        with self._errors(op, key):
            try:
                return call()
            except oss.exceptions.OperationError as exc:
                se = exc.unwrap()
                if isinstance(se, oss.exceptions.ServiceError) and se.code == "NoSuchKey":
                    return None
                raise

    def _head(self, key: str) -> ObjectInfo | None:
        r = self._unless_missing(
            "head", key, lambda: self.client.head_object(self._oss.HeadObjectRequest(bucket=self.bucket, key=key))
        )
        return None if r is None else ObjectInfo(size=int(r.content_length), checksum=r.hash_crc64)

    def _put_file(self, path: Path, key: str, size: int) -> str | None:
        self._ensure_bucket()
        oss = self._oss
        uploader = self.client.uploader(part_size=self.part_size, parallel_num=self.parallel)
        with self._errors("upload", key):
            try:
                checkpoints = checkpoint_dir()
                result = uploader.upload_file(
                    oss.PutObjectRequest(bucket=self.bucket, key=key),
                    str(path),
                    enable_checkpoint=checkpoints is not None,
                    checkpoint_dir=checkpoints,
                )
            except oss.uploader.UploadError as exc:
                # With checkpoints the SDK keeps parts for a resume; after an error (not a kill) we abort
                # instead, so no multipart upload is left behind (a retry starts the file afresh).
                if exc.upload_id:
                    with contextlib.suppress(Exception):
                        self.client.abort_multipart_upload(
                            oss.AbortMultipartUploadRequest(bucket=self.bucket, key=key, upload_id=exc.upload_id)
                        )
                raise
        return result.hash_crc64  # the server's CRC64 of the completed object

    def _get_file(self, key: str, path: Path) -> None:
        """Ranged GETs, in order, into ``path``, by our own loop: the SDK's downloader swallows every exception in its
        part loop and re-requests the same range forever when a server sends headers and drops the body, or when
        the local disk is full. Here a failed range is retried from the last byte written, with back-off; after
        ``PIPELINE_STORE_RETRIES`` failures in a row without a byte of progress, or ``PIPELINE_STORE_STALL_SECONDS``
        (default 120) without one, the download fails in one line naming the object (transient: Airflow retries).
        A full disk fails at once. The whole object's CRC64 is checked against the server's at the end."""
        import fastcrc

        self._ensure_bucket()
        oss = self._oss
        where = f"oss://{self.bucket}/{key}"
        info = self._head(key)
        if info is None:
            raise TransientError(f"OSS download {where}: the object disappeared during the download; retried")
        attempts = max(settings.get_int(settings.STORE_RETRIES), 1)
        stall = settings.get_float(settings.STORE_STALL_SECONDS)
        crc, offset, failures, last = fastcrc.crc64.xz(b""), 0, 0, ""
        progress_at = time.monotonic()
        with open(path, "wb") as f:
            while offset < info.size:
                end = min(offset + self.part_size, info.size) - 1
                before = offset
                try:
                    with self._errors("download", key):
                        r = self.client.get_object(
                            oss.GetObjectRequest(bucket=self.bucket, key=key, range_header=f"bytes={offset}-{end}")
                        )
                        with contextlib.closing(r.body):
                            for chunk in r.body.iter_bytes(block_size=1 << 20):
                                chunk = chunk[: end + 1 - offset]
                                f.write(chunk)  # a full disk raises here, and is not retried
                                crc = fastcrc.crc64.xz(chunk, initial=crc)
                                offset += len(chunk)
                except TransientError as exc:
                    last = str(exc)
                except Exception as exc:
                    if disk_full(exc) or isinstance(exc, UserError):
                        raise
                    last = f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if offset > before:
                    failures, progress_at = 0, time.monotonic()
                elif offset < info.size:
                    failures += 1
                    if failures >= attempts or time.monotonic() - progress_at > stall:
                        raise TransientError(
                            f"OSS download {where}: no progress at byte {offset} of {info.size} after {failures} "
                            f"attempts ({last[:160]}); retried"
                        )
                    time.sleep(min(0.2 * 2**failures, 5.0))
        if info.checksum and str(crc) != str(info.checksum):
            raise TransientError(
                f"OSS download {where}: CRC64 mismatch between client and server; the transfer was corrupted, retried"
            )

    def _get_bytes(self, key: str) -> bytes | None:
        def get():
            r = self.client.get_object(self._oss.GetObjectRequest(bucket=self.bucket, key=key))
            with contextlib.closing(r.body):
                return r.body.read()

        return self._unless_missing("get", key, get)

    def _put_bytes(self, key: str, data: bytes) -> None:
        self._ensure_bucket()
        with self._errors("put", key):
            self.client.put_object(self._oss.PutObjectRequest(bucket=self.bucket, key=key, body=data))

    def _create_bytes(self, key: str, data: bytes) -> bool:
        self._ensure_bucket()
        oss = self._oss
        try:  # OSS refuses the write with 409 FileAlreadyExists when the object exists
            self.client.put_object(oss.PutObjectRequest(bucket=self.bucket, key=key, body=data, forbid_overwrite=True))
            return True
        except oss.exceptions.OperationError as exc:
            err = exc.unwrap() if hasattr(exc, "unwrap") else None
            if isinstance(err, oss.exceptions.ServiceError) and err.code == "FileAlreadyExists":
                return False
            with self._errors("create", key):
                raise

    def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        self._ensure_bucket()
        keys, prefixes = [], []
        with self._errors("list", prefix):
            pages = self.client.list_objects_v2_paginator().iter_page(
                self._oss.ListObjectsV2Request(bucket=self.bucket, prefix=prefix, delimiter=delimiter or None)
            )
            for page in pages:
                keys += [o.key for o in page.contents or []]
                prefixes += [p.prefix for p in page.common_prefixes or []]
        return keys, prefixes

    def _delete(self, keys: list[str]) -> int:
        if not keys:
            return 0
        self._ensure_bucket()
        oss = self._oss
        n = 0
        with self._errors("delete", keys[0]):
            for i in range(0, len(keys), 1000):
                batch = [oss.DeleteObject(key=k) for k in keys[i : i + 1000]]
                self.client.delete_multiple_objects(
                    oss.DeleteMultipleObjectsRequest(bucket=self.bucket, objects=batch, quiet=True)
                )
                n += len(batch)
        return n

    def _cleanup_incomplete(self, prefix: str) -> int:
        self._ensure_bucket()
        oss = self._oss
        n = 0
        with self._errors("abort-multipart", prefix):
            pages = self.client.list_multipart_uploads_paginator().iter_page(
                oss.ListMultipartUploadsRequest(bucket=self.bucket, prefix=prefix)
            )
            for page in pages:
                for up in page.uploads or []:
                    self.client.abort_multipart_upload(
                        oss.AbortMultipartUploadRequest(bucket=self.bucket, key=up.key, upload_id=up.upload_id)
                    )
                    n += 1
        return n


def _path_style(endpoint: str, forced: str = "") -> bool:
    if forced.lower() in ("1", "true", "yes"):
        return True
    host = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").hostname or ""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
        return True  # virtual-hosted names cannot be formed on an IP address
    except ValueError:
        return False
