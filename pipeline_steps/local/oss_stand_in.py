"""A small Alibaba OSS-dialect HTTP server for the store tests and benchmarks, on moto's in-process S3 backend.

No local server speaks OSS: ``alibabacloud-oss-v2`` signs with ``OSS4-HMAC-SHA256``,
sends ``x-oss-*`` headers, expects namespace-free XML and checks CRC64-ECMA
headers. This layer sits in front of moto's S3 Flask app (called in process
through werkzeug's test client, no second server) and translates:

- request headers ``x-oss-*`` -> ``x-amz-*``; response headers ``x-amz-*`` -> ``x-oss-*``;
- response XML: the S3 namespace is stripped (the SDK parses plain tag names);
- ``x-oss-hash-crc64ecma``: a real CRC64-ECMA (fastcrc's CRC-64/XZ, the same function as
  the SDK's ``Crc64``) on PutObject and UploadPart (of the body received), on
  CompleteMultipartUpload (combined from the parts, as OSS does), on GetObject and
  HeadObject (of the whole stored object), and ``<HashCrc64ecma>`` per part in
  ListParts, so the SDK's CRC checks in put, the uploader (including resume) and
  the downloader really run;
- authentication: the V4 signature is recomputed from the request with the
  server's secret; an unknown key id answers 403 ``InvalidAccessKeyId``, a wrong
  secret 403 ``SignatureDoesNotMatch`` (OSS error codes and XML shape).

Covered for real (moto's S3 semantics): bucket create/head, Put/Get/Head/Delete
object, ranged GET, ListObjectsV2 with prefix/delimiter/continuation,
DeleteMultipleObjects, multipart initiate/upload-part/complete/abort/list-parts/
list-multipart-uploads, NoSuchBucket/NoSuchKey errors.

Objects live in moto by default. For throughput figures (benchmarks/bench_upload.py) the same
layer can forward to a real S3 server instead (``s3_url``, SeaweedFS without authentication):
moto assembles multipart uploads in Python, several copies of the object, which would make the
emulator, not the client, the thing measured.

Virtual-hosted addressing (``<bucket>.<endpoint>/<key>``, what the store uses on Alibaba Cloud): a request for a
host under ``VIRTUAL_HOST`` is the path-style request for its bucket. That name resolves nowhere; clients reach the
server as their HTTP proxy (``HTTP_PROXY``), the way a request to ``oss-<region>.aliyuncs.com`` would leave a
corporate network. Each request is logged to stdout with its form (``virtual-hosted GET <host>/<key>``,
``path-style GET /<bucket>/<key>``).

AppendObject, an OSS-only API that Airflow's OSS task-log handler writes with, is served (``_append``). Not covered:
STS tokens and presigned URLs (query-string auth), ACLs, versioning, the other OSS-only APIs (symlink, restore,
tagging differences), server-side encryption, request time skew and exact OSS error ``EC`` codes.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import os
import re
import signal
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import fastcrc
from alibabacloud_oss_v2.crc import Crc64

# OSS's minimum part size is 100 KiB (S3's is 5 MiB); moto reads this when first imported.
os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", str(100 * 1024))

_NS_RE = re.compile(rb'\sxmlns="[^"]*"')
VIRTUAL_HOST = "oss-cn-test.aliyuncs.com"  # the endpoint name of virtual-hosted requests (see above)
_AUTH_RE = re.compile(
    r"OSS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aliyun_v4_request"
    r"(?:,\s*AdditionalHeaders=([^,]*))?,\s*Signature=([0-9a-f]+)"
)


def crc64(data: bytes, crc: int | None = None) -> int:
    """CRC-64/XZ, which is OSS's CRC64-ECMA (the SDK's crcmod-based ``Crc64`` gives the same values, checked in
    tests/unit/pipeline_steps/store/test_store_backends.py), from fastcrc: ~50x faster and without holding the GIL, so
    this layer's checks do not become the bottleneck that throughput figures measure."""
    return fastcrc.crc64.xz(data) if crc is None else fastcrc.crc64.xz(data, initial=crc)


def _combine(crc1: int, crc2: int, len2: int) -> int:
    return Crc64.combine(crc1, crc2, len2)


