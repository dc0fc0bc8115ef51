"""``gs://bucket/prefix``: Google Cloud Storage through ``google-cloud-storage``.

Files at or above one part go through resumable uploads in ``PIPELINE_STORE_PART_MB``
chunks (default 100, the library's own; memory bounded by one chunk); smaller files are
single-request uploads.
Every upload and download is CRC32C-checked by the library; CRC32C is also the
native checksum the manifest records and re-runs compare against (object
metadata, no data read). Parallel composite/XML multipart uploads
(``transfer_manager.upload_chunks_concurrently``) are not used: the local emulators
do not support them, and a code path that cannot be tested here is not shipped.

Credentials, handed to the client (``open_store(uri, credentials=...)``) or else from the environment:
``GOOGLE_APPLICATION_CREDENTIALS`` (key file path) or ``GCS_KEYFILE_JSON``
(key file content, from a connection's ``keyfile_dict``), ``GOOGLE_CLOUD_PROJECT``;
``STORAGE_EMULATOR_HOST`` points the client at an emulator (no credentials then).
``PIPELINE_STORE_RETRY_DEADLINE`` (seconds, 60) bounds retries of transient errors.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from pipeline_steps import settings
from pipeline_steps.errors import TransientError, UserError, disk_full
from pipeline_steps.store.base import ObjectInfo, Store
from pipeline_steps.store.oss import _tuning
from pipeline_steps.store.store_uri import StoreURI, transient_status

log = logging.getLogger(__name__)


def _drop_sent_body(response, *args, **kwargs):
    response.request.body = None


class GcsStore(Store):
    scheme = "gs"
    native = "crc32c"

    def __init__(self, root: StoreURI, credentials=None):
        super().__init__(root, credentials)
        from google.api_core import exceptions as gexc
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY

        self._gexc = gexc
        # One chunk in flight, so memory is one chunk; 100 MiB is the library's own default: fewer, larger
        # requests (fake-gcs-server's cost per chunk also grows with the bytes already received).
        self.part_size, _ = _tuning(100)
        self.part_size = max(256 << 10, self.part_size // (256 << 10) * (256 << 10))  # GCS chunks: multiples of 256 KiB
        deadline = settings.get_float(settings.STORE_RETRY_DEADLINE)
        self.retry = DEFAULT_RETRY.with_timeout(deadline)
        self.timeout = (settings.get_float(settings.STORE_CONNECT_TIMEOUT), 120)
        project = self.setting("GOOGLE_CLOUD_PROJECT") or self.setting("GCLOUD_PROJECT")
        emulator = self.setting("STORAGE_EMULATOR_HOST")
        # API_ENDPOINT_OVERRIDE: the client library's own endpoint setting (a private endpoint), used with credentials
        self.endpoint = emulator or self.setting("API_ENDPOINT_OVERRIDE") or "storage.googleapis.com"
        # the library reads its endpoint variables from the environment itself: one handed to the store is passed
        handed = [n for n in ("STORAGE_EMULATOR_HOST", "API_ENDPOINT_OVERRIDE") if self.handed(n)]
        options = {"api_endpoint": self.endpoint} if handed else None
        credentials = None
        keyfile_json = self.setting("GCS_KEYFILE_JSON")
        with self._errors("connect", ""):
            if emulator:
                from google.auth.credentials import AnonymousCredentials

                credentials, project = AnonymousCredentials(), project or "test-project"
            elif keyfile_json:
                from google.oauth2 import service_account

                try:
                    info = json.loads(keyfile_json)
                    credentials = service_account.Credentials.from_service_account_info(info)
                except (ValueError, KeyError, TypeError):
                    raise UserError(
                        f"store connection {self.conn_id!r}: its GCS key file JSON is not a valid service-account key; "
                        "paste the key file again"
                    ) from None
                project = project or info.get("project_id")
            elif self.handed("GOOGLE_APPLICATION_CREDENTIALS"):  # a key file path from the connection
                import google.auth

                credentials, key_project = google.auth.load_credentials_from_file(
                    self.setting("GOOGLE_APPLICATION_CREDENTIALS"), scopes=list(storage.Client.SCOPE)
                )
                project = project or key_project
            self.client = storage.Client(project=project, credentials=credentials, client_options=options)
            # requests keeps each response's request body alive until the next chunk's response replaces
            # it, so a resumable upload would hold two chunks; drop a body once its response is in (a
            # retried chunk is re-read from the file, never from the old request).
            self.client._http.hooks["response"].append(_drop_sent_body)
        self.bucket_name = root.bucket
        self.bucket = self.client.bucket(root.bucket)
        self._bucket_checked = False

    @contextlib.contextmanager
    def _errors(self, op: str, key: str):
        """Library errors -> one-line UserError naming the connection id; never a secret."""
        gexc = self._gexc
        cid = self.conn_id
        where = f"gs://{self.root.bucket}/{key}" if key else f"gs://{self.root.bucket}"
        try:
            yield
        except UserError:
            raise
        except (gexc.Unauthorized, gexc.Forbidden) as exc:
            raise UserError(
                f"store connection {cid!r}: GCS refused the credentials for {where} (HTTP {exc.code}); check the "
                "connection's key file and project"
            ) from None
        except gexc.NotFound:
            raise UserError(
                f"store connection {cid!r}: bucket {self.root.bucket!r} does not exist (GCS {op} {where}); "
                "create it or fix the URI"
            ) from None
        except gexc.GoogleAPICallError as exc:
            if transient_status(exc.code):
                raise TransientError(
                    f"store connection {cid!r}: GCS {op} {where} failed (HTTP {exc.code}) after the client's retries; "
                    "the store is failing or throttling, Airflow retries the task"
                ) from None
            raise UserError(f"store connection {cid!r}: GCS {op} {where} failed (HTTP {exc.code})") from None
        except Exception as exc:
            import google.auth.exceptions as gae
            import requests
            from google.resumable_media import DataCorruption

            if isinstance(exc, DataCorruption):
                raise TransientError(
                    f"GCS {op} {where}: CRC32C mismatch between client and server; the transfer was corrupted, retried"
                ) from None
            if disk_full(exc):
                raise disk_full(exc) from None  # the CLI reports a full disk as transient
            if isinstance(exc, gae.DefaultCredentialsError):
                raise UserError(
                    f"store connection {cid!r}: no GCS credentials found; set the connection's key_path/keyfile_dict "
                    "(or GOOGLE_APPLICATION_CREDENTIALS)"
                ) from None
            if isinstance(exc, gae.RefreshError) and not exc.retryable:  # e.g. invalid_grant: a deleted or wrong key
                reason = str(exc.args[0] if exc.args else "").strip().split("\n")[0][:200]  # "invalid_grant: ..."
                raise UserError(
                    f"store connection {cid!r}: Google's token endpoint refused the connection's key for {op} {where} "
                    f"({reason or exc.__class__.__name__}); check the key file (a deleted or rotated key, another "
                    "service account) and update the connection"
                ) from None
            if isinstance(
                exc,
                (
                    gae.TransportError,
                    gae.RefreshError,
                    requests.ConnectionError,
                    requests.Timeout,
                    gexc.RetryError,
                    ConnectionError,
                    TimeoutError,
                ),
            ):
                raise TransientError(
                    f"store connection {cid!r}: cannot reach GCS at {self.endpoint} or get a token for {op} {where} "
                    f"({exc.__class__.__name__}); check the connection and the network (retried)"
                ) from None
            raise

    def _ensure_bucket(self):
        if self._bucket_checked:
            return
        with self._errors("get-bucket", ""):
            self.client.get_bucket(self.bucket_name, retry=self.retry, timeout=self.timeout)
        self._bucket_checked = True

    # -- primitives -------------------------------------------------------------------------------
    def _head(self, key: str) -> ObjectInfo | None:
        self._ensure_bucket()
        with self._errors("head", key):
            blob = self.bucket.get_blob(key, retry=self.retry, timeout=self.timeout)
        if blob is None:
            return None
        return ObjectInfo(size=int(blob.size), checksum=blob.crc32c)

    def _put_file(self, path: Path, key: str, size: int) -> str | None:
        self._ensure_bucket()
        blob = self.bucket.blob(key, chunk_size=self.part_size if size >= self.part_size else None)
        with self._errors("upload", key):
            blob.upload_from_filename(str(path), checksum="crc32c", retry=self.retry, timeout=self.timeout)
        return blob.crc32c  # the library checked it against the CRC32C of the bytes it sent

    def _get_file(self, key: str, path: Path) -> None:
        self._ensure_bucket()
        blob = self.bucket.blob(key, chunk_size=self.part_size)
        with self._errors("download", key):
            blob.download_to_filename(str(path), checksum="crc32c", retry=self.retry, timeout=self.timeout)

    def _get_bytes(self, key: str) -> bytes | None:
        self._ensure_bucket()
        with self._errors("get", key):
            try:
                return self.bucket.blob(key).download_as_bytes(retry=self.retry, timeout=self.timeout)
            except self._gexc.NotFound:
                return None

    def _put_bytes(self, key: str, data: bytes) -> None:
        self._ensure_bucket()
        with self._errors("put", key):
            self.bucket.blob(key).upload_from_string(data, checksum="crc32c", retry=self.retry, timeout=self.timeout)

    def _create_bytes(self, key: str, data: bytes) -> bool:
        self._ensure_bucket()
        with self._errors("create", key):
            try:  # generation 0 = "no live object": GCS lets exactly one such write succeed
                self.bucket.blob(key).upload_from_string(
                    data, checksum="crc32c", if_generation_match=0, retry=self.retry, timeout=self.timeout
                )
                return True
            except self._gexc.PreconditionFailed:
                return False

    def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        self._ensure_bucket()
        with self._errors("list", prefix):
            it = self.client.list_blobs(
                self.bucket_name, prefix=prefix, delimiter=delimiter, retry=self.retry, timeout=self.timeout
            )
            keys = [b.name for b in it]
            return keys, sorted(it.prefixes)

    def _delete(self, keys: list[str]) -> int:
        self._ensure_bucket()
        n = 0
        for k in keys:
            with self._errors("delete", k):
                try:
                    self.bucket.blob(k).delete(retry=self.retry, timeout=self.timeout)
                    n += 1
                except self._gexc.NotFound:
                    pass
        return n
