"""A fault-injecting HTTP proxy on the loopback, in front of a test storage server (OSS or GCS stand-in).

Requests are forwarded unchanged (Host header included, so signed requests still verify upstream) unless a fault is
set; ``proxy.fault`` may be changed between requests:

* ``None``: pass through;
* ``("status", code, seconds)``: answer ``code`` (503, 429, ...) with an empty body for ``seconds`` from the first
  faulted request, then pass through;
* ``("drop_after_headers", None, seconds)``: for GETs that return an object body (not XML/JSON), send the upstream
  status line and headers, then close the connection before the body (what a dying load balancer does);
* ``("corrupt", None, seconds)``: flip one byte in the middle of each object body (a checksum mismatch).

``proxy.hits`` counts the faulted responses. ``authorize`` (a function of the request's headers) makes the proxy
check authentication as the real service does: a request it refuses gets GCS's 401 ``Invalid Credentials`` and is
counted in ``proxy.refused`` (tests/helpers/google_auth.py).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, authorize=None):
        target = urlsplit(upstream)
        self.authorize, self.refused = authorize, 0
        self.upstream = (target.hostname, target.port)
        self.fault: tuple | None = None
        self.hits = 0
        self._since: float | None = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.authorize is not None and not proxy.authorize(self.headers):
                    with proxy._lock:
                        proxy.refused += 1
                    error = {"code": 401, "message": "Invalid Credentials", "errors": [{"reason": "authError"}]}
                    data = json.dumps({"error": error}).encode()
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json; charset=UTF-8")
                    self.send_header("WWW-Authenticate", 'Bearer realm="https://accounts.google.com/"')
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                fault = proxy._active()
                if fault and fault[0] == "status":
                    proxy._hit()
                    self.send_response(fault[1])
                    self.send_header("Content-Length", "0")
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                kind = (resp.getheader("Content-Type") or "").lower()
                # object bodies only: listings and metadata (XML, JSON) pass, so the client gets as far as the data
                has_body = (
                    self.command == "GET"
                    and resp.status in (200, 206)
                    and data
                    and not ("xml" in kind or "json" in kind)
                )
                if fault and has_body and fault[0] == "corrupt":
                    proxy._hit()
                    i = len(data) // 2
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault and has_body and fault[0] == "drop_after_headers":
                    proxy._hit()
                    self.close_connection = True
                    return  # headers sent, body never: the client sees the connection close mid-response
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def set(self, kind: str | None, arg=None, seconds: float = 1e9) -> None:
        with self._lock:
            self.fault = None if kind is None else (kind, arg, seconds)
            self._since, self.hits = None, 0

    def _active(self):
        with self._lock:
            if self.fault is None:
                return None
            if self._since is None:
                self._since = time.monotonic()
            if time.monotonic() - self._since > self.fault[2]:
                return None
            return self.fault

    def _hit(self):
        with self._lock:
            self.hits += 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