def _signature(secret: str, date: str, region: str, product: str, string_to_sign: str) -> str:
    key = ("aliyun_v4" + secret).encode()
    for part in (date, region, product, "aliyun_v4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()


class MotoS3:
    """moto's S3 Flask app, called in process through werkzeug's test client (no second server)."""

    def __init__(self):
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.moto_server.werkzeug_app import create_backend_app
        from moto.s3.models import s3_backends
        from werkzeug.test import Client

        self._app = Client(create_backend_app("s3"))
        self._backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        self._lock = threading.Lock()  # moto's backend is not meant for concurrent mutation
        self._buckets: set[str] = set()  # moto's backend is per process: forget only this server's buckets

    def forward(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes):
        # authenticated by the OSS layer; moto only needs to see a signed request (else it applies anonymous ACLs)
        headers = {
            **headers,
            "Authorization": "AWS4-HMAC-SHA256 Credential=test/20000101/us-east-1/s3/aws4_request, "
            "SignedHeaders=host, Signature=0",
        }
        with self._lock:
            resp = self._app.open(method=method, path=path, query_string=query, headers=headers, data=body)
            return resp.status_code, list(resp.headers.items()), resp.get_data() if method != "HEAD" else b""

    def create_bucket(self, name: str) -> None:
        with self._lock:
            self._backend.create_bucket(name, "us-east-1")
            self._buckets.add(name)

    def bucket_exists(self, bucket: str) -> bool:
        try:
            with self._lock:
                self._backend.get_bucket(bucket)
            return True
        except Exception:
            return False

    def etag(self, bucket: str, key: str) -> str | None:
        try:
            with self._lock:
                return self._backend.get_object(bucket, key).etag
        except Exception:
            return None

    def chunks(self, bucket: str, key: str):
        with self._lock:
            obj = self._backend.get_object(bucket, key)
        with obj.lock:  # stream the stored buffer; objects may be large (benchmarks)
            obj._value_buffer.seek(0)
            while chunk := obj._value_buffer.read(8 << 20):
                yield chunk

    def reset(self) -> None:
        with self._lock:
            for name in self._buckets:
                self._backend.buckets.pop(name, None)
            self._buckets.clear()


class HttpS3:
    """A real S3 server reached over HTTP without authentication (the benchmarks' SeaweedFS), so
    throughput figures measure the client and this layer, not moto's in-Python object assembly."""

    def __init__(self, url: str):
        self.host = urlsplit(url).netloc
        self._local = threading.local()  # one keep-alive connection per handler thread

    def _conn(self) -> http.client.HTTPConnection:
        if getattr(self._local, "conn", None) is None:
            self._local.conn = http.client.HTTPConnection(self.host, timeout=600)
        return self._local.conn

    def forward(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes):
        target = f"{quote(unquote(path))}?{query}" if query else quote(unquote(path))
        for attempt in (0, 1):  # a keep-alive connection the server closed is reopened once
            conn = self._conn()
            try:
                conn.request(method, target, body=body or None, headers={**headers, "Host": self.host})
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise

    def create_bucket(self, name: str) -> None:
        status, _, body = self.forward("PUT", f"/{name}", "", {}, b"")
        if status >= 300 and b"BucketAlreadyOwnedByYou" not in body:
            raise RuntimeError(f"create bucket {name}: HTTP {status}")

    def bucket_exists(self, bucket: str) -> bool:
        return self.forward("HEAD", f"/{bucket}", "", {}, b"")[0] < 300

    def etag(self, bucket: str, key: str) -> str | None:
        status, headers, _ = self.forward("HEAD", f"/{bucket}/{key}", "", {}, b"")
        return dict((k.lower(), v) for k, v in headers).get("etag") if status < 300 else None

    def chunks(self, bucket: str, key: str):
        status, _, data = self.forward("GET", f"/{bucket}/{key}", "", {}, b"")
        if status < 300:
            yield data

    def reset(self) -> None:
        pass


class OssTestServer:
    """``with OssTestServer(key_id, secret) as srv: srv.endpoint`` -> ``http://127.0.0.1:<port>``.

    :param access_key_id: the only key id the server accepts
    :param access_key_secret: its secret (used to verify V4 signatures)
    :param region: region name expected in the signature scope
    :param port: 0 picks a free port on 127.0.0.1
    """

    def __init__(
        self,
        access_key_id: str,
        access_key_secret: str,
        region: str = "cn-test",
        port: int = 0,
        s3_url: str | None = None,
    ):
        self.s3 = HttpS3(s3_url) if s3_url else MotoS3()
        self.credentials = {access_key_id: access_key_secret}
        self.region = region
        self.part_delay = float(os.environ.get("OSS_TEST_SERVER_PART_DELAY", "0"))
        self._crc_cache: dict[tuple[str, str, str], int] = {}
        self._part_crc: dict[tuple[str, int], tuple[int, int]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path?query) for assertions
        self._create_lock = threading.Lock()  # x-oss-forbid-overwrite: check and write as one step, as OSS does
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OssTestServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="oss-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread:
            self._thread.join(timeout=5)
        self.s3.reset()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def create_bucket(self, name: str) -> None:
        self.s3.create_bucket(name)

    # -- translation ---------------------------------------------------------------------------------
    def _object_crc(self, bucket: str, key: str) -> int | None:
        etag = self.s3.etag(bucket, key)
        if etag is None:
            return None
        ck = (bucket, key, etag)
        if ck not in self._crc_cache:
            crc = None
            for chunk in self.s3.chunks(bucket, key):
                crc = crc64(chunk, crc)
            self._crc_cache[ck] = crc64(b"") if crc is None else crc
        return self._crc_cache[ck]

    def _check_auth(
        self, method: str, raw_path: str, raw_query: str, headers: dict[str, str]
    ) -> tuple[int, str, str] | None:
        auth = headers.get("authorization", "")
        m = _AUTH_RE.fullmatch(auth.strip())
        if not m:
            return 403, "AccessDenied", "missing or malformed OSS4-HMAC-SHA256 Authorization header"
        key_id, date, region, product, additional, signature = m.groups()
        secret = self.credentials.get(key_id)
        if secret is None:
            return 403, "InvalidAccessKeyId", "The OSS Access Key Id you provided does not exist in our records."
        additional_list = [h for h in (additional or "").split(";") if h]
        path = unquote(raw_path)
        segs = path.lstrip("/").split("/", 1)
        uri = "/" + (segs[0] + "/" + (segs[1] if len(segs) > 1 else "") if segs[0] else "")
        canonical_uri = quote(uri, safe="/")
        pairs = sorted(p.partition("=")[::2] for p in raw_query.split("&") if p) if raw_query else []
        canonical_query = "&".join(f"{k}={v}" if v else k for k, v in pairs)
        signed = sorted(
            (k, v)
            for k, v in headers.items()
            if k.startswith("x-oss-") or k in ("content-type", "content-md5") or k in additional_list
        )
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in signed)
        payload = headers.get("x-oss-content-sha256", "UNSIGNED-PAYLOAD")
        canonical = (
            f"{method}\n{canonical_uri}\n{canonical_query}\n{canonical_headers}\n{';'.join(additional_list)}\n{payload}"
        )
        scope = f"{date}/{region}/{product}/aliyun_v4_request"
        sts = "\n".join(
            ["OSS4-HMAC-SHA256", headers.get("x-oss-date", ""), scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        if os.environ.get("OSS_TEST_SERVER_DEBUG"):
            print("canonical:", repr(canonical), headers)
        if region != self.region or not hmac.compare_digest(_signature(secret, date, region, product, sts), signature):
            return (
                403,
                "SignatureDoesNotMatch",
                "The request signature we calculated does not match the signature you provided.",
            )
        return None

    def handle(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        parts = urlsplit(target)  # origin-form, or absolute-form when the client uses the server as its proxy
        raw_path, raw_query = parts.path, parts.query
        host = (parts.hostname or headers.get("host", "").rsplit(":", 1)[0]).lower()
        if host.endswith("." + VIRTUAL_HOST):  # <bucket>.<endpoint>: OSS signs it as /<bucket>/<key> all the same
            raw_path = "/" + host[: -len(VIRTUAL_HOST) - 1] + (raw_path or "/")
            print(f"virtual-hosted {method} {host}{parts.path}", flush=True)
        else:
            print(f"path-style {method} {parts.path}", flush=True)
        self.requests.append((method, target))
        request_id = uuid.uuid4().hex.upper()[:24]
        denied = self._check_auth(method, raw_path, raw_query, headers)
        if denied:
            status, code, msg = denied
            err = self._error_xml(code, msg, request_id)
            if method == "HEAD":
                return status, {"x-oss-request-id": request_id, "x-oss-err": base64.b64encode(err).decode()}, b""
            return status, {"x-oss-request-id": request_id, "Content-Type": "application/xml"}, err
        query = dict(parse_qsl(raw_query, keep_blank_values=True))
        path = unquote(raw_path).lstrip("/")
        bucket, _, key = path.partition("/")

        fwd = {}
        for k, v in headers.items():
            if k in ("authorization", "host", "content-length", "transfer-encoding"):
                continue
            fwd["x-amz-" + k[6:] if k.startswith("x-oss-") else k] = v
        fwd["Host"] = f"127.0.0.1:{self.port}"
        if method == "POST" and "append" in query and key:
            return self._append(raw_path, bucket, key, query, fwd, body, request_id)
        forbid = method == "PUT" and not query and headers.get("x-oss-forbid-overwrite", "").lower() == "true"
        fwd.pop("x-amz-forbid-overwrite", None)
        with self._create_lock if forbid else contextlib.nullcontext():
            if forbid and self.s3.forward("HEAD", raw_path, "", {"Host": fwd["Host"]}, b"")[0] == 200:
                err = self._error_xml("FileAlreadyExists", "The object you specified already exists.", request_id)
                return 409, {"x-oss-request-id": request_id, "Content-Type": "application/xml"}, err
            status, resp_headers, out_body = self.s3.forward(method, raw_path, raw_query, fwd, body)
        out_headers: dict[str, str] = {}
        for k, v in resp_headers:
            lk = k.lower()
            if lk in ("content-length", "transfer-encoding", "server", "date", "connection"):
                if method == "HEAD" and lk == "content-length":
                    out_headers["Content-Length"] = v
                continue
            out_headers["x-oss-" + lk[6:] if lk.startswith("x-amz-") else k] = v
        is_object_data = (
            bool(key)
            and method in ("GET", "HEAD")
            and status < 300
            and not ({"uploadId", "uploads", "acl", "tagging"} & set(query))
        )
        crc = None
        if status < 300 and key:
            if method == "PUT" and "partNumber" in query and "uploadId" in query:
                if self.part_delay:
                    time.sleep(self.part_delay)  # lets tests interrupt a multipart upload midway
                crc = crc64(body)
                self._part_crc[(query["uploadId"], int(query["partNumber"]))] = (crc, len(body))
            elif method == "PUT" and "x-oss-copy-source" not in headers and not query:
                crc = crc64(body)
                self._crc_cache[(bucket, key, dict((k.lower(), v) for k, v in resp_headers).get("etag", ""))] = crc
            elif method == "POST" and "uploadId" in query:
                crc = self._completed_crc(bucket, key, query["uploadId"], body)
            elif is_object_data:
                crc = self._object_crc(bucket, key)
        if crc is not None:
            out_headers["x-oss-hash-crc64ecma"] = str(crc)
        if not is_object_data and out_body.lstrip().startswith(b"<"):
            out_body = _NS_RE.sub(b"", out_body, count=1)
            if method == "GET" and "uploadId" in query and status < 300:
                out_body = self._add_part_crcs(query["uploadId"], out_body)
            out_headers["Content-Type"] = "application/xml"
        out_headers["x-oss-request-id"] = request_id
        if status == 404 and method == "HEAD" and not out_body:  # moto answers HEAD 404s without a document
            code = "NoSuchKey" if self.s3.bucket_exists(bucket) else "NoSuchBucket"
            out_body = self._error_xml(code, "The specified resource does not exist.", request_id)
        if status >= 300 and method == "HEAD":  # OSS puts a HEAD's error document in a header
            out_headers["x-oss-err"] = base64.b64encode(out_body).decode()
            out_body = b""
        return status, out_headers, out_body

    def _append(self, raw_path: str, bucket: str, key: str, query: dict, fwd: dict, body: bytes, request_id: str):
        """OSS's AppendObject (``POST /<key>?append&position=N``; Airflow's OSS task-log handler writes with it), which
        S3 lacks: the object is read, checked against ``position``, and written back whole with the data appended."""
        headers = {"x-oss-request-id": request_id}
        with self._create_lock:
            status, _, current = self.s3.forward("GET", raw_path, "", {"Host": fwd["Host"]}, b"")
            current = current if status < 300 else b""
            if int(query.get("position") or 0) != len(current):
                err = self._error_xml("PositionNotEqualToLength", "Position is not equal to file length", request_id)
                headers.update({"x-oss-next-append-position": str(len(current)), "Content-Type": "application/xml"})
                return 409, headers, err
            data = current + body
            put = {k: v for k, v in fwd.items() if k.lower().startswith("content-type") or k == "Host"}
            status, resp_headers, out = self.s3.forward("PUT", raw_path, "", put, data)
            if status >= 300:
                return status, {**headers, "Content-Type": "application/xml"}, _NS_RE.sub(b"", out, count=1)
            crc = crc64(data)
            etag = dict((k.lower(), v) for k, v in resp_headers).get("etag", "")
            self._crc_cache[(bucket, key, etag)] = crc
        headers.update({"x-oss-next-append-position": str(len(data)), "x-oss-hash-crc64ecma": str(crc), "ETag": etag})
        return 200, headers, b""

    def _completed_crc(self, bucket: str, key: str, upload_id: str, body: bytes) -> int | None:
        """The object's CRC64 combined from its parts' (as OSS does), without re-reading the object."""
        numbers = [int(n.text) for n in ET.fromstring(_NS_RE.sub(b"", body, count=1)).iter("PartNumber")]
        parts = [self._part_crc.get((upload_id, n)) for n in numbers]
        if not parts or None in parts:  # parts from before a restart: read the object instead
            return self._object_crc(bucket, key)
        crc = 0
        for part_crc, size in parts:
            crc = _combine(crc, part_crc, size)
        self._crc_cache[(bucket, key, self.s3.etag(bucket, key))] = crc
        return crc

    def _add_part_crcs(self, upload_id: str, xml: bytes) -> bytes:
        root = ET.fromstring(xml)
        for part in root.iter("Part"):
            n = int(part.findtext("PartNumber"))
            if (upload_id, n) in self._part_crc:
                ET.SubElement(part, "HashCrc64ecma").text = str(self._part_crc[(upload_id, n)][0])
        return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root)

    @staticmethod
    def _error_xml(code: str, message: str, request_id: str) -> bytes:
        root = ET.Element("Error")
        for tag, text in (
            ("Code", code),
            ("Message", message),
            ("RequestId", request_id),
            ("HostId", "127.0.0.1"),
            ("EC", "0002-00000000"),
        ):
            ET.SubElement(root, tag).text = text
        return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root)

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: tests read assertions, not access logs
                pass

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _do(self):
                body = self._read_body()
                headers = {k.lower(): v.strip() for k, v in self.headers.items()}
                try:
                    status, out_headers, out_body = server.handle(self.command, self.path, headers, body)
                except Exception as exc:  # surface as a 500 so the client's retry/err path runs
                    status, out_headers, out_body = (
                        500,
                        {"Content-Type": "application/xml"},
                        server._error_xml("InternalError", f"{exc.__class__.__name__}: {exc}", "0"),
                    )
                self.send_response(status)
                for k, v in out_headers.items():
                    self.send_header(k, v)
                self.send_header("Date", formatdate(usegmt=True))
                if "Content-Length" not in out_headers:
                    self.send_header("Content-Length", str(len(out_body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(out_body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _do

        return Handler


def main() -> None:
    """Run standalone: ``python -m pipeline_steps.local.oss_stand_in KEY SECRET [PORT] [BUCKET...]``; with
    ``OSS_TEST_SERVER_S3_URL`` set, objects live in that S3 server instead of moto."""
    import sys

    key, secret = sys.argv[1], sys.argv[2]
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    srv = OssTestServer(key, secret, port=port, s3_url=os.environ.get("OSS_TEST_SERVER_S3_URL") or None).start()
    for b in sys.argv[4:]:
        srv.create_bucket(b)
    print(srv.endpoint, flush=True)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopped by the fixture with SIGTERM: stop() runs, exit code 0
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    srv.stop()


if __name__ == "__main__":
    main()
